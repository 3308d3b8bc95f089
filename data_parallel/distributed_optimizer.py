"""Mixed-precision AdamW on flat float32 shards: ZeRO stages 1-3 (Megatron's distributed
optimizer, `--data-parallel-sharding-strategy`), the fp32 main weights of --bf16, and
ZeRO-Offload (`--optimizer-cpu-offload`).

Sharded (Rajbhandari et al. 2020, sec. 5.1, "P_os"): the gradients of
`data_parallel.ddp.DistributedDataParallel` are reduce-scattered over DP, bucket by bucket,
during backward; DP rank r owns shard r of every bucket (`ddp.shard_range`). For that shard only
it keeps float32 main parameters and the AdamW moments (exp_avg, exp_avg_sq), updates them, and
writes the result into its shard of the parameters (`ddp.param_view`: the contiguous parameter
buffer, all-gathered over DP afterwards by `ddp.start_param_sync`, or under ZeRO-3 the
parameter shards themselves, gathered per unit when next used). The gradient it reads is
`ddp.grad_view`: a range of the full buffer (ZeRO-1) or of the gradient shards (ZeRO-2/3).
In float32 the main weights are the model weights (views of the parameter store); in bf16 they
are separate float32 copies.

Without sharding (`shard=False`, plain --bf16) the same code owns every bucket whole: float32
main weights and moments for all parameters, copied back into the bf16 weights after the step
(Micikevicius et al. 2018, sec. 3.1; Megatron's Float16OptimizerWithFloat16Params).

CPU offload (ZeRO-Offload, Ren et al. 2021, sec. 4; Megatron's HybridDeviceOptimizer with
--optimizer-offload-fraction): the first `offload_fraction` of this rank's owned elements (in
flat order, i.e. the last layers first, whose gradients are ready first) keep main weights and
moments in host memory (pinned when the model is on CUDA) and are updated there by torch's
fused CPU AdamW. In `step`, every offloaded shard's gradient is copied to a host buffer (async
on CUDA), the on-device shards are updated while those copies run, then each host shard is
updated as soon as its copy has landed and its new weights are copied back (async), so the
transfers of one shard overlap the CPU update of another (Megatron's
--overlap-cpu-optimizer-d2h-h2d). The copies cannot start during backward: the sequence-
parallel and tied-embedding gradient sums and the clipping scale change gradients after it.

NVMe offload (`offload_device="nvme"`, ZeRO-Infinity, Rajbhandari et al. 2021, sec. 5.1:
the "infinity offload engine" for optimizer states): the offloaded shards' main weights and
moments live in one raw file per rank (data_parallel/offload_files.py), each shard's three
tensors side by side ([main | exp_avg | exp_avg_sq], 12 bytes per element). `step` streams
them through `buffer_count` host buffers: while shard i is updated (its gradient copied into
the buffer's gradient slot, torch's fused AdamW, the new weights copied to the model), the
reads of shards i+1 .. i+buffer_count-1 and the write of shard i-1 run on the file's I/O
threads (a read into a buffer first waits for that buffer's previous write). Host memory
holds only the buffers: `buffer_count` x 16 bytes x the largest offloaded shard.

The update is torch.optim.AdamW's (decoupled weight decay, Loshchilov & Hutter 2019), run by
torch's fused kernel (one pass over each tensor, on the device or the host) over views of the
flat shards, one per parameter segment, so it matches AdamW elementwise up to rounding. 1-D
parameters (biases, norm weights) get no weight decay: their views sit in a group without it.

Gradient norm (Megatron's clip_grad_norm_fp32): the squared norm is summed over each rank's
owned element ranges, counting a range only if its parameter counts (`counts_toward_norm`:
replicated-over-TP parameters on TP rank 0, the tied embedding's last-stage copy never), then
all-reduced over DP (the shards are disjoint) and over the model-parallel group; an expert
bucket's squares (expert parallelism: its own buckets, sharded over the expert-data-parallel
group) are kept apart and also summed over the expert-parallel ranks
(data_parallel/grad_norm.py `global_norm`).
"""
from __future__ import annotations

import os
import signal
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.adamw import adamw

import parallel_state as ps

from .ddp import DistributedDataParallel
from .grad_norm import counts_toward_norm, global_norm, squares
from .offload_files import SwapFile, make_scratch, remove_scratch

OFFLOAD_DEVICES = ("cpu", "nvme")


