"""The peak TFLOP/s that MFU divides by, measured or read from the data sheet, once per run.

Model FLOPs per token (the numerator) are planner/flops.py's formulas (Narayanan et al. 2021,
sec. 5.1); this module only fixes the denominator (`PeakFlops`).
"""
from __future__ import annotations

import os
import time

import torch

from layers import gemm
from planner.flops import GPU_PEAK_BF16_TFLOPS, GPU_PEAK_FP8_TFLOPS, blended_peak


def measured_matmul_peak(dtype: torch.dtype, device: torch.device, n: int = 2048,
                         repeats: int = 8, max_seconds: float = 2.0) -> tuple[float, int]:
    """Best FLOP/s of timed `[n, n] x [n, n]` matmuls in `dtype`: of the whole device on CUDA,
    of one CPU thread on a CPU.

    On CUDA, wall time between synchronizations. On a CPU the matmuls run on one thread
    (`torch.set_num_threads(1)` for the measurement) and are timed in that thread's CPU time
    (`time.thread_time`), which does not grow while other processes hold the cores: a busy
    machine gives the same rate as an idle one (a 2-core VM with three processes per core:
    0.092 against 0.091 TFLOP/s idle, where wall time said 0.050). The caller multiplies by
    the threads a process has (`PeakFlops`). In float32 both GEMMs torch has are timed, MKL's
    (`torch.matmul`) and oneDNN's (layers/gemm.py), and the faster counts: the peak is the
    machine's, whichever one the model runs on.

    `repeats` matmuls are timed (at most `max_seconds` once two are). After one warm-up
    matmul, the size grows from 256 by doubling up to `n` while one matmul stays under
    `max_seconds / 64`, so that a slow dtype (bf16 on a CPU without bf16 instructions runs
    ~40x below fp32) is measured at a smaller size in a fraction of a second. The best, not
    the mean: interference only ever makes a matmul slower.

    Returns:
        `(FLOP/s, size)`: the rate and the matrix size it was measured at.
    """
    kernels = [torch.matmul]
    if device.type == "cpu" and dtype == torch.float32 and gemm.available():
        kernels.append(lambda a, b: gemm.linear_nt(a, b.t()))  # oneDNN's (layers/gemm.py)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return max(_measured_kernel_peak(k, dtype, device, n, repeats, max_seconds)
                   for k in kernels)
    finally:
        torch.set_num_threads(threads)


