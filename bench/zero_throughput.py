"""Training tokens/s and per-rank model-state bytes of the data-parallel sharding strategies
(no_shard, optim = ZeRO-1, optim_grads = ZeRO-2, optim_grads_params = ZeRO-3) and of
offload (ZeRO-Offload: the optimizer in host memory; ZeRO-Infinity: the optimizer on NVMe,
and ZeRO-3's parameters on NVMe or in host memory too), on the same model and layout,
measured in the same run, with the device / host / disk bytes of each, and the read and
write GB/s of `--offload-path` beside the planner's NVMe assumption.

Each variant is a short `training.trainer.pretrain` run (the real training path: schedules,
bucketed reductions, gathers, clipping, optimizer) on the embedded demo corpus, in its own
torchrun launch (so one variant's memory is gone before the next starts: the host allocator
keeps what a run freed, and at 135M parameters x 4 ranks five variants in one process do not
fit a 24 GB machine). Rounds visit
the variants in turn (ABCD...) to cancel drift on a shared machine; a variant's tokens/s is
the global batch's tokens over the median step time of its steps after the first, taken over
all rounds. Ratios are against no_shard (or the first --only variant). Model-state bytes are read off the tensors on rank 0
(training/memory.py) beside ZeRO's formula; on CUDA the peak allocated memory of each run is
printed too (the memory effect of sharding and offload), on CPU it is not (host RSS only
grows).

Run: `python bench/zero_throughput.py` (launches itself under torchrun with `--nproc`
processes for each variant: 2 on CPU, one per GPU on CUDA; a few minutes on 2 CPU cores). Flags after `--` go
to every run, e.g. `-- --model llama-style-135m --seq-length 512 --bf16`.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STRATEGY = "--data-parallel-sharding-strategy"


def variants(offload_base: str, offload_path: str) -> list[tuple[str, list[str]]]:
    nvme = ["--offload-path", offload_path]
    zero3 = [STRATEGY, "optim_grads_params"]
    return [("no_shard", [STRATEGY, "no_shard"]), ("optim", [STRATEGY, "optim"]),
            ("optim_grads", [STRATEGY, "optim_grads"]),
            ("optim_grads_params", zero3),
            (f"{offload_base}+opt cpu", [STRATEGY, offload_base, "--optimizer-cpu-offload"]),
            (f"{offload_base}+opt nvme", [STRATEGY, offload_base, "--optimizer-offload-device",
                                          "nvme", *nvme]),
            ("zero3+opt,params cpu", zero3 + ["--optimizer-offload-device", "cpu",
                                              "--param-offload-device", "cpu"]),
            ("zero3+opt,params nvme", zero3 + ["--optimizer-offload-device", "nvme",
                                               "--param-offload-device", "nvme", *nvme])]


def measure_path(path: str, nbytes: int = 256 << 20, chunk: int = 16 << 20) -> tuple[float, float]:
    """(write, read) GB/s of `path` through the offload's own file path (SwapFile: pwrite /
    preadv), written then synced (fdatasync) and dropped from the page cache
    (POSIX_FADV_DONTNEED) before it is read back, so both hit the drive as far as the kernel
    lets a non-root process."""
    import time

    from data_parallel.offload_files import SwapFile

    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path) as tmp:
        f = SwapFile(tmp, "bench.bin", nbytes, threads=2)
        buf = torch.randn(chunk // 4)
        start = time.perf_counter()
        for fut in [f.write(at, buf) for at in range(0, nbytes, chunk)]:
            fut.result()
        os.fdatasync(f.fd)
        write = nbytes / (time.perf_counter() - start) / 1e9
        os.posix_fadvise(f.fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        outs = [torch.empty(chunk // 4) for _ in range(2)]
        start = time.perf_counter()
        for i, at in enumerate(range(0, nbytes, chunk)):
            f.read(at, outs[i % 2]).result()
        read = nbytes / (time.perf_counter() - start) / 1e9
        f.close()
    return write, read


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (data-parallel ranks unless the flags add --tp/--pp)")
    p.add_argument("--iters", type=int, default=5, help="training steps per run")
    p.add_argument("--rounds", type=int, default=2, help="passes over all variants")
    p.add_argument("--offload-base", default="optim_grads",
                   help="strategy of the optimizer-offload variants (ZeRO-Offload is stage 2)")
    p.add_argument("--offload-path", default=os.path.join(tempfile.gettempdir(),
                                                          "shardzoo-bench-offload"),
                   help="folder of the NVMe variants' scratch files (default: in the temp dir)")
    p.add_argument("--nvme-bandwidth", type=float, default=25.0,
                   help="GB/s per node the planner is told (tools/plan.py --nvme-bandwidth), "
                        "printed beside the measured GB/s of --offload-path")
    p.add_argument("--only", help="comma-separated variants to run (default: all)")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # worker: the variant to run
    p.add_argument("--out", help=argparse.SUPPRESS)  # worker: where rank 0 writes its result
    p.add_argument("train_args", nargs="*", help="after --: flags for every run")
    args = p.parse_args(argv)
    if not args.train_args:
        args.train_args = ["--config", "configs/tiny-llama.yaml", "--micro-batch-size", "4",
                           "--global-batch-size", "16"]
    return args


def common_flags(args) -> list[str]:
    return args.train_args + ["--train-iters", str(args.iters), "--log-interval", "1",
                              "--eval-interval", "0", "--no-tensorboard", "--peak-tflops", "1"]


def launch(args, nproc: int, name: str, out: str) -> None:
    """One variant under torchrun; rank 0 writes its result (json) to `out`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", __file__, "--iters", str(args.iters),
           "--offload-base", args.offload_base, "--offload-path", args.offload_path,
           "--variant", name, "--out", out, "--",
           *args.train_args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"variant {name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def worker(args) -> None:
    """Under torchrun: run `args.variant` once; rank 0 writes the result to `args.out`."""
    import torch.distributed as dist

    import parallel_state as ps

    ps.initialize_distributed()
    flags = dict(variants(args.offload_base, args.offload_path))[args.variant]
    with tempfile.TemporaryDirectory() as tmp:
        out = one_run(common_flags(args) + flags, tmp)
    if dist.get_rank() == 0:
        out["world"] = dist.get_world_size()
        out["device"] = str(ps.get_device())
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def one_run(flags: list[str], log_dir: str) -> dict:
    """A short pretrain; returns step times and rank 0's model-state record (quietly)."""
    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    ps.destroy_model_parallel()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with contextlib.redirect_stdout(io.StringIO()):
        records = pretrain(parse_config(flags + ["--log-dir", log_dir]))
    steps = [r for r in records if "loss" in r]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    record = dict(steps[-1])
    metrics = os.path.join(log_dir, "metrics.jsonl")  # rank 0: its run_start accounting
    if os.path.exists(metrics):
        with open(metrics) as f:
            record.update(json.loads(f.readline()))
    return {"step_times": [r["step_time_s"] for r in steps[1:]], "record": record,
            "loss": steps[-1]["loss"], "cuda_peak": peak}