@dataclass(eq=False)
class _Shard:
    """What one rank owns of one bucket: flat range [lo, hi) and its optimizer tensors."""

    ddp: DistributedDataParallel
    bucket: object
    lo: int
    hi: int
    main: torch.Tensor | None  # float32 [hi - lo]: a view of the parameter store, or its
    exp_avg: torch.Tensor | None  # own copy; None on NVMe (read through `shard_state`)
    exp_avg_sq: torch.Tensor | None
    owns_main: bool  # main is a separate copy (bf16 weights, no parameter store, or host)
    # (param, first element in param, first element in shard, count) for each overlap
    segments: list[tuple] = field(default_factory=list)
    norm: list[tuple[int, int]] = field(default_factory=list)
    outside_norm: list[tuple[int, int]] = field(default_factory=list)  # the other segments
    host_grad: torch.Tensor | None = None  # offloaded: the gradient's host copy
    adamw: torch.optim.AdamW | None = None  # torch's fused AdamW over views of the above
    steps: list[torch.Tensor] = field(default_factory=list)  # its per-view step counts
    nvme_offset: int = -1  # NVMe: byte offset of [main | exp_avg | exp_avg_sq] in the file

    @property
    def host(self) -> bool:
        return self.host_grad is not None

    @property
    def nvme(self) -> bool:
        return self.nvme_offset >= 0

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def grad(self) -> torch.Tensor:
        return self.ddp.grad_view(self.bucket, self.lo, self.hi)


