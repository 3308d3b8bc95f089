"""Exact gradient clipping across a parallel model.

Gradient norm across a parallel model (Megatron's `clip_grad_norm_fp32`): a parameter
replicated over TP ranks (norm weights, row-parallel biases, position embeddings) is counted on
TP rank 0 only, a sharded one on every rank (each holds a disjoint slice), and the tied
embedding's second copy on the last pipeline stage not at all; the squares are summed over the
tensor x pipeline ranks of one model replica. Data-parallel replicas hold identical, already
reduced gradients, so they are not summed again.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import parallel_state as ps
from parallel_state import collectives


def counts_toward_norm(param: nn.Parameter) -> bool:
    """True if this rank owns `param` for the global gradient norm (see module docstring)."""
    if getattr(param, "pipeline_duplicate", False):  # a copy another stage counts (T5)
        return False
    if getattr(param, "shared_embedding", False) and ps.model_parallel_is_initialized() \
            and ps.is_pipeline_last_stage(ignore_virtual=True) \
            and not ps.is_pipeline_first_stage(ignore_virtual=True):
        return False
    return getattr(param, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


def global_grad_norm(params: list[nn.Parameter]) -> float:
    """L2 norm of the full model's gradient, each parameter counted exactly once."""
    owned = [p.grad for p in params if p.grad is not None and counts_toward_norm(p)]
    device = owned[0].device if owned else ps.get_device()
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if owned:
        sq = torch.stack([g.float().pow(2).sum() for g in owned]).sum()
    if ps.model_parallel_is_initialized() and \
            dist.get_world_size(ps.get_model_parallel_group()) > 1:
        collectives.all_reduce(sq, group=ps.get_model_parallel_group())
    return float(sq.sqrt())


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
