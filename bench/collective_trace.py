"""Overhead of the hang doctor's collective trace and of --debug-collectives, against the same
run without them, measured in the same run.

1. Per call: the CPU time the trace (and --report-comm's counter) adds to one observed call
   (around a no-op, so no communication noise), and the wall time of an all-reduce on 2 gloo processes without and
   with --debug-collectives (which adds an all-gather of a 512-byte fingerprint per call).
2. Per training step: `train.py` on 4 processes (tiny-llama, tp 2 x pp 2, sequence parallel,
   4 microbatches, about 100 collective and p2p calls per step and rank) with
   `--collective-trace-size 0`, with the default trace, and with `--debug-collectives`;
   launches alternate the modes for `--rounds` rounds. Prints per step the CPU time of the 4
   processes (all threads; what the trace costs) and rank 0's wall time, medians of steps
   3.., and their ratios to the run without the trace.

    python bench/collective_trace.py                 # ~5 min on 2 busy cores
    python bench/collective_trace.py --rounds 1 --iters 10

On a machine shared with other jobs wall times move a lot between launches (they are
printed per launch); CPU time per step is the steadier measure of what the trace adds.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("off", "trace", "debug")


# ---------------------------------------------------------------------------- per call
def trace_cpu_us(calls: int, rounds: int) -> dict:
    """CPU microseconds per observed call around a no-op (no communication), without and
    with the trace, and with --report-comm's counter: what the layer and each consumer add to
    every collective."""
    import parallel_state as ps
    from parallel_state import collectives
    from parallel_state.hang_doctor import trace
    from parallel_state.comm_counter import CommCounter

    ps.initialize_distributed("cpu")
    group = torch.distributed.distributed_c10d._get_default_group()
    x = torch.ones(16, 2, 64)

    def run() -> float:
        start = time.process_time()
        for _ in range(calls):
            collectives._run(collectives.Call("all_reduce", group, (x,),
                                              reduce_op=collectives.ReduceOp.SUM), _noop)
        return (time.process_time() - start) / calls * 1e6

    times = {"layer": [], "trace": [], "counter": []}
    with tempfile.TemporaryDirectory() as log_dir:
        for _ in range(rounds):
            times["layer"].append(run())
            trace.start_trace(log_dir, handlers=False)
            times["trace"].append(run())
            trace.stop_trace()
            with CommCounter():
                times["counter"].append(run())
    ps.destroy_model_parallel(destroy_world=True)
    return {m: statistics.median(v) for m, v in times.items()}


def _noop():
    return None


def _debug_worker(rank: int, port: int, calls: int, rounds: int, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import parallel_state as ps
    from parallel_state import collectives
    from parallel_state.hang_doctor import debug_collectives

    ps.initialize_distributed("cpu", timeout=timedelta(minutes=2))
    x = torch.ones(16, 2, 64)
    times = {"off": [], "debug": []}
    for _ in range(rounds):
        for mode in times:
            if mode == "debug":
                debug_collectives.enable()
            collectives.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                collectives.all_reduce(x)
            times[mode].append((time.perf_counter() - start) / calls * 1e6)
            debug_collectives.disable()
    if rank == 0:
        out.put({m: statistics.median(v) for m, v in times.items()})
    ps.destroy_model_parallel(destroy_world=True)


def debug_wall_us(calls: int, rounds: int) -> dict:
    """Wall microseconds per all-reduce of 2 x 16 x 64 floats on 2 gloo processes, without
    and with --debug-collectives (one more all-gather per call)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_debug_worker, args=(r, port, calls, rounds, out))
             for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join()
    return result


# ---------------------------------------------------------------------------- per step
TRAIN = ["--config", "configs/tiny-llama.yaml", "--tp", "2", "--pp", "2", "--sequence-parallel",
         "--eval-interval", "0", "--log-interval", "1", "--peak-tflops", "1"]