class DistributedOptimizer:
    """AdamW over the owned shards of `model` (DDP wrappers, one per model chunk).

    Per step: `norm = clip_grad_norm(max_norm)` then `step()`. `param_groups` holds one dict
    whose "lr" the trainer sets each iteration (as for torch optimizers).

    Args:
        shard: own 1/dp of each bucket (needs sharding wrappers, any strategy but no_shard);
            False owns everything (plain mixed precision).
        offload_fraction: share of this rank's owned elements whose main weights and moments
            live and are updated off the device (0 = none; see the module docstring).
        offload_device: where they live: "cpu" (host memory) or "nvme" (files in a scratch
            folder of this process under `offload_path`, streamed through `buffer_count`
            host buffers of `buffer_size` elements (a longer shard goes in pieces) by
            `io_threads` threads; pinned when the model is on CUDA and `pin_memory`).
        rank: this process's global rank (names its scratch folder).
    Raises:
        ValueError: `shard` without sharding wrappers; a fraction outside [0, 1]; an unknown
            device; nvme without a path; fewer than 2 buffers.
        data_parallel.offload_files.OffloadPathError: the offload file cannot be reserved.
    """

    def __init__(self, model: list[DistributedDataParallel], *, lr: float, weight_decay: float,
                 betas=(0.9, 0.999), eps: float = 1e-8, shard: bool = True,
                 offload_fraction: float = 0.0, offload_device: str = "cpu",
                 offload_path: str | None = None, buffer_count: int = 2,
                 buffer_size: int = 4_000_000, io_threads: int = 2,
                 pin_memory: bool = True, rank: int = 0):
        if shard and not all(d.use_distributed_optimizer for d in model):
            raise ValueError("the distributed optimizer needs DistributedDataParallel wrappers "
                             "with a sharding strategy (reduce-scatter buffers)")
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
        if offload_device not in OFFLOAD_DEVICES:
            raise ValueError(f"offload_device must be one of {OFFLOAD_DEVICES}, got "
                             f"{offload_device!r}")
        nvme = offload_device == "nvme" and offload_fraction > 0
        if nvme and (not offload_path or buffer_count < 2):
            raise ValueError("NVMe offload needs an offload_path and buffer_count >= 2 (one "
                             "buffer being updated while the next is read)")
        self.model, self.sharded = model, shard
        self.offload_fraction, self.offload_device = offload_fraction, offload_device
        self.swap, self.scratch, self._slots = None, None, []
        self.buffer_count = buffer_count if nvme else 0  # host buffers NVMe shards stream through
        self.param_groups = [{"lr": lr, "weight_decay": weight_decay, "betas": betas,
                              "eps": eps}]
        self.step_count = 0
        ranges = [(ddp, b, *ddp.shard_range(b)) for ddp in model for b in ddp.buffer.buckets]
        cut = int(offload_fraction * sum(hi - lo for _, _, lo, hi in ranges))  # host elements
        pieces = []  # (ddp, bucket, lo, hi, offloaded)
        for ddp, b, lo, hi in ranges:
            host_hi = min(hi, lo + max(cut, 0))
            cut -= host_hi - lo
            if host_hi > lo:
                pieces.append((ddp, b, lo, host_hi, True))
            if hi > host_hi:
                pieces.append((ddp, b, host_hi, hi, False))
        if nvme:  # streamed in pieces of at most buffer_size elements
            pieces = [(d, b, a, min(a + buffer_size, hi), off) if off else (d, b, lo, hi, off)
                      for d, b, lo, hi, off in pieces
                      for a in (range(lo, hi, buffer_size) if off else [lo])]
            sizes = [hi - lo for _, _, lo, hi, off in pieces if off]
            device = model[0].device if model else torch.device("cpu")
            self.scratch = make_scratch(offload_path, rank)
            self._remove_scratch = weakref.finalize(self, remove_scratch, self.scratch)
            try:
                self.swap = SwapFile(self.scratch, "optimizer.bin", 12 * sum(sizes), io_threads)
            except BaseException:
                remove_scratch(self.scratch)
                raise
            pin = pin_memory and device.type == "cuda"
            biggest = max(sizes, default=0)
            self._slots = [(torch.empty(3 * biggest, dtype=torch.float32, pin_memory=pin),
                            torch.empty(biggest, dtype=torch.float32, pin_memory=pin))
                           for _ in range(buffer_count)]
        self.shards, offset = [], 0
        for ddp, b, lo, hi, off in pieces:
            if off and nvme:
                self.shards.append(self._make_nvme_shard(ddp, b, lo, hi, offset))
                offset += 12 * (hi - lo)
            else:
                self.shards.append(self._make_shard(ddp, b, lo, hi, host=off))

    @torch.no_grad()
    def _make_shard(self, ddp: DistributedDataParallel, bucket, lo: int, hi: int,
                    host: bool) -> _Shard:
        store = ddp.read_params(bucket, lo, hi)  # NVMe parameters: a host copy
        alias = (not host and store is not None and store.dtype == torch.float32
                 and ddp.param_file is None and store.device == ddp.device)
        device = torch.device("cpu") if host else ddp.device
        pin = host and ddp.device.type == "cuda"

        def zeros():
            return torch.zeros(hi - lo, dtype=torch.float32, device=device, pin_memory=pin)

        main = store if alias else zeros()
        shard = _Shard(ddp, bucket, lo, hi, main, zeros(), zeros(), owns_main=not alias,
                       segments=ddp.owned_segments(bucket, lo, hi))
        for p, p_start, at, n in shard.segments:
            (shard.norm if counts_toward_norm(p) else shard.outside_norm).append((at, at + n))
            if not alias and store is None:
                main[at: at + n].copy_(p.detach().reshape(-1)[p_start: p_start + n])
        if not alias and store is not None:
            main.copy_(store)
        if host:
            shard.host_grad = zeros()
        self._build_adamw(shard)
        return shard

    @torch.no_grad()
    def _make_nvme_shard(self, ddp: DistributedDataParallel, bucket, lo: int, hi: int,
                         offset: int) -> _Shard:
        """A shard whose main weights (the current weights) and zero moments are written to
        the offload file at byte `offset`."""
        shard = _Shard(ddp, bucket, lo, hi, None, None, None, owns_main=True,
                       segments=ddp.owned_segments(bucket, lo, hi), nvme_offset=offset)
        for p, _, at, n in shard.segments:
            (shard.norm if counts_toward_norm(p) else shard.outside_norm).append((at, at + n))
        buf, _ = self._slots[0]
        main, moments = buf[:hi - lo], buf[hi - lo: 3 * (hi - lo)]
        store = ddp.read_params(bucket, lo, hi)
        if store is not None:
            main.copy_(store)
        for p, p_start, at, n in shard.segments if store is None else []:
            main[at: at + n].copy_(p.detach().reshape(-1)[p_start: p_start + n])
        moments.zero_()
        self.swap.write(offset, buf[:3 * (hi - lo)]).result()
        return shard

    def _build_adamw(self, s: _Shard) -> None:
        """torch's fused AdamW (one pass over each tensor) over parameter views of the
        shard's flat tensors, one per parameter segment: weights `main`, gradients the DDP
        buffer's (or its host copy), moments pre-set to views of `exp_avg`/`exp_avg_sq`. The
        views stay valid: every one of these buffers is only ever updated in place."""
        g = self.param_groups[0]
        grad = s.host_grad if s.host else s.grad
        groups = {True: [], False: []}
        state = {}
        for p, _, at, n in s.segments:
            view = nn.Parameter(s.main[at: at + n], requires_grad=False)
            view.grad = grad[at: at + n]
            step = torch.zeros((), dtype=torch.float32, device=s.main.device)
            s.steps.append(step)
            state[view] = {"step": step, "exp_avg": s.exp_avg[at: at + n],
                           "exp_avg_sq": s.exp_avg_sq[at: at + n]}
            groups[p.ndim > 1].append(view)
        param_groups = [{"params": v, "decay": decay,
                         "weight_decay": g["weight_decay"] if decay else 0.0}
                        for decay, v in groups.items() if v]
        if not param_groups:
            return
        s.adamw = torch.optim.AdamW(param_groups, lr=g["lr"], betas=g["betas"],
                                    eps=g["eps"], fused=True)
        s.adamw.state.update(state)

    # ------------------------------------------------------------------ gradient norm
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the (DP-reduced) gradient, each element counted once; scales
        the owned gradients so the norm is at most `max_norm` (0 disables). Returns the norm
        before clipping."""
        device = self.model[0].device if self.model else ps.get_device()
        dense, expert = (squares([s.grad[a:b] for s in self.shards for a, b in s.norm
                                  if s.bucket.comm.expert == e], device) for e in (False, True))
        norm = global_norm(dense, expert, self.sharded)
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for s in self.shards:
                s.grad.mul_(scale)
        return norm

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def step(self) -> None:
        """AdamW on every owned shard (torch.optim.AdamW's arithmetic), then write the new
        weights into the model: the owned range of the parameter store plus its all-gather or
        invalidation (sharded), or a copy into each bf16 parameter (not sharded)."""
        g = self.param_groups[0]
        self.step_count += 1
        host = [s for s in self.shards if s.host]
        copied = []
        for s in host:  # stream the offloaded gradients to the host
            s.host_grad.copy_(s.grad, non_blocking=True)
            copied.append(_event(s.grad.device))
        for s in self.shards:
            if not s.host and not s.nvme:
                self._adamw_step(s, g)
                self._write_back(s)
        for s, done in zip(host, copied):
            if done is not None:
                done.synchronize()
            self._adamw_step(s, g)
            self._write_back(s, non_blocking=True)
        self._nvme_step([s for s in self.shards if s.nvme], g)
        for ddp in self.model:
            ddp.start_param_sync()

    def _nvme_step(self, shards: list[_Shard], g: dict) -> None:
        """AdamW on the NVMe shards, streamed through the host buffers (module docstring):
        buffer i % k holds shard i; the reads of the next k - 1 shards and the write of the
        previous one run on the I/O threads while shard i is updated."""
        k, n = len(self._slots), len(shards)
        reads, writes = [None] * n, [None] * n

        def start_read(j):
            buf = self._slots[j % k][0][:3 * shards[j].numel]
            reads[j] = self.swap.read(shards[j].nvme_offset, buf,
                                      after=writes[j - k] if j >= k else None)

        for j in range(min(k - 1, n)):
            start_read(j)
        for i, s in enumerate(shards):
            if i + k - 1 < n:
                start_read(i + k - 1)
            reads[i].result()
            buf, grad = self._slots[i % k]
            main, exp_avg, exp_avg_sq = _split(buf, s.numel)
            grad = grad[:s.numel]
            grad.copy_(s.grad)
            self._functional_step(s, main, exp_avg, exp_avg_sq, grad, g)
            self._write_back(s, main=main)
            writes[i] = self.swap.write(s.nvme_offset, buf[:3 * s.numel])
            if i == 0:
                _kill_hook(self.step_count, writes[0])
        for w in writes:
            w.result()

    def _functional_step(self, s: _Shard, main, exp_avg, exp_avg_sq, grad, g: dict) -> None:
        """torch.optim.AdamW's fused update of shard `s` held in the given flat tensors (one
        view per parameter segment, 1-D parameters without weight decay)."""
        for decay in (True, False):
            spans = [(at, n) for p, _, at, n in s.segments if (p.ndim > 1) == decay]
            if not spans:
                continue
            views = lambda t: [t[a: a + n] for a, n in spans]  # noqa: E731
            steps = [torch.full((), float(self.step_count - 1)) for _ in spans]
            adamw(views(main), views(grad), views(exp_avg), views(exp_avg_sq), [], steps,
                  fused=True, amsgrad=False, beta1=g["betas"][0], beta2=g["betas"][1],
                  lr=g["lr"], weight_decay=g["weight_decay"] if decay else 0.0, eps=g["eps"],
                  maximize=False)

    @contextmanager
    def shard_state(self, s: _Shard, write: bool = False):
        """`(main, exp_avg, exp_avg_sq)` of shard `s` as float32 [hi - lo] tensors: its own
        (device or host) tensors, or for an NVMe shard a copy read from the file, written
        back on exit when `write` (checkpoint save and load use this)."""
        if not s.nvme:
            yield s.main, s.exp_avg, s.exp_avg_sq
            return
        buf = torch.empty(3 * s.numel, dtype=torch.float32)
        self.swap.read(s.nvme_offset, buf).result()
        yield _split(buf, s.numel)
        if write:
            self.swap.write(s.nvme_offset, buf).result()

    def close(self) -> None:
        """Delete the NVMe offload file and this process's scratch folder (no-op without
        them); the optimizer is unusable afterwards."""
        if self.swap is not None:
            self.swap.close()
            self.swap = None
        if self.scratch is not None:
            self._remove_scratch()
            self.scratch = None

    def _adamw_step(self, s: _Shard, g: dict) -> None:
        """torch.optim.AdamW's update of one shard (fused), at this step's lr and count."""
        if s.adamw is None:
            return
        for group in s.adamw.param_groups:
            group.update(lr=g["lr"], betas=g["betas"], eps=g["eps"],
                         weight_decay=g["weight_decay"] if group["decay"] else 0.0)
        for t in s.steps:  # the fused kernel counts from here to step_count
            t.fill_(self.step_count - 1)
        s.adamw.step()

    @staticmethod
    def _write_back(s: _Shard, non_blocking: bool = False, main=None) -> None:
        main = s.main if main is None else main
        if s.ddp.param_file is not None:  # NVMe parameter shards: written to their file
            s.ddp.write_params(s.bucket, s.lo, s.hi, main)
            return
        store = s.ddp.param_view(s.bucket, s.lo, s.hi)
        if store is not None:
            if s.owns_main:
                store.copy_(main, non_blocking=non_blocking)
        else:
            for p, p_start, m_start, n in s.segments:
                p.view(-1)[p_start: p_start + n].copy_(main[m_start: m_start + n],
                                                       non_blocking=non_blocking)

    def finish_param_sync(self) -> None:
        """Make the weights readable outside a forward (see `ddp.finish_param_sync`)."""
        for ddp in self.model:
            ddp.finish_param_sync()

    # ------------------------------------------------------------------ accounting
    def state_bytes(self) -> dict:
        """Bytes this rank holds in float32 main weights (separate copies only) and AdamW
        moments, on the device and (offloaded) in host memory with the host gradient copies."""
        def size(t):
            return t.numel() * t.element_size()

        dev = [s for s in self.shards if not s.host and not s.nvme]
        host = [s for s in self.shards if s.host]
        nvme = sum(s.numel for s in self.shards if s.nvme)
        return {"main_params": sum(size(s.main) for s in dev if s.owns_main),
                "optimizer_states": sum(size(s.exp_avg) + size(s.exp_avg_sq) for s in dev),
                "host_main_params": sum(size(s.main) for s in host),
                "host_optimizer_states": sum(size(s.exp_avg) + size(s.exp_avg_sq) for s in host),
                "host_grads": sum(size(s.host_grad) for s in host),
                "host_swap_buffers": sum(size(a) + size(b) for a, b in self._slots),
                "nvme_main_params": 4 * nvme, "nvme_optimizer_states": 8 * nvme}


def _split(buf: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The [main | exp_avg | exp_avg_sq] views of an NVMe shard of `n` elements in `buf`."""
    return buf[:n], buf[n: 2 * n], buf[2 * n: 3 * n]


def _kill_hook(step: int, first_write) -> None:
    """Test hook (tests/test_offload.py): SIGKILL this process in the middle of optimizer
    step `step` -- after the first NVMe shard's new values reached the file, before the
    others -- if env `SHARDZOO_TEST_KILL_IN_OFFLOAD_STEP` is "<global rank>:<step>"."""
    spec = os.environ.get("SHARDZOO_TEST_KILL_IN_OFFLOAD_STEP")
    if not spec:
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if spec == f"{rank}:{step}":
        first_write.result()
        os.kill(os.getpid(), signal.SIGKILL)


def _event(device: torch.device):
    """A CUDA event recorded on the current stream (None elsewhere: copies are synchronous)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev
