"""`--profile`: where a training step's time goes, per rank (torch.profiler).

On the ranks in `--profile-ranks`, torch.profiler records the iterations after
`--profile-step-start` up to `--profile-step-end` (Megatron's flags and semantics: the counts of
finished iterations at the top of the loop, so the defaults 10 and 12 record steps 11 and 12).
Each profiled rank writes a Chrome trace (`<log-dir>/profile/rank<r>.json`, open it in
chrome://tracing or https://ui.perfetto.dev); rank 0 prints one table of milliseconds per step
by category and rank, each rank's top operators by self time, and logs the same as a
`profile` record in metrics.jsonl.

Categories. An operator's self time (device time on CUDA, CPU time otherwise) is counted once,
in the first that applies:
- communication: the time the calling thread is blocked in parallel_state.collectives: the
  whole call for a synchronous one, from `wait()` to its return for an asynchronous one (a
  collectives consumer opens a `shardzoo.comm.<op> <group>` range there, so the trace names
  each call and its group). An asynchronous call's time from launch to `wait()` is reported
  beside the table as "in flight behind compute" (an upper bound of the overlapped part: the
  call may finish before the wait);
- the named scopes the trainer and layers open (`record_function`): `shardzoo.data` (making
  the microbatches), `shardzoo.optimizer` (gradient clipping and the optimizer step),
  `shardzoo.cross_entropy` (the vocab-parallel loss, forward; its backward by the autograd
  node's name);
- attention: scaled-dot-product attention and what runs inside it, forward and backward;
- matmul: `mm`, `addmm`, `bmm`, `baddbmm`, oneDNN's inner product (layers/gemm.py) and
  what `matmul`/`linear` run around them (transposes, reshapes);
- elementwise/norm: every other `aten::` operator (norms, RoPE, activations, residual adds,
  dropout, copies, the gradient buffer's arithmetic).
What is left of the step's wall time is `other`: Python between operators, framework glue
outside the scopes, anything not recorded (on CUDA: the time the device is idle).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from parallel_state import collectives

SCOPES = {"shardzoo.data": "data", "shardzoo.optimizer": "optimizer",
          "shardzoo.cross_entropy": "cross entropy"}
CATEGORIES = ("matmul", "attention", "elementwise/norm", "cross entropy", "optimizer",
              "communication", "data", "other")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
              "aten::linear", "aten::_mkl_linear", "aten::mkldnn_linear",
              "mkldnn::_linear_pointwise", "shardzoo::onednn_linear_nt"}  # layers/gemm.py
_ATTENTION_KEYS = ("scaled_dot_product", "scaleddotproduct", "flash_attention",
                   "efficient_attention")
_COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
COMM_SCOPE = "shardzoo.comm"
TOP_OPS = 8


class _CommClock:
    """A collectives consumer: opens a profiler range (`shardzoo.comm.<op> <group>`) over the
    time the calling thread is blocked in each call (a synchronous call whole, an async one
    from its `wait()`), and adds up each async call's time from launch to `wait()`."""

    def __init__(self):
        self.in_flight_s = 0.0
        self.calls = 0

    def _open(self, call) -> None:
        rf = record_function(f"{COMM_SCOPE}.{call.op} {call.label}")
        rf.__enter__()
        call.extra = {**(call.extra or {}), "profile_range": rf}

    def start(self, call) -> None:
        if not call.async_op:
            self._open(call)

    def wait(self, call) -> None:
        self.in_flight_s += call.t_wait - call.t_start
        self._open(call)

    def end(self, call, error) -> None:
        self.calls += 1
        rf = (call.extra or {}).pop("profile_range", None)
        if rf is not None:
            rf.__exit__(None, None, None)


def _category(ev) -> str | None:
    """Category of an event's self time (None: framework glue outside every scope)."""
    names, e = [], ev
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    if any(n.startswith(COMM_SCOPE) or n.startswith(_COMM_PREFIXES) for n in names):
        return "communication"
    for n in names:
        if n in SCOPES:
            return SCOPES[n]
    low = [n.lower() for n in names]
    if any("crossentropy" in n for n in low):
        return "cross entropy"
    if any(k in n for n in low for k in _ATTENTION_KEYS):
        return "attention"
    if any(n in MATMUL_OPS for n in names):  # also oneDNN's ops, which are not aten's
        return "matmul"
    return "elementwise/norm" if ev.name.startswith("aten::") else None


