"""Microbatch schedules: forward and backward over the microbatches of one global batch.

Three schedules behind one signature, chosen by `get_forward_backward_func()` from the grid:

- no pipelining: gradient accumulation over microbatches on one stage;
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, SC21, sec. 2.2.1): warm-up forwards, then
  alternate one forward / one backward, then cool-down backwards; at most `pp` microbatches
  of activations are alive per stage;
- interleaved 1F1B (same paper, sec. 2.2.2): each rank holds `vpp` model chunks and runs the
  1F1B pattern over virtual stages, shrinking the bubble from (p-1)/m to (p-1)/(v*m). It needs
  `num_microbatches % pp == 0` (checked by the config).

Each takes `model` (a list of model chunks, each a DistributedDataParallel wrapper), the
microbatches (dicts with `tokens`, `labels`, `loss_mask`), `loss_scale` = 1 / tokens of the
whole global batch, and the p2p `spec`. It returns the sum of this rank's token losses (nats,
a float32 tensor; zero on stages without the loss). Gradients of each chunk are DP-synced during
its last backward (`sync_enabled`), overlapping communication with the remaining backward.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

import parallel_state as ps
from parallel_state import p2p


def loss_from_batch(model, batch: dict, hidden_states=None):
    """Forward one microbatch on one model chunk. Returns (summed masked token loss `[]`
    float32, None) on the chunk holding the loss, else (None, output hidden states: a tensor,
    or a tuple for an encoder-decoder stage). `hidden_states` is what the previous stage sent
    (a tensor, or the tuple an encoder-decoder stage receives). A T5 batch (`encoder_mask`)
    holds encoder `tokens`, decoder `labels` (the decoder input is their right shift)."""
    if "encoder_mask" in batch:
        out = model(batch["tokens"], labels=batch["labels"], hidden_states=hidden_states,
                    encoder_attention_mask=batch["encoder_mask"])
    else:
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        out = model(batch["tokens"], labels=batch["labels"], hidden_states=hidden_states,
                    position_ids=batch.get("position_ids"),
                    attention_mask=batch.get("attention_mask"))
    inner = getattr(model, "module", model)
    if not inner.post_process:
        return None, out
    return (out.float() * batch["loss_mask"]).sum(), None


class _Runner:
    """Shared state of one schedule run: forward/backward steps, loss total, timeline."""

    def __init__(self, model, microbatches, loss_scale, forward_only, timeline):
        self.model, self.microbatches = model, microbatches
        self.loss_scale, self.forward_only = loss_scale, forward_only
        self.timeline = timeline
        self.total = torch.zeros((), dtype=torch.float32,
                                 device=microbatches[0]["tokens"].device)
        self.backwards_left = [len(microbatches)] * len(model)

    def _timed(self, kind: str, chunk: int, mb: int):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(kind, chunk, mb)

    def forward(self, chunk: int, mb: int, inputs):
        """Run chunk `chunk` on microbatch `mb`; returns the output tuple (the scaled loss on
        the last stage)."""
        if inputs is not None and not self.forward_only:
            for t in inputs:
                t.requires_grad_(True)
        with self._timed("F", chunk, mb):
            grad_ctx = torch.no_grad() if self.forward_only else contextlib.nullcontext()
            batch = self.microbatches[mb]
            with grad_ctx, ps.dropout_sample_ids(batch.get("sample_ids")):
                loss, out = loss_from_batch(self.model[chunk], batch,
                                            tuple(inputs) if inputs is not None else None)
        if loss is not None:
            self.total += loss.detach()
            return (loss * self.loss_scale,)
        return out if isinstance(out, tuple) else (out,)

    def backward(self, chunk: int, mb: int, inputs, outputs, output_grads):
        """Backpropagate `outputs` (with `output_grads`, None for the loss); returns the
        gradients of `inputs` (None on the first stage)."""
        self.backwards_left[chunk] -= 1
        ddp = self.model[chunk]
        if hasattr(ddp, "sync_enabled"):
            ddp.sync_enabled = self.backwards_left[chunk] == 0  # last backward of this chunk
        with self._timed("B", chunk, mb):
            torch.autograd.backward(outputs, grad_tensors=output_grads)
        if inputs is None:
            return None
        return tuple(t.grad for t in inputs)


def forward_backward_no_pipelining(*, model, microbatches, loss_scale, spec=None,
                                   forward_only=False,
                                   timeline=None) -> torch.Tensor:
    """Gradient accumulation over microbatches on one stage."""
    run = _Runner(model, microbatches, loss_scale, forward_only, timeline)
    for mb in range(len(microbatches)):
        outputs = run.forward(0, mb, None)
        if not forward_only:
            run.backward(0, mb, None, outputs, None)
    return run.total


def forward_backward_pipelining_without_interleaving(
        *, model, microbatches, loss_scale, spec, forward_only=False,
        timeline=None) -> torch.Tensor:
    """1F1B: warm-up of (pp - rank - 1) forwards, steady 1F1B, cool-down backwards."""
    run = _Runner(model, microbatches, loss_scale, forward_only, timeline)
    m = len(microbatches)
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    num_warmup = m if forward_only else min(pp - rank - 1, m)
    num_remaining = m - num_warmup
    inputs_q, outputs_q = [], []

    for mb in range(num_warmup):
        inputs = p2p.recv_forward(spec)
        outputs = run.forward(0, mb, inputs)
        p2p.send_forward(spec, outputs)
        if not forward_only:
            inputs_q.append(inputs)
            outputs_q.append(outputs)

    inputs = p2p.recv_forward(spec) if num_remaining > 0 else None
    for i in range(num_remaining):
        mb = num_warmup + i
        last = i == num_remaining - 1
        outputs = run.forward(0, mb, inputs)
        output_grads = p2p.send_forward_recv_backward(spec, outputs)
        inputs_q.append(inputs)
        outputs_q.append(outputs)
        b_inputs, b_outputs = inputs_q.pop(0), outputs_q.pop(0)
        input_grads = run.backward(0, mb - num_warmup, b_inputs, b_outputs, output_grads)
        if last:
            p2p.send_backward(spec, input_grads)
        else:
            inputs = p2p.send_backward_recv_forward(spec, input_grads)

    if not forward_only:
        for i in range(num_warmup):
            b_inputs, b_outputs = inputs_q.pop(0), outputs_q.pop(0)
            output_grads = p2p.recv_backward(spec)
            input_grads = run.backward(0, num_remaining + i, b_inputs, b_outputs, output_grads)
            p2p.send_backward(spec, input_grads)
    return run.total


def forward_backward_pipelining_with_interleaving(
        *, model, microbatches, loss_scale, spec, forward_only=False,
        timeline=None) -> torch.Tensor:
    """Interleaved 1F1B over `vpp = len(model)` chunks per rank (Megatron's schedule).

    Step k of the forward order runs chunk (k mod pp*vpp) // pp on microbatch
    (k // (pp*vpp)) * pp + k mod pp; backward visits chunks in reverse.
    """
    run = _Runner(model, microbatches, loss_scale, forward_only, timeline)
    vpp, m = len(model), len(microbatches)
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if m % pp:
        raise ValueError(f"the interleaved schedule needs num_microbatches ({m}) divisible by "
                         f"pipeline-model-parallel-size ({pp})")
    total = m * vpp
    all_warmup = forward_only or m == pp
    num_warmup = total if all_warmup else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    num_remaining = total - num_warmup

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % (pp * vpp)) // pp
        return c if forward else vpp - 1 - c

    def microbatch_id(k: int) -> int:
        return (k // (pp * vpp)) * pp + k % pp

    inputs_q = [[] for _ in range(vpp)]
    outputs_q = [[] for _ in range(vpp)]
    grads_q = [[] for _ in range(vpp)]

    def set_chunk(c: int) -> None:
        ps.set_virtual_pipeline_model_parallel_rank(c)

    def forward_k(k: int):
        c = chunk_id(k, True)
        set_chunk(c)
        if ps.is_pipeline_first_stage() and len(inputs_q[c]) == len(outputs_q[c]):
            inputs_q[c].append(None)
        outputs = run.forward(c, microbatch_id(k), inputs_q[c][-1])
        outputs_q[c].append(outputs)
        if forward_only:  # nothing to keep for backward
            inputs_q[c].pop()
            outputs_q[c].pop()
        return outputs

    def backward_k(k: int):
        c = chunk_id(k, False)
        set_chunk(c)
        if ps.is_pipeline_last_stage() and not grads_q[c]:
            grads_q[c].append(None)
        return run.backward(c, microbatch_id(k), inputs_q[c].pop(0), outputs_q[c].pop(0),
                            grads_q[c].pop(0))

    set_chunk(0)
    inputs_q[0].append(p2p.recv_forward(spec))
    for k in range(num_warmup):
        outputs = forward_k(k)
        next_chunk = chunk_id(k + 1, True)
        recv_prev = not (ps.is_pipeline_first_stage(ignore_virtual=True) and next_chunk == 0)
        if k == total - 1:
            recv_prev = False
        set_chunk(chunk_id(k, True))
        if ps.is_pipeline_last_stage():
            outputs = None
        if k == num_warmup - 1 and not all_warmup:
            recv_next = not ps.is_pipeline_last_stage(ignore_virtual=True)
            from_prev, from_next = p2p.communicate(spec, send_next=outputs, recv_prev=recv_prev,
                                                   recv_next=recv_next)
            grads_q[vpp - 1].append(from_next)
        else:
            from_prev, _ = p2p.communicate(spec, send_next=outputs, recv_prev=recv_prev)
        if recv_prev:
            inputs_q[next_chunk].append(from_prev)

    for i in range(num_remaining):
        fk, bk = num_warmup + i, i
        outputs = forward_k(fk)
        input_grads = backward_k(bk)
        set_chunk(chunk_id(fk, True))
        if ps.is_pipeline_last_stage():
            outputs = None
        set_chunk(chunk_id(bk, False))
        if ps.is_pipeline_first_stage():
            input_grads = None
        recv_prev, recv_next = True, True
        if ps.is_pipeline_first_stage(ignore_virtual=True):
            next_f = chunk_id(fk - (pp - 1), True)
            recv_prev = next_f != vpp - 1
            next_f += 1
        else:
            next_f = chunk_id(fk + 1, True)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            next_b = chunk_id(bk - (pp - 1), False)
            recv_next = next_b != 0
            next_b -= 1
        else:
            next_b = chunk_id(bk + 1, False)
        if i == num_remaining - 1:
            recv_prev = False
        from_prev, from_next = p2p.communicate(spec, send_next=outputs, send_prev=input_grads,
                                               recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs_q[next_f].append(from_prev)
        if recv_next:
            grads_q[next_b].append(from_next)

    if not forward_only:
        if all_warmup:
            set_chunk(vpp - 1)
            grads_q[vpp - 1].append(p2p.recv_backward(spec))
        for k in range(num_remaining, total):
            input_grads = backward_k(k)
            next_b = chunk_id(k + 1, False)
            recv_next = not (ps.is_pipeline_last_stage(ignore_virtual=True) and next_b == vpp - 1)
            if k == total - 1:
                recv_next = False
            set_chunk(chunk_id(k, False))
            if ps.is_pipeline_first_stage():
                input_grads = None
            _, from_next = p2p.communicate(spec, send_prev=input_grads, recv_next=recv_next)
            if recv_next:
                grads_q[next_b].append(from_next)
    set_chunk(0)
    return run.total


def get_forward_backward_func() -> Callable:
    """The schedule for the current grid; pass `timeline=` to record its spans."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        schedule = forward_backward_no_pipelining
    elif (ps.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
        schedule = forward_backward_pipelining_with_interleaving
    else:
        schedule = forward_backward_pipelining_without_interleaving

    def run(**kwargs):
        with p2p.recording(kwargs.get("timeline")):
            return schedule(**kwargs)

    run.__name__ = run.__qualname__ = schedule.__name__
    run.__doc__ = schedule.__doc__
    return run
