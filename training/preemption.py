"""Stopping a run cleanly before it is killed: Megatron's --exit-signal-handler,
--exit-duration-in-mins and --exit-interval.

After every iteration the loop asks `ExitCheck.reason(iteration)`; a non-None answer means
"save a checkpoint at this iteration and return normally" (train.py then exits 0), and it is
the same answer on every rank:

- `--exit-interval N`: after an iteration divisible by N (deterministic, no communication);
- `--exit-signal-handler`: SIGTERM or SIGUSR1 (what Slurm's `--signal=USR1@120` or a
  preempting scheduler sends) on *any* rank; the handler only records the signal, so the
  current step finishes;
- `--exit-duration-in-mins M`: once this rank's run has lasted M minutes (wall clock since
  `pretrain` started).

The last two are local observations; the ranks agree through one MAX all-reduce of two
flags over the world group per iteration (only when either option is on), so every rank
stops after the same iteration and saves the same checkpoint.

The hang doctor (parallel_state/hang_doctor/trace.py) also watches SIGTERM and SIGUSR1 (dump,
and on SIGTERM exit). With --exit-signal-handler they are a clean stop instead: the signals are
marked with `trace.handle_gracefully`, and the handler installed here chains to the one it
replaced (restored by `close`). A SIGTERM that torchrun sends because another worker died
then leads to that worker's missing peer being reported by the collective that fails.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

import parallel_state as ps
from parallel_state import collectives
from parallel_state.hang_doctor import trace

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitCheck:
    """Decides, alike on every rank, whether the run stops after an iteration.

    Args:
        train: the `TrainConfig` (exit_signal_handler, exit_duration_in_mins, exit_interval).
        run_start: `time.time()` when the run started (for --exit-duration-in-mins).
    """

    def __init__(self, train, run_start: float):
        self.interval = train.exit_interval
        self.duration_s = None if train.exit_duration_in_mins is None else \
            60.0 * train.exit_duration_in_mins
        self.run_start = run_start
        self.received: int | None = None  # the signal number seen on this rank
        self._old: dict[int, object] = {}
        if train.exit_signal_handler:
            self._install()

    def _install(self) -> None:
        trace.handle_gracefully(EXIT_SIGNALS)
        for sig in EXIT_SIGNALS:
            self._old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received is None:  # os.write: print() may be mid-write on this thread
            os.write(sys.stdout.fileno(), (
                f"rank {torch.distributed.get_rank()}: received {signal.Signals(signum).name}: "
                f"finishing this step, then saving and exiting (--exit-signal-handler)\n"
            ).encode())
        self.received = signum
        old = self._old.get(signum)
        if callable(old):
            old(signum, frame)

    def close(self) -> None:
        """Give the signals back to whoever had them."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._old:
            trace.handle_gracefully()
        self._old = {}

    def reason(self, iteration: int) -> str | None:
        """Why the run stops after `iteration` (completed steps), or None; collective over
        the world when --exit-signal-handler or --exit-duration-in-mins is on."""
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}: stopping after iteration {iteration}"
        if not self._old and self.duration_s is None:
            return None
        elapsed = time.time() - self.run_start
        flags = torch.tensor([float(self.received or 0),  # MAX: a signal number any rank saw
                              float(self.duration_s is not None and elapsed > self.duration_s)],
                             device=ps.get_device())
        if torch.distributed.get_world_size() > 1:
            collectives.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if flags[0] > 0:
            return (f"--exit-signal-handler: {signal.Signals(int(flags[0])).name} received; "
                    f"stopping after iteration {iteration}")
        if flags[1] > 0:
            return (f"--exit-duration-in-mins {self.duration_s / 60:g}: the run has lasted "
                    f"{elapsed / 60:.2f} min; stopping after iteration {iteration}")
        return None
