"""Print the latest training curve of a log folder: every iteration once, resumes applied.

    python tools/metrics_curve.py runs/demo                       # iteration, loss, valid_loss
    python tools/metrics_curve.py runs/demo --keys loss,lr,tokens_per_s --format csv
    python tools/metrics_curve.py runs/demo --runs                # where each run started

`<log-dir>/metrics.jsonl` is append-only: every run (and every torchrun restart) adds to it
and begins with a `run_start` record. A run that resumed from iteration r supersedes the
earlier records with iteration > r; a run from scratch supersedes all of them
(`training.metrics.latest_curve`, the rule TensorBoard applies through purge_step).
Exit status 1 with a message when the folder has no metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.metrics import RUN_START, latest_curve, read_records  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log_dir", help="a --log-dir folder, or its metrics.jsonl")
    p.add_argument("--keys", default="loss,valid_loss",
                   help="comma-separated record fields to print (default: loss,valid_loss)")
    p.add_argument("--format", choices=("table", "csv", "jsonl"), default="table")
    p.add_argument("--runs", action="store_true", help="list the runs (run_start records)")
    args = p.parse_args(argv)
    try:
        records = read_records(args.log_dir)
    except FileNotFoundError:
        print(f"metrics_curve.py: no metrics.jsonl in {args.log_dir}; pass the --log-dir of a "
              f"train.py run", file=sys.stderr)
        return 1
    if args.runs:
        for r in records:
            if r.get("event") == RUN_START:
                start = r.get("resumed_from_iteration")
                print(f"{r.get('run_id', '?')}  {r.get('time', '?')}  "
                      f"{'from scratch' if start is None else f'resumed at {start}'}  "
                      f"restart {r.get('restart', 0)}  {r.get('command', '')}")
        return 0
    keys = [k for k in args.keys.split(",") if k]
    rows = [r for r in latest_curve(records) if "iteration" in r and any(k in r for k in keys)]
    if args.format == "jsonl":
        for r in rows:
            print(json.dumps({"iteration": r["iteration"], **{k: r[k] for k in keys if k in r}}))
        return 0
    table = [["iteration", *keys]] + [[str(r["iteration"])] + [
        "" if r.get(k) is None else (f"{r[k]:.6g}" if isinstance(r[k], float) else str(r[k]))
        for k in keys] for r in rows]
    for cells in table:
        print(",".join(cells) if args.format == "csv" else
              "  ".join(c.rjust(max(12, len(c))) for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
