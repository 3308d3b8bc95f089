"""Exact gradient clipping across a parallel model.

Gradient norm across a parallel model (Megatron's `clip_grad_norm_fp32`): a parameter
replicated over TP ranks (norm weights, row-parallel biases, position embeddings) is counted on
TP rank 0 only, a sharded one on every rank (each holds a disjoint slice), and the tied
embedding's second copy on the last pipeline stage not at all; the squares are summed over the
tensor x pipeline ranks of one model replica. Data-parallel replicas hold identical, already
reduced gradients, so they are not summed again.

Expert parallelism (Megatron-Core's separate expert norm): at ep > 1 a routed expert's weight
(`expert_parallel`) holds this rank's block of the layer's experts, identical on the
expert-data-parallel replicas only, so its squares are summed separately: over the ep ranks
(disjoint blocks), then with the dense squares over tensor x pipeline (each TP rank holds a
disjoint slice of every expert: expert TP is TP). Counted once per (tp, pp, ep) coordinate.
With ZeRO (disjoint owned shards) the squares are first summed over the shard groups: the
dense ones over dp, the expert ones over edp and then ep, which together are the dp ranks of
one TP rank (dp = edp x ep), so one all-reduce over dp does both (`global_norm`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import parallel_state as ps
from parallel_state import collectives


def counts_toward_norm(param: nn.Parameter) -> bool:
    """True if this rank owns `param` for the global gradient norm (see module docstring)."""
    if getattr(param, "pipeline_duplicate", False):  # a copy the embedding's stage counts
        return False
    return getattr(param, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


def is_expert_parallel(param: nn.Parameter) -> bool:
    """True for a routed expert's weight split over ep > 1 ranks (module docstring); at ep 1
    the experts are counted as dense parameters."""
    return getattr(param, "expert_parallel", False) and \
        ps.get_expert_model_parallel_world_size() > 1


def global_norm(dense_sq: torch.Tensor, expert_sq: torch.Tensor, sharded: bool) -> float:
    """The global L2 norm from this rank's float32 sums of squares of the dense and of the
    expert-parallel gradients it counts (`counts_toward_norm`); `sharded`: they are sums over
    disjoint ZeRO shards (owned ranges), else over whole replicated gradients. Collective
    over dp (sharded) or ep (experts, unsharded) and the model-parallel group."""
    dense, expert = dense_sq.float(), expert_sq.float().to(dense_sq.device)
    if not ps.model_parallel_is_initialized():
        return float((dense + expert).sqrt())
    if sharded and ps.get_data_parallel_world_size(True) > 1:  # dense over dp x cp, experts
        both = torch.stack([dense, expert])  # over edp x ep
        collectives.all_reduce(both, group=ps.get_data_parallel_group(with_context_parallel=True))
        dense, expert = both
    elif ps.get_expert_model_parallel_world_size() > 1:  # the experts' blocks over ep
        expert = expert.clone()
        collectives.all_reduce(expert, group=ps.get_expert_model_parallel_group())
    total = dense + expert
    if dist.get_world_size(ps.get_model_parallel_group()) > 1:
        collectives.all_reduce(total, group=ps.get_model_parallel_group())
    return float(total.sqrt())


def global_grad_norm(params: list[nn.Parameter]) -> float:
    """L2 norm of the full model's gradient, each parameter counted exactly once."""
    owned = [p for p in params if p.grad is not None and counts_toward_norm(p)]
    device = owned[0].grad.device if owned else ps.get_device()
    dense, expert = (squares([p.grad for p in owned if is_expert_parallel(p) == e], device)
                     for e in (False, True))
    return global_norm(dense, expert, sharded=False)


def squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    """Float32 sum of the squares of `grads` (0 when there are none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


def clip_grads(params: list[nn.Parameter], max_norm: float) -> float:
    """Scale gradients so their global norm is at most `max_norm` (0 disables); returns the
    norm before clipping."""
    norm = global_grad_norm(params)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