FLAGS = {"off": ["--collective-trace-size", "0"], "trace": [], "debug": ["--debug-collectives"]}


def _train_worker(out_dir: str, argv: list[str]) -> int:
    """Under torchrun: train.py's main, noting this process's CPU time (all its threads) and
    the wall time at every logged step, written to out_dir/steps-<rank>.json."""
    import train
    import training.metrics as metrics

    marks, log = [], metrics.MetricsLogger.log

    def noting_log(self, record, *args, **kwargs):
        if "step_time_s" in record:
            marks.append((record["iteration"], time.process_time(), time.perf_counter()))
        return log(self, record, *args, **kwargs)

    metrics.MetricsLogger.log = noting_log
    rc = train.main(argv)
    with open(os.path.join(out_dir, f"steps-{os.environ['RANK']}.json"), "w") as f:
        json.dump(marks, f)
    return rc


def train_step_costs(mode: str, iters: int) -> tuple[float, float]:
    """(median CPU seconds per step summed over the 4 ranks, median wall seconds per step on
    rank 0), over steps 3.. of one launch."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=4", __file__, "--worker", out, "--", *TRAIN, "--train-iters",
               str(iters), "--log-dir", out, *FLAGS[mode]]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"train.py failed ({mode}):\n{proc.stderr[-3000:]}")
        ranks = [json.load(open(os.path.join(out, f"steps-{r}.json"))) for r in range(4)]
    steps = range(2, min(len(m) for m in ranks))  # marks[i] is taken after step i + 1
    cpu = [sum(m[i][1] - m[i - 1][1] for m in ranks) for i in steps]
    wall = [ranks[0][i][2] - ranks[0][i - 1][2] for i in steps]
    return statistics.median(cpu), statistics.median(wall)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        sys.exit(_train_worker(argv[1], argv[3:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per timed round")
    p.add_argument("--call-rounds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="train.py launches per mode")
    p.add_argument("--iters", type=int, default=20, help="training steps per launch")
    p.add_argument("--skip-train", action="store_true")
    args = p.parse_args(argv)

    cpu = trace_cpu_us(args.calls * 5, args.call_rounds)
    print(f"CPU per observed call, no communication (median of {args.call_rounds} rounds): "
          f"layer alone {cpu['layer']:.1f} us, with the trace {cpu['trace']:.1f} us "
          f"(the trace adds {cpu['trace'] - cpu['layer']:.1f} us per call); with the "
          f"--report-comm counter {cpu['counter']:.1f} us (adds "
          f"{cpu['counter'] - cpu['layer']:.1f} us, only in the counted step)")
    wall = debug_wall_us(args.calls, args.call_rounds)
    print(f"all-reduce of 2x16x64 floats on 2 gloo processes (median of {args.call_rounds} "
          f"rounds of {args.calls}): {wall['off']:.0f} us, with --debug-collectives "
          f"{wall['debug']:.0f} us (x{wall['debug'] / wall['off']:.2f})")
    if args.skip_train:
        return
    cpu, wall = {m: [] for m in MODES}, {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            c, w = train_step_costs(mode, args.iters)
            cpu[mode].append(c)
            wall[mode].append(w)
    print(f"train.py, 4 processes (tiny-llama, tp 2 x pp 2, sp, 4 microbatches), {args.rounds} "
          f"launches of {args.iters} steps per mode, medians of steps 3..:")
    for mode in MODES:
        c, w = statistics.median(cpu[mode]), statistics.median(wall[mode])
        c_off, w_off = statistics.median(cpu["off"]), statistics.median(wall["off"])
        print(f"  {mode:>5}: CPU {c * 1e3:7.1f} ms per step (4 ranks) ratio {c / c_off:.3f}"
              f" | wall {w * 1e3:7.1f} ms per step ratio {w / w_off:.3f}"
              f" (launches {', '.join(f'{x * 1e3:.0f}' for x in wall[mode])} ms)")


if __name__ == "__main__":
    main()
