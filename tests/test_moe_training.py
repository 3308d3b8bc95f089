"""Training a mixture of experts at any layout (the trainer's side): train.py's
pretrain() at ep 2, ep 4, ep 2 x tp 2 (sequence parallel), ep 2 x pp 2, ep 2 x dp 2 (world
4: edp 2) under ZeRO-3 and ep 2 x cp 2 (ep carved out of dp x cp; dropless) gives the losses, gradient norms (with clipping active every step, so
the exact global norm over dense and expert gradients enters every update) and final weights
of one process, to tests/tolerances.py's derived bound (`k` from the dense model's chain,
which is longer than the MoE layer's: router and fc1 over h, fc2 over the expert width, the
k choices); dropless with the auxiliary loss, the z-loss and the expert bias on, and again
with capacity dropping. Per step and MoE layer the tokens and dropped tokens per expert in
metrics.jsonl (gathered over the pipeline stages) are exactly one process's, the expert bias
ends bitwise equal, and the replica check (every step) compares expert weights over the
expert-data-parallel ranks only: it passes although EP ranks hold different experts, and
names a perturbed expert weight. A skipped step (NaN loss) leaves weights and expert bias
bitwise unchanged. Bad expert layouts fail validation with the flag and the fix.

Tiny model: tiny-llama (4 layers, h 64) with layers 0 and 2 MoE (--moe-layer-freq 2: dense
and expert parameters side by side on every pipeline stage), 8 experts of width 32, top-2
sigmoid routing, float32, dropout 0. Three worlds (1, 2 and 4 processes); the runs of one
world run one after the other in it.
"""
from __future__ import annotations

import math

import pytest
import torch

from distributed import batched_by_world, run_distributed
from models.config import ConfigError
from tolerances import assert_losses_close, training_chain_terms, weights_mismatch

MOE = ["--config", "configs/tiny-llama.yaml", "--num-experts", "8", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "2",
       "--moe-router-score-function", "sigmoid", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "0.01"]
# --adam-eps 1e-4 and --clip-grad 0.05: see tests/test_distributed_optimizer.py
COMMON = ["--train-iters", "5", "--log-interval", "1", "--eval-interval", "0",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--no-tensorboard",
          "--adam-eps", "1e-4", "--clip-grad", "0.05", "--peak-tflops", "1"]
CAPACITY = ["--moe-expert-capacity-factor", "0.75"]  # drops a share of every step's tokens
REPLICAS = ["--check-weight-hash-across-dp-replicas-interval", "1"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]

LAYOUTS = [  # id, world, flags
    ("ep2", 2, ["--ep", "2"]),
    ("ep4", 4, ["--ep", "4"]),
    ("ep2-tp2-sp", 4, ["--ep", "2", "--tp", "2", "--sequence-parallel"]),
    ("ep2-pp2", 4, ["--ep", "2", "--pp", "2"]),
    ("ep2-dp2-zero3", 4, ["--ep", "2", *ZERO3]),
    # context parallelism: each rank routes its part of every sequence (dropless only)
    ("ep2-cp2", 4, ["--ep", "2", "--context-parallel-size", "2"]),
]
CASES = [(name, world, flags, drop) for name, world, flags in LAYOUTS for drop in (False, True)
         if not (drop and "--context-parallel-size" in flags)]


def _args(flags: list[str], drop: bool) -> list[str]:
    return MOE + COMMON + flags + (CAPACITY if drop else [])


# ----------------------------------------------------------------------------- in the workers

def _end_of_run(chunks, replica_probe: bool) -> dict:
    """pretrain's on_end: the full weights and expert biases (rank 0's and every rank's), and
    with `replica_probe` the replica check's verdicts before and after one expert weight of
    global rank 0 is perturbed (restored afterwards)."""
    import torch.distributed as dist

    from models.state_dict import gather_full_state_dict
    from training.replicas import ReplicaMismatchError, check_replicas

    state = gather_full_state_dict(chunks)
    biases = {f"{n}": b.clone() for c in chunks for n, b in c.named_buffers()
              if n.endswith("expert_bias")}
    out = {"state": state if dist.get_rank() == 0 else None, "biases": biases}
    if replica_probe:
        verdicts = []
        expert = next(p for c in chunks for n, p in c.named_parameters()
                      if getattr(p, "expert_parallel", False))
        for perturb in (False, True):
            if perturb and dist.get_rank() == 0:
                expert.data.view(-1)[0] += 1.0
            try:
                check_replicas(chunks, 5)
                verdicts.append(None)
            except ReplicaMismatchError as e:
                verdicts.append(str(e))
        if dist.get_rank() == 0:
            expert.data.view(-1)[0] -= 1.0
        out["replicas"] = verdicts
    return out


