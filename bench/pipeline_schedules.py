"""The pipeline schedules side by side at pp 4, 8 microbatches: per schedule the bubble
(idle / compute per stage) in theory, predicted from the run's measured F / B / W times and
measured (the timeline re-timed with each span's CPU time), the chunk-microbatches of
activations held at peak (measured from the timeline, and the table's), stage 0's activation
bytes at peak measured beside the planner's, and tokens/s against 1F1B.

Model: tiny-llama widened to 16 layers, hidden 256, ffn 704, seq 64, on the default corpus
(its 1,024-token vocabulary: the output layer is about a third of a layer), micro batch 1,
global batch 8, float32, one thread per rank. Schedules: 1f1b, interleaved (`--vpp 2`),
zb-h1 and zbv (two chunks per stage in a V: stage 0 holds the embedding and the output
layer). Each run is `train.py --profile-pipeline` under torchrun with 4 processes for
`--iters` iterations; the bubble numbers are medians over the profiled steps after the first,
tokens/s is over the median step (steps after the first). Rounds visit the schedules in turn
`--repeats` times; a schedule's figures come from its median-tokens/s round. The load
average (`os.getloadavg`) before and after is printed: on a shared machine wall times move.

Run: `python bench/pipeline_schedules.py [--repeats 1] [--iters 7]` (about 4 minutes per
round on 2 CPU cores). Flags after `--` go to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["--config", "configs/tiny-llama.yaml", "--pp", "4", "--num-layers", "16",
           "--hidden-size", "256", "--ffn-hidden-size", "704", "--seq-length", "64",
           "--micro-batch-size", "1", "--global-batch-size", "8", "--eval-interval", "0",
           "--profile-pipeline", "--no-tensorboard"]
SCHEDULES = {"1f1b": ["--pipeline-schedule", "1f1b"],
             "interleaved": ["--pipeline-schedule", "interleaved", "--vpp", "2"],
             "zb-h1": ["--pipeline-schedule", "zb-h1"],
             "zbv": ["--pipeline-schedule", "zbv"]}


def run(schedule: str, iters: int, extra: list[str]) -> dict:
    """One train.py run; its pipeline record, tokens/s of the median step and stage 0's
    activation bytes at peak (measured per microbatch x the timeline's peak count; the
    planner's)."""
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", str(ROOT / "train.py"), *COMMAND,
               *SCHEDULES[schedule], "--train-iters", str(iters), "--log-dir", log_dir, *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            raise SystemExit(f"{schedule} failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    pipe = next(r for r in records if "bubble_theory" in r)
    steps = [r["tokens_per_s"] for r in records
             if "tokens_per_s" in r and r.get("iteration", 0) > 1]
    start = next(r for r in records if r.get("event") == "run_start")
    v = pipe["vpp"]  # a chunk-microbatch holds 1 / v of a stage-microbatch's activations
    held = {"measured": start["activation_bytes_per_microbatch"] * pipe["in_flight_peak"][0] / v,
            "planner": start["planner_activation_bytes_per_microbatch"]
            * start["planner_microbatches_in_flight"] / v}
    return {**pipe, "tokens_per_s": statistics.median(steps), "held_bytes": held}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--iters", type=int, default=7, help="iterations per run (>= 3)")
    p.add_argument("extra", nargs="*", help="after --: flags for every run")
    args = p.parse_args(argv)
    load = os.getloadavg()
    rounds = {s: [] for s in SCHEDULES}
    for _ in range(args.repeats):
        for s in SCHEDULES:
            rounds[s].append(run(s, args.iters, args.extra))
    print(f"load average (1, 5, 15 min) before {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, "
          f"after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    print("| schedule | bubble, equal passes | predicted from measured passes (max) | "
          "measured, replay (stages 0-3) | held at peak, measured / table "
          "(chunk-microbatches) | stage 0 activations at peak, measured / planner (MiB) | "
          "tokens/s (median step) | F / B / W ms |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for s, rs in rounds.items():
        r = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
        base = base or r["tokens_per_s"]
        f, b, w = (1e3 * c for c in r["pass_costs"])
        print(f"| {s} | {r['bubble_theory']:.3f} | {max(r['bubble_predicted']):.3f} | "
              f"{fmt(r['bubble_replay'])} | {' '.join(map(str, r['in_flight_peak']))} / "
              f"{' '.join(map(str, r['in_flight_peak_predicted']))} | "
              f"{r['held_bytes']['measured'] / 2**20:.1f} / "
              f"{r['held_bytes']['planner'] / 2**20:.1f} | "
              f"{r['tokens_per_s']:.0f} ({r['tokens_per_s'] / base:.2f}x) | "
              f"{f:.1f} / {b:.1f} / {(f'{w:.1f}' if w else '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
