"""Training with context parallelism (the trainer's side): train.py's pretrain() at
cp 2, cp 4, cp 2 x tp 2 (sequence parallel), cp 2 x pp 2 and cp 2 x dp 2 under ZeRO-3 gives
the losses, gradient norms and final weights of one process, to tests/tolerances.py's derived
bound; with hidden and attention dropout 0.1 in three of the six (masks keyed by global
position, so a CP rank's masks are the one-process masks of its tokens), one with
--debug-collectives (the ring's messages pass its fingerprint check), two with validation
(the loss over dp x cp before and after training). Each run's start-up
measurement of activation bytes equals the planner's prediction. A checkpoint saved at
cp 2 resumes at cp 1 (dp 2) and at cp 4 and continues the uninterrupted losses and weights. The
layouts that are not built are refused by the run's checks with the flag named, before any
process starts.

Tiny models (tiny-llama: RoPE, GQA, untied; tiny-gpt: learned positions, tied embeddings,
over two pipeline stages), 3 steps, float32; the runs of one world size run one after the
other in one world (tests/distributed.py), the one-process references in one world.
"""
from __future__ import annotations

import pytest
import torch

from distributed import batched_by_world, run_distributed
from models.config import ConfigError
from tolerances import assert_losses_close, training_chain_terms, weights_mismatch

LLAMA = ["--config", "configs/tiny-llama.yaml"]
GPT = ["--config", "configs/tiny-gpt.yaml"]
# --adam-eps 1e-4: see tests/test_distributed_optimizer.py (bounded update differences)
COMMON = ["--train-iters", "3", "--log-interval", "1", "--eval-interval", "0",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--no-tensorboard",
          "--adam-eps", "1e-4", "--peak-tflops", "1", "--lr-warmup-iters", "0"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
EVAL = ["--eval-interval", "3", "--eval-iters", "1"]  # validation before and after (cp runs too)

REFERENCES = {  # name: one-process flags
    "llama-dropout": LLAMA + DROPOUT,
    "llama": LLAMA + NO_DROPOUT,
    "gpt": GPT + NO_DROPOUT,
}
LAYOUTS = [  # id, world, reference, flags
    # --debug-collectives: ranks compare each call's fingerprint first (the ring's p2p too)
    ("cp2", 2, "llama-dropout", ["--cp", "2", "--debug-collectives"]),
    ("cp2-all-gather", 2, "llama", ["--cp", "2", "--cp-comm-type", "all_gather"]),
    ("cp4", 4, "llama", ["--cp", "4"]),
    ("cp2-tp2-sp", 4, "llama-dropout", ["--cp", "2", "--tp", "2", "--sequence-parallel"]),
    ("cp2-pp2-gpt", 4, "gpt", ["--cp", "2", "--pp", "2"]),
    ("cp2-dp2-zero3", 4, "llama-dropout", ["--cp", "2", *ZERO3]),
]


def _args(reference: str, flags: list[str]) -> list[str]:
    """The flags of a run compared with `reference` (the "llama" ones also validate)."""
    return REFERENCES[reference] + COMMON + flags + (EVAL if reference == "llama" else [])


# ----------------------------------------------------------------------------- in the workers

def _train_worker(runs: list[list[str]], log_dir: str, cache: str) -> list[dict]:
    """pretrain() once per argument list in this run_distributed world; per run the step
    records of rank 0's metrics.jsonl, its start-up activation bytes and the full final
    weights (rank 0)."""
    import os

    import torch.distributed as dist

    import parallel_state as ps
    from models.state_dict import gather_full_state_dict
    from training.arguments import parse_config
    from training.metrics import read_records
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()  # pretrain builds the grid from the config
        folder = f"{log_dir}/{i}"
        records = pretrain(parse_config(args + ["--log-dir", folder]),
                           on_end=gather_full_state_dict)
        state = records[-1]["on_end"] if dist.get_rank() == 0 else None
        records = read_records(folder)
        start = next(r for r in records if "activation_bytes_layers" in r)
        out.append({"steps": [r for r in records if "loss" in r], "state": state,
                    "valid": [r["valid_loss"] for r in records if "valid_loss" in r],
                    "activations": {k: v for k, v in start.items() if k.startswith("activation")}})
    return out


def _run(world: int, runs: list[list[str]], log_dir: str, cache: str) -> list[dict]:
    return run_distributed(_train_worker, world, runs, log_dir, cache,
                           timeout=300 * len(runs))[0]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cp2-checkpoint")


def _resume_runs(save: str) -> tuple[list[str], list[str]]:
    """(the cp 2 run that saves at iteration 2 and stops, the cp 1 x dp 2 run resuming it
    to iteration 3), both of 3 --train-iters so the LR schedule is the reference's."""
    base = _args("llama-dropout", [])
    return (base + ["--cp", "2", "--save", save, "--exit-interval", "2"],
            base + ["--load", save])


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_env):
    names = list(REFERENCES)
    out = _run(1, [_args(n, []) for n in names], str(tmp_path_factory.mktemp("ref")),
               corpus_env["SHARDZOO_CACHE"])
    return dict(zip(names, out))


@pytest.fixture(scope="module")
def case_results(tmp_path_factory, corpus_env, checkpoint_dir):
    """case -> rank 0's result; the cases of one world size run in one world; world 2 also
    runs the save at cp 2 and its resume at cp 1 (under the key "resume")."""
    extra = {}

    def run_cases(world, cases):
        runs = [_args(ref, flags) for _, _, ref, flags in cases]
        if world == 2:
            runs += list(_resume_runs(str(checkpoint_dir)))
        # world 4, once world 2 saved: the cp 2 checkpoint resumed at cp 4
        resume_cp4 = world == 4 and any(checkpoint_dir.glob("iter_*"))
        if resume_cp4:
            runs.append(_args("llama-dropout", ["--cp", "4", "--load", str(checkpoint_dir)]))
        out = _run(world, runs, str(tmp_path_factory.mktemp(f"world{world}")),
                   corpus_env["SHARDZOO_CACHE"])
        if world == 2:
            extra["resume"] = out[len(cases):]
        if resume_cp4:
            extra["resume_cp4"] = out[-1]
        return out[:len(cases)]

    get = batched_by_world(LAYOUTS, lambda c: c[1], run_cases)
    get.extra = extra
    return get


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_layout_matches_one_process(case, references, case_results):
    name, _, reference, flags = case
    out, ref = case_results(case), references[reference]
    k_step = training_chain_terms(_args(reference, flags))
    losses, norms = ([r[key] for r in out["steps"]] for key in ("loss", "grad_norm"))
    ref_losses, ref_norms = ([r[key] for r in ref["steps"]] for key in ("loss", "grad_norm"))
    assert len(losses) == 3
    assert ref_losses[-1] < ref_losses[0]  # it is training, not just agreeing
    assert_losses_close(losses, ref_losses, k_step)
    assert_losses_close(norms, ref_norms, k_step, "gradient norms")
    assert len(out["valid"]) == len(ref["valid"]) == (2 if reference == "llama" else 0)
    assert_losses_close(out["valid"], ref["valid"], k_step, "validation losses")
    assert sorted(out["state"]) == sorted(ref["state"])
    assert not weights_mismatch(out["state"], ref["state"], 3 * k_step), name


def test_activation_bytes_per_rank_are_predicted(references, case_results):
    """The start-up measurement of what one microbatch's decoder layers save for backward
    (training/memory.py) equals planner/activations.py's prediction at every cp layout, and
    falls with cp (each rank holds s/cp tokens; no s x s term): cp 4's is within 5% of a
    quarter of cp 1's."""
    layers = {}
    for case in LAYOUTS:
        a = case_results(case)["activations"]
        assert a["activation_bytes_layers"] == a["activation_bytes_layers_predicted"], (case, a)
        layers[case[0]] = a["activation_bytes_layers"]
    one = references["llama"]["activations"]["activation_bytes_layers"]
    assert layers["cp4"] < layers["cp2-all-gather"] < one, (layers, one)
    # the bound: cp 4 within 5% of a quarter of cp 1 (the same model, no dropout)
    assert abs(layers["cp4"] / (one / 4) - 1) < 0.05, (layers["cp4"], one)
    print(f"decoder-layer activation bytes per rank: cp 1 {one:,}, cp 2 "
          f"{layers['cp2-all-gather']:,}, cp 4 {layers['cp4']:,} "
          f"({layers['cp4'] / (one / 4):.4f} x a quarter of cp 1)")


def test_dropout_is_on_in_the_comparisons(references):
    """The dropout references differ from the dropout-free ones (the masks were applied), so
    the cp 2, cp 2 x tp 2 and cp 2 x dp 2 comparisons hold with dropout."""
    with_, without = references["llama-dropout"]["steps"], references["llama"]["steps"]
    assert all(a["loss"] != b["loss"] for a, b in zip(with_, without))


