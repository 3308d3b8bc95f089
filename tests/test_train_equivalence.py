"""Layout equivalence of train.py: the first 5 losses at several (tp, dp, sp) layouts equal the
single-process run to 1e-5 relative, in float32 with dropout 0 (issue 2)."""
from __future__ import annotations

import pytest

from launch import run_train, train_losses

COMMON = ["--train-iters", "5", "--log-interval", "1", "--eval-interval", "0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
          "--global-batch-size", "8"]

# (tp, dp, sequence parallel) from the issue
LAYOUTS = [(2, 1, False), (4, 1, True), (2, 2, True), (1, 2, False)]

FAMILIES = {
    # tiny-gpt: 4 heads, learned positions, LayerNorm, GeLU, biases, tied embeddings
    "gpt": ["--config", "configs/tiny-gpt.yaml"],
    # tiny-llama with 4 query groups so tp=4 divides them: RoPE, RMSNorm, SwiGLU, untied
    "llama": ["--config", "configs/tiny-llama.yaml", "--num-query-groups", "4"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_env):
    out = {}
    for family, args in FAMILIES.items():
        log = tmp_path_factory.mktemp(f"ref-{family}")
        run_train(1, args + COMMON, log, env=corpus_env)
        out[family] = train_losses(log)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tp,dp,sp", LAYOUTS)
def test_layout_matches_single_process(family, tp, dp, sp, reference, tmp_path, corpus_env):
    args = FAMILIES[family] + COMMON + ["--tp", str(tp)]
    args.append("--sequence-parallel" if sp else "--no-sequence-parallel")
    run_train(tp * dp, args, tmp_path, env=corpus_env)
    losses = train_losses(tmp_path)
    ref = reference[family]
    assert len(losses) == len(ref) == 5
    assert losses == pytest.approx(ref, rel=1e-5), (losses, ref)
    assert ref[-1] < ref[0]  # it is training, not just agreeing
