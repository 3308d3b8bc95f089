"""Microbatch schedules: forward and backward over the microbatches of one global batch.

Four schedules behind one signature, chosen by `get_forward_backward_func()` from the grid:

- no pipelining: gradient accumulation over microbatches on one stage;
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, SC21, sec. 2.2.1): warm-up forwards, then
  alternate one forward / one backward, then cool-down backwards; at most `pp` microbatches
  of activations are alive per stage;
- interleaved 1F1B (same paper, sec. 2.2.2): each rank holds `vpp` model chunks and runs the
  1F1B pattern over virtual stages, shrinking the bubble from (p-1)/m to (p-1)/(v*m). It needs
  `num_microbatches % pp == 0` (checked by the config);
- ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 3.1; `--pipeline-schedule
  zb-h1`): 1F1B with each backward split into B (input gradient, sent upstream at once) and
  W (weight gradient, run later where 1F1B idles), from the table in
  parallel_state/schedule_tables.py; about a third of 1F1B's bubble at its memory;
- ZBV (same paper, sec. 6; `--pipeline-schedule zbv`): two chunks per rank in a V (chunk 1
  of rank r is virtual stage 2 pp - 1 - r, so rank 0 holds the embedding and the loss), the
  same split backward and table executor; near-zero bubble at 1F1B's activation memory.

Each takes `model` (a list of model chunks, each a DistributedDataParallel wrapper), the
microbatches (dicts with `tokens`, `labels`, `loss_mask`), `loss_scale` = 1 / tokens of the
whole global batch, and the p2p `spec`. It returns the sum of this rank's token losses (nats,
a float32 tensor; zero on stages without the loss). Gradients of each chunk are DP-synced during
its last backward (`sync_enabled`), overlapping communication with the remaining backward.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

import parallel_state as ps
from models.mtp import mtp_shifted
from parallel_state import p2p, schedule_tables, weight_grads


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
        shifted = {k: batch[k] for k in ("mtp_tokens", "mtp_labels") if k in batch}
        out = model(batch["tokens"], labels=batch["labels"], hidden_states=hidden_states,
                    position_ids=batch.get("position_ids"),
                    attention_mask=batch.get("attention_mask"), **shifted)
    inner = getattr(model, "module", model)
    if not inner.post_process:
        return None, out
    loss = (out.float() * batch["loss_mask"]).sum()
    if getattr(inner, "mtp", None) is not None and inner.training:
        # the MTP term: value 0, the depths' gradient under their shifted masks (models/mtp.py)
        mask = batch.get("mtp_loss_mask")
        if mask is None:
            mask = mtp_shifted(batch["loss_mask"], len(inner.mtp.layers), 0)
        loss = loss + inner.mtp.objective(mask)
    return loss, None


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
        gradients of `inputs` (None on the first stage). Inside
        `weight_grads.input_gradients_only()` this is a zero-bubble B."""
        self.backwards_left[chunk] -= 1
        self._sync(chunk, self.backwards_left[chunk] == 0)  # last backward of this chunk
        with self._timed("B", chunk, mb):
            torch.autograd.backward(outputs, grad_tensors=output_grads)
        if inputs is None:
            return None
        return tuple(t.grad for t in inputs)

    def weight_pass(self, chunk: int, mb: int, deferred, last: bool) -> None:
        """Run the W of microbatch `mb` on `chunk` (`deferred`: what its B queued); `last`:
        the chunk's last W, during which the DP gradient sync may start (its B already
        counted the gradients computed in B)."""
        self._sync(chunk, last)
        with self._timed("W", chunk, mb):
            deferred.run()

    def _sync(self, chunk: int, enabled: bool) -> None:
        if hasattr(self.model[chunk], "sync_enabled"):
            self.model[chunk].sync_enabled = enabled


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


