"""Microbatch schedules: run forward and backward over the microbatches of one global batch.

`get_forward_backward_func()` picks the schedule from the grid. Every schedule takes the
same arguments and returns the sum over this rank's microbatches of the token losses (nats,
unscaled, a float32 tensor; zero on ranks that do not compute the loss).

Loss scaling: each microbatch's summed token loss is multiplied by `loss_scale` =
1 / (tokens in the whole global batch, over all DP ranks) before backward, so accumulated and
DP-summed gradients are exactly those of the global token-mean loss, whatever the layout.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


def loss_from_batch(model, batch: dict, autocast_dtype: torch.dtype | None,
                    label_smoothing: float = 0.0, hidden_states=None):
    """Forward one microbatch. Returns (summed masked token loss `[]` float32, None) on a stage
    that computes the loss, or (None, output hidden states) on an earlier pipeline stage."""
    device_type = batch["tokens"].device.type
    ctx = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    with ctx:
        out = model(batch["tokens"], labels=batch["labels"], hidden_states=hidden_states,
                    label_smoothing=label_smoothing)
    inner = getattr(model, "module", model)
    if not inner.post_process:
        return None, out
    return (out.float() * batch["loss_mask"]).sum(), None


def forward_backward_no_pipelining(*, model, microbatches: list[dict], loss_scale: float,
                                   forward_only: bool = False,
                                   autocast_dtype: torch.dtype | None = None,
                                   label_smoothing: float = 0.0) -> torch.Tensor:
    """Gradient accumulation over microbatches on one stage; gradient sync only on the last."""
    total = torch.zeros((), dtype=torch.float32, device=microbatches[0]["tokens"].device)
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    for i, batch in enumerate(microbatches):
        last = i == len(microbatches) - 1
        with (contextlib.nullcontext() if last or forward_only else no_sync()):
            if forward_only:
                with torch.no_grad():
                    loss, _ = loss_from_batch(model, batch, autocast_dtype, label_smoothing)
            else:
                loss, _ = loss_from_batch(model, batch, autocast_dtype, label_smoothing)
                (loss * loss_scale).backward()
        total += loss.detach()
    return total


def get_forward_backward_func() -> Callable:
    """The schedule for the current grid (no pipelining when pp == 1)."""
    import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("pipeline schedules are not available yet")
    return forward_backward_no_pipelining
