"""Training tokens/s of our trainer at 1 process, tp2, pp2 (1F1B), dp2 and tp2 x pp2 on one
model, its scaling over the 1-process figure, and each layout's communication share (from
`train.py --profile`), measured in the same run.

Layouts: also pp2 with 3 layers on the first stage (`--decoder-first-pipeline-num-layers 3`),
since the last stage's output layer and loss cost about 2.6 layers at this vocabulary. And the
machine's own ceiling, "2 x 1 process": two independent 1-process runs started together, no
communication at all; their summed tokens/s over the 1-process figure is the most any 2-rank
layout can scale here (the ranks share the memory bandwidth and the last-level cache).

Model: picotron's tiny Llama (hidden 256, ffn 688, 4 layers, 4 heads / 2 KV heads, seq 256,
micro batch 2, global batch 8: 4 microbatches at dp 1), float32, one thread per rank
(OMP_NUM_THREADS=1). Its vocabulary is the training tokenizer's (the embedded demo corpus:
8,192 ids; picotron's bench uses 32,000), because train.py sizes a fresh model's vocabulary
from its tokenizer.

Each run is `train.py` under torchrun for 12 iterations: tokens/s is the global batch's tokens
over the median step time of steps 2-10 (the first step's one-time set-up left out), and
steps 11-12 are profiled on every rank for the communication share (the time blocked in
collectives over the step's wall time, averaged over ranks; profiling slows those two steps,
which are not timed). Rounds visit the layouts in turn (ABCDE...) `--repeats` times to cancel
drift on a shared machine; a layout's figure is the median over its rounds.

Targets (idle 2-core CPU): scaling >= 1.8x at dp2, >= 1.4x at pp2 (the 1F1B ideal
with 4 microbatches is 1.6x), >= 1.5x at tp2 and at tp2 x pp2; printed as MET / NOT MET.

Mixture of experts (`--moe`): tiny-moe (configs/models/tiny-moe.yaml, 8 experts top-2,
dropless) at seq 256, micro batch 2, global batch 8, on 1 process (ep 1), at ep 2 (the experts
split over the 2 ranks, tokens exchanged by all-to-all) and at dp 2 with ep 1 (every rank holds
every expert: the same 2 processes without the all-to-all), beside the 2-process ceiling. No
targets: the figures say what expert parallelism costs or saves on this machine.

Context parallelism (`--cp`): the same tiny Llama at seq 1024, micro batch 1, global
batch 4 (the same global batch for every layout), on 1 process, at cp 2 (each sequence split
over the 2 ranks, ring attention), at cp 2 with the all_gather type, and at dp 2 (the same 2
processes splitting the batch instead of the sequence), beside the 2-process ceiling. No
targets: cp trades dp's one gradient all-reduce per step for a K/V exchange in every layer,
worth it only when a sequence does not fit one rank.

Run: `python bench/parallel_throughput.py [--repeats 3] [--iters 12] [--moe | --cp]` (about
10 minutes on 2 CPU cores with the defaults). Flags after `--` go to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SEQ = 256
MODEL = ["--model", "tiny-llama", "--num-layers", "4", "--hidden-size", "256",
         "--ffn-hidden-size", "688", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2",
         "--global-batch-size", "8"]
INDEPENDENT = "2 x 1 process"  # two 1-process runs at once: the machine's 2-rank ceiling
# "pp2 3|1": the first stage takes 3 of the 4 layers (the last stage's output layer and loss
# cost ~2.6 layers at this vocabulary), the split --profile-pipeline suggests
LAYOUTS = [("1 process", 1, []), ("tp2", 2, ["--tp", "2"]), ("pp2", 2, ["--pp", "2"]),
           ("pp2 3|1", 2, ["--pp", "2", "--decoder-first-pipeline-num-layers", "3"]),
           ("dp2", 2, []), ("tp2 x pp2", 4, ["--tp", "2", "--pp", "2"]),
           (INDEPENDENT, 2, [])]
TARGETS = {"dp2": 1.8, "pp2": 1.4, "pp2 3|1": 1.4, "tp2": 1.5, "tp2 x pp2": 1.5}
MOE_MODEL = ["--model", "tiny-moe", "--seq-length", str(SEQ), "--max-position-embeddings",
             str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "8"]
MOE_LAYOUTS = [("1 process", 1, []), ("ep2", 2, ["--expert-model-parallel-size", "2"]),
               ("dp2 ep1", 2, []), (INDEPENDENT, 2, [])]
CP_SEQ = 1024
CP_MODEL = [*MODEL[:MODEL.index("--seq-length")], "--seq-length", str(CP_SEQ),
            "--max-position-embeddings", str(CP_SEQ), "--micro-batch-size", "1",
            "--global-batch-size", "4"]
CP_LAYOUTS = [("1 process", 1, []), ("cp2", 2, ["--cp", "2"]),
              ("cp2 all_gather", 2, ["--cp", "2", "--cp-comm-type", "all_gather"]),
              ("dp2", 2, []), (INDEPENDENT, 2, [])]


def run_layout(nproc: int, flags: list[str], iters: int, log_dir: str,
               copies: int = 1) -> dict:
    """One train.py run (or `copies` independent 1-process runs started together, summed);
    tokens/s over steps 2..iters-2 and the profiled comm share."""
    if copies == 1:
        return _result(*_launch(nproc, flags, iters, log_dir), log_dir, iters)
    runs = [_launch(1, flags, iters, f"{log_dir}-{c}") for c in range(copies)]
    try:
        outs = [_result(*run, f"{log_dir}-{c}", iters) for c, run in enumerate(runs)]
    finally:  # one copy failed: stop the others too
        for proc, _ in runs:
            if proc.poll() is None:
                proc.kill()
    return {"tokens_per_s": sum(o["tokens_per_s"] for o in outs),
            "comm_share": statistics.mean(o["comm_share"] for o in outs),
            "loss": outs[0]["loss"]}


def _launch(nproc: int, flags: list[str], iters: int, log_dir: str):
    start, end = iters - 2, iters
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ROOT / "train.py"), *flags,
           "--train-iters", str(iters), "--eval-interval", "0", "--log-interval", "1",
           "--no-tensorboard", "--peak-tflops", "1", "--log-dir", log_dir,
           "--profile", "--profile-step-start", str(start), "--profile-step-end", str(end),
           "--profile-ranks", *[str(r) for r in range(nproc)]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, cmd


def _result(proc, cmd, log_dir: str, iters: int) -> dict:
    start = iters - 2
    seq = int(cmd[cmd.index("--seq-length") + 1])
    stdout, stderr = proc.communicate()
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{stdout[-2000:]}\n"
                 f"{stderr[-4000:]}")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = {r["iteration"]: r for r in records if "loss" in r}
    timed = [steps[i]["step_time_s"] for i in range(2, start + 1)]
    tokens = steps[2]["global_batch_size"] * seq
    profile = next(r for r in records if r.get("event") == "profile")
    share = statistics.mean(p["ms"]["communication"] / p["step_ms"] for p in profile["ranks"])
    return {"tokens_per_s": tokens / statistics.median(timed), "comm_share": share,
            "loss": steps[iters]["loss"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=12, help="iterations per run (>= 5)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--moe", action="store_true",
                      help="tiny-moe at 1 process, ep 2 and dp 2 (ep 1) instead of the dense "
                      "layouts")
    kind.add_argument("--cp", action="store_true",
                      help=f"seq {CP_SEQ} at 1 process, cp 2 (p2p, all_gather) and dp 2 "
                      f"instead of the dense layouts")
    p.add_argument("extra", nargs="*", help="after --: flags for every run")
    args = p.parse_args(argv)
    if args.iters < 5:
        p.error("--iters must be >= 5 (steps 2..iters-2 are timed, the last two profiled)")
    model, layouts = (MOE_MODEL, MOE_LAYOUTS) if args.moe else \
        (CP_MODEL, CP_LAYOUTS) if args.cp else (MODEL, LAYOUTS)
    results = {name: [] for name, _, _ in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, nproc, flags in layouts:
                out = run_layout(nproc, model + flags + args.extra, args.iters,
                                 os.path.join(tmp, f"{r}-{re.sub(r'[^a-z0-9]', '', name)}"),
                                 copies=nproc if name == INDEPENDENT else 1)
                results[name].append(out)
                print(f"round {r + 1}: {name:<10} {out['tokens_per_s']:8.0f} tok/s", flush=True)
    base = statistics.median(o["tokens_per_s"] for o in results["1 process"])
    what = "tiny-moe (8 experts, top-2)" if args.moe else "picotron's tiny Llama" + (
        f" at seq {CP_SEQ}, global batch 4" if args.cp else "")
    print(f"\n{what} (vocab 8192), float32, OMP 1 per rank, {os.cpu_count()} "
          f"cores, median of {args.repeats} rounds (steps 2-{args.iters - 2} each)")
    w = max(11, *(len(name) + 1 for name, _, _ in layouts))
    print(f"{'layout':<{w}} {'procs':>5} {'tok/s':>8} {'scaling':>8} {'target':>14} "
          f"{'comm share':>11} {'spread':>7}")
    for name, nproc, _ in layouts:
        tps = [o["tokens_per_s"] for o in results[name]]
        med = statistics.median(tps)
        scaling = med / base
        target = None if args.cp else TARGETS.get(name)
        verdict = "" if target is None else \
            f">= {target:.1f}x {'MET' if scaling >= target else 'NOT MET'}"
        share = statistics.median(o["comm_share"] for o in results[name])
        spread = (max(tps) - min(tps)) / med
        print(f"{name:<{w}} {nproc:>5} {med:8.0f} {scaling:7.2f}x {verdict:>14} {share:10.1%} "
              f"{spread:6.0%}")
    print("comm share: time blocked in collectives / step wall time (train.py --profile, "
          "profiled steps), mean over ranks; spread: (max - min) / median over rounds")
    ceiling = statistics.median(o["tokens_per_s"] for o in results[INDEPENDENT]) / base
    print(f"'{INDEPENDENT}': two independent runs at once (no communication), tokens/s summed: "
          f"this machine lets no 2-rank layout pass {ceiling:.2f}x"
          + ("" if args.moe or args.cp else "; each target as a share of that ceiling: "
             + ", ".join(f"{n} {t / ceiling:.0%}" for n, t in TARGETS.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