class _InterleavedSchedule:
    """One rank's interleaved 1F1B run, in Megatron-Core's terms.

    The rank's forward work is `total_num_microbatches = m * vpp` virtual microbatches
    k = 0, 1, ...; groups of `pp` consecutive k run on one model chunk, cycling through the
    chunks (`get_model_chunk_id`); backward visits the chunks in reverse order. Per chunk,
    FIFO queues hold the inputs received (`input_tensors`), the outputs kept for backward
    (`output_tensors`) and the gradients received for them (`output_tensor_grads`).
    Every step ends in one `p2p.communicate` that sends this step's results and receives
    the next step's inputs, which is why each phase works out which chunk they belong to.
    """

    def __init__(self, run: _Runner, spec, pp: int, vpp: int):
        self.run, self.spec, self.pp, self.vpp = run, spec, pp, vpp
        self.total_num_microbatches = len(run.microbatches) * vpp
        self.input_tensors = [[] for _ in range(vpp)]
        self.output_tensors = [[] for _ in range(vpp)]
        self.output_tensor_grads = [[] for _ in range(vpp)]

    def get_model_chunk_id(self, k: int, forward: bool) -> int:
        """Model chunk of virtual microbatch `k`: (k mod pp*vpp) // pp, reversed backward."""
        chunk = (k % (self.pp * self.vpp)) // self.pp
        return chunk if forward else self.vpp - 1 - chunk

    def get_microbatch_id_in_model_chunk(self, k: int) -> int:
        """Microbatch that virtual microbatch `k` runs: (k // (pp*vpp)) * pp + k mod pp."""
        return (k // (self.pp * self.vpp)) * self.pp + k % self.pp

    def forward_chunk_step(self, k: int):
        """Forward virtual microbatch `k` on the input last received for its chunk (None on
        the embedding chunk); returns its outputs (kept for backward unless forward-only)."""
        c = self.get_model_chunk_id(k, forward=True)
        ps.set_virtual_pipeline_model_parallel_rank(c)
        inputs, outputs_kept = self.input_tensors[c], self.output_tensors[c]
        if ps.is_pipeline_first_stage() and len(inputs) == len(outputs_kept):
            inputs.append(None)  # the embedding chunk reads tokens, not a received tensor
        outputs = self.run.forward(c, self.get_microbatch_id_in_model_chunk(k), inputs[-1])
        outputs_kept.append(outputs)
        if self.run.forward_only:  # nothing to keep for backward
            inputs.pop()
            outputs_kept.pop()
        return outputs

    def backward_chunk_step(self, k: int):
        """Backward the oldest kept forward of virtual microbatch `k`'s chunk; returns the
        gradients of its inputs."""
        c = self.get_model_chunk_id(k, forward=False)
        ps.set_virtual_pipeline_model_parallel_rank(c)
        if ps.is_pipeline_last_stage() and not self.output_tensor_grads[c]:
            self.output_tensor_grads[c].append(None)  # the loss chunk has no incoming gradient
        return self.run.backward(c, self.get_microbatch_id_in_model_chunk(k),
                                 self.input_tensors[c].pop(0), self.output_tensors[c].pop(0),
                                 self.output_tensor_grads[c].pop(0))

    def _activation_to_send(self, k: int, outputs):
        """`outputs` of forward `k`, or None on the last virtual stage (nothing downstream)."""
        ps.set_virtual_pipeline_model_parallel_rank(self.get_model_chunk_id(k, forward=True))
        return None if ps.is_pipeline_last_stage() else outputs

    def _grad_to_send(self, k: int, input_grads):
        """`input_grads` of backward `k`, or None on the first virtual stage (nothing upstream)."""
        ps.set_virtual_pipeline_model_parallel_rank(self.get_model_chunk_id(k, forward=False))
        return None if ps.is_pipeline_first_stage() else input_grads

    def run_warmup(self, num_warmup_microbatches: int, recv_first_grads: bool) -> None:
        """Warmup: forwards 0 .. num_warmup_microbatches - 1, each sending its activations and
        receiving the input of forward k + 1; with `recv_first_grads` the last one also
        receives the gradient for the steady state's first backward (on the last chunk)."""
        ps.set_virtual_pipeline_model_parallel_rank(0)
        self.input_tensors[0].append(p2p.recv_forward(self.spec))
        for k in range(num_warmup_microbatches):
            outputs = self.forward_chunk_step(k)
            next_forward_model_chunk_id = self.get_model_chunk_id(k + 1, forward=True)
            # the first stage's chunk 0 reads tokens; after the last forward nothing follows
            recv_prev = (not (ps.is_pipeline_first_stage(ignore_virtual=True)
                              and next_forward_model_chunk_id == 0)
                         and k != self.total_num_microbatches - 1)
            outputs = self._activation_to_send(k, outputs)
            if k == num_warmup_microbatches - 1 and recv_first_grads:
                recv_next = not ps.is_pipeline_last_stage(ignore_virtual=True)
                from_prev, from_next = p2p.communicate(self.spec, send_next=outputs,
                                                       recv_prev=recv_prev, recv_next=recv_next)
                self.output_tensor_grads[self.vpp - 1].append(from_next)
            else:
                from_prev, _ = p2p.communicate(self.spec, send_next=outputs, recv_prev=recv_prev)
            if recv_prev:
                self.input_tensors[next_forward_model_chunk_id].append(from_prev)

    def _steady_recv_prev(self, forward_k: int) -> tuple[bool, int]:
        """(receive from the previous stage?, chunk it is for) after steady-state forward
        `forward_k`. The first stage is pp - 1 virtual microbatches ahead of the last stage
        that sends to it, and receives nothing when that stage's chunk was the last one."""
        if ps.is_pipeline_first_stage(ignore_virtual=True):
            sender_chunk = self.get_model_chunk_id(forward_k - (self.pp - 1), forward=True)
            return sender_chunk != self.vpp - 1, sender_chunk + 1
        return True, self.get_model_chunk_id(forward_k + 1, forward=True)

    def _steady_recv_next(self, backward_k: int) -> tuple[bool, int]:
        """(receive from the next stage?, chunk it is for) after steady-state backward
        `backward_k`; the mirror of `_steady_recv_prev` (the last stage is pp - 1 backward
        microbatches ahead of the first)."""
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            sender_chunk = self.get_model_chunk_id(backward_k - (self.pp - 1), forward=False)
            return sender_chunk != 0, sender_chunk - 1
        return True, self.get_model_chunk_id(backward_k + 1, forward=False)

    def run_steady_1f1b(self, num_warmup_microbatches: int) -> None:
        """Steady 1F1B: forward num_warmup_microbatches + i, backward i, then one exchange
        that sends both results and receives the next forward's input and backward's grads."""
        num_microbatches_remaining = self.total_num_microbatches - num_warmup_microbatches
        for backward_k in range(num_microbatches_remaining):
            forward_k = num_warmup_microbatches + backward_k
            outputs = self.forward_chunk_step(forward_k)
            input_grads = self.backward_chunk_step(backward_k)
            outputs = self._activation_to_send(forward_k, outputs)
            input_grads = self._grad_to_send(backward_k, input_grads)
            recv_prev, next_forward_model_chunk_id = self._steady_recv_prev(forward_k)
            recv_next, next_backward_model_chunk_id = self._steady_recv_next(backward_k)
            if backward_k == num_microbatches_remaining - 1:
                recv_prev = False  # no forward follows; cooldown is backward only
            from_prev, from_next = p2p.communicate(self.spec, send_next=outputs,
                                                   send_prev=input_grads, recv_prev=recv_prev,
                                                   recv_next=recv_next)
            if recv_prev:
                self.input_tensors[next_forward_model_chunk_id].append(from_prev)
            if recv_next:
                self.output_tensor_grads[next_backward_model_chunk_id].append(from_next)

    def run_cooldown(self, num_microbatches_remaining: int, recv_first_grads: bool) -> None:
        """Cooldown: the backwards num_microbatches_remaining .. total - 1, each sending its
        input gradients and receiving those of backward k + 1. `recv_first_grads` (all
        forwards ran in warmup) first receives the gradient of the last chunk's output."""
        if recv_first_grads:
            ps.set_virtual_pipeline_model_parallel_rank(self.vpp - 1)
            self.output_tensor_grads[self.vpp - 1].append(p2p.recv_backward(self.spec))
        for k in range(num_microbatches_remaining, self.total_num_microbatches):
            input_grads = self.backward_chunk_step(k)
            next_backward_model_chunk_id = self.get_model_chunk_id(k + 1, forward=False)
            # the last stage's last chunk holds the loss; after the last backward nothing follows
            recv_next = (not (ps.is_pipeline_last_stage(ignore_virtual=True)
                              and next_backward_model_chunk_id == self.vpp - 1)
                         and k != self.total_num_microbatches - 1)
            input_grads = self._grad_to_send(k, input_grads)
            _, from_next = p2p.communicate(self.spec, send_prev=input_grads, recv_next=recv_next)
            if recv_next:
                self.output_tensor_grads[next_backward_model_chunk_id].append(from_next)


def forward_backward_pipelining_with_interleaving(
        *, model, microbatches, loss_scale, spec, forward_only=False,
        timeline=None) -> torch.Tensor:
    """Interleaved 1F1B over `vpp = len(model)` chunks per rank (Megatron's schedule).

    Step k of the forward order runs chunk (k mod pp*vpp) // pp on microbatch
    (k // (pp*vpp)) * pp + k mod pp; backward visits chunks in reverse. Warmup runs
    (pp - rank - 1) * 2 + (vpp - 1) * pp forwards (all m * vpp when forward-only or when
    m == pp), then steady 1F1B, then cooldown backwards (`_InterleavedSchedule`).

    Raises:
        ValueError: num_microbatches is not a multiple of pipeline-model-parallel-size.
    """
    run = _Runner(model, microbatches, loss_scale, forward_only, timeline)
    vpp, m = len(model), len(microbatches)
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if m % pp:
        raise ValueError(f"the interleaved schedule needs num_microbatches ({m}) divisible by "
                         f"pipeline-model-parallel-size ({pp})")
    schedule = _InterleavedSchedule(run, spec, pp, vpp)
    total = schedule.total_num_microbatches
    all_warmup_microbatches = forward_only or m == pp
    num_warmup_microbatches = (total if all_warmup_microbatches
                               else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total))
    schedule.run_warmup(num_warmup_microbatches, recv_first_grads=not all_warmup_microbatches)
    schedule.run_steady_1f1b(num_warmup_microbatches)
    if not forward_only:
        schedule.run_cooldown(total - num_warmup_microbatches,
                              recv_first_grads=all_warmup_microbatches)
    ps.set_virtual_pipeline_model_parallel_rank(0)
    return run.total