def bench(args) -> None:
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    vs = variants(args.offload_base, args.offload_path)
    if args.only:  # ratios are then against the first of these
        keep = args.only.split(",")
        vs = [v for v in vs if v[0] in keep]
    times = {name: [] for name, _ in vs}
    last = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, _ in vs:
                path = os.path.join(tmp, f"{r}-{name}.json")
                launch(args, nproc, name, path)
                out = json.loads(Path(path).read_text())
                times[name] += out["step_times"]
                last[name] = out
    from training.arguments import parse_config

    first = vs[0][0]  # the baseline of the ratios: no_shard unless --only says otherwise
    rec0, world = last[first]["record"], last[first]["world"]
    cfg = parse_config(common_flags(args)).validate(world)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    mib = lambda b: f"{b / 2**20:10.2f}"  # noqa: E731
    print(f"device {last[first]['device']}, world {world} (dp "
          f"{rec0['model_state_dp']}), {cfg.model.name}: {cfg.model.num_parameters() / 1e6:.2f}M "
          f"params, {tokens} tokens/step, {args.iters} steps x {args.rounds} rounds per variant, "
          f"bf16 {cfg.train.bf16}")
    base = tokens / statistics.median(times[first])
    cuda = last[first]["cuda_peak"] is not None
    head = (f"{'variant':<24} {'tok/s':>9} {'vs first':>11} {'states MiB/rank':>15} "
            f"{'formula':>10} {'paper':>10} {'host MiB':>10} {'formula':>10} {'NVMe MiB':>10} "
            f"{'formula':>10} {'gathered':>10}")
    if cuda:
        head += f" {'cuda peak':>10}"
    print(head)
    for name, _ in vs:
        rec = last[name]["record"]
        tps = tokens / statistics.median(times[name])
        spread = (max(times[name]) - min(times[name])) / statistics.median(times[name])
        line = (f"{name:<24} {tps:9.0f} {tps / base:10.3f}x {mib(rec['model_state_total_bytes']):>15}"
                f" {mib(rec['model_state_predicted_total_bytes'])} "
                f"{mib(rec['model_state_paper_total_bytes'])} "
                f"{mib(rec['model_state_host_total_bytes'])} "
                f"{mib(rec['model_state_predicted_host_total_bytes'])} "
                f"{mib(rec.get('model_state_nvme_total_bytes', 0))} "
                f"{mib(rec.get('model_state_predicted_nvme_total_bytes', 0))} "
                f"{mib(rec.get('gathered_params_peak_bytes', 0))}")
        if cuda:
            line += f" {mib(last[name]['cuda_peak'])}"
        print(line + (f"   (step-time spread {spread:.0%}: busy machine)" if spread > 0.5 else ""))
    print("states: params + grads + main params + optimizer states on the device, measured "
          "on rank 0; formula: ZeRO (Rajbhandari et al. 2020, sec. 5) with the padded parameter "
          "count, paper: with the unpadded one; host: offloaded main params, moments, "
          "gradient copies, parameter shards and the NVMe streaming buffers; NVMe: the scratch "
          "files (12 B per offloaded optimizer element, the weight shards); gathered: ZeRO-3 "
          "peak of gathered parameters")
    if any("nvme" in name for name, _ in vs):
        write, read = measure_path(args.offload_path)
        print(f"--offload-path {args.offload_path}: measured write {write:.2f} GB/s, read "
              f"{read:.2f} GB/s (256 MiB, synced, page cache dropped); the planner was told "
              f"--nvme-bandwidth {args.nvme_bandwidth:g} GB/s per node, "
              f"{args.nvme_bandwidth / max(1, nproc):.2f} GB/s per rank at {nproc} ranks")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.variant:
        worker(args)
    else:
        bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
