"""The straggler report (training/stragglers.py): a rank slowed on purpose is named,
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
    # records after iterations 1 (the first), 2, 4, 6; a line for the first, then at most
    # one a minute (test_report_lines_are_rate_limited)
    assert lines[0].startswith("stragglers, iters 1-1: ") and len(lines) <= 4, out
    host = socket.gethostname()
    for line in lines:
        assert line.startswith("stragglers, iters ") and len(line) < 250, line
        assert f"slowest rank 1 ({host})" in line and "fastest rank 0" in line, line
        assert "most above them in compute" in line, line
    records = [r for r in read_metrics(log) if r.get("event") == "stragglers"]
    assert [(r["first_iteration"], r["iteration"]) for r in records] == \
        [(1, 1), (2, 2), (3, 4), (5, 6)]
    assert [r["slowest_rank"] for r in records] == [1, 1, 1, 1]
    steady = records[-1]
    assert steady["phase"] == "compute" and steady["slowest_over_median"] > 3
    assert steady["waited_fraction"] > 0.5  # rank 0 spends most of its step waiting for rank 1
    assert steady["fastest"]["wait_dp_s"] > steady["slowest"]["wait_dp_s"]
    warnings = [x for x in out.splitlines() if x.startswith("WARNING: rank 1")]
    # recorded from the second interval above the threshold on; printed at once, then at
    # most one a minute
    assert sum(r.get("event") == "straggler_warning" for r in read_metrics(log)) == 3
    assert 1 <= len(warnings) <= 3, out
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


def test_report_lines_are_rate_limited():
    """At --log-interval 1 every step is recorded (metrics.jsonl), but a line is printed for
    the first interval and then at most one a minute, each under 250 characters; the
    persistent-straggler warning likewise (at once for a new rank). Before: a ~400-character
    line every step."""
    from training.stragglers import StragglerReport, summarize

    now = [0.0]

    class Logger:
        def __init__(self):
            self.records, self.lines = [], []

        def log(self, rec, line=None, prefix="train"):
            self.records.append(rec)
            if line:
                self.lines.append(line)

    def ranks(slow):
        fast = {"step": 0.1, "data": 0.0, "compute": 0.02, "waits": {"dp": 0.08}}
        slowed = {"step": 0.1, "data": 0.01, "compute": 0.09, "waits": {"dp": 0.0}}
        return [dict(slowed if r == slow else fast, host="h") for r in range(4)]

    report, logger = StragglerReport(3.0, clock=lambda: now[0]), Logger()
    try:
        for it in range(1, 151):  # 150 steps of 1 s, rank 1 slow, then rank 2 from step 101
            now[0] += 1.0
            rec = {"iteration": it, "event": "stragglers", "first_iteration": it,
                   **summarize(ranks(1 if it <= 100 else 2))}
            report.log(rec, logger)
    finally:
        report.close()
    reports = [r for r in logger.records if r["event"] == "stragglers"]
    warned = [r["iteration"] for r in logger.records if r["event"] == "straggler_warning"]
    assert len(reports) == 150 and len(warned) == 148  # all but each rank's first interval
    lines = [ln for ln in logger.lines if ln.startswith("stragglers")]
    assert [ln.split(":")[0] for ln in lines] == ["stragglers, iters 1-1",
                                                  "stragglers, iters 61-61",
                                                  "stragglers, iters 121-121"]
    assert lines[0] == ("stragglers, iters 1-1: slowest rank 1 (h) 0.100 s/step of work, "
                        "5.00x the others' median, most above them in compute; fastest rank "
                        "0 0.020 s; the others waited 80% of their step for it")
    warnings = [ln.split(" is a")[0] for ln in logger.lines if ln.startswith("WARNING")]
    # rank 1 at step 2 and a minute later; rank 2 at once (step 102)
    assert warnings == ["WARNING: rank 1 on host h", "WARNING: rank 1 on host h",
                        "WARNING: rank 2 on host h"]
