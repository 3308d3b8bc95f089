"""Data-parallel sharding strategies (ZeRO-1/2/3), CPU offload and bf16 mixed precision.

- Every `--data-parallel-sharding-strategy` (no_shard, optim, optim_grads,
  optim_grads_params), with `--optimizer-cpu-offload` too, with the optimizer on NVMe
  (`--optimizer-offload-device nvme`: dp 2, tp 2 x dp 2, pp 2 x dp 2) and ZeRO-3's parameters
  on NVMe (dp 2 under full recompute, tp 2 x dp 2 with the optimizer there too, pp 2 x dp 2
  with 30% of the optimizer in host memory) or in host memory (dp 4), at dp 2 and 4, with
  TP 2 + SP and
  with PP 2 (tied embedding, so its gradient all-reduce across stages runs on shards), and
  ZeRO-3 under full recompute, gives the same losses, gradient norms and weights after 5
  steps as torch.optim.AdamW in one process (the world-1 run), to 1e-5 relative per tensor
  (observed: ~1e-7) and within the rounding bound of tests/tolerances.py, with gradient
  clipping active every step; every DP replica ends with the same weights. Several
  strategies run in one spawned world, one after the other.
- Measured model-state bytes per rank equal the ZeRO formula (padded parameter count) exactly
  for each strategy, in float32 and bf16, with and without offload; ZeRO-3's gathered-
  parameter peak equals its prediction, and between uses only the shards stay allocated.
- A checkpoint saved under optim_grads_params at (tp2, dp2) resumes bitwise on the same layout,
  and to 1e-6 under no_shard at dp1 and under optim at (pp2, dp2).
- A --bf16 run (bf16 weights and activations, fp32 main weights, moments and gradient
  accumulation) trains and its loss stays within a few bf16 ulps of the float32 run's
  (tests/tolerances.py `bf16_loss_atol`: 4 x 2^-8 x |loss|) for 20 steps, also with ZeRO-1
  at dp 2 and ZeRO-3 with offload at dp 2.
"""
from __future__ import annotations

import pytest
import torch

from distributed import batched_by_world, run_distributed
from tolerances import (assert_losses_close, bf16_loss_atol, training_chain_terms,
                        weights_mismatch)

# --adam-eps 1e-4: see tests/test_pipeline.py (exactly-zero gradients make elementwise Adam
# comparisons ill-conditioned); --clip-grad 0.05 is below every step's norm (~1), so the
# clipping scale (hence the exact global norm) enters every update.
COMMON = ["--train-iters", "5", "--log-interval", "1", "--eval-interval", "0",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--no-tensorboard",
          "--adam-eps", "1e-4", "--clip-grad", "0.05", "--peak-tflops", "1"]
GPT = ["--config", "configs/tiny-gpt.yaml", "--num-layers", "2"]  # tied embeddings, biases
LLAMA = ["--config", "configs/tiny-llama.yaml", "--num-layers", "2"]  # untied, RMSNorm
STRATEGY = "--data-parallel-sharding-strategy"
OFFLOAD = ["--optimizer-cpu-offload"]
# ZeRO-Infinity: main weights and moments in raw files under a scratch folder ({offload}: a
# folder of the run's own, substituted by the worker), streamed per bucket
NVME = ["--optimizer-offload-device", "nvme", "--offload-path", "{offload}"]


