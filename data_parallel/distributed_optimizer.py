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

from dataclasses import dataclass, field

import torch
from torch import nn

import parallel_state as ps

from .ddp import DistributedDataParallel
from .grad_norm import counts_toward_norm, global_norm, squares


@dataclass(eq=False)
class _Shard:
    """What one rank owns of one bucket: flat range [lo, hi) and its optimizer tensors."""

    ddp: DistributedDataParallel
    bucket: object
    lo: int
    hi: int
    main: torch.Tensor  # float32 [hi - lo]; a view of the parameter store, or its own copy
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    owns_main: bool  # main is a separate copy (bf16 weights, no parameter store, or host)
    # (param, first element in param, first element in shard, count) for each overlap
    segments: list[tuple] = field(default_factory=list)
    norm: list[tuple[int, int]] = field(default_factory=list)
    outside_norm: list[tuple[int, int]] = field(default_factory=list)  # the other segments
    host_grad: torch.Tensor | None = None  # offloaded: the gradient's host copy
    adamw: torch.optim.AdamW | None = None  # torch's fused AdamW over views of the above
    steps: list[torch.Tensor] = field(default_factory=list)  # its per-view step counts

    @property
    def host(self) -> bool:
        return self.host_grad is not None

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
            live and are updated in host memory (0 = none; see the module docstring).
    Raises:
        ValueError: `shard` without sharding wrappers; a fraction outside [0, 1].
    """

    def __init__(self, model: list[DistributedDataParallel], *, lr: float, weight_decay: float,
                 betas=(0.9, 0.999), eps: float = 1e-8, shard: bool = True,
                 offload_fraction: float = 0.0):
        if shard and not all(d.use_distributed_optimizer for d in model):
            raise ValueError("the distributed optimizer needs DistributedDataParallel wrappers "
                             "with a sharding strategy (reduce-scatter buffers)")
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
        self.model, self.sharded = model, shard
        self.offload_fraction = offload_fraction
        self.param_groups = [{"lr": lr, "weight_decay": weight_decay, "betas": betas,
                              "eps": eps}]
        self.step_count = 0
        ranges = [(ddp, b, *ddp.shard_range(b)) for ddp in model for b in ddp.buffer.buckets]
        cut = int(offload_fraction * sum(hi - lo for _, _, lo, hi in ranges))  # host elements
        self.shards = []
        for ddp, b, lo, hi in ranges:
            host_hi = min(hi, lo + max(cut, 0))
            cut -= host_hi - lo
            if host_hi > lo:
                self.shards.append(self._make_shard(ddp, b, lo, host_hi, host=True))
            if hi > host_hi:
                self.shards.append(self._make_shard(ddp, b, host_hi, hi, host=False))

    @torch.no_grad()
    def _make_shard(self, ddp: DistributedDataParallel, bucket, lo: int, hi: int,
                    host: bool) -> _Shard:
        store = ddp.param_view(bucket, lo, hi)
        alias = not host and store is not None and store.dtype == torch.float32
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
            if not s.host:
                self._adamw_step(s, g)
                self._write_back(s)
        for s, done in zip(host, copied):
            if done is not None:
                done.synchronize()
            self._adamw_step(s, g)
            self._write_back(s, non_blocking=True)
        for ddp in self.model:
            ddp.start_param_sync()

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
    def _write_back(s: _Shard, non_blocking: bool = False) -> None:
        store = s.ddp.param_view(s.bucket, s.lo, s.hi)
        if store is not None:
            if s.owns_main:
                store.copy_(s.main, non_blocking=non_blocking)
        else:
            for p, p_start, m_start, n in s.segments:
                p.view(-1)[p_start: p_start + n].copy_(s.main[m_start: m_start + n],
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

        dev = [s for s in self.shards if not s.host]
        host = [s for s in self.shards if s.host]
        return {"main_params": sum(size(s.main) for s in dev if s.owns_main),
                "optimizer_states": sum(size(s.exp_avg) + size(s.exp_avg_sq) for s in dev),
                "host_main_params": sum(size(s.main) for s in host),
                "host_optimizer_states": sum(size(s.exp_avg) + size(s.exp_avg_sq) for s in host),
                "host_grads": sum(size(s.host_grad) for s in host)}


def _event(device: torch.device):
    """A CUDA event recorded on the current stream (None elsewhere: copies are synchronous)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev
