"""Per-iteration metrics: one stdout line, one JSON object in `<log-dir>/metrics.jsonl`, and
TensorBoard scalars in `<log-dir>` when `tensorboard` is installed. Only global rank 0 writes.
No torch at import: tools/metrics_curve.py reads a metrics.jsonl without it.

Runs and resumes append to the same files. Each run first writes a `run_start` record
(`{"event": "run_start", "run_id", "time", "command", "restart", "resumed_from_iteration",
...}`), so the file says where every run began. The reading rule (`latest_curve`,
`tools/metrics_curve.py`): a `run_start` with `resumed_from_iteration` r supersedes the records
of earlier runs with an iteration above r; with `resumed_from_iteration` null (a run from
scratch) it supersedes all earlier records. What is left, in file order, is the curve of
the latest run including the history it resumed from: every iteration once. TensorBoard gets
the same rule through `SummaryWriter(purge_step=r + 1)` (0 from scratch), which hides earlier
events at or after that step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time

from checkpoint.progress import ProgressLog, format_duration  # noqa: F401 - re-exported

RUN_START = "run_start"


def purge_step(resumed_from_iteration: int | None) -> int:
    """First step whose earlier records a run supersedes: r + 1 on resume from r, else 0."""
    return 0 if resumed_from_iteration is None else resumed_from_iteration + 1


class MetricsLogger:
    """Writes metrics on global rank 0; other ranks get a no-op logger.

    `run_start` (a dict) is written first as the run's boundary record (see the module
    docstring); its `resumed_from_iteration` also sets TensorBoard's `purge_step`.
    """

    def __init__(self, log_dir: str | None, *, enabled: bool, tensorboard: bool = True,
                 run_start: dict | None = None):
        self.enabled = enabled and log_dir is not None
        self.start = time.time()
        self.writer = None
        self.jsonl = None
        if not self.enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", buffering=1)
        run_start = {"event": RUN_START, "resumed_from_iteration": None, **(run_start or {})}
        self.jsonl.write(json.dumps(run_start) + "\n")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: metrics.jsonl only
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(
                    log_dir=log_dir, purge_step=purge_step(run_start["resumed_from_iteration"]))

    def log(self, record: dict, line: str | None = None, prefix: str = "train") -> None:
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        self.jsonl.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record.get("iteration", 0)
            for tag, v in _scalars(record, prefix):
                self.writer.add_scalar(tag, v, step)
            self.writer.flush()  # like the jsonl: a killed run keeps what it logged

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def _scalars(record: dict, prefix: str):
    """`(tag, number)` of a record's numbers for TensorBoard: `prefix/key`, and numbers in
    nested dicts as `prefix/key/subkey` (e.g. `train/moe/layer_2/imbalance`); lists and
    strings are left to metrics.jsonl."""
    for k, v in record.items():
        if isinstance(v, dict):
            yield from _scalars(v, f"{prefix}/{k}")
        elif k != "iteration" and isinstance(v, (int, float)):
            yield f"{prefix}/{k}", v


def read_records(path: str) -> list[dict]:
    """Every record of a metrics.jsonl (or of `<path>/metrics.jsonl` for a log folder)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def latest_curve(records: list[dict]) -> list[dict]:
    """The records of the latest run and the history it resumed from, each iteration once
    (the rule of the module docstring); `run_start` records are dropped."""
    out: list[dict] = []
    for r in records:
        if r.get("event") == RUN_START:
            first = purge_step(r.get("resumed_from_iteration"))
            out = [x for x in out if x.get("iteration", 0) < first]
        else:
            out.append(r)
    return out