def _train_worker(runs: list[list[str]], log_dir: str, cache: str):
    """pretrain() once per argument list in this run_distributed world; per run the losses,
    grad norms, full weights and the model-state records."""
    import json
    import os

    import parallel_state as ps
    from models.state_dict import gather_full_state_dict
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()  # pretrain builds the grid from the config
        offload = f"{log_dir}/{i}/offload"
        args = [a.replace("{offload}", offload) for a in args]

        def on_end(chunks):
            return {"state": gather_full_state_dict(chunks),
                    "dtypes": sorted({str(p.dtype) for c in chunks for p in c.parameters()})}

        records = pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]), on_end=on_end)
        steps = [r for r in records if "loss" in r]
        start = {}  # rank 0's start-up accounting: the run_start record of metrics.jsonl
        if os.path.exists(f"{log_dir}/{i}/metrics.jsonl"):
            start = json.loads(open(f"{log_dir}/{i}/metrics.jsonl").readline())
        out.append({"losses": [r["loss"] for r in steps],
                    "grad_norms": [r["grad_norm"] for r in steps],
                    "bytes": {k: v for k, v in {**start, **steps[-1]}.items()
                              if k.startswith(("model_state_", "gathered_"))},
                    "scratch_left": os.listdir(offload) if os.path.isdir(offload) else None,
                    **records[-1]["on_end"]})
    return out


def _run(world, runs, tmp_path, corpus_env):
    return run_distributed(_train_worker, world, runs, str(tmp_path),
                           corpus_env["SHARDZOO_CACHE"], timeout=max(600, 120 * len(runs)))


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_env):
    out = _run(1, [GPT + COMMON, LLAMA + COMMON], tmp_path_factory.mktemp("ref"), corpus_env)[0]
    return {"gpt": out[0], "llama": out[1]}


def _strategy(name: str, *extra: str) -> list[str]:
    return [STRATEGY, name, *extra]


CASES = [
    # id, family, world, layout flags, runs (strategy flags) in that one world
    ("dp2", "llama", 2, [], [
        _strategy("no_shard"), _strategy("optim"), _strategy("optim_grads"),
        _strategy("optim_grads_params"),
        _strategy("optim_grads_params", "--recompute-granularity", "full",
                  "--recompute-num-layers", "2"),
        _strategy("optim_grads_params", *OFFLOAD, "--optimizer-offload-fraction", "0.5"),
        _strategy("no_shard", *OFFLOAD),
        _strategy("optim_grads", *NVME, "--optimizer-offload-fraction", "0.6",
                  "--offload-buffer-count", "3", "--offload-buffer-size", "7000",
                  "--ddp-bucket-size", "20000"),
        _strategy("optim_grads_params", "--param-offload-device", "nvme", "--offload-path",
                  "{offload}", "--recompute-granularity", "full", "--recompute-num-layers",
                  "1", "--ddp-bucket-size", "20000")]),
    ("dp4-tied", "gpt", 4, [], [
        _strategy("no_shard"), _strategy("optim"), _strategy("optim_grads"),
        _strategy("optim_grads_params", "--param-offload-device", "cpu"),
        _strategy("optim_grads", *OFFLOAD)]),
    ("tp2-dp2-sp", "llama", 4, ["--tp", "2", "--sequence-parallel"], [
        _strategy("optim"), _strategy("optim_grads"), _strategy("optim_grads_params"),
        _strategy("optim_grads_params", *OFFLOAD),
        _strategy("optim_grads_params", *NVME, "--param-offload-device", "nvme",
                  "--ddp-bucket-size", "20000")]),
    ("pp2-dp2-tied", "gpt", 4, ["--pp", "2"], [
        _strategy("optim"), _strategy("optim_grads"), _strategy("optim_grads_params"),
        _strategy("optim_grads_params", *OFFLOAD, "--optimizer-offload-fraction", "0.3",
                  "--param-offload-device", "nvme", "--offload-path", "{offload}"),
        _strategy("optim", *NVME, "--offload-io-threads", "1")]),
]


def _case_base(case) -> list[str]:
    return (GPT if case[1] == "gpt" else LLAMA) + COMMON + case[3]


@pytest.fixture(scope="module")
def case_results(tmp_path_factory, corpus_env):
    """case -> `[rank][run]` results; the cases of one world size run in one world."""
    def run_cases(world, cases):
        flat = [_case_base(c) + r for c in cases for r in c[4]]
        out = _run(world, flat, tmp_path_factory.mktemp(f"world{world}"), corpus_env)
        starts = [sum(len(c[4]) for c in cases[:j]) for j in range(len(cases))]
        return [[rank_out[start:start + len(c[4])] for rank_out in out]
                for start, c in zip(starts, cases)]
    return batched_by_world(CASES, lambda c: c[2], run_cases)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sharding_strategies_match_adamw(case, references, case_results):
    _, family, world, layout, runs = case
    base = _case_base(case)
    out = case_results(case)
    ref = references[family]
    assert all(n > 0.05 for n in ref["grad_norms"])  # clipping was active at every step
    k_step = training_chain_terms(base)
    for i, flags in enumerate(runs):
        what = " ".join(flags)
        for rank_out in out:
            r = rank_out[i]
            assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
            assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), what
            assert_losses_close(r["losses"], ref["losses"], k_step, what)
        assert "model_state_total_bytes" in out[0][i]["bytes"], what
        for r in [o[i] for o in out if "model_state_total_bytes" in o[i]["bytes"]]:
            b = r["bytes"]  # (rank 0's) measured model states are exactly the formula's
            assert b["model_state_total_bytes"] == b["model_state_predicted_total_bytes"], what
            assert b["model_state_host_total_bytes"] == \
                b["model_state_predicted_host_total_bytes"], what
            nvme = "nvme" in flags
            host = "--optimizer-cpu-offload" in flags or "--optimizer-offload-device" in flags \
                or "--param-offload-device cpu" in what
            assert (b["model_state_host_total_bytes"] > 0) == host, what
            assert b["model_state_nvme_total_bytes"] == \
                b["model_state_predicted_nvme_total_bytes"], what
            assert (b["model_state_nvme_total_bytes"] > 0) == nvme, what
        if "nvme" in flags:  # every rank's scratch folder was removed when its run closed
            assert [o[i]["scratch_left"] for o in out] == [[]] * len(out), what
            if "pp" not in case[0] and "optim_grads_params" in flags:
                assert b["gathered_params_peak_bytes"] == \
                    b["model_state_gathered_params_predicted_peak_bytes"], what
        state = out[0][i]["state"]
        assert sorted(state) == sorted(ref["state"])
        assert not weights_mismatch(state, ref["state"], 5 * k_step), what
        for name, full in ref["state"].items():
            rel = float((state[name] - full).norm() / full.norm().clamp_min(1e-12))
            assert rel < 1e-5, f"{what}: {name}: relative error {rel:.2e}"
        for rank_out in out[1:]:  # every DP replica ends with the same weights
            other = rank_out[i]["state"]
            if other.keys() == state.keys():
                for name in state:
                    assert torch.equal(other[name], state[name]), (what, name)


