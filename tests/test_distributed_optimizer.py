"""Distributed optimizer (ZeRO stage 1) and bf16 mixed precision (issue 4, items 1-2).

- `--use-distributed-optimizer` at dp 2 and 4, with TP 2 + SP and with PP 2 (tied embedding,
  so its gradient all-reduce across stages runs on the reduce-scattered shard), gives the same
  weights after 5 steps as torch.optim.AdamW in one process (the world-1 run without the flag),
  with gradient clipping active every step, and the same reported gradient norms, up to
  rounding (tests/tolerances.py: `k` = the training steps' chains);
- per-rank AdamW state bytes are 1/dp of the unsharded figure within the bucket padding, and
  under --bf16 the weights are bf16 while main weights and moments are float32;
- a --bf16 run (bf16 weights and activations, fp32 main weights, moments and gradient
  accumulation) trains and its loss stays within a few bf16 ulps of the float32 run's
  (tests/tolerances.py `bf16_loss_atol`: 4 x 2^-8 x |loss|) for 20 steps, also with ZeRO at
  dp 2.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from tolerances import (assert_losses_close, bf16_loss_atol, training_chain_terms,
                        weights_mismatch)

# --adam-eps 1e-4: see tests/test_pipeline.py (exactly-zero gradients make elementwise Adam
# comparisons ill-conditioned); --clip-grad 0.05 is below every step's norm (~1), so the
# clipping scale (hence the exact global norm) enters every update.
COMMON = ["--train-iters", "5", "--log-interval", "1", "--eval-interval", "0",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--no-tensorboard",
          "--adam-eps", "1e-4", "--clip-grad", "0.05"]
GPT = ["--config", "configs/tiny-gpt.yaml", "--num-layers", "2"]  # tied embeddings, biases
LLAMA = ["--config", "configs/tiny-llama.yaml", "--num-layers", "2"]  # untied, RMSNorm
ZERO = ["--use-distributed-optimizer"]


def _train_worker(args: list[str], log_dir: str, cache: str):
    """pretrain() in a run_distributed world; losses, grad norms and the full weights."""
    import os

    import parallel_state as ps
    from models.state_dict import gather_full_state_dict
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    ps.destroy_model_parallel()  # pretrain builds the grid from the config

    def on_end(chunks):
        return {"state": gather_full_state_dict(chunks),
                "dtypes": sorted({str(p.dtype) for c in chunks for p in c.parameters()})}

    records = pretrain(parse_config(args + ["--log-dir", log_dir]), on_end=on_end)
    return {"losses": [r["loss"] for r in records if "loss" in r],
            "grad_norms": [r["grad_norm"] for r in records if "grad_norm" in r],
            **records[-1]["on_end"]}


def _run(world, args, tmp_path, corpus_env):
    return run_distributed(_train_worker, world, args, str(tmp_path),
                           corpus_env["SHARDZOO_CACHE"], timeout=300)


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_env):
    return {name: _run(1, args + COMMON, tmp_path_factory.mktemp(name), corpus_env)[0]
            for name, args in (("gpt", GPT), ("llama", LLAMA))}


CASES = [
    # id, family, world, extra flags
    ("dp2", "llama", 2, []),
    ("dp4-tied", "gpt", 4, []),
    ("tp2-dp2-sp", "llama", 4, ["--tp", "2", "--sequence-parallel"]),
    ("pp2-dp2-tied", "gpt", 4, ["--pp", "2"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_distributed_optimizer_matches_adamw(case, references, tmp_path, corpus_env):
    _, family, world, extra = case
    out = _run(world, (GPT if family == "gpt" else LLAMA) + COMMON + ZERO + extra, tmp_path,
               corpus_env)
    ref = references[family]
    assert all(n > 0.05 for n in ref["grad_norms"])  # clipping was active at every step
    k_step = training_chain_terms((GPT if family == "gpt" else LLAMA) + COMMON)
    for rank_out in out:
        assert_losses_close(rank_out["losses"], ref["losses"], k_step)
        # a norm of step t sums the squares of every gradient element on top of the chain
        assert_losses_close(rank_out["grad_norms"], ref["grad_norms"], k_step, "grad norms")
    state = out[0]["state"]
    assert sorted(state) == sorted(ref["state"])
    assert not weights_mismatch(state, ref["state"], 5 * k_step)
    for rank_out in out[1:]:  # every DP replica ends with the same (all-gathered) weights
        if rank_out["state"].keys() == state.keys():
            for name in state:
                assert torch.equal(rank_out["state"][name], state[name]), name


def _state_bytes_worker(bf16: bool):
    """Build tiny-llama with DDP + the distributed optimizer on this grid; report bytes."""
    import parallel_state as ps
    from training.arguments import parse_config
    from training.distributed import DistributedDataParallel
    from training.distributed_optimizer import DistributedOptimizer, model_state_bytes
    from training.trainer import build_model

    config = parse_config(["--config", "configs/tiny-llama.yaml", "--bf16" if bf16 else
                           "--no-bf16", "--ddp-bucket-size", "100000"])
    config.validate(torch.distributed.get_world_size())
    chunks = build_model(config, torch.device("cpu"))
    model = [DistributedDataParallel(c, data_parallel_group=ps.get_data_parallel_group(),
                                     bucket_size=100_000, use_distributed_optimizer=True)
             for c in chunks]
    opt = DistributedOptimizer(model, lr=1e-3, weight_decay=0.01)
    return {"bytes": model_state_bytes(model, opt),
            "buckets": sum(len(d.buffer.buckets) for d in model),
            "numel": sum(p.numel() for c in chunks for p in c.parameters()),
            "param_dtypes": {str(p.dtype) for c in chunks for p in c.parameters()},
            "main_dtypes": {str(s.main.dtype) for s in opt.shards}
            | {str(s.exp_avg.dtype) for s in opt.shards}}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_state_bytes_are_sharded(bf16):
    dp = 4
    for r in run_distributed(_state_bytes_worker, dp, bf16):
        b, n, padding = r["bytes"], r["numel"], dp * r["buckets"]  # < dp elements per bucket
        assert r["param_dtypes"] == {"torch.bfloat16" if bf16 else "torch.float32"}
        assert r["main_dtypes"] == {"torch.float32"}
        assert b["params"] == n * (2 if bf16 else 4)
        assert b["unsharded_optimizer_states"] == 8 * n
        assert 0 <= b["optimizer_states"] * dp - 8 * n < 8 * padding
        assert n * 4 <= b["grads"] < (n + padding) * 4  # fp32 grad buffer, unsharded (ZeRO-1)
        if bf16:
            assert b["unsharded_main_params"] == 4 * n
            assert 0 <= b["main_params"] * dp - 4 * n < 4 * padding
        else:  # fp32 main weights are the model weights themselves
            assert b["main_params"] == b["unsharded_main_params"] == 0


BF16_RUN = ["--config", "configs/tiny-llama.yaml", "--train-iters", "20", "--eval-interval",
            "0", "--log-interval", "1", "--no-tensorboard"]


def test_bf16_tracks_fp32(tmp_path, corpus_env):
    fp32 = _run(1, BF16_RUN, tmp_path / "fp32", corpus_env)[0]
    bf16 = _run(1, BF16_RUN + ["--bf16"], tmp_path / "bf16", corpus_env)[0]
    zero = _run(2, BF16_RUN + ["--bf16"] + ZERO, tmp_path / "zero", corpus_env)[0]
    assert fp32["dtypes"] == ["torch.float32"]
    assert bf16["dtypes"] == zero["dtypes"] == ["torch.bfloat16"]
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.5  # it trains
    for run in (bf16, zero):
        for a, b in zip(run["losses"], fp32["losses"]):
            assert abs(a - b) <= bf16_loss_atol(b), (run["losses"], fp32["losses"])