def summarize(prof, wall_s: float, steps: int, comm: _CommClock, cuda: bool) -> dict:
    """Per-step milliseconds by category, the top operators by self time, and the totals."""
    per = defaultdict(float)  # category -> microseconds
    ops = defaultdict(float)
    for ev in prof.events():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us <= 0:
            continue
        cat = _category(ev)
        if cat is None:
            continue
        per[cat] += us
        ops[ev.name] += us
    ms = {c: per[c] / 1e3 / steps for c in CATEGORIES if c != "other"}
    step_ms = wall_s * 1e3 / steps
    ms["other"] = max(0.0, step_ms - sum(ms.values()))
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:TOP_OPS]
    return {"rank": dist.get_rank(), "steps": steps, "step_ms": step_ms, "ms": ms,
            "comm_in_flight_ms": comm.in_flight_s * 1e3 / steps, "comm_calls": comm.calls,
            "top_ops": [(name, us / 1e3 / steps) for name, us in top],
            "time_base": "device" if cuda else "cpu"}


@contextlib.contextmanager
def without_probe_lines():
    """Drop the lines Kineto (torch.profiler's C++ side) writes to stderr for its USDT probes
    while the block runs (`USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52]
    profiler_start`, and `profiler_stop`): trace markers, not messages, printed at every
    start and stop whatever KINETO_LOG_LEVEL says short of hiding its errors too. The block's
    stderr (file descriptor 2, where C++ writes) goes to a temporary file and everything
    else in it is written back after."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace")
                    .splitlines(keepends=True) if not line.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class StepProfiler:
    """Records the configured iterations on the configured ranks; `before(iteration)` and
    `after(iteration)` bracket each training step (iteration = finished steps before it).
    Every rank must call both (the report is gathered to rank 0 with a collective)."""

    def __init__(self, t, log_dir: str, device: torch.device):
        self.enabled = bool(t.profile)
        self.start_it, self.end_it = t.profile_step_start, t.profile_step_end
        self.mine = self.enabled and dist.get_rank() in {int(r) for r in t.profile_ranks}
        self.folder = os.path.join(log_dir, "profile")
        self.cuda = device.type == "cuda"
        self.prof = self.comm = None
        self.wall = 0.0
        self._t0 = 0.0

    def before(self, iteration: int) -> None:
        if not self.enabled or not self.start_it <= iteration < self.end_it:
            return
        if iteration == self.start_it and self.mine:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities)
            self.comm = _CommClock()
            collectives.add_consumer(self.comm)
            with without_probe_lines():
                self.prof.start()
        if self.mine:
            self._sync()
            self._t0 = time.perf_counter()

    def after(self, iteration: int, logger) -> dict | None:
        """After the step `iteration` + 1; returns rank 0's record at the last profiled step."""
        if not self.enabled or not self.start_it <= iteration < self.end_it:
            return None
        if self.mine:
            self._sync()
            self.wall += time.perf_counter() - self._t0
        if iteration + 1 != self.end_it:
            return None
        mine = None
        if self.mine:
            with without_probe_lines():
                self.prof.stop()
            collectives.remove_consumer(self.comm)
            os.makedirs(self.folder, exist_ok=True)
            trace = os.path.join(self.folder, f"rank{dist.get_rank()}.json")
            self.prof.export_chrome_trace(trace)
            mine = summarize(self.prof, self.wall, self.end_it - self.start_it, self.comm,
                             self.cuda)
            mine["trace"] = trace
            self.prof = None
        gathered = [None] * dist.get_world_size()
        collectives.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            return None
        reports = [g for g in gathered if g is not None]
        record = {"event": "profile", "iteration": self.end_it, "ranks": reports}
        logger.log(record, format_report(reports), prefix="profile")
        return record

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def format_report(reports: list[dict]) -> str:
    """The table: one row per category (ms per step on each profiled rank, and its share)."""
    head = f"{'ms per step':<18}" + "".join(f"{'rank ' + str(r['rank']):>16}" for r in reports)
    lines = [f"profile of {reports[0]['steps']} step(s) ({reports[0]['time_base']} self time; "
             f"traces in {os.path.dirname(reports[0]['trace'])})", head]
    for c in CATEGORIES:
        cells = "".join(f"{r['ms'][c]:9.1f} {r['ms'][c] / r['step_ms']:5.1%}" for r in reports)
        lines.append(f"{c:<18}{cells}")
    lines.append(f"{'step (wall)':<18}" + "".join(f"{r['step_ms']:9.1f} {'':>6}" for r in reports))
    lines.append(f"{'comm in flight':<18}" + "".join(
        f"{r['comm_in_flight_ms']:9.1f} {'':>6}" for r in reports)
        + "   (async collectives, launch -> wait: behind compute)")
    for r in reports:
        lines.append(f"rank {r['rank']} top operators (self ms/step): " + ", ".join(
            f"{name.removeprefix('aten::')} {ms:.1f}" for name, ms in r["top_ops"]))
    return "\n".join(lines)
