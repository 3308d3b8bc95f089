"""`train.py --profile`: the categories an operator's time lands in, the flag
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


def _events(fn) -> list[tuple[str, tuple[str, ...], str | None]]:
    """(operator name, its enclosing ranges innermost first, category) of every event `fn`
    runs under the profiler, however long it took."""
    from training.profiling import _category

    with profile() as prof:
        fn()
    out = []
    for ev in prof.events():
        up, e = [], ev.cpu_parent
        while e is not None:
            up.append(e.name)
            e = e.cpu_parent
        out.append((ev.name, tuple(up), _category(ev)))
    return out


def _categories(fn) -> dict[str, set[str]]:
    """The operator names in each category of what `fn` runs (glue outside every category
    left out)."""
    out = {}
    for name, _, cat in _events(fn):
        if cat is not None:
            out.setdefault(cat, set()).add(name)
    return out


# the operators that compute a weight matmul on CPU: oneDNN's inner product (layers/gemm.py,
# forward and both gradients) or, with SHARDZOO_CPU_GEMM=torch, aten's
_GEMMS = {"mkldnn::_linear_pointwise", "shardzoo::onednn_linear_nt", "aten::mm", "aten::addmm"}


def test_operators_land_in_their_category():
    """Which category each operator lands in (by name, never by how long it took)."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    assert set(_categories(lambda: a @ b)) == {"matmul"}
    # every weight matmul of our layers, forward and backward, and what runs inside it (the
    # copy of a transposed operand) is matmul; the loss's sum around it is not
    x, w = torch.randn(32, 16, requires_grad=True), torch.randn(8, 16)
    events = _events(lambda: linear(x, w).sum().backward())
    gemm = [(name, up, cat) for name, up, cat in events if name in _GEMMS]
    assert any(not any(u.startswith("autograd::") for u in up) for _, up, _ in gemm), events
    assert any(any(u.startswith("autograd::") for u in up) for _, up, _ in gemm), events
    inside = [(name, cat) for name, up, cat in events if name in _GEMMS or _GEMMS & set(up)]
    assert inside and all(cat == "matmul" for _, cat in inside), inside
    assert {cat for name, _, cat in events if name == "aten::sum"} == {"elementwise/norm"}
    assert set(_categories(lambda: (a * b).relu())) == {"elementwise/norm"}
    # a scope of ours wins over the operator's own kind
    assert set(_categories(lambda: _scoped("shardzoo.optimizer", lambda: a @ b))) \
        == {"optimizer"}

    def attention():
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    cats = _categories(attention)
    # forward and backward kernels both count as attention, never as matmul
    assert "attention" in cats and "matmul" not in cats, cats
    assert any("backward" in n.lower() for n in cats["attention"]), cats
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
