"""The straggler report: which rank the others wait for, and in which phase.

Synchronous training runs at the pace of its slowest rank. Each rank splits every training step
(`train_step`, wall time `step`) into

- `data`: building the step's microbatches (`get_microbatches`),
- `waits`: time blocked in collectives, per group (`tp`, `dp`, `pp`, ...), observed by a
  consumer of parallel_state.collectives: a synchronous call from its start to its end, an
  async one (the DP buckets' overlapped reductions, the pipeline's p2p) from its `wait()` to
  its end, so overlapped communication does not count,
- `compute`: the rest (`step - data - waits`): forward, backward, the optimizer, Python.

Every log interval the per-rank means are gathered to rank 0 (one gather_object over the
world, between steps), which records the slowest and the fastest rank (by compute + data: a
rank's own work) with host, per-phase times, and the fraction of their step the other
ranks spent waiting for the slowest, estimated per rank r as min(work_slowest - work_r,
waits_r) / step_r (time r was ahead of the slowest, bounded by what r actually spent blocked),
averaged over the others, in metrics.jsonl (`"event": "stragglers"`) and TensorBoard
(`straggler/...`) every interval; a one-line summary is printed for the first interval and then
at most every `LINE_EVERY_S` seconds (at --log-interval 1 it was a 400-character line a step). The named phase is the slowest rank's phase (compute or data)
furthest above the median of the other ranks.

--straggler-threshold R: when the same rank's compute + data is more than R times the median
of the other ranks' in two log intervals in a row, a WARNING line names its host and rank
(recorded every such interval; printed for a new rank at once, else at most every
`LINE_EVERY_S` seconds).

Cost: the consumer adds a dictionary update per collective (the timestamps are taken by the
collectives layer whenever any consumer is registered, as the hang doctor's trace is by
default); measured in docs/PERFORMANCE.md. On by default at world size > 1.

Test hook: `SHARDZOO_TEST_SLOW=RANK:compute:FACTOR` makes rank RANK's forward-backward take
FACTOR times as long (a sleep of (FACTOR - 1) x its measured time): the injected fault the
report must name (tests/test_stragglers.py).
"""
from __future__ import annotations

import os
import socket
import statistics
import time

import torch.distributed as dist

from checkpoint.progress import ProgressLog
from parallel_state import collectives

LINE_EVERY_S = 60.0  # seconds between printed report lines (and between repeated warnings)
TEST_ENV = "SHARDZOO_TEST_SLOW"
PHASES = ("compute", "data")


class StepTimes(collectives.Consumer):
    """This rank's per-phase times of the training steps since the last `take()`."""

    def __init__(self):
        self.active = False
        self.steps, self.step, self.data = 0, 0.0, 0.0
        self.waits: dict[str, float] = {}
        self._labels: dict[str, str] = {}  # torch group name -> label (groups outlive a step)

    def start(self, call) -> None:
        pass

    def end(self, call, error) -> None:
        if not self.active:
            return
        began = call.t_wait if call.async_op and call.t_wait else call.t_start
        label = self._labels.get(call.group_name)
        if label is None:  # "world/dp": the dp dimension spans the world
            label = self._labels[call.group_name] = call.label.rsplit("/", 1)[-1]
        self.waits[label] = self.waits.get(label, 0.0) + (call.t_end - began)

    def begin_step(self) -> None:
        self.active = True

    def end_step(self, seconds: float, data_seconds: float) -> None:
        self.active = False
        self.steps += 1
        self.step += seconds
        self.data += data_seconds

    def take(self) -> dict:
        """Per-step means since the last call (and reset): step, data, waits, compute."""
        n = max(self.steps, 1)
        waits = {k: v / n for k, v in sorted(self.waits.items())}
        out = {"steps": self.steps, "step": self.step / n, "data": self.data / n,
               "waits": waits}
        out["compute"] = max(out["step"] - out["data"] - sum(waits.values()), 0.0)
        self.steps, self.step, self.data, self.waits = 0, 0.0, 0.0, {}
        return out


def summarize(ranks: list[dict]) -> dict:
    """The report of the per-rank means `ranks` (index = global rank; each with `host`):
    slowest and fastest rank by own work (compute + data), the slowest's phase furthest above
    the other ranks' median, its work over theirs, and the others' waited fraction."""
    work = [r["compute"] + r["data"] for r in ranks]
    slow = max(range(len(ranks)), key=work.__getitem__)
    fast = min(range(len(ranks)), key=work.__getitem__)
    others = [r for i, r in enumerate(ranks) if i != slow]
    excess = {ph: ranks[slow][ph] - statistics.median(r[ph] for r in others) for ph in PHASES}
    phase = max(PHASES, key=excess.__getitem__)
    median_work = statistics.median(work[i] for i in range(len(ranks)) if i != slow)
    waited = [min(max(work[slow] - work[i], 0.0), sum(r["waits"].values())) / r["step"]
              for i, r in enumerate(ranks) if i != slow and r["step"] > 0]
    return {"slowest_rank": slow, "fastest_rank": fast, "phase": phase,
            "slowest_over_median": work[slow] / median_work if median_work > 0 else None,
            "waited_fraction": sum(waited) / len(waited) if waited else 0.0,
            "slowest": _phases(ranks[slow]), "fastest": _phases(ranks[fast]),
            "hosts": [r["host"] for r in ranks],
            "compute_s_per_rank": [r["compute"] for r in ranks],
            "data_s_per_rank": [r["data"] for r in ranks],
            "wait_s_per_rank": [sum(r["waits"].values()) for r in ranks]}


