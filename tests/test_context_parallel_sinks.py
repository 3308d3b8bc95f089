"""gpt-oss under context parallelism: attention sinks (one learned logit per head in each
query's softmax denominator) and its alternating sliding-window layers, trained at cp 2.

tiny-gpt-oss (sinks, a window of 8 tokens on the even layers, the biased MoE) trained 4
steps with hidden and attention dropout 0.1 (masks keyed by global position) gives one
process's losses and gradient norms at cp 2 with the ring ("p2p") and with "all_gather",
each also under selective recompute (the core attention, sinks included, checkpointed and
run again in backward), to tests/tolerances.py's derived bound; each run's start-up
activation bytes equal the planner's prediction (the CP core keeps q, k, v, its output and
the log-sum-exp; the sink adds no activation). The attention itself (output and the
gradients of q, k, v and the sinks against a float64 reference) is in
tests/test_context_parallel_attention.py.
"""
from __future__ import annotations

from distributed import run_distributed
from tolerances import assert_losses_close, training_chain_terms

CP_LAYOUTS = [["--cp", "2"], ["--cp", "2", "--cp-comm-type", "all_gather"],
              ["--cp", "2", "--recompute-granularity", "selective"],
              ["--cp", "2", "--cp-comm-type", "all_gather", "--recompute-granularity",
               "selective"]]


def _runs() -> list[str]:
    from test_dropout import DROPOUT

    return ["--config", "configs/tiny-llama.yaml", "--model", "tiny-gpt-oss",
            "--peak-tflops", "1"] + DROPOUT


def _train(runs: list[list[str]], log_dir: str, cache: str) -> list[dict]:
    """pretrain() once per argument list in this world: per run rank 0's losses, gradient
    norms and start-up activation bytes (measured, predicted)."""
    import os

    import parallel_state as ps
    from training.arguments import parse_config
    from training.metrics import read_records
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))
        records = read_records(f"{log_dir}/{i}")
        steps = [r for r in records if "loss" in r]
        start = next(r for r in records if "activation_bytes_layers" in r)
        out.append({"losses": [r["loss"] for r in steps],
                    "norms": [r["grad_norm"] for r in steps],
                    "activations": (start["activation_bytes_layers"],
                                    start["activation_bytes_layers_predicted"])})
    return out


def test_training_with_sinks_and_windows_at_cp2_matches_one_process(corpus_env, tmp_path):
    base, cache = _runs(), corpus_env["SHARDZOO_CACHE"]
    ref = run_distributed(_train, 1, [base], str(tmp_path / "one"), cache, timeout=600)[0][0]
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]  # it learns
    runs = run_distributed(_train, 2, [base + f for f in CP_LAYOUTS], str(tmp_path / "two"),
                           cache, timeout=1200)[0]
    for flags, run in zip(CP_LAYOUTS, runs, strict=True):
        k_step = training_chain_terms(base + flags)
        print(f"gpt-oss {flags}: losses {run['losses']} (one process {ref['losses']}), "
              f"activation bytes {run['activations']}")
        assert len(run["losses"]) == 4, (flags, run)
        assert_losses_close(run["losses"], ref["losses"], k_step, f"losses at {flags}")
        assert_losses_close(run["norms"], ref["norms"], k_step, f"grad norms at {flags}")
        measured, predicted = run["activations"]
        assert measured == predicted, (flags, measured, predicted)
