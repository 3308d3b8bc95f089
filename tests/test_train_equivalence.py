"""Layout equivalence of train.py: the first 5 losses and gradient norms at several (tp, dp, sp)
layouts equal the
single-process run up to float32 rounding (tests/tolerances.py: step t carries `t` training
steps' chains of `k` terms), with dropout 0 (issue 2); also with every transformer layer
compiled (`--compile`, issue 16) against the eager single-process run."""
from __future__ import annotations

import pytest

from launch import read_metrics, run_train
from tolerances import assert_losses_close, training_chain_terms

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
        out[family] = _curves(log)
    return out


def _curves(log_dir):
    """Losses and gradient norms of the 5 steps (a step's norm is as layout-sensitive as its
    loss and at step 1, before any update, a pure function of one forward and backward)."""
    records = [r for r in read_metrics(log_dir) if "loss" in r]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tp,dp,sp", LAYOUTS)
def test_layout_matches_single_process(family, tp, dp, sp, reference, tmp_path, corpus_env):
    args = FAMILIES[family] + COMMON + ["--tp", str(tp)]
    args.append("--sequence-parallel" if sp else "--no-sequence-parallel")
    run_train(tp * dp, args, tmp_path, env=corpus_env)
    (losses, norms), (ref, ref_norms) = _curves(tmp_path), reference[family]
    assert len(losses) == len(ref) == 5
    k_step = training_chain_terms(args)
    assert_losses_close(losses, ref, k_step)
    assert_losses_close(norms, ref_norms, k_step, "gradient norms")
    assert ref[-1] < ref[0]  # it is training, not just agreeing


def test_compiled_layers_match_eager_single_process(reference, tmp_path, corpus_env):
    """--compile at tp=2 with sequence parallelism (collectives are graph breaks, inductor
    fuses the elementwise chains between them) against the eager 1-process run."""
    args = FAMILIES["llama"] + COMMON + ["--tp", "2", "--sequence-parallel", "--compile"]
    run_train(2, args, tmp_path, env=corpus_env)
    (losses, norms), (ref, ref_norms) = _curves(tmp_path), reference["llama"]
    assert len(losses) == len(ref) == 5
    k_step = training_chain_terms(args)
    assert_losses_close(losses, ref, k_step)
    assert_losses_close(norms, ref_norms, k_step, "gradient norms")