def _phases(r: dict) -> dict:
    return {"step_s": r["step"], "compute_s": r["compute"], "data_s": r["data"],
            **{f"wait_{g}_s": v for g, v in r["waits"].items()}}


def _line(rec: dict) -> str:
    """The report's log line (about 200 characters; the per-group waits and the fastest
    rank's phases are in the record)."""
    slow, fast, ratio = rec["slowest_rank"], rec["fastest_rank"], rec["slowest_over_median"]
    p, q = rec["slowest"], rec["fastest"]
    return (f"stragglers, iters {rec['first_iteration']}-{rec['iteration']}: slowest rank "
            f"{slow} ({rec['hosts'][slow]}) {p['compute_s'] + p['data_s']:.3f} s/step of work"
            + (f", {ratio:.2f}x the others' median" if ratio else "") + f", most above them "
            f"in {rec['phase']}; fastest rank {fast} {q['compute_s'] + q['data_s']:.3f} s; "
            f"the others waited {rec['waited_fraction']:.0%} of their step for it")


class StragglerReport:
    """Owns this rank's `StepTimes` (registered with the collectives layer) and, every log
    interval, gathers and reports them (module docstring). `threshold`: --straggler-threshold
    (None: no warning); `clock`: seconds, for the printed lines' rate limit."""

    def __init__(self, threshold: float | None, clock=time.perf_counter):
        self.threshold = threshold
        # lines at most every LINE_EVERY_S (the first at once); every record is kept
        self.lines = ProgressLog(None, first=0.0, every=LINE_EVERY_S, clock=clock)
        self.warnings = ProgressLog(None, first=0.0, every=LINE_EVERY_S, clock=clock)
        self.times = StepTimes()
        self.host = socket.gethostname()
        self.first_it = None
        self.suspect: int | None = None  # the rank above the threshold in the last interval
        self.warned: int | None = None  # the rank of the last warning
        collectives.add_consumer(self.times)

    def close(self) -> None:
        collectives.remove_consumer(self.times)

    def begin_step(self, iteration: int) -> None:
        if self.first_it is None:
            self.first_it = iteration + 1
        self.times.begin_step()

    def end_step(self, seconds: float, data_seconds: float) -> None:
        self.times.end_step(seconds, data_seconds)

    def report(self, it: int, logger) -> dict | None:
        """Gather every rank's means since the last report to rank 0 (collective over the
        world) and log the line and record there; returns the record on rank 0, else None."""
        mine = dict(self.times.take(), host=self.host)
        rank0 = dist.get_rank() == 0
        ranks = [None] * dist.get_world_size() if rank0 else None
        collectives.gather_object(mine, ranks, dst=0)
        first, self.first_it = self.first_it, None
        if not rank0 or not ranks[0]["steps"]:
            return None
        s = summarize(ranks)
        rec = {"iteration": it, "event": "stragglers", "first_iteration": first, **s}
        self.log(rec, logger)
        return rec

    def log(self, rec: dict, logger) -> None:
        """Record report `rec` (and a warning, when due) with `logger` (training/metrics.py
        `MetricsLogger`), with a printed line when one is due (module docstring)."""
        logger.log(rec, _line(rec) if self.lines.due() else None, prefix="straggler")
        self._warn(rec, logger)

    def _warn(self, rec: dict, logger) -> None:
        ratio, slow = rec["slowest_over_median"], rec["slowest_rank"]
        above = self.threshold is not None and ratio is not None and ratio > self.threshold
        if above and self.suspect == slow:
            show = self.warnings.due()
            if not show and self.warned != slow:  # another rank: said at once
                show = True
                self.warnings.restart()
            logger.log({"iteration": rec["iteration"], "event": "straggler_warning",
                        "rank": slow, "host": rec["hosts"][slow], "ratio": ratio},
                       f"WARNING: rank {slow} on host {rec['hosts'][slow]} is a persistent "
                       f"straggler: its compute + data time was {ratio:.2f}x the other ranks' "
                       f"median for two log intervals in a row (--straggler-threshold "
                       f"{self.threshold:g}; its slow phase: {rec['phase']}); check that "
                       f"host's load, clocks and thermals, or drain it" if show else None,
                       prefix="straggler")
            self.warned = slow
        self.suspect = slow if above else None


def slow_down_for_test(seconds: float) -> None:
    """The test hook (module docstring): sleep (FACTOR - 1) x `seconds` (this rank's
    forward-backward time) when `SHARDZOO_TEST_SLOW` names this rank and compute."""
    spec = os.environ.get(TEST_ENV)
    if not spec:
        return
    rank, phase, factor = spec.split(":")
    if phase == "compute" and int(rank) == dist.get_rank():
        time.sleep((float(factor) - 1.0) * seconds)
