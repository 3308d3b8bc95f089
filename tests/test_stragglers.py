"""The straggler report (issue 34, training/stragglers.py): a rank slowed on purpose is named,
with its phase, in the log line, metrics.jsonl, TensorBoard and the --straggler-threshold
warning; the summary's arithmetic on made-up times."""
from __future__ import annotations

import socket

import pytest

from launch import read_metrics, train_in_one_world


def test_slowed_rank_is_named(tmp_path, corpus_env, monkeypatch):
    """Rank 1's forward-backward made 20x slower (the injected fault; a large factor so that
    machine load cannot hide it): every interval names rank 1 and compute, the other rank
    waited for it, and the persistent outlier is warned about with host and rank."""
    monkeypatch.setenv("SHARDZOO_TEST_SLOW", "1:compute:20")
    log = tmp_path / "log"
    out, = train_in_one_world(2, [[
        "--config", "configs/tiny-llama.yaml", "--train-iters", "6", "--eval-interval", "0",
        "--log-interval", "2", "--peak-tflops", "1", "--straggler-threshold", "3",
        "--log-dir", str(log)]], corpus_env["SHARDZOO_CACHE"])
    lines = [x for x in out.splitlines() if x.startswith("stragglers, iters")]
    # log lines after iterations 1 (the first), 2, 4, 6
    assert [x.split(" (mean")[0] for x in lines] == [
        "stragglers, iters 1-1", "stragglers, iters 2-2", "stragglers, iters 3-4",
        "stragglers, iters 5-6"], out
    host = socket.gethostname()
    for line in lines:
        assert f"slowest rank 1 ({host})" in line and f"fastest rank 0 ({host})" in line, line
        assert "for rank 1 (its compute + data" in line, line
        assert line.endswith("furthest above them: compute)"), line
    records = [r for r in read_metrics(log) if r.get("event") == "stragglers"]
    assert [r["slowest_rank"] for r in records] == [1, 1, 1, 1]
    steady = records[-1]
    assert steady["phase"] == "compute" and steady["slowest_over_median"] > 3
    assert steady["waited_fraction"] > 0.5  # rank 0 spends most of its step waiting for rank 1
    assert steady["fastest"]["wait_dp_s"] > steady["slowest"]["wait_dp_s"]
    warnings = [x for x in out.splitlines() if x.startswith("WARNING: rank 1")]
    assert len(warnings) == 3, out  # from the second interval above the threshold on
    assert f"rank 1 on host {host} is a persistent straggler" in warnings[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log))
    events.Reload()
    assert [e.value for e in events.Scalars("straggler/slowest_rank")] == [1, 1, 1, 1]


def test_summary_names_phase_and_waited_fraction():
    from training.stragglers import summarize

    def rank(compute, data, wait):
        return {"host": "h", "compute": compute, "data": data, "waits": {"dp": wait},
                "step": compute + data + wait}

    # rank 2 loads its data slowly: the others are 0.4 s ahead and spend it waiting
    s = summarize([rank(0.1, 0.01, 0.41), rank(0.12, 0.01, 0.39), rank(0.11, 0.41, 0.0)])
    assert (s["slowest_rank"], s["fastest_rank"], s["phase"]) == (2, 0, "data")
    assert s["waited_fraction"] == pytest.approx((0.41 / 0.52 + 0.39 / 0.52) / 2)
    assert s["slowest_over_median"] == pytest.approx(0.52 / 0.12)
    # a rank ahead but barely blocked (its wait bounds what it can have waited)
    s = summarize([rank(0.1, 0.0, 0.05), rank(0.5, 0.0, 0.0)])
    assert s["waited_fraction"] == pytest.approx(0.05 / 0.15)
