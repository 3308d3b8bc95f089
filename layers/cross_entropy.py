"""Cross entropy over vocab-parallel logits, without ever gathering the full logits.

Each rank holds logits for a contiguous slice of the (padded) vocabulary. The softmax
normalizer needs only three all-reduces of `[s, b]` tensors over TP: the max, the target
logit, and the sum of exponentials (Shoeybi et al. 2019, sec. 3, "output embedding"). Padding
columns (ids >= the real vocab size) are masked out, so the loss does not depend on TP.

Label smoothing follows Szegedy et al. 2016 (sec. 7) and torch.nn.functional.cross_entropy:
the target distribution is (1 - eps) * one_hot + eps / K over the K real classes, so
loss = (1 - eps) * nll + eps * mean_k(-log p_k).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from parallel_state import (
    collectives,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def _all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if get_tensor_model_parallel_world_size() > 1:
        collectives.all_reduce(x, op=op, group=get_tensor_model_parallel_group())
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, label_smoothing, ignore_index):
        part = logits.shape[-1]
        start = get_tensor_model_parallel_rank() * part
        valid_cols = (torch.arange(start, start + part, device=logits.device) < vocab_size)
        # One float32 [s, b, v/tp] buffer, made once and then shifted, exponentiated and
        # normalized in place (each extra buffer costs a full pass over memory); the caller's
        # logits are never written.
        work = logits.float()
        owned = work is not logits  # a fresh copy (from bf16/fp16) may be written in place
        if not bool(valid_cols.all()):
            work = work.masked_fill_(~valid_cols, float("-inf")) if owned else \
                work.masked_fill(~valid_cols, float("-inf"))
            owned = True
        logits_max = work.max(dim=-1).values
        _all_reduce(logits_max, dist.ReduceOp.MAX)
        shifted = work.sub_(logits_max.unsqueeze(-1)) if owned else \
            work - logits_max.unsqueeze(-1)

        ignored = target == ignore_index
        in_range = (target >= start) & (target < start + part) & ~ignored
        local_target = (target - start).masked_fill(~in_range, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(~in_range, 0.0)
        _all_reduce(predicted)
        if label_smoothing > 0:
            sum_shifted = shifted.masked_fill(~valid_cols, 0.0).sum(dim=-1)
            _all_reduce(sum_shifted)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp)
        log_z = sum_exp.log()
        loss = log_z - predicted
        if label_smoothing > 0:
            mean_neg_log_p = log_z - sum_shifted / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_neg_log_p
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, in_range, ignored, valid_cols)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, in_range, ignored, valid_cols = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # reuse: d loss / d logits = softmax - target distribution
        one_hot_weight = (1.0 - eps) * in_range.to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot_weight.unsqueeze(-1))
        if eps > 0:
            grad.sub_(valid_cols.to(grad.dtype) * (eps / ctx.vocab_size))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                                 vocab_size: int | None = None, label_smoothing: float = 0.0,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy from vocab-parallel logits.

    Args:
        logits: `[..., v/tp]` this rank's slice of the (padded) vocabulary; any float dtype
            (computed in float32).
        target: `[...]` token ids in the full vocabulary; `ignore_index` marks tokens that
            contribute neither loss nor gradient.
        vocab_size: the real vocabulary size; columns at and beyond it are padding and are
            excluded from the softmax. Default: no padding.
        label_smoothing: eps in [0, 1).
    Returns:
        `[...]` float32 loss per token (0 at ignored positions), in nats.
    Raises:
        ValueError: for label_smoothing outside [0, 1).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_size is None:
        vocab_size = logits.shape[-1] * get_tensor_model_parallel_world_size()
    with record_function("shardzoo.cross_entropy"):  # a named scope for `train.py --profile`
        return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, label_smoothing,
                                                ignore_index)
