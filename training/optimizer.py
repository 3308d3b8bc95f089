"""AdamW with weight-decay groups and the learning-rate schedule (gradient clipping:
data_parallel/grad_norm.py)."""
from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.999),
                    eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019); biases and norm weights (1-D tensors) get no decay.

    torch's fused kernel (one pass over each tensor instead of a Python loop of elementwise
    ops: ~5x faster on a CPU for a small model) when every parameter is a floating tensor on
    the CPU or a CUDA device; the same update up to rounding."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    params = decay + no_decay
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                                 for p in params)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                             fused=fused or None)


def learning_rate(iteration: int, *, lr: float, min_lr: float, warmup_iters: int,
                  decay_iters: int, style: str = "cosine") -> float:
    """LR for 0-based `iteration`: linear warmup to `lr`, then decay to `min_lr`.

    Cosine decay is SGDR's annealing without restarts (Loshchilov & Hutter 2017, eq. 5):
    min_lr + (lr - min_lr) * (1 + cos(pi * t / T)) / 2, with t counted after warmup.
    """
    step = iteration + 1
    if warmup_iters > 0 and step <= warmup_iters:
        return lr * step / warmup_iters
    if style == "constant":
        return lr
    span = max(decay_iters - warmup_iters, 1)
    ratio = min(max((step - warmup_iters) / span, 0.0), 1.0)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown --lr-decay-style {style!r}; use cosine, linear or constant")
    return min_lr + coeff * (lr - min_lr)


def schedule_lr(schedule: dict, iteration: int) -> float:
    """`learning_rate` of a schedule dict (the `SCHEDULE_FIELDS` of a TrainConfig)."""
    return learning_rate(iteration, lr=schedule["lr"], min_lr=schedule["min_lr"],
                         warmup_iters=schedule["lr_warmup_iters"],
                         decay_iters=schedule["lr_decay_iters"], style=schedule["lr_decay_style"])


def reconcile_schedule(train, saved: dict | None, iteration: int) -> str | None:
    """On resume at `iteration`: pick the LR schedule (Megatron's choice of flags) and say
    what changed. `saved` is the checkpoint's schedule (None for checkpoints that predate
    it). This command line's schedule wins (--override-opt-param-scheduler, the default)
    unless `train.use_checkpoint_opt_param_scheduler`, which copies the saved values into
    `train`. Returns the one log line when the schedules differ, else None."""
    if not saved:
        return None
    now = {k: getattr(train, k) for k in saved}
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in saved if saved[k] != now[k]]
    if not changed:
        return None
    before, after = schedule_lr(saved, iteration), schedule_lr(now, iteration)
    if train.use_checkpoint_opt_param_scheduler:
        for k, v in saved.items():
            setattr(train, k, v)
        return (f"LR schedule: this command line's differs from the checkpoint's "
                f"({'; '.join(changed)}); keeping the checkpoint's "
                f"(--use-checkpoint-opt-param-scheduler): LR of step {iteration + 1} stays "
                f"{before:.4e}")
    how = ("--override-opt-param-scheduler" if train.override_opt_param_scheduler else
           "the default; --use-checkpoint-opt-param-scheduler keeps the checkpoint's")
    return (f"LR schedule changed on resume ({'; '.join(changed)}): using this command "
            f"line's ({how}): LR of step {iteration + 1} {before:.4e} -> {after:.4e}")
