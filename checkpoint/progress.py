"""Progress lines of long work that prints nothing of its own (loading a model's weights,
tokenizing a corpus, a long validation): none while the work is short, then one plain line
after `first` seconds and every `every` seconds after that, so that a terminal, a log file and
a pipe all get a few whole lines rather than a bar redrawn in place.

Only one rank should report (the entry points pass `say=None` elsewhere): several ranks'
lines about the same work interleave and say nothing more.
"""
from __future__ import annotations

import time
from typing import Callable


def format_duration(seconds: float) -> str:
    """`M:SS`-style duration: `01:05`, `1:02:03` above an hour (negative reads as 0)."""
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ProgressLog:
    """Rate-limited progress lines: call it as often as the work moves (each tensor, each
    document); it passes a line to `say` only after `first` seconds and then at most every
    `every` seconds. `line` is a string or a function of the seconds elapsed returning one
    (called only when a line is due, so formatting costs nothing in between). `say` None
    prints nothing (ranks other than 0)."""

    def __init__(self, say: Callable[[str], None] | None, first: float = 10.0,
                 every: float = 30.0, clock: Callable[[], float] = time.perf_counter):
        self.say, self.every, self.clock = say, every, clock
        self.start = clock()
        self.next_at, self.now = first, 0.0

    def elapsed(self) -> float:
        """Seconds since this log was made."""
        return self.clock() - self.start

    def due(self) -> bool:
        """Whether a line is due now; if so the next one is due `every` seconds later (for a
        caller that prints its own way, as the straggler report does)."""
        self.now = self.elapsed()
        if self.now < self.next_at:
            return False
        self.next_at = self.now + self.every
        return True

    def restart(self) -> None:
        """Count a line said now, out of turn: the next is due `every` seconds from now."""
        self.next_at = self.elapsed() + self.every

    def __call__(self, line: str | Callable[[float], str]) -> bool:
        """Say `line` if one is due; returns whether it was said."""
        if self.say is None or not self.due():
            return False
        self.say(line(self.now) if callable(line) else line)
        return True
