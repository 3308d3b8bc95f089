"""Context-parallel attention by all-gather ("all_gather"): every rank gathers the whole
sequence's K and V over the CP group, then attends its own queries locally.

One collective instead of cp - 1 ring steps, at the price of holding the whole sequence's
K/V (`2 * b * g * s * d` elements) during the attention: the choice for small cp and short
sequences (docs/DECISIONS.md). The backward gathers K/V again (so only the local k, v are
saved, as in the ring) and reduce-scatters the float32 dK, dV over the group: the sum over
every rank's queries lands at the key's owner.

The gathered blocks are put back in global order, so each local query chunk needs one
contiguous run of keys (keys up to its last position, and from its first position minus
the window): blocks.plan_blocks gives two blocks, the rest of the sequence is not computed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_state import collectives

from .blocks import (AttentionSpec, OnlineSoftmax, backward_block, backward_inputs, plan_blocks,
                     save_result, sink_gradient)
from .layout import chunk_ranges, local_positions


def _gather(k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """k, v `[b, g, s/cp, d]` of every rank -> `[2, b, g, s, d]` in global order."""
    cp = dist.get_world_size(group)
    kv = torch.stack([k, v])
    two, b, g, sl, d = kv.shape
    gathered = kv.new_empty((cp * 2, b, g, sl, d))  # concatenated along dim 0, rank order
    collectives.all_gather_single(gathered, kv, group=group)
    halves = gathered.view(cp, 2, b, g, 2, sl // 2, d)
    # chunk c < cp is rank c's early chunk, chunk 2cp-1-c rank c's late one
    chunks = torch.cat([halves[:, :, :, :, 0], halves[:, :, :, :, 1].flip(0)])
    return chunks.permute(1, 2, 3, 0, 4, 5).reshape(2, b, g, cp * sl, d)


def _reduce_scatter(dkv: torch.Tensor, group) -> torch.Tensor:
    """`[2, b, g, s, d]` in global order, summed over the group -> this rank's
    `[2, b, g, s/cp, d]` (the inverse layout of `_gather`)."""
    cp = dist.get_world_size(group)
    two, b, g, s, d = dkv.shape
    chunks = dkv.view(2, b, g, 2 * cp, s // (2 * cp), d).permute(3, 0, 1, 2, 4, 5)
    per_rank = torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=4)  # [cp, 2, b, g, 2, ..]
    out = dkv.new_empty((2, b, g, s // cp, d))
    collectives.reduce_scatter_single(out, per_rank.reshape(cp * 2, b, g, s // cp, d),
                                      group=group)
    return out


def _blocks(q, group, spec):
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    s = q.shape[2] * cp
    qpos = local_positions(s, cp, r, q.device)
    kpos = torch.arange(s, device=q.device)
    return qpos, kpos, plan_blocks(chunk_ranges(s, cp, r), [range(s)], spec.window_left)


class AllGatherAttention(torch.autograd.Function):
    """`apply(q [b, n, s/cp, d], k, v [b, g, s/cp, d], sinks [n] | None, group, spec)` ->
    `[b, n, s/cp, d]`."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, spec: AttentionSpec):
        kv = _gather(k, v, group)
        qpos, kpos, blocks = _blocks(q, group, spec)
        state = OnlineSoftmax(q)
        for block in blocks:
            state.update(q, kv[0], kv[1], qpos, kpos, block, spec)
        return save_result(ctx, state, q, k, v, sinks, group, spec)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, dout, lse, delta, dq, sinks, group, spec = backward_inputs(ctx, dout)
        kv = _gather(k, v, group)
        qpos, kpos, blocks = _blocks(q, group, spec)
        dkv = torch.zeros(kv.shape, device=q.device)
        for block in blocks:
            backward_block(q, kv[0], kv[1], dout, lse, delta, qpos, kpos, block, spec,
                           dq, dkv[0], dkv[1])
        dk, dv = _reduce_scatter(dkv, group)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                sink_gradient(sinks, lse, delta), None, None)
