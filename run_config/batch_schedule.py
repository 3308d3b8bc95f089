"""Global batch size ramp-up and sample-based run length (Megatron's --rampup-batch-size and
--train-samples), both driven by the data position `consumed_samples`.

`--rampup-batch-size START INCREMENT SAMPLES` (Megatron-LM's
`RampupBatchsizeNumMicroBatchesCalculator`): the global batch starts at START and grows by
INCREMENT in `(global_batch_size - START) / INCREMENT` equal steps spread over the first
SAMPLES consumed samples; a step that begins after `consumed_samples` samples uses

    START + floor(consumed_samples / (SAMPLES / num_increments)) * INCREMENT

(capped at --global-batch-size; the full size once `consumed_samples > SAMPLES`). Because it
is a function of the consumed samples, a resumed run continues the ramp exactly. Unlike
Megatron, which checks each size against `micro batch x dp` when it is reached, START and
INCREMENT must be multiples of it up front, so no size of the ramp can fail mid-run.

`--train-samples N` replaces --train-iters: the run takes as many steps as reach N samples
without passing them (Megatron's rule: the ramp's steps, then whole global batches), and the
LR schedule counts samples (--lr-warmup-samples, --lr-decay-samples, default N).
"""
from __future__ import annotations

import math

from models.config import ConfigError


class BatchSchedule:
    """Global batch size of each step from the consumed samples.

    Args:
        global_batch_size: the final (and, without ramp-up, only) size.
        rampup: None or (start, increment, ramp samples).
    Raises:
        ConfigError: a ramp that does not reach `global_batch_size` in whole increments.
    """

    def __init__(self, global_batch_size: int, rampup: tuple[int, int, int] | None = None):
        self.global_batch_size = int(global_batch_size)
        self.rampup = rampup
        self.per_increment = math.inf
        if rampup is not None:
            start, incr, samples = rampup
            diff = self.global_batch_size - start
            if start < 1 or incr < 1 or samples < 0 or diff < 0 or diff % incr:
                raise ConfigError(
                    f"--rampup-batch-size {start} {incr} {samples}: need START >= 1, "
                    f"INCREMENT >= 1, SAMPLES >= 0 and --global-batch-size "
                    f"{self.global_batch_size} - START a non-negative multiple of INCREMENT")
            self.per_increment = samples / (diff // incr) if diff else 0.0

    def size(self, consumed_samples: int) -> int:
        """Global batch of the step that starts after `consumed_samples` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, incr, samples = self.rampup
        if consumed_samples > samples or not self.per_increment:
            return self.global_batch_size
        return min(self.global_batch_size,
                   start + int(consumed_samples / self.per_increment) * incr)

    def steps_to(self, consumed_samples: int, train_samples: int) -> int:
        """Steps from `consumed_samples` that reach at most `train_samples` (whole batches)."""
        steps = 0
        ramp_end = self.rampup[2] if self.rampup else 0
        while consumed_samples <= ramp_end:  # the ramp: one step at a time (few steps)
            size = self.size(consumed_samples)
            if consumed_samples + size > train_samples or size == self.global_batch_size:
                break
            consumed_samples += size
            steps += 1
        return steps + max(0, train_samples - consumed_samples) // self.global_batch_size


def rampup_of(t) -> tuple[int, int, int] | None:
    """`t.rampup_batch_size` as three ints, or None. Raises `ConfigError` naming the form."""
    if not t.rampup_batch_size:
        return None
    try:
        values = tuple(int(float(v)) for v in t.rampup_batch_size)
    except ValueError:
        values = ()
    if len(values) != 3:
        raise ConfigError(f"--rampup-batch-size {' '.join(map(str, t.rampup_batch_size))}: "
                          f"expected three integers START INCREMENT SAMPLES, e.g. "
                          f"--rampup-batch-size 16 16 5000000")
    return values


def check_batch_schedule(t, per_step: int, pp: int, interleaved: bool) -> None:
    """Up-front checks of --rampup-batch-size and --train-samples; derives `t.train_iters`
    and the sample-based LR lengths from --train-samples. Raises `ConfigError`."""
    ramp = rampup_of(t)
    schedule = BatchSchedule(t.global_batch_size, ramp)
    if ramp is not None:
        for name, value in (("START", ramp[0]), ("INCREMENT", ramp[1])):
            if value % per_step or (interleaved and (value // per_step) % pp):
                unit = per_step * (pp if interleaved else 1)
                raise ConfigError(
                    f"--rampup-batch-size {name} {value} must be a multiple of --micro-batch-"
                    f"size x data-parallel size{' x pipeline size (interleaved)' * interleaved}"
                    f" = {unit}, so every batch of the ramp splits into whole microbatches")
    if t.train_samples is None:
        if t.lr_warmup_samples or t.lr_decay_samples:
            raise ConfigError("--lr-warmup-samples / --lr-decay-samples go with --train-samples;"
                              " with --train-iters use --lr-warmup-iters / --lr-decay-iters")
        return
    if t.train_samples < 1:
        raise ConfigError(f"--train-samples must be a positive integer, got {t.train_samples}")
    if t.lr_warmup_iters:
        raise ConfigError("--lr-warmup-iters goes with --train-iters; with --train-samples use "
                          "--lr-warmup-samples")
    t.train_iters = schedule.steps_to(0, t.train_samples)
    if t.train_iters < 1:
        raise ConfigError(f"--train-samples {t.train_samples} is less than one global batch "
                          f"({schedule.size(0)}); raise it")
    if t.lr_decay_samples is None:
        t.lr_decay_samples = t.train_samples
    if not 0 <= t.lr_warmup_samples <= t.lr_decay_samples:
        raise ConfigError(f"--lr-warmup-samples {t.lr_warmup_samples} must be in [0, "
                          f"--lr-decay-samples {t.lr_decay_samples}]")
