"""Layout equivalence of training: the first 5 losses and gradient norms at several (tp, dp, sp)
layouts equal the
single-process run up to float32 rounding (tests/tolerances.py: step t carries `t` training
steps' chains of `k` terms), with dropout 0; also with every transformer layer
compiled (`--compile` at tp 2 with SP) against the eager single-process run.
The layouts run pretrain() in run_distributed worlds, the cases of one world size in one world,
the compiled run in the world of the other two-process cases (train.py's command line under
torchrun: test_checkpointing.py, test_profile.py)."""
from __future__ import annotations

import pytest

from distributed import batched_by_world, run_distributed
from launch import read_metrics
from tolerances import assert_losses_close, training_chain_terms

COMMON = ["--train-iters", "5", "--log-interval", "1", "--eval-interval", "0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
          "--global-batch-size", "8"]

# (tp, dp, sequence parallel)
LAYOUTS = [(2, 1, False), (4, 1, True), (2, 2, True), (1, 2, False)]

FAMILIES = {
    # tiny-gpt: 4 heads, learned positions, LayerNorm, GeLU, biases, tied embeddings
    "gpt": ["--config", "configs/tiny-gpt.yaml"],
    # tiny-llama with 4 query groups so tp=4 divides them: RoPE, RMSNorm, SwiGLU, untied
    "llama": ["--config", "configs/tiny-llama.yaml", "--num-query-groups", "4"],
}


def _train_worker(runs: list[list[str]], log_dir: str, cache: str) -> None:
    """In a run_distributed world: pretrain() once per argument list, one after the other,
    each logging to `<log_dir>/<i>` (read back by `_curves`, as from a train.py run)."""
    import os

    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()  # pretrain builds the grid from the config
        pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))


def _run(world: int, runs: list[list[str]], root, corpus_env) -> list[tuple[list, list]]:
    """The `_curves` of the argument lists `runs`, trained in one world of `world` processes
    (starting a world costs more than a 5-step run of these tiny models)."""
    run_distributed(_train_worker, world, runs, str(root), corpus_env["SHARDZOO_CACHE"],
                    timeout=300 * len(runs))
    return [_curves(root / str(i)) for i in range(len(runs))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_env):
    curves = _run(1, [args + COMMON for args in FAMILIES.values()],
                  tmp_path_factory.mktemp("ref"), corpus_env)
    return dict(zip(FAMILIES, curves))


def _curves(log_dir):
    """Losses and gradient norms of the 5 steps (a step's norm is as layout-sensitive as its
    loss and at step 1, before any update, a pure function of one forward and backward)."""
    records = [r for r in read_metrics(log_dir) if "loss" in r]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


CASES = [(family, tp, dp, sp) for tp, dp, sp in LAYOUTS for family in sorted(FAMILIES)]
# every transformer layer compiled at tp 2 with SP: collectives are graph breaks, inductor fuses
# the elementwise chains between them
COMPILED = ("llama", 2, 1, "compile")


def _case_args(case) -> list[str]:
    family, tp, _, sp = case
    flags = (["--sequence-parallel", "--compile"] if sp == "compile" else
             ["--sequence-parallel"] if sp else ["--no-sequence-parallel"])
    return FAMILIES[family] + COMMON + ["--tp", str(tp)] + flags


@pytest.fixture(scope="module")
def case_curves(tmp_path_factory, corpus_env):
    """case -> its `_curves`; the cases of one world size (tp * dp) run in one world."""
    def run_cases(world, cases):
        return _run(world, [_case_args(c) for c in cases],
                    tmp_path_factory.mktemp(f"world{world}"), corpus_env)
    return batched_by_world(CASES + [COMPILED], lambda c: c[1] * c[2], run_cases)


@pytest.mark.parametrize("case", CASES, ids=[f"{tp}-{dp}-{sp}-{family}"
                                             for family, tp, dp, sp in CASES])
def test_layout_matches_single_process(case, reference, case_curves):
    args = _case_args(case)
    (losses, norms), (ref, ref_norms) = case_curves(case), reference[case[0]]
    assert len(losses) == len(ref) == 5
    k_step = training_chain_terms(args)
    assert_losses_close(losses, ref, k_step)
    assert_losses_close(norms, ref_norms, k_step, "gradient norms")
    assert ref[-1] < ref[0]  # it is training, not just agreeing


def test_compiled_layers_match_eager_single_process(reference, case_curves):
    """--compile at tp=2 with sequence parallelism (collectives are graph breaks, inductor
    fuses the elementwise chains between them) against the eager 1-process run."""
    args = _case_args(COMPILED)
    (losses, norms), (ref, ref_norms) = case_curves(COMPILED), reference["llama"]
    assert len(losses) == len(ref) == 5
    k_step = training_chain_terms(args)
    assert_losses_close(losses, ref, k_step)
    assert_losses_close(norms, ref_norms, k_step, "gradient norms")
