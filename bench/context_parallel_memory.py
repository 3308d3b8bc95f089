"""Activation bytes per rank at context-parallel sizes 1, 2 and 4 (the acceptance check):
measured by train.py's start-up meter (training/memory.py `measure_activation_bytes`: the
bytes one microbatch saves for backward on a rank) beside the planner's prediction
(planner/memory.py, the `planner_activation_bytes_per_microbatch` record), for one model at
one sequence length, and each figure over cp 1's.

Model: tiny-llama (configs/models/tiny-llama.yaml: hidden 64, 4 layers, 4 heads / 2 KV heads,
ffn 128) at seq 4096, micro batch 1, float32, one train.py step per cp size under torchrun
(world = cp: tp, pp, dp 1). The meter runs before the first step; the step only shows the
run works.

Printed per cp: the whole microbatch's bytes (decoder layers + embedding + output layer and
loss), the decoder layers' share, the planner's prediction of each, and the ratio to cp 1.
At cp > 1 a rank holds s/cp tokens, so every sequence-dependent term falls by cp (the CP
attention saves q, k, v, its output and a float32 log-sum-exp, as the fused kernel at cp 1
does): 1/2 and 1/4 of cp 1's (docs/PLANNING.md, bench/README.md).

Run: `python bench/context_parallel_memory.py [--seq-length 4096] [--cp 1 2 4]` (2 to 4
minutes on 2 CPU cores). Flags after `--` go to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--model", "tiny-llama", "--micro-batch-size", "1", "--global-batch-size", "1"]


def measure(cp: int, seq: int, extra: list[str], log_dir: str) -> dict:
    """One train.py step at `cp` (world = cp); the start-up record's activation fields."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={cp}", str(ROOT / "train.py"), *MODEL, "--cp", str(cp),
           "--seq-length", str(seq), "--max-position-embeddings", str(seq), *extra,
           "--train-iters", "1", "--eval-interval", "0", "--no-tensorboard",
           "--log-dir", log_dir]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n"
                 f"{proc.stderr[-4000:]}")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        start = next(r for r in map(json.loads, f) if r.get("event") == "run_start")
    return {"total": start["activation_bytes_per_microbatch"],
            "total_predicted": start["planner_activation_bytes_per_microbatch"],
            "layers": start["activation_bytes_layers"],
            "layers_predicted": start["activation_bytes_layers_predicted"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("extra", nargs="*", help="after --: flags for every run")
    args = p.parse_args(argv)
    if args.cp[0] != 1:
        p.error("--cp must start with 1 (the figures are ratios to cp 1)")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            rows[cp] = measure(cp, args.seq_length, args.extra, os.path.join(tmp, f"cp{cp}"))
            print(f"cp {cp}: {json.dumps(rows[cp])}", flush=True)
    mib = 2 ** 20
    print(f"\ntiny-llama, seq {args.seq_length}, micro batch 1, float32: activation bytes one "
          f"microbatch saves on a rank (MiB; measured / planner; ratio to cp 1)")
    print(f"{'cp':>3} {'total':>9} {'predicted':>10} {'x cp1':>7} {'layers':>9} "
          f"{'predicted':>10} {'x cp1':>7}")
    one = rows[1]
    for cp, r in rows.items():
        print(f"{cp:>3} {r['total'] / mib:9.2f} {r['total_predicted'] / mib:10.2f} "
              f"{r['total'] / one['total']:7.4f} {r['layers'] / mib:9.2f} "
              f"{r['layers_predicted'] / mib:10.2f} {r['layers'] / one['layers']:7.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
