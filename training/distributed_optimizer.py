"""Mixed-precision AdamW on flat float32 shards: ZeRO stage 1 (Megatron's
--use-distributed-optimizer) and the fp32 main weights of --bf16.

ZeRO stage 1 (Rajbhandari et al. 2020, sec. 5.1, "P_os"): the gradient buffer of
`training.distributed.DistributedDataParallel` is reduce-scattered over DP, bucket by bucket,
during backward; DP rank r owns shard r of every bucket (`ddp.shard_range`). For that shard only
it keeps float32 main parameters and the AdamW moments (exp_avg, exp_avg_sq), updates them, and
writes the result into its shard of the contiguous parameter buffer, which is then all-gathered
over DP (`ddp.start_param_sync`, overlapped with the next forward). Model-state bytes per rank
go from (2 + 2 + 12) * psi to (2 + 2 + 12 / dp) * psi in bf16 (the paper's K = 12), or from
16 * psi to (4 + 4 + 8 / dp) * psi in float32, where the main weights are the model weights.

Without sharding (`shard=False`, plain --bf16) the same code owns every bucket whole: float32
main weights and moments for all parameters, copied back into the bf16 weights after the step
(Micikevicius et al. 2018, sec. 3.1; Megatron's Float16OptimizerWithFloat16Params).

The update is torch.optim.AdamW's (decoupled weight decay, Loshchilov & Hutter 2019) operation
for operation, applied to whole shards at once, so it matches AdamW elementwise. 1-D parameters
(biases, norm weights) get no weight decay; a shard records which element ranges decay.

Gradient norm (Megatron's clip_grad_norm_fp32): the squared norm is summed over each rank's
owned element ranges, counting a range only if its parameter counts (`counts_toward_norm`:
replicated-over-TP parameters on TP rank 0, the tied embedding's last-stage copy never), then
all-reduced over DP (the shards are disjoint) and over the model-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import parallel_state as ps
from parallel_state import collectives

from .distributed import DistributedDataParallel
from .optimizer import counts_toward_norm


@dataclass
class _Shard:
    """What one rank owns of one bucket: buffer range [lo, hi) and its optimizer tensors."""

    ddp: DistributedDataParallel
    lo: int
    hi: int
    main: torch.Tensor  # float32 [hi - lo]; a view of the fp32 param buffer, or its own copy
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    owns_main: bool  # main is a separate copy (bf16 weights, or no parameter buffer)
    # (param, first element in param, first element in shard, count) for each overlap
    segments: list[tuple] = field(default_factory=list)
    decay: list[tuple[int, int]] = field(default_factory=list)  # shard-relative ranges
    norm: list[tuple[int, int]] = field(default_factory=list)

    @property
    def grad(self) -> torch.Tensor:
        return self.ddp.buffer.data[self.lo: self.hi]


class DistributedOptimizer:
    """AdamW over the owned shards of `model` (DDP wrappers, one per model chunk).

    Per step: `norm = clip_grad_norm(max_norm)` then `step()`. `param_groups` holds one dict
    whose "lr" the trainer sets each iteration (as for torch optimizers).

    Args:
        shard: own 1/dp of each bucket (needs the wrappers built with
            use_distributed_optimizer=True); False owns everything (plain mixed precision).
    Raises:
        ValueError: `shard` without sharded wrappers.
    """

    def __init__(self, model: list[DistributedDataParallel], *, lr: float, weight_decay: float,
                 betas=(0.9, 0.999), eps: float = 1e-8, shard: bool = True):
        if shard and not all(d.use_distributed_optimizer for d in model):
            raise ValueError("the distributed optimizer needs DistributedDataParallel("
                             "use_distributed_optimizer=True) wrappers (reduce-scatter buffers)")
        self.model, self.sharded = model, shard
        self.param_groups = [{"lr": lr, "weight_decay": weight_decay, "betas": betas,
                              "eps": eps}]
        self.step_count = 0
        self.shards = [self._make_shard(ddp, b) for ddp in model for b in ddp.buffer.buckets]

    def _make_shard(self, ddp: DistributedDataParallel, bucket) -> _Shard:
        lo, hi = ddp.shard_range(bucket)
        device = ddp.buffer.data.device
        pbuf = ddp.param_buffer
        alias = pbuf is not None and pbuf.dtype == torch.float32
        main = pbuf[lo:hi] if alias else torch.zeros(hi - lo, dtype=torch.float32, device=device)
        shard = _Shard(ddp, lo, hi, main, torch.zeros_like(main), torch.zeros_like(main),
                       owns_main=not alias)
        for p in bucket.params:
            start = ddp.offsets[id(p)]
            a, b = max(start, lo), min(start + p.numel(), hi)
            if a >= b:
                continue
            seg = (p, a - start, a - lo, b - a)
            shard.segments.append(seg)
            if p.ndim > 1:
                shard.decay.append((a - lo, b - lo))
            if counts_toward_norm(p):
                shard.norm.append((a - lo, b - lo))
            if not alias:
                with torch.no_grad():
                    main[a - lo: b - lo].copy_(p.detach().reshape(-1)[a - start: b - start])
        return shard

    # ------------------------------------------------------------------ gradient norm
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the (DP-reduced) gradient, each element counted once; scales
        the owned gradients so the norm is at most `max_norm` (0 disables). Returns the norm
        before clipping."""
        parts = [s.grad[a:b].pow(2).sum() for s in self.shards for a, b in s.norm]
        device = self.shards[0].main.device if self.shards else ps.get_device()
        sq = torch.stack(parts).sum() if parts else torch.zeros((), device=device)
        sq = sq.to(torch.float32)
        if self.sharded and ps.get_data_parallel_world_size() > 1:
            collectives.all_reduce(sq, group=ps.get_data_parallel_group())
        if ps.model_parallel_is_initialized() and \
                dist.get_world_size(ps.get_model_parallel_group()) > 1:
            collectives.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for s in self.shards:
                s.grad.mul_(scale)
        return norm

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def step(self) -> None:
        """AdamW on every owned shard (torch.optim.AdamW's arithmetic), then write the new
        weights into the model: the owned shard of the parameter buffer plus an all-gather
        over DP (sharded), or a copy into each bf16 parameter (not sharded)."""
        g = self.param_groups[0]
        lr, wd, (beta1, beta2), eps = g["lr"], g["weight_decay"], g["betas"], g["eps"]
        self.step_count += 1
        step = float(self.step_count)
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        for s in self.shards:
            if wd != 0:
                for a, b in s.decay:
                    s.main[a:b].mul_(1 - lr * wd)
            grad = s.grad
            s.exp_avg.lerp_(grad, 1 - beta1)
            s.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (s.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            s.main.addcdiv_(s.exp_avg, denom, value=-step_size)
        for s in self.shards:
            pbuf = s.ddp.param_buffer
            if pbuf is not None:
                if s.owns_main:
                    pbuf[s.lo: s.hi].copy_(s.main)
            else:
                for p, p_start, m_start, n in s.segments:
                    p.view(-1)[p_start: p_start + n].copy_(s.main[m_start: m_start + n])
        for ddp in self.model:
            ddp.start_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers (before reading weights outside a forward)."""
        for ddp in self.model:
            ddp.finish_param_sync()

    # ------------------------------------------------------------------ accounting
    def state_bytes(self) -> dict:
        """Bytes this rank holds in float32 main weights (separate copies only) and AdamW
        moments, and what they would be unsharded (every element of every bucket, unpadded)."""
        main = sum(s.main.numel() * s.main.element_size() for s in self.shards if s.owns_main)
        states = sum(s.exp_avg.numel() * s.exp_avg.element_size()
                     + s.exp_avg_sq.numel() * s.exp_avg_sq.element_size() for s in self.shards)
        numel = sum(p.numel() for ddp in self.model for p in ddp.params)
        copies = any(s.owns_main for s in self.shards)
        return {"main_params": main, "optimizer_states": states,
                "unsharded_main_params": 4 * numel if copies else 0,
                "unsharded_optimizer_states": 8 * numel}


def model_state_bytes(model: list[DistributedDataParallel], optimizer) -> dict:
    """Exact per-rank bytes of model states, from the tensors (ZeRO's accounting, Rajbhandari
    et al. 2020, sec. 3.1): `params` (model weights), `grads` (the float32 gradient buffers,
    padding included, plus any live low-precision `.grad`), `main_params` (float32 copies
    separate from the weights), `optimizer_states` (AdamW moments and step counters), their
    sum `total`, and `unsharded_main_params` / `unsharded_optimizer_states`: the same for this
    model-parallel rank without ZeRO (dp = 1), so sharded ~= unsharded / dp within padding.

    `optimizer` is a `DistributedOptimizer` or a torch optimizer (AdamW), whose lazily created
    moments are counted as allocated if they exist yet, else as AdamW will allocate them.
    """
    params = [p for ddp in model for p in ddp.params]
    out = {"params": sum(p.numel() * p.element_size() for p in params),
           "grads": sum(d.buffer.data.numel() * d.buffer.data.element_size() for d in model)
           + sum(p.grad.numel() * p.grad.element_size() for p in params
                 if p.grad is not None and p.grad.data_ptr() != p.main_grad.data_ptr())}
    if isinstance(optimizer, DistributedOptimizer):
        out.update(optimizer.state_bytes())
    else:
        state = [t for st in optimizer.state.values() for t in st.values()
                 if torch.is_tensor(t)]
        states = sum(t.numel() * t.element_size() for t in state) if state else \
            sum(2 * p.numel() * p.element_size() for p in params)
        out.update(main_params=0, optimizer_states=states, unsharded_main_params=0,
                   unsharded_optimizer_states=states)
    out["total"] = out["params"] + out["grads"] + out["main_params"] + out["optimizer_states"]
    out["predicted_total"] = zero_formula_bytes(params, model, optimizer)
    return out


def zero_formula_bytes(params, model, optimizer) -> int:
    """Model-state bytes predicted by Rajbhandari et al. 2020 (ZeRO), sec. 3.1 and 5.1:
    `W*psi + G*psi + K*psi / N_d` for psi parameters on this rank, with our byte counts: weights
    W = 2 (bf16) or 4 (fp32), gradients G = 4 (accumulated in fp32), and K = 12 (fp32 main
    weights + two Adam moments) in bf16 or K = 8 (moments only; the weights are the main
    copy) in fp32; N_d = dp with the distributed optimizer (ZeRO stage 1), else 1.
    """
    psi = sum(p.numel() for p in params)
    weight_bytes = params[0].element_size() if params else 4
    k = 12 if weight_bytes == 2 else 8
    sharded = isinstance(optimizer, DistributedOptimizer) and any(
        getattr(d, "use_distributed_optimizer", False) for d in model)
    n_d = model[0].dp_size if sharded else 1
    return int(weight_bytes * psi + 4 * psi + k * psi / n_d)