def test_cp2_checkpoint_resumes_at_cp1(references, case_results, checkpoint_dir):
    """Checkpoints are layout-free: saved at cp 2 after iteration 2, resumed at cp 1 (dp 2),
    iteration 3 gives the uninterrupted one-process loss and final weights; read in one
    process without a grid (the weights a converter or server reads), the checkpoint holds
    bitwise the weights the cp 2 run ended with."""
    from checkpoint.model_io import read_dense_weights

    case_results(LAYOUTS[0])  # world 2 ran the pair
    saved, resumed = case_results.extra["resume"]
    folders = sorted(checkpoint_dir.glob("iter_*"))
    assert [f.name for f in folders] == ["iter_0000002"]
    _, tensors = read_dense_weights(str(folders[0]))
    assert sorted(tensors) == sorted(saved["state"])
    for name, read in tensors.items():
        assert torch.equal(read(), saved["state"][name]), name
    ref = references["llama-dropout"]
    k_step = training_chain_terms(_args("llama-dropout", []))
    assert [r["iteration"] for r in saved["steps"]] == [1, 2]
    assert [r["iteration"] for r in resumed["steps"]][-1:] == [3]
    assert_losses_close([r["loss"] for r in saved["steps"]],
                        [r["loss"] for r in ref["steps"][:2]], k_step)
    assert_losses_close([resumed["steps"][-1]["loss"]], [ref["steps"][-1]["loss"]], 3 * k_step)
    assert not weights_mismatch(resumed["state"], ref["state"], 3 * k_step)


def test_cp2_checkpoint_resumes_at_cp4(references, case_results, checkpoint_dir):
    """The other direction: the cp 2 checkpoint of iteration 2 resumed at cp 4 (each rank
    now holds a quarter of every sequence) gives the uninterrupted one-process iteration 3."""
    case_results(LAYOUTS[0])  # world 2 saves first
    case_results(next(c for c in LAYOUTS if c[1] == 4))
    assert "resume_cp4" in case_results.extra, "world 4 ran before world 2 saved"
    resumed = case_results.extra["resume_cp4"]
    ref = references["llama-dropout"]
    k_step = training_chain_terms(_args("llama-dropout", ["--cp", "4"]))
    assert [r["iteration"] for r in resumed["steps"]] == [3]
    assert_losses_close([resumed["steps"][-1]["loss"]], [ref["steps"][-1]["loss"]], 3 * k_step)
    assert not weights_mismatch(resumed["state"], ref["state"], 3 * k_step)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("world, flags, message", [
    (2, LLAMA + ["--cp", "2", "--seq-length", "62"],
     "--seq-length 62 is not divisible by 2 x --context-parallel-size = 4"),
    (4, LLAMA + ["--cp", "2", "--tp", "2", "--sequence-parallel", "--seq-length", "36"],
     "--seq-length 36 is not divisible by 2 x --context-parallel-size x "
     "--tensor-model-parallel-size = 8"),
    (2, LLAMA + ["--cp", "2", "--reset-attention-mask"],
     "--reset-attention-mask (attention inside each packed document) is not built with "
     "--context-parallel-size 2"),
    (2, ["--model", "t5-tiny", "--cp", "2"],
     "--context-parallel-size 2 is for decoder-only models"),
    (2, LLAMA + ["--cp", "2", "--num-experts", "4", "--moe-expert-capacity-factor", "1.0"],
     "--moe-expert-capacity-factor is not built with --context-parallel-size 2"),
    (2, LLAMA + ["--cp", "2", "--dropout-masks", "rank-streams", "--hidden-dropout", "0.1"],
     "--dropout-masks rank-streams draws per-rank streams"),
    (6, LLAMA + ["--cp", "4"], "world size 6 is not divisible by --tensor-model-parallel-size "
     "1 x --context-parallel-size 4 x --pipeline-model-parallel-size 1 = 4"),
    (2, LLAMA + ["--cp", "2", "--cp-comm-type", "a2a"], "--cp-comm-type must be one of"),
    (2, LLAMA + ["--cp", "0"], "--context-parallel-size must be a positive integer"),
])
def test_unsupported_context_parallel_runs_are_refused(world, flags, message):
    from training.arguments import parse_config

    with pytest.raises(ConfigError) as e:
        parse_config(flags).validate(world)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_context_parallel_layout_sizes():
    """dp = world / (tp cp pp); the batch is split over dp only (CP ranks share samples)."""
    from training.arguments import parse_config

    c = parse_config(LLAMA + ["--cp", "2", "--tp", "2", "--global-batch-size", "8"])
    c.validate(8)
    assert (c.data_parallel_size, c.num_microbatches) == (2, 2)
    assert "cp 2 (p2p)" in c.summary()