def _state_bytes_worker(bf16: bool):
    """Build tiny-llama under every strategy (and ZeRO-3 with offload) on this dp-4 grid;
    report measured and formula bytes; run one ZeRO-3 forward/backward and record which
    gathered units are alive."""
    import parallel_state as ps
    from training.arguments import parse_config
    from data_parallel.ddp import STRATEGIES, DistributedDataParallel
    from data_parallel.distributed_optimizer import DistributedOptimizer
    from data_parallel.fsdp import peak_gathered_bytes
    from training.memory import model_state_bytes
    from training.optimizer import build_optimizer
    from training.trainer import build_model

    config = parse_config(["--config", "configs/tiny-llama.yaml", "--num-layers", "2",
                           "--bf16" if bf16 else "--no-bf16"])
    config.validate(torch.distributed.get_world_size())
    out = {}
    for strategy, fraction in [(s, 0.0) for s in STRATEGIES] + [("optim_grads_params", 0.25)]:
        chunks = build_model(config, torch.device("cpu"))
        model = [DistributedDataParallel(c, data_parallel_group=ps.get_data_parallel_group(),
                                         bucket_size=100_000,
                                         data_parallel_sharding_strategy=strategy)
                 for c in chunks]
        if strategy == "no_shard" and not bf16:
            opt = build_optimizer(chunks[0], lr=1e-3, weight_decay=0.01)
        else:
            opt = DistributedOptimizer(model, lr=1e-3, weight_decay=0.01,
                                       shard=strategy != "no_shard", offload_fraction=fraction)
        rec = {"bytes": model_state_bytes(model, opt),
               "param_dtypes": {str(p.dtype) for c in chunks for p in c.parameters()}}
        if isinstance(opt, DistributedOptimizer):
            rec["main_dtypes"] = {str(t.dtype) for s in opt.shards
                                  for t in (s.main, s.exp_avg, s.exp_avg_sq)}
        if strategy == "optim_grads_params" and not fraction:
            ddp = model[0]
            alive = lambda: [u.name for u in ddp.units.order if u.gathered]  # noqa: E731
            rec["alive_at_start"] = alive()
            peak_gathered_bytes(reset=True)
            tokens = torch.randint(0, 100, (2, 64))
            loss = ddp(tokens, labels=tokens).sum()
            rec["alive_after_forward"] = alive()
            loss.backward()
            ddp.finish_grad_sync()
            rec["alive_after_backward"] = alive()
            rec["storage_bytes_after_backward"] = sum(
                p.untyped_storage().nbytes() for p in ddp.params)
            rec["peak"] = peak_gathered_bytes()
            rec["unit_bytes"] = ddp.units.unit_bytes()
        out[(strategy, fraction)] = rec
    return out


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_model_state_bytes_equal_formula(bf16):
    dp = 4
    w = 2 if bf16 else 4
    for r in run_distributed(_state_bytes_worker, dp, bf16):
        for (strategy, fraction), rec in r.items():
            b, what = rec["bytes"], (strategy, fraction)
            psi, padded = b["psi"], b["psi_padded"]
            assert rec["param_dtypes"] == {"torch.bfloat16" if bf16 else "torch.float32"}
            assert rec.get("main_dtypes", {"torch.float32"}) == {"torch.float32"}
            assert b["total"] == b["predicted_total"], what
            assert b["host_total"] == b["predicted_host_total"], what
            assert 0 <= padded - psi < dp * 20, what  # < dp elements of padding per bucket
            k = 12 if bf16 else 8
            # Rajbhandari et al. 2020 sec. 5 (with our byte counts, padded psi)
            expect = {"no_shard": (w + 4 + k) * padded,
                      "optim": (w + 4) * padded + k * padded // dp,
                      "optim_grads": w * padded + (4 + k) * padded // dp,
                      "optim_grads_params": (w + 4 + k) * padded // dp}[strategy]
            host = int(fraction * padded // dp)
            expect -= k * host
            assert b["total"] == expect, what
            assert b["host_total"] == 16 * host, what
            assert abs(b["paper_total"] - b["total"]) <= 20 * dp * (w + 4 + k), what
        rec = r[("optim_grads_params", 0.0)]
        units = dict(rec["unit_bytes"])
        assert rec["alive_at_start"] == []  # only the shards are allocated between uses
        # root (final norm) and the last unit (output layer) stay for backward, layers do not
        assert rec["alive_after_forward"] == ["root", "ColumnParallelLinear"]
        assert rec["alive_after_backward"] == [] and rec["storage_bytes_after_backward"] == 0
        layer = units["TransformerLayer"]
        assert rec["peak"] == units["root"] + max(units["LanguageModelEmbedding"] + layer,
                                                  layer + units["ColumnParallelLinear"])
        assert rec["peak"] == rec["bytes"]["gathered_params_predicted_peak"]


CKPT = LLAMA + ["--num-query-groups", "4", "--train-iters", "6", "--log-interval", "1",
                "--eval-interval", "0", "--no-tensorboard", "--peak-tflops", "1"]


def test_checkpoint_across_strategies(tmp_path, corpus_env):
    """Saved under optim_grads_params with the optimizer on NVMe at (tp2, dp2), iteration 3
    resumes bitwise there, and to 1e-6 without offload under optim at (pp2, dp2) and under
    no_shard at dp 1; the pp2 run's own checkpoint of iteration 4 (no offload) resumes with
    the optimizer on NVMe under optim_grads at dp 4 (the scratch files are never a
    checkpoint's source or target: both ways go through the normal state dict)."""
    save, save2 = str(tmp_path / "save"), str(tmp_path / "save2")
    ckpt = save + "/iter_0000003"
    zero3 = CKPT + ["--tp", "2", STRATEGY, "optim_grads_params", *NVME]
    four = _run(4, [zero3 + ["--save", save, "--save-interval", "3"],
                    zero3 + ["--load", ckpt],
                    CKPT + ["--pp", "2", STRATEGY, "optim", "--load", ckpt, "--save", save2,
                            "--save-interval", "4"],
                    CKPT + [STRATEGY, "optim_grads", *NVME, "--load", save2 + "/iter_0000004"]],
                tmp_path / "four", corpus_env)[0]
    one = _run(1, [CKPT + [STRATEGY, "no_shard", "--load", ckpt]], tmp_path / "one",
               corpus_env)[0]
    ref = four[0]["losses"]
    assert len(ref) == 6 and ref[-1] < ref[0]
    assert four[1]["losses"] == ref[3:]  # bitwise
    for resumed in (four[2], one[0]):
        assert resumed["losses"] == pytest.approx(ref[3:], rel=1e-6)
    assert four[3]["losses"] == pytest.approx(ref[4:], rel=1e-6)
    for name, full in four[0]["state"].items():  # and the final weights agree
        for resumed in (four[1], four[2], four[3], one[0]):
            rel = float((resumed["state"][name] - full).norm() / full.norm().clamp_min(1e-12))
            assert rel < 1e-5, (name, rel)


def test_sharding_flags_validated_up_front():
    from models.config import ConfigError
    from training.arguments import parse_config

    def resolved(*flags):
        t = parse_config(LLAMA + list(flags)).validate(4).train
        return t.data_parallel_sharding_strategy, t.use_distributed_optimizer, \
            t.optimizer_offload_fraction

    assert resolved() == ("no_shard", False, None)
    assert resolved("--use-distributed-optimizer") == ("optim", True, None)
    assert resolved(STRATEGY, "optim_grads_params") == ("optim_grads_params", True, None)
    assert resolved(*OFFLOAD) == ("no_shard", False, 1.0)
    with pytest.raises(ConfigError, match="contradicts --data-parallel-sharding-strategy"):
        resolved("--use-distributed-optimizer", STRATEGY, "no_shard")
    with pytest.raises(ConfigError, match="must be one of"):
        resolved(STRATEGY, "zero3")
    with pytest.raises(ConfigError, match="needs --optimizer-cpu-offload"):
        resolved("--optimizer-offload-fraction", "0.5")
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\]"):
        resolved(*OFFLOAD, "--optimizer-offload-fraction", "1.5")


BF16_RUN = ["--config", "configs/tiny-llama.yaml", "--train-iters", "20", "--eval-interval",
            "0", "--log-interval", "1", "--no-tensorboard", "--peak-tflops", "1"]


def test_bf16_tracks_fp32(tmp_path, corpus_env):
    fp32, bf16 = _run(1, [BF16_RUN, BF16_RUN + ["--bf16"]], tmp_path / "one", corpus_env)[0]
    zero1, zero3 = _run(2, [BF16_RUN + ["--bf16", "--use-distributed-optimizer"],
                            BF16_RUN + ["--bf16", STRATEGY, "optim_grads_params", *OFFLOAD]],
                        tmp_path / "two", corpus_env)[0]
    assert fp32["dtypes"] == ["torch.float32"]
    assert bf16["dtypes"] == zero1["dtypes"] == zero3["dtypes"] == ["torch.bfloat16"]
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.5  # it trains
    for run in (bf16, zero1, zero3):
        for a, b in zip(run["losses"], fp32["losses"]):
            assert abs(a - b) <= bf16_loss_atol(b), (run["losses"], fp32["losses"])


def _resident_peak_kib(reset: bool = False) -> int:
    """This process's peak resident memory (VmHWM, KiB); `reset`: restart it from now."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak resident set size
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _zero3_build_worker(argv: list[str]):
    """Build the model under ZeRO-3 at this world's dp, gather it, then build it dense: the
    build's peak resident memory, the wrapper's parameter and gradient shard bytes, the whole
    model's bytes, the parameters unequal to the dense ones, those left on the meta device."""
    import ctypes

    import torch.distributed as dist

    from training.arguments import parse_config
    from training.trainer import build_model, wrap_model

    # glibc keeps freed blocks under its adaptive mmap threshold (up to 32 MB) in the heap;
    # a fixed 1 MiB one gives every larger block back on free: the peak counts live memory
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20) == 1  # M_MMAP_THRESHOLD
    world, cpu = dist.get_world_size(), torch.device("cpu")
    config = parse_config(argv + [STRATEGY, "optim_grads_params"]).validate(world)
    base = _resident_peak_kib(reset=True)
    chunks = build_model(config, cpu)
    model = wrap_model(config, chunks, cpu)
    peak = (_resident_peak_kib() - base) * 1024
    states = sum(t.numel() * t.element_size() for t in (model[0].param_shards,
                                                         model[0].grad_shards))
    model[0].units.gather_all()
    zero3 = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    dense = build_model(parse_config(argv).validate(world), cpu)[0]
    whole = sum(p.numel() * p.element_size() for p in dense.parameters())
    equal = [n for n, p in dense.named_parameters() if not torch.equal(zero3[n], p)]
    return peak, states, whole, equal, [n for n, p in chunks[0].named_parameters() if p.is_meta]


