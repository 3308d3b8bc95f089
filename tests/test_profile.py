"""`train.py --profile` (issue 16): the categories an operator's time lands in, the flag
checks, and one torchrun job (tp=2 with sequence parallel, both ranks profiled) whose table
and Chrome traces are read back."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile, record_function

from launch import read_metrics, run_train
from layers.linear import linear


def _categories(fn) -> dict:
    """Self CPU microseconds per category of what `fn` runs under the profiler."""
    from training.profiling import _category

    with profile() as prof:
        fn()
    out = {}
    for ev in prof.events():
        if ev.self_cpu_time_total > 0:
            cat = _category(ev)
            out[cat] = out.get(cat, 0) + ev.self_cpu_time_total
    return out


def test_operators_land_in_their_category():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    assert set(_categories(lambda: a @ b)) == {"matmul"}
    # every weight matmul of our layers: oneDNN's op on CPU (layers/gemm.py), not aten's
    x, w = torch.randn(512, 512, requires_grad=True), torch.randn(512, 512)
    cats = _categories(lambda: linear(x, w).sum().backward())
    assert cats.get("matmul", 0) > sum(v for c, v in cats.items() if c != "matmul"), cats
    assert set(_categories(lambda: (a * b).relu())) == {"elementwise/norm"}
    # a scope of ours wins over the operator's own kind
    assert set(_categories(lambda: _scoped("shardzoo.optimizer", lambda: a @ b))) \
        == {"optimizer"}

    def attention():
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    cats = _categories(attention)
    assert cats.get("attention", 0) > 0 and "matmul" not in cats, cats  # bwd included
    assert set(_categories(lambda: _scoped("shardzoo.comm.all_reduce tp", lambda: a @ b))) \
        == {"communication"}


def _scoped(name, fn):
    with record_function(name):
        return fn()


def test_profile_flags_are_checked():
    from models.config import ConfigError
    from training.arguments import parse_config

    base = ["--config", "configs/tiny-llama.yaml", "--profile", "--train-iters", "5"]
    with pytest.raises(ConfigError, match="--profile-step-end"):
        parse_config(base).validate(1)  # the defaults 10..12 lie past --train-iters 5
    with pytest.raises(ConfigError, match=r"--profile-ranks \[3\]"):
        parse_config(base + ["--profile-step-start", "1", "--profile-step-end", "3",
                             "--profile-ranks", "3"]).validate(2)
    cfg = parse_config(base + ["--profile-step-start", "1", "--profile-step-end", "3"])
    assert cfg.validate(2).train.profile_ranks == [0]


def test_profile_table_and_traces_at_tp2(tmp_path):
    proc = run_train(2, ["--config", "configs/tiny-llama.yaml", "--tp", "2",
                         "--sequence-parallel", "--train-iters", "3", "--eval-interval", "0",
                         "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                         "--profile-ranks", "0", "1", "--no-tensorboard",
                         "--peak-tflops", "1"], tmp_path)
    assert "profile of 2 step(s)" in proc.stdout and "rank 1" in proc.stdout, proc.stdout
    # Kineto's probe markers (USDT:... profiler_start / profiler_stop) stay out of the log
    assert "USDT:" not in proc.stdout + proc.stderr and "profiler_start" not in proc.stderr
    (record,) = [r for r in read_metrics(tmp_path) if r.get("event") == "profile"]
    assert [r["rank"] for r in record["ranks"]] == [0, 1] and record["iteration"] == 3
    for rank in record["ranks"]:
        ms = rank["ms"]
        for cat in ("matmul", "elementwise/norm", "cross entropy", "optimizer",
                    "communication", "data"):
            assert ms[cat] > 0, (cat, ms)
        # each operator's time is counted once: the categories never exceed the wall time
        assert sum(v for c, v in ms.items() if c != "other") <= rank["step_ms"] * 1.01, rank
        with open(rank["trace"]) as f:
            names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
        # the comm ranges name the call and its group (SP's all-gather, TP's all-reduce)
        assert any(n.startswith("shardzoo.comm.all_gather_single") for n in names), rank
        assert "shardzoo.optimizer" in names and "shardzoo.cross_entropy" in names
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert len(losses) == 3 and all(x == x for x in losses)
