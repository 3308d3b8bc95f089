"""Cross entropy over vocab-parallel logits, without ever gathering the full logits.

Each rank holds logits for a contiguous slice of the (padded) vocabulary (Shoeybi et al.
2019, sec. 3, "output embedding"). Each takes the log-softmax of its slice with torch's fused
kernel (one pass computes max, exp, sum and log; separate passes took twice as long on CPU),
then corrects it to the full vocabulary's normalizer, log Z = logsumexp over ranks of the
local log Z: all-reduces of `[s, b]` tensors only (the max and the sum of the local
normalizers, then the target's log-probability). Padding columns (ids >= the real vocab size)
are masked out, so the loss does not depend on TP.

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
        real = min(max(vocab_size - start, 0), part)  # this rank's real (unpadded) columns
        x = logits
        if 0 < real < part:  # padding columns take no probability: -inf before the softmax
            x = logits.masked_fill(torch.arange(part, device=logits.device) >= real,
                                   float("-inf"))
        # One fused kernel (max, exp, sum, log) writes the only float32 [s, b, v/tp] buffer;
        # the caller's logits are never written. A rank holding padding only has log p = -inf.
        if real:
            log_p = torch.log_softmax(x, dim=-1, dtype=torch.float32)
        else:
            log_p = torch.full(logits.shape, float("-inf"), device=logits.device)
        if get_tensor_model_parallel_world_size() > 1:
            # log p over the full vocabulary = local log p - (log Z - log Z_local). With the
            # local max m and L = log sum exp(x - m) = -max log p (the max's own term, no
            # extra exp), log Z_local = m + L and log Z = M + log sum_r exp(m_r - M + L_r),
            # M = max_r m_r: two [s, b] all-reduces. The correction is assembled from
            # differences (M - m, log S - L), never from log Z itself, so a large common
            # offset of the logits costs no precision.
            m = x.amax(dim=-1).float() if real else log_p[..., 0].clone()
            dead = torch.isneginf(m)  # rows whose slice is all -inf: nothing to normalize
            lse = (-log_p.amax(dim=-1)).masked_fill_(dead, 0.0)
            # not log_softmax's NaN there; the check would sync a GPU, where the pass is cheap
            if real and (log_p.device.type != "cpu" or bool(dead.any())):
                log_p.masked_fill_(dead.unsqueeze(-1), float("-inf"))
            m_max = _all_reduce(m.clone(), dist.ReduceOp.MAX)
            sum_exp = _all_reduce((m - m_max + lse).exp())
            log_p.sub_(((m_max - m) + sum_exp.log() - lse).unsqueeze(-1))

        ignored = target == ignore_index
        in_range = (target >= start) & (target < start + part) & ~ignored
        local_target = (target - start).masked_fill(~in_range, 0)
        predicted = log_p.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        loss = _all_reduce(predicted.masked_fill(~in_range, 0.0)).neg_()
        if label_smoothing > 0:  # mean over the real classes of -log p_k
            mean_neg_log_p = _all_reduce(log_p[..., :real].sum(dim=-1)).div_(-vocab_size)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_neg_log_p
        loss = loss.masked_fill(ignored, 0.0)

        ctx.save_for_backward(log_p, local_target, in_range, ignored)
        ctx.label_smoothing, ctx.vocab_size, ctx.real = label_smoothing, vocab_size, real
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        log_p, local_target, in_range, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = log_p.exp_()  # in place: d loss / d logits = softmax - target distribution
        one_hot_weight = (1.0 - eps) * in_range.to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot_weight.unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.real].sub_(eps / ctx.vocab_size)
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