def _train_worker(runs: list[tuple[list[str], dict]], log_dir: str, cache: str) -> list[dict]:
    """pretrain() once per (arguments, options) in this run_distributed world; per run its
    step records (from rank 0's metrics.jsonl), skipped-step records, and `_end_of_run`.
    Options: `replica_probe`, `nonfinite` (SHARDZOO_TEST_NONFINITE for that run)."""
    import os

    import parallel_state as ps
    from training.arguments import parse_config
    from training.metrics import read_records
    from training.nonfinite import TEST_ENV
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, (args, options) in enumerate(runs):
        ps.destroy_model_parallel()  # pretrain builds the grid from the config
        os.environ.pop(TEST_ENV, None)
        if options.get("nonfinite"):
            os.environ[TEST_ENV] = options["nonfinite"]
        folder = f"{log_dir}/{i}"
        records = pretrain(parse_config(args + ["--log-dir", folder]), on_end=lambda c: (
            _end_of_run(c, options.get("replica_probe", False))))
        os.environ.pop(TEST_ENV, None)
        steps = [r for r in read_records(folder) if "loss" in r] \
            if os.path.exists(f"{folder}/metrics.jsonl") else None
        out.append({"steps": steps, "skipped": [r for r in records if r.get("event") == "skipped"],
                    **records[-1]["on_end"]})
    return out


def _ddp_refuses_expert_weights_without_their_group() -> str:
    """At ep 2, a data-parallel wrapper given no expert-data-parallel group would sum
    different experts' gradients over dp: it refuses."""
    import parallel_state as ps
    from data_parallel.ddp import DistributedDataParallel
    from layers.moe import MoELayer
    from models import ModelConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, device="cpu", expert_model_parallel_size=2)
    config = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8,
                         seq_length=4, add_bias_linear=False, num_moe_experts=4)
    config.validate()
    try:
        DistributedDataParallel(MoELayer(config), data_parallel_group=ps.get_data_parallel_group())
    except ValueError as e:
        return str(e)
    return "no error"


def _world2_worker(runs, log_dir, cache):
    return {"runs": _train_worker(runs, log_dir, cache),
            "ddp_error": _ddp_refuses_expert_weights_without_their_group()}


# ----------------------------------------------------------------------------- fixtures

SKIP = ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]  # step 1 alike in both
SKIP_RUNS = [(MOE + COMMON + SKIP + ["--train-iters", "1"], {}),
             (MOE + COMMON + SKIP + ["--train-iters", "2"], {"nonfinite": "loss:2"})]


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_env):
    """The one-process runs: dropless, capacity dropping, and the skipped-step pair."""
    runs = [(_args([], False), {}), (_args([], True), {})] + SKIP_RUNS
    out = run_distributed(_train_worker, 1, runs, str(tmp_path_factory.mktemp("ref")),
                          corpus_env["SHARDZOO_CACHE"], timeout=600)[0]
    return {False: out[0], True: out[1], "skip": out[2:]}


@pytest.fixture(scope="module")
def case_results(tmp_path_factory, corpus_env):
    """case -> rank 0's result (and, under "ranks", every rank's); the cases of one world size
    run in one world."""
    extra = {}

    def run_cases(world, cases):
        runs = [(_args(flags, drop), {"replica_probe": name == "ep2-dp2-zero3" and not drop})
                for name, _, flags, drop in cases]
        for args, _ in runs:
            args += REPLICAS
        log_dir, cache = str(tmp_path_factory.mktemp(f"world{world}")), corpus_env["SHARDZOO_CACHE"]
        if world == 2:
            out = run_distributed(_world2_worker, world, runs, log_dir, cache, timeout=600)
            extra["ddp_error"] = out[0]["ddp_error"]
            out = [o["runs"] for o in out]
        else:
            out = run_distributed(_train_worker, world, runs, log_dir, cache, timeout=900)
        return [dict(out[0][i], ranks=[o[i] for o in out]) for i in range(len(cases))]

    get = batched_by_world(CASES, lambda c: c[1], run_cases)
    get.extra = extra
    return get


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}{'-capacity' if c[3] else ''}"
                                             for c in CASES])
def test_layout_matches_one_process(case, references, case_results):
    name, _, flags, drop = case
    out, ref = case_results(case), references[drop]
    args = _args(flags, drop)
    k_step = training_chain_terms(args)
    losses, norms = ([r[key] for r in out["steps"]] for key in ("loss", "grad_norm"))
    ref_losses, ref_norms = ([r[key] for r in ref["steps"]] for key in ("loss", "grad_norm"))
    assert len(losses) == 5
    assert all(n > 0.05 for n in ref_norms)  # clipping was active at every step
    assert ref_losses[-1] < ref_losses[0]  # it is training, not just agreeing
    assert_losses_close(losses, ref_losses, k_step)
    assert_losses_close(norms, ref_norms, k_step, "gradient norms")
    assert sorted(out["state"]) == sorted(ref["state"])
    assert not weights_mismatch(out["state"], ref["state"], 5 * k_step), name
    for step, (got, want) in enumerate(zip(out["steps"], ref["steps"]), 1):
        assert sorted(got["moe"]) == ["layer_0", "layer_2"]  # layer 2: from stage 1 under pp
        for layer, load in want["moe"].items():
            mine = got["moe"][layer]
            for key in ("tokens_per_expert", "dropped_per_expert", "min_tokens", "max_tokens",
                        "dropped_tokens", "imbalance"):
                assert mine[key] == load[key], (step, layer, key, mine[key], load[key])
            for key in ("aux_loss", "z_loss"):
                assert math.isclose(mine[key], load[key], rel_tol=1e-5), (step, layer, key)
            assert sum(load["tokens_per_expert"]) == 8 * 64 * 2  # every token's top-2 copies
            assert (load["dropped_tokens"] > 0) == drop, (step, layer, load)
    biases = {}
    for rank in out["ranks"]:
        for n, b in rank["biases"].items():
            assert n not in biases or torch.equal(biases[n], b), n  # TP / DP copies agree
            biases[n] = b
    assert sorted(biases) == sorted(ref["biases"])
    for n, b in ref["biases"].items():
        assert b.abs().sum() > 0, n  # the bias moved
        assert torch.equal(biases[n], b), (n, biases[n], b)