class Progress:
    """Training-step times for the log line: the recent rate and a steady ETA.

    The trainer reports each training step's duration (`step`) and each validation's and
    checkpoint save's (`other`), so time outside the steps never enters a rate. `window()`
    is the mean step time since the previous call (the log line's tokens/s, TFLOP/s, MFU).
    `eta(it)` is the remaining steps times the mean step time since the first step (which
    carries one-time warm-up and is used alone only until a second step exists), plus the
    validations and saves still to come times their mean measured durations.

    Args:
        train_iters: the last iteration; eval_interval / save_interval: 0 or None when off;
        save_at_end: a checkpoint is written after the last iteration (--save given).
    """

    def __init__(self, train_iters: int, eval_interval: int | None, save_interval: int | None,
                 save_at_end: bool, eval_at_end: bool = True):
        self.train_iters = train_iters
        self.eval_interval, self.save_interval = eval_interval or 0, save_interval or 0
        self.save_at_end, self.eval_at_end = save_at_end, eval_at_end
        self.first_step: float | None = None
        self.steps_time, self.steps = 0.0, 0  # after the first step
        self.window_time, self.window_steps = 0.0, 0
        self.other_time = {"valid": [0.0, 0], "save": [0.0, 0]}

    def step(self, seconds: float) -> None:
        if self.first_step is None:
            self.first_step = seconds
        else:
            self.steps_time += seconds
            self.steps += 1
        self.window_time += seconds
        self.window_steps += 1

    def other(self, kind: str, seconds: float) -> None:
        """A validation ("valid") or checkpoint save ("save") that took `seconds`."""
        self.other_time[kind][0] += seconds
        self.other_time[kind][1] += 1

    def window(self) -> float:
        """Mean seconds per step since the previous call; starts the next window."""
        mean = self.window_time / max(self.window_steps, 1)
        self.window_time, self.window_steps = 0.0, 0
        return mean

    def mean_step(self) -> float:
        return self.steps_time / self.steps if self.steps else (self.first_step or 0.0)

    def _remaining(self, it: int, interval: int, at_end: bool, kind: str = "save") -> int:
        """Events at iterations it..train_iters (the one at `it` follows its log line); a
        validation the last one closely follows is not run (`validates_at`)."""
        n = (self.train_iters // interval - (it - 1) // interval) if interval else 0
        if at_end and not (interval and self.train_iters % interval == 0):
            n += 1
        last = self.train_iters // interval * interval if interval else 0
        if kind == "valid" and at_end and it <= last and \
                not validates_at(last, self.train_iters, interval):
            n -= 1
        return n

    def eta(self, it: int) -> float:
        """Seconds still to go at iteration `it`'s log line, which comes after its step and
        before its validation or save."""
        total = (self.train_iters - it) * self.mean_step()
        for kind, interval, at_end in (("valid", self.eval_interval, self.eval_at_end),
                                       ("save", self.save_interval, self.save_at_end)):
            spent, count = self.other_time[kind]
            if count:
                total += self._remaining(it, interval, at_end, kind) * spent / count
        return total


def validates_at(it: int, train_iters: int, interval: int) -> bool:
    """Whether a run of `train_iters` iterations validating every `interval` validates after
    iteration `it`: at each multiple of `interval` and after the last iteration, except a
    multiple the last one follows within half an interval or at once (10 iterations every 3:
    after 3, 6 and 10; not after 9 and then 10 back to back)."""
    if it == train_iters:
        return True
    left = train_iters - it
    return it % interval == 0 and 2 * left >= interval and (left > 1 or interval == 1)


class EvalProgress:
    """Progress lines of a long validation (a fine-tune's can run for minutes): none while it
    is short, then after `first` seconds and every `every` seconds after that one line,
    `<label>: <done>/<total> batches in <elapsed>, about <left> to go` (checkpoint/progress.py
    `ProgressLog`). Call it with the batches done after each one; `enabled` False (other
    ranks than 0) prints nothing."""

    def __init__(self, label: str, total: int, enabled: bool, first: float = 10.0,
                 every: float = 30.0, clock=time.perf_counter):
        self.label, self.total = label, total
        self.log = ProgressLog((lambda line: print(line, flush=True)) if enabled else None,
                               first, every, clock)

    def __call__(self, done: int) -> None:
        if done < self.total:
            self.log(lambda elapsed: f"{self.label}: {done}/{self.total} batches in "
                                     f"{format_duration(elapsed)}, about "
                                     f"{format_duration(elapsed / done * (self.total - done))}"
                                     f" to go")


def run_start_record(config, start_iteration: int, peak, flops_per_token: float,
                     memory: dict) -> dict:
    """The run-boundary record of metrics.jsonl (see the module docstring): who, what, from
    where, the run's one MFU peak and its source (training/flops.PeakFlops), and the detailed
    start-up accounting (model-state and activation bytes, formulas)."""
    t = config.train
    return {"run_id": f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "resumed_from_iteration": start_iteration if start_iteration > 0 else None,
            "train_iters": t.train_iters, "world_size": config.world_size,
            "layout": {"tp": t.tensor_model_parallel_size, "pp": t.pipeline_model_parallel_size,
                       "vpp": t.virtual_pipeline_model_parallel_size,
                       "dp": config.data_parallel_size},
            "num_parameters": config.model.num_parameters(), "flops_per_token": flops_per_token,
            "peak_tflops": peak.tflops, "peak_source": peak.source,
            "fp8_flops_share": peak.fp8_share, **memory,
            "config": {"model": config.model.to_dict(), "train": dataclasses.asdict(t)}}


def log_run_end(config, first: int, last: int, wall_s: float, progress: Progress, peak,
                flops_per_token: float, logger: MetricsLogger, world_size: int,
                is_logger: bool) -> dict:
    """The closing line and `run_end` record: iterations `first`+1..`last` in `wall_s`
    seconds, the mean training rate (steps after the first) and its MFU against the run's
    one peak (the start-up line's); MFU is computed where the log is written (`is_logger`)."""
    steps = last - first
    step_time = progress.mean_step()
    tps = config.train.global_batch_size * config.model.seq_length / step_time
    tflops = flops_per_token * tps / world_size / 1e12
    mfu = peak.mfu(tflops) if is_logger else None
    if is_logger:
        peak.say_note()
    rec = {"iteration": last, "event": "run_end",
           "steps": steps, "wall_s": wall_s, "mean_step_time_s": step_time,
           "mean_tokens_per_s": tps, "mean_tflops": tflops, "mean_mfu": mfu,
           "peak_tflops": peak.tflops}
    which = "steps after the first" if progress.steps else "one step, its warm-up included"
    logger.log(rec, f"done: {steps} iteration{'' if steps == 1 else 's'} in "
                    f"{format_duration(wall_s)} | {tps:,.0f} tok/s on average ({which}) | "
                    f"mfu {'n/a' if mfu is None else f'{mfu:.1%}'} of the peak "
                    f"{peak.tflops:.3g} TFLOP/s per device", prefix="run")
    return rec