def forward_backward_pipelining_zero_bubble(
        *, model, microbatches, loss_scale, spec, forward_only=False,
        timeline=None, schedule: str = "zb-h1") -> torch.Tensor:
    """A zero-bubble schedule (Qi et al. 2024): ZB-H1 (sec. 3.1, one chunk per rank) or ZBV
    (sec. 6, `len(model) == 2` chunks in a V: `parallel_state.schedule_tables.virtual_stage`).
    This rank's table of F / B / W actions (`schedule_tables.build(schedule, pp, m, vpp)`)
    runs in order. B computes input gradients only (`weight_grads.input_gradients_only`);
    the linears' weight gradients it queues run at the W of the same microbatch, exactly
    once. Sends are posted without waiting (`p2p.isend`) and an action receives its input
    when it runs, so any table that `schedule_tables.check` accepts runs without deadlock.
    Forward-only runs the table's forwards.

    Raises:
        RuntimeError: the table left a forward without backward or a B without W.
    """
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    table = schedule_tables.build(schedule, pp, len(microbatches), len(model))
    run = _Runner(model, microbatches, loss_scale, forward_only, timeline)
    actions = table.actions[rank]
    if forward_only:
        _run_table(run, spec, table, [a for a in actions if a.kind == "F"])
    else:
        with weight_grads.split_backward():
            _run_table(run, spec, table, actions)
    return run.total