def test_replica_check_compares_experts_over_expert_data_parallel(case_results):
    """ep 2 x dp 2 (edp 2): the check passes with different experts on the two EP ranks and
    names an expert weight that one of its expert-data-parallel replicas changed."""
    out = case_results(next(c for c in CASES if c[0] == "ep2-dp2-zero3" and not c[3]))
    before, after = out["replicas"]
    assert before is None
    assert "experts.linear_fc" in after and "expert-data-parallel replicas" in after, after
    assert "ranks [0] vs [2]" in after, after  # rank 0's edp peer is rank 2 (ep ranks 0, 1)


def test_skipped_step_leaves_expert_bias(references):
    """A step skipped for a NaN loss moves neither the weights nor the expert bias: 2 steps
    with the second skipped end bitwise where 1 step ends."""
    one, two = references["skip"]
    assert [r["iteration"] for r in two["skipped"]] == [2]
    assert all(b.abs().sum() > 0 for b in one["biases"].values())  # step 1 moved it
    for n, b in one["biases"].items():
        assert torch.equal(two["biases"][n], b), n
    for n, w in one["state"].items():
        assert torch.equal(two["state"][n], w), n


def test_ddp_refuses_expert_weights_without_their_group(case_results):
    case_results(CASES[0])  # the world-2 run also tries the wrapper
    assert "expert-data-parallel group" in case_results.extra["ddp_error"]


@pytest.mark.parametrize("world, flags, message", [
    (2, ["--config", "configs/tiny-llama.yaml", "--ep", "2"],
     "--expert-model-parallel-size 2 splits the experts of MoE layers over ranks, but "
     "--num-experts is not set"),
    (4, MOE + ["--num-experts", "6", "--ep", "4"],
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (4, MOE + ["--ep", "4", "--tp", "2"],
     "--expert-model-parallel-size 4 must divide the data-parallel size 2"),
    (4, MOE + ["--ep", "2", "--tp", "2", "--expert-tensor-parallel-size", "1"],
     "--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2 is not built"),
    (2, MOE + ["--ep", "2", "--moe-layer-freq", "[0,0,0,0]"],
     "--moe-layer-freq makes no layer an MoE layer; put a 1 in --moe-layer-freq"),
    (2, MOE + ["--expert-model-parallel-size", "0"],
     "--expert-model-parallel-size must be a positive integer, got 0"),
])
def test_bad_expert_layouts_are_refused(world, flags, message):
    from training.arguments import parse_config

    with pytest.raises(ConfigError) as e:
        parse_config(flags).validate(world)
    assert message in str(e.value)


def test_megatron_flag_spellings():
    from training.arguments import parse_config

    c = parse_config(MOE + ["--moe-router-pre-softmax", "--moe-router-score-function",
                            "softmax", "--moe-shared-expert-intermediate-size", "16",
                            "--moe-expert-capacity-factor", "1.5",
                            "--expert-model-parallel-size", "2",
                            "--expert-tensor-parallel-size", "1", "--num-experts", "4"])
    m, t = c.model, c.train
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_router_score_function) == \
        (4, 2, "softmax")
    assert m.moe_router_pre_softmax and m.moe_router_enable_expert_bias
    assert (m.moe_shared_expert_intermediate_size, m.moe_layer_freq) == (16, 2)
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_router_bias_update_rate,
            m.moe_expert_capacity_factor) == (0.01, 0.001, 0.01, 1.5)
    assert (t.expert_model_parallel_size, t.expert_tensor_parallel_size) == (2, 1)
    assert parse_config(["--ep", "4"]).train.expert_model_parallel_size == 4


def test_tensorboard_gets_nested_numbers():
    from training.metrics import _scalars

    record = {"iteration": 3, "loss": 1.5, "moe_imbalance_max": 1.2,
              "moe": {"layer_2": {"imbalance": 1.2, "tokens_per_expert": [1, 2]}}}
    assert list(_scalars(record, "train")) == [
        ("train/loss", 1.5), ("train/moe_imbalance_max", 1.2),
        ("train/moe/layer_2/imbalance", 1.2)]