def _measured_kernel_peak(kernel, dtype, device, n, repeats, max_seconds):
    clock = time.thread_time if device.type == "cpu" else time.perf_counter

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        kernel(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - t0

    size = min(256, n)
    # its own generator: how many matrices a measurement makes depends on the machine's speed,
    # and no measurement may move a random stream of the run (parallel_state/random.py)
    gen = torch.Generator().manual_seed(0)
    make = lambda: torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    a, b = make(), make()
    timed(a, b)  # warm-up: one-time costs (CUDA context, BLAS handles) are not the rate
    while size < n and timed(a, b) <= max_seconds / 64:
        size *= 2
        a, b = make(), make()
    best, spent, done = float("inf"), 0.0, 0
    while done < repeats and not (done >= 2 and spent >= max_seconds):
        elapsed = timed(a, b)
        best, spent, done = min(best, elapsed), spent + elapsed, done + 1
    return 2.0 * size ** 3 / best, size


def cpu_threads_per_rank() -> tuple[float, str]:
    """The CPU threads one rank can keep busy: its torch threads, but no more than the CPUs
    this process may run on shared by the ranks on this host (torchrun's LOCAL_WORLD_SIZE),
    so the ranks' peaks add up to the host's. Returns `(threads, what limited them)`."""
    threads = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if threads * ranks <= cpus:
        return float(threads), f"{threads} thread{'s' if threads > 1 else ''}"
    return cpus / ranks, f"{cpus} CPUs shared by {ranks} ranks"


class PeakFlops:
    """The per-device peak TFLOP/s that MFU divides by: one figure per run, fixed at start-up.

    Where it comes from (`source` says which): `--peak-tflops` when given; else on a GPU the
    data sheet's dense bf16 peak (`GPU_PEAK_BF16_TFLOPS`; fp32 runs as TF32, half of it), as
    torchtitan does, and under FP8 training (`fp8_share`: the FP8 GEMMs' share of the model
    FLOPs, planner/flops.py `fp8_flops_share`) blended with the data sheet's dense FP8 peak
    (`GPU_PEAK_FP8_TFLOPS`, `blended_peak`) where the GPU has one; else measured here: on a
    CPU one thread's best matmul rate in CPU time
    (`measured_matmul_peak`) times the threads the rank has (`cpu_threads_per_rank`); on a
    GPU missing from the table its best matmul rate. It is not measured again: every MFU of
    the run (log lines, the closing line) divides by the same figure. An achieved rate above
    it would mean the peak is wrong; `mfu` then returns None rather than a figure over 100%,
    and `note` says why and what to pass.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, given: float | None = None,
                 fp8_share: float = 0.0):
        self.device, self.dtype = device, dtype
        self.key = "bf16" if dtype == torch.bfloat16 else "fp32"
        self.note: str | None = None
        self._said = False
        self.measured = False
        self.fp8_share = fp8_share
        if given:
            self.tflops, self.source = float(given), "--peak-tflops"
            return
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        for key, tflops in GPU_PEAK_BF16_TFLOPS.items():
            if device.type == "cuda" and key in name:
                self.tflops = tflops / (1 if self.key == "bf16" else 2)
                self.source = f"{key} data sheet, dense {'bf16' if self.key == 'bf16' else 'TF32'}"
                fp8 = GPU_PEAK_FP8_TFLOPS.get(key)
                if fp8_share and fp8 is not None:
                    self.tflops = blended_peak(self.tflops, fp8, fp8_share)
                    self.source += (f" {tflops / (1 if self.key == 'bf16' else 2):g} and "
                                    f"FP8 {fp8:g} TFLOP/s, weighted by the FP8 GEMMs' "
                                    f"{fp8_share:.1%} of the model FLOPs")
                elif fp8_share:
                    self.source += f"; {key} has no FP8 peak: the FP8 GEMMs count at it"
                return
        self.measured = True
        if device.type == "cpu":
            # 1024^3 on one thread: ~20-30 ms in fp32, 16 of them (MKL's and oneDNN's) < 0.5 s
            rate, n = measured_matmul_peak(dtype, device, 1024)
            threads, why = cpu_threads_per_rank()
            self.tflops = rate * threads / 1e12
            self.source = (f"measured at start-up: {rate / 1e12:.3g} TFLOP/s per thread, the "
                           f"best of {n}^3 {self.key} matmuls on one thread in CPU time, x "
                           f"{why}")
            if fp8_share:
                self.source += (f"; a CPU has no FP8 peak: the FP8 GEMMs ({fp8_share:.1%} of "
                                f"the model FLOPs) count at it")
        else:
            rate, n = measured_matmul_peak(dtype, device, 8192)
            self.tflops = rate / 1e12
            self.source = (f"measured at start-up: the best of {n}^3 {self.key} matmuls; "
                           f"{name} is not in the peak table, pass --peak-tflops with its "
                           f"data sheet's dense peak")

    def mfu(self, achieved_tflops: float) -> float | None:
        """`achieved / peak`, or None when the achieved rate exceeds the peak (see class)."""
        if achieved_tflops <= self.tflops:
            return achieved_tflops / self.tflops
        if self.note is None:
            self.note = (f"the achieved {achieved_tflops:.3g} TFLOP/s per device exceeds the "
                         f"peak {self.tflops:.3g} TFLOP/s ({self.source}), so MFU is not "
                         f"shown; pass --peak-tflops with the device's real peak")
        return None

    def say_note(self) -> None:
        """Print `note` once per run (the first time it is set; later calls print nothing)."""
        if self.note is not None and not self._said:
            print(f"note: {self.note}", flush=True)
            self._said = True

    def describe(self) -> str:
        return f"{self.tflops:.3g} TFLOP/s per device ({self.source})"
