"""FP8 layout table: each recipe's training loss at tp 2 + SP, dp 2 ZeRO-3, pp 2, cp 2 and
ep 2 (MoE) against one process, dropout on.

    python bench/fp8_layouts.py [--steps 3]

Tiny-llama as tests/test_fp8.py trains it (2 layers, dropout 0.1 on hidden states and
attention, hybrid format; hidden 256 where blockwise's 128-wide tiles must stay whole on
each of 2 TP ranks; sequence 256 at cp 2 so a rank's chunk holds whole 128-token tiles; an
MoE tiny-llama, 8 experts top-2, at ep 2). All 2-rank runs share one spawned gloo world, as
the suite's layout tests do (tests/distributed.py). Prints, per recipe and layout, the
largest relative loss difference from one process over the steps; the first step's loss
(the forward alone) is one process's to float32 rounding, later ones carry float8 roundings
that a float32 summation-order difference can flip (docs/guide/fp8.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from distributed import run_distributed  # noqa: E402  (tests/distributed.py)
from test_fp8 import BASE, RECIPES, WIDE, _fp8, _train  # noqa: E402

LAYOUTS = {
    "tp 2 + SP": ["--tp", "2", "--sequence-parallel"],
    "dp 2 ZeRO-3": ["--data-parallel-sharding-strategy", "optim_grads_params"],
    "pp 2": ["--pp", "2"],
    "cp 2": ["--context-parallel-size", "2"],
    "ep 2 (MoE)": ["--expert-model-parallel-size", "2"],
}


def model_flags(recipe: str, layout: str, steps: int) -> list[str]:
    """The one-process flags a (recipe, layout) cell compares against."""
    args = BASE + ["--train-iters", str(steps)] + _fp8(recipe)
    if layout == "tp 2 + SP" and recipe == "blockwise":
        args += WIDE
    if layout == "cp 2":
        args += ["--seq-length", "256"]
    if layout == "ep 2 (MoE)":
        args += ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                 "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "0.01"]
    return args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="training steps per run")
    args = p.parse_args()
    cells = [(r, n) for r in RECIPES for n in LAYOUTS]
    refs = {}
    for r, n in cells:
        refs.setdefault(tuple(model_flags(r, n, args.steps)), None)
    from data_pipeline.default_corpus import default_cache_dir
    cache = default_cache_dir()
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        one = run_distributed(_train, 1, [list(k) for k in refs], f"{tmp}/1", cache,
                              timeout=3600)[0]
        refs = dict(zip(refs, one))
        two = run_distributed(_train, 2, [model_flags(r, n, args.steps) + LAYOUTS[n]
                                          for r, n in cells], f"{tmp}/2", cache,
                              timeout=3600)[0]
    print(f"{len(refs)} one-process runs and {len(cells)} two-rank runs, {args.steps} steps "
          f"each, in {time.time() - start:.0f} s; load average {os.getloadavg()[0]:.1f}")
    print("\n| recipe | " + " | ".join(LAYOUTS) + " |")
    print("|---" * (len(LAYOUTS) + 1) + "|")
    for r in RECIPES:
        row = []
        for n in LAYOUTS:
            got = two[cells.index((r, n))]
            ref = refs[tuple(model_flags(r, n, args.steps))]
            worst = max(abs(a - e) / e for a, e in zip(got, ref))
            first = abs(got[0] - ref[0]) / ref[0]
            row.append(f"{worst:.1e} (step 1: {first:.0e})")
        print(f"| {r} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