class _Neighbours:
    """Where a chunk's virtual stage exchanges with its neighbours in `table`'s placement:
    for the stage before it (inputs, gradients sent back) and the one after it (outputs,
    gradients received), None when there is none, "local" when this rank holds it (the
    bottom of a V), else whether it is the next pipeline rank."""

    def __init__(self, table, rank: int, chunk: int):
        pp, v = table.pp, table.vpp
        self.stage = table.virtual_stage(rank, chunk)

        def where(k: int):
            if not 0 <= k < pp * v:
                return None
            peer = schedule_tables.stage_rank(pp, k, table.v_shape)[0]
            if peer == rank:
                return "local"
            return peer == (rank + 1) % pp  # at pp 2 both are the same rank (tags differ)
        self.before, self.after = where(self.stage - 1), where(self.stage + 1)


def _incoming(source, kind: str, stage: int, action, handed: dict, spec):
    """What action `kind` ("F": activations, "B": their gradients) of `stage` receives from
    `source`: nothing at the pipeline's end (None), the tensors this rank's other chunk handed
    over ("local"), or a p2p receive from rank `source`."""
    if source is None:
        return None
    if source == "local":
        return handed.pop((kind, stage, action.microbatch))
    return p2p.recv(spec, from_next=source, gradient=kind == "B", chunk=action.chunk)


