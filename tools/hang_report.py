"""Say where the ranks of a stuck or failed distributed run disagree.

    python tools/hang_report.py runs/latest/hang      # the hang/ folder inside --log-dir

Reads the rank files the collective trace writes (rank-K.ring: the newest calls, kept even
when a process is killed; rank-K.txt: a dump with the reason, error and Python stacks, written
on a timeout, a collective error, an exception, SIGUSR1 or SIGTERM; rank-K.crash: stacks after
a fatal signal) and prints one paragraph per finding, the first point of disagreement first,
then the evidence per rank. See parallel_state/hang_doctor/trace_report.py for what is found
and how.

Exit code 0 when nothing disagrees, 1 when something does, 2 when there is nothing to read.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel_state.hang_doctor.trace_report import analyze, load, report  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="the hang/ folder of a run (<--log-dir>/hang)")
    args = p.parse_args(argv)
    try:
        traces, _ = load(args.directory)
    except FileNotFoundError as e:
        print(f"hang_report.py: {e}", file=sys.stderr)
        return 2
    try:
        print(report(args.directory))
    except BrokenPipeError:  # piped into head: fine
        sys.stderr.close()
    if not traces:
        return 2
    return 1 if analyze(traces) else 0


if __name__ == "__main__":
    sys.exit(main())
