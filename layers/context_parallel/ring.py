"""Ring attention over the CP group ("p2p"): K/V blocks travel, queries stay.

Forward (Liu et al. 2023, "Ring Attention with Blockwise Transformers", sec. 3): cp steps; at
step i rank r holds the K/V of rank j = (r - i) mod cp. Before computing with it, rank r posts
the send of that block to rank r+1 and the receive of the next one from rank r-1, so the
transfer runs while the block's attention is computed; partial results merge in the online
softmax (blocks.py). Only the g KV heads travel, K and V in one message of `2 * b * g *
s/cp * d` elements of k's dtype per step (cp - 1 steps send).

Backward, a second ring: K and V travel again (sent ahead, overlapped as in the forward);
each rank adds its queries' contribution to the dK, dV of the block it holds and passes that
float32 accumulator on after computing, so after cp steps every block's dK, dV arrive back
at their owner holding the sum over all ranks' queries (TransformerEngine's
AttnFuncWithCPAndKVP2P does the same). Per step the backward sends `2 * b * g * s/cp * d`
elements of k's dtype (K, V) and as many float32 (dK, dV).

Saved for backward: q, k, v, out, lse (`[b, n, s/cp]` float32) and the dropout keys `[b, n]`;
no block's probabilities.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_state import collectives

from .blocks import (AttentionSpec, OnlineSoftmax, backward_block, backward_inputs, plan_blocks,
                     save_result, sink_gradient)
from .layout import chunk_ranges, local_positions

# gloo matches messages by tag: the three streams of the ring on their own tags
TAG_KV, TAG_KV_BACKWARD, TAG_DKV = 320, 321, 322


class _Pending:
    """A posted exchange: `wait()` -> the received tensor. Holds the sent tensor too, so its
    memory is not reused while the transfer runs."""

    def __init__(self, requests, sent, received):
        self.requests, self.sent, self.received = requests, sent, received

    def wait(self) -> torch.Tensor:
        for req in self.requests:
            req.wait()
        return self.received


def _exchange(send: torch.Tensor, group, tag: int) -> _Pending:
    """Post: `send` to the next rank of `group`, a tensor like it from the previous one."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:
        return _Pending([], send, send)
    received = torch.empty_like(send)
    nxt = dist.get_global_rank(group, (r + 1) % cp)
    prv = dist.get_global_rank(group, (r - 1) % cp)
    ops = [dist.P2POp(dist.isend, send, nxt, group=group, tag=tag),
           dist.P2POp(dist.irecv, received, prv, group=group, tag=tag)]
    return _Pending(collectives.batch_isend_irecv(ops), send, received)


def _layout(q, group):
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    seq_length = q.shape[2] * cp
    return cp, r, seq_length, local_positions(seq_length, cp, r, q.device)


class RingAttention(torch.autograd.Function):
    """`apply(q [b, n, s/cp, d], k, v [b, g, s/cp, d], sinks [n] | None, group, spec)` ->
    `[b, n, s/cp, d]`."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, spec: AttentionSpec):
        cp, r, s, qpos = _layout(q, group)
        kv = torch.stack([k, v])  # [2, b, g, s/cp, d]: one message per step
        state = OnlineSoftmax(q)
        for i in range(cp):
            j = (r - i) % cp  # whose keys this rank holds at step i
            pending = _exchange(kv, group, TAG_KV) if i < cp - 1 else None
            kpos = local_positions(s, cp, j, q.device)
            for block in plan_blocks(chunk_ranges(s, cp, r), chunk_ranges(s, cp, j),
                                     spec.window_left):
                state.update(q, kv[0], kv[1], qpos, kpos, block, spec)
            if pending is not None:
                kv = pending.wait()
        return save_result(ctx, state, q, k, v, sinks, group, spec)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, dout, lse, delta, dq, sinks, group, spec = backward_inputs(ctx, dout)
        cp, r, s, qpos = _layout(q, group)
        kv = torch.stack([k, v])
        grads = None  # the exchange bringing the dK, dV accumulated so far for the next block
        for i in range(cp):
            j = (r - i) % cp
            pending = _exchange(kv, group, TAG_KV_BACKWARD) if i < cp - 1 else None
            kpos = local_positions(s, cp, j, q.device)
            dkv = torch.zeros(kv.shape, device=q.device)
            for block in plan_blocks(chunk_ranges(s, cp, r), chunk_ranges(s, cp, j),
                                     spec.window_left):
                backward_block(q, kv[0], kv[1], dout, lse, delta, qpos, kpos, block, spec,
                               dq, dkv[0], dkv[1])
            if grads is not None:
                dkv += grads.wait()  # what ranks r-i+1 .. r-1 added to block j
            grads = _exchange(dkv, group, TAG_DKV)  # on to r+1; after step cp-1: to j
            if pending is not None:
                kv = pending.wait()
        dk, dv = grads.wait()  # this rank's own block, summed over every rank's queries
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                sink_gradient(sinks, lse, delta), None, None)