def _run_table(run: _Runner, spec, table, actions) -> None:
    """Run this rank's `actions` of `table`. Activations travel down the virtual stages and
    gradients up; between two chunks of this rank (the bottom of a V) they are handed over
    here, the outputs detached as a received tensor would be."""
    rank = ps.get_pipeline_model_parallel_rank()
    nb = [_Neighbours(table, rank, c) for c in range(len(run.model))]
    kept, deferred, sends = {}, {}, []
    handed = {}  # (kind, virtual stage, microbatch) -> tensors passed between this rank's chunks
    weights_left = [len(run.microbatches)] * len(run.model)
    try:
        for a in actions:
            key, n = (a.chunk, a.microbatch), nb[a.chunk]
            p2p.wait_sends(sends, completed_only=True)
            if a.kind == "F":
                inputs = _incoming(n.before, "F", n.stage, a, handed, spec)
                outputs = run.forward(a.chunk, a.microbatch, inputs)
                if n.after == "local":
                    handed[("F", n.stage + 1, a.microbatch)] = tuple(
                        t.detach().to(spec.dtype).clone() for t in outputs)
                elif n.after is not None:
                    sends.append(p2p.isend(spec, outputs, to_next=n.after, gradient=False,
                                           chunk=a.chunk))
                if not run.forward_only:
                    kept[key] = (inputs, outputs)
            elif a.kind == "B":
                grads = _incoming(n.after, "B", n.stage, a, handed, spec)
                inputs, outputs = kept.pop(key)
                with weight_grads.input_gradients_only() as w:
                    input_grads = run.backward(a.chunk, a.microbatch, inputs, outputs, grads)
                deferred[key] = w
                if n.before == "local":
                    handed[("B", n.stage - 1, a.microbatch)] = input_grads
                elif n.before is not None:
                    sends.append(p2p.isend(spec, input_grads, to_next=n.before, gradient=True,
                                           chunk=a.chunk))
            else:
                weights_left[a.chunk] -= 1
                run.weight_pass(a.chunk, a.microbatch, deferred.pop(key),
                                last=weights_left[a.chunk] == 0)
    finally:
        p2p.wait_sends(sends)
    if kept or deferred or handed:
        raise RuntimeError(f"pipeline table left forwards {sorted(kept)} without B, B's "
                           f"{sorted(deferred)} without W and {sorted(handed)} unused")


def get_forward_backward_func(schedule_name: str | None = None) -> Callable:
    """The schedule for the current grid (`schedule_name`: --pipeline-schedule; None picks
    interleaved with vpp > 1, else 1F1B); pass `timeline=` to record its spans."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        schedule = forward_backward_no_pipelining
    elif schedule_name in schedule_tables.SPLIT_BACKWARD:
        schedule = functools.partial(forward_backward_pipelining_zero_bubble,
                                     schedule=schedule_name)
        schedule.__name__ = forward_backward_pipelining_zero_bubble.__name__
        schedule.__doc__ = forward_backward_pipelining_zero_bubble.__doc__
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