def test_zero3_builds_without_a_whole_model_copy():
    """ZeRO-3 makes each sharding unit's full values from the seed, keeps this rank's shard and
    frees the rest, one unit at a time (data_parallel/fsdp.py `build`): at dp 2 the build's
    peak resident memory beyond the shards it keeps (parameters and float32 gradients) is
    under half the model (measured: 34 MiB for this 240 MiB model, one unit and its init;
    before, when the model was built whole and then sharded: 258 MiB), and the weights are the
    dense build's, bit for bit (a 16-layer, 63M-parameter llama)."""
    argv = LLAMA[:2] + ["--num-layers", "16", "--hidden-size", "512", "--ffn-hidden-size",
                        "1536", "--num-attention-heads", "8", "--num-query-groups", "8"]
    for peak, states, whole, unequal, meta in run_distributed(_zero3_build_worker, 2, argv):
        assert whole > 250e6 and peak - states < whole / 2, (peak / 2**20, states / 2**20)
        assert unequal == [] and meta == []


def test_meta_parameters_need_zero3():
    """A model with meta-device parameters is refused, naming the fix, by every strategy but
    ZeRO-3 and by ZeRO-3 without `param_init`."""
    from data_parallel.ddp import DistributedDataParallel
    from layers import parameters_on_meta

    with parameters_on_meta():
        module = torch.nn.Linear(4, 4)
    assert module.weight.is_meta and module.bias.is_meta
    for strategy, init in [("no_shard", None), ("optim", None), ("optim_grads_params", None)]:
        with pytest.raises(ValueError, match="materialized only by ZeRO-3: pass "
                                             "data_parallel_sharding_strategy"):
            DistributedDataParallel(module, data_parallel_sharding_strategy=strategy,
                                    param_init=init, device="cpu")
    ddp = DistributedDataParallel(module, data_parallel_sharding_strategy="optim_grads_params",
                                  param_init=lambda name, p: torch.full(p.shape, 2.0),
                                  device="cpu")
    ddp.units.gather_all()
    assert not module.weight.is_meta and torch.equal(module.weight, torch.full((4, 4), 2.0))
