"""Token dispatch: the routed copies of the tokens grouped by expert, sent to the ranks that
hold those experts, and their outputs brought back and weighted (Megatron-Core's alltoall
dispatcher, as one pipeline of named steps without its variants):

    dispatch: drop over capacity -> permute by expert -> [EP] exchange counts, then tokens
              -> [EP] sort the received blocks by local expert
    combine:  [EP] unsort -> [EP] exchange back -> unpad -> weight by the routing
              probability and sum each token's k copies

Permuting is a stable argsort of the chosen experts, so an expert's rows keep the token
order, and a token's k outputs are added in the order of its choices: the same sums at every
layout. Expert parallelism splits the layer's experts into contiguous blocks of
`num_local_experts` per EP rank; each rank dispatches its own tokens, and a rank may receive
no token for an expert, or none at all (every size below may be 0).

Capacity (`moe_expert_capacity_factor`, Megatron's default "probs" drop policy): of the
microbatch's copies routed to an expert, the `capacity = ceil(k T / E * factor)` with the
highest routing probability are kept (ties: the earlier token), the rest dropped (they add
nothing; the token keeps its other copies and the residual). Capacity and dropping are
decided per microbatch over all its T tokens (gathered over TP first), so they are the same
at every layout for the same routing; Megatron decides per EP-local batch, which changes with
the layout. `moe_pad_expert_input_to_capacity` pads every expert's block with zero rows to
exactly `capacity`, so the exchanged sizes no longer depend on the routing.

Replicated tokens (`replicated=True`: experts split over the TP ranks, expert TP 1, as vLLM's
`--enable-expert-parallel` lays out serving): every EP rank already holds every token and the
same routing, so nothing is exchanged. A rank keeps only the copies routed to its own experts;
`combine` returns its partial sum (zeros for tokens none of whose experts it holds), and the
caller's reduce over the group adds the ranks' parts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallel_state import collectives
from parallel_state.mappings import all_to_all


def capacity_keep(indices: torch.Tensor, probs: torch.Tensor, num_experts: int,
                  capacity_factor: float) -> tuple[torch.Tensor, int]:
    """Which routed copies fit their expert's capacity: `indices`, `probs` `[T, k]` ->
    (`keep [T, k]` bool, capacity), capacity = ceil(k T / num_experts * capacity_factor)
    (Megatron's `get_capacity`); per expert the copies of highest probability win, ties going
    to the earlier (token, choice)."""
    t, k = indices.shape
    capacity = math.ceil(t * k / num_experts * capacity_factor)
    experts = indices.reshape(-1)
    by_prob = torch.argsort(probs.detach().reshape(-1), descending=True, stable=True)
    order = by_prob[torch.argsort(experts[by_prob], stable=True)]  # by expert, then prob
    counts = torch.bincount(experts, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    rank = torch.empty_like(experts)
    rank[order] = torch.arange(t * k, device=experts.device) - starts[experts[order]]
    return (rank < capacity).view(t, k), capacity


def _chunk_order(sizes: torch.Tensor) -> torch.Tensor:
    """Rows received as blocks `(source rank i, local expert e)` in `(i, e)` order ->
    the index that reads them in `(e, i)` order (each expert's rows contiguous). `sizes`
    `[ep, num_local_experts]`."""
    flat = sizes.reshape(-1)
    starts = (flat.cumsum(0) - flat).view(sizes.shape).t().reshape(-1)
    by_expert = sizes.t().reshape(-1)
    target_starts = by_expert.cumsum(0) - by_expert
    offset = torch.repeat_interleave(starts - target_starts, by_expert)
    return offset + torch.arange(offset.numel(), device=sizes.device)


@dataclass
class DispatchPlan:
    """What `combine` needs to undo a `dispatch`: `token_index [N]` the token of each sent
    row, `probs [N]` its weight (float32, with autograd), `num_tokens` T, `pad_rows [N]`
    (the rows' places in the padded layout, or None), and under EP the row counts sent to
    and received from each rank and `local_order` (received rows sorted by local expert)."""

    token_index: torch.Tensor
    probs: torch.Tensor
    num_tokens: int
    pad_rows: torch.Tensor | None = None
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    local_order: torch.Tensor | None = None


class AllToAllDispatcher:
    """Dispatch and combine over the expert-parallel group `group` of `ep_size` ranks
    (None, 1: one rank holds every expert); `replicated`: every rank of the group holds the
    same tokens (module docstring) and `ep_rank` says which block of experts is its own.
    Stateless between calls: `dispatch` returns the plan that `combine` takes, so
    microbatches may interleave (pipeline schedules)."""

    def __init__(self, num_experts: int, ep_size: int = 1, group=None,
                 replicated: bool = False, ep_rank: int = 0):
        if num_experts % ep_size:
            raise ValueError(f"--num-experts {num_experts} is not divisible by "
                             f"--expert-model-parallel-size {ep_size}; each EP rank holds "
                             f"the same number of experts")
        self.num_experts, self.ep_size, self.group = num_experts, ep_size, group
        self.num_local_experts = num_experts // ep_size
        # replicated tokens (module docstring): this rank's experts are [lo, lo + local)
        self.replicated = replicated and ep_size > 1
        self.first_local_expert = ep_rank * self.num_local_experts if self.replicated else 0

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor,
                 keep: torch.Tensor | None = None, pad_to: int | None = None
                 ) -> tuple[torch.Tensor, list[int], DispatchPlan]:
        """`x [T, h]`, `indices`/`probs`/`keep` `[T, k]` (keep None: all) -> (rows for this
        rank's experts `[M, h]`, rows per local expert, plan). `pad_to`: pad every expert
        block to that many rows (the capacity)."""
        t, k = indices.shape
        experts = indices.reshape(-1)
        if self.replicated:  # only the copies routed to this rank's experts
            lo = self.first_local_expert
            mine = (indices >= lo) & (indices < lo + self.num_local_experts)
            keep = mine if keep is None else keep & mine
        kept = None if keep is None else keep.reshape(-1).nonzero().squeeze(1)
        chosen = experts if kept is None else experts[kept]
        sort = torch.argsort(chosen, stable=True)
        order = sort if kept is None else kept[sort]  # flat (token, choice) ids by expert
        counts = torch.bincount(chosen, minlength=self.num_experts)
        plan = DispatchPlan(order // k, probs.reshape(-1).index_select(0, order), t)
        rows = x.index_select(0, plan.token_index)
        if self.replicated:  # experts [lo, lo + local) only, numbered from 0
            lo = self.first_local_expert
            chosen, counts = chosen - lo, counts[lo:lo + self.num_local_experts]
        if pad_to is not None:
            by_expert = chosen[sort]
            starts = counts.cumsum(0) - counts
            plan.pad_rows = by_expert * pad_to + \
                torch.arange(by_expert.numel(), device=x.device) - starts[by_expert]
            rows = rows.new_zeros(counts.numel() * pad_to, x.shape[1]).index_copy(
                0, plan.pad_rows, rows)
            counts = torch.full_like(counts, pad_to)
        if self.ep_size == 1 or self.replicated:
            return rows, counts.tolist(), plan
        return self._exchange(rows, counts, plan)

    def _exchange(self, rows, counts, plan):
        send = counts.view(self.ep_size, self.num_local_experts)
        recv = torch.empty_like(send)
        collectives.all_to_all_single(recv, send.contiguous(), None, None, group=self.group)
        plan.send_splits, plan.recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = all_to_all(rows, plan.recv_splits, plan.send_splits, self.group)
        if self.num_local_experts > 1:
            plan.local_order = _chunk_order(recv)
            received = received.index_select(0, plan.local_order)
        return received, recv.sum(0).tolist(), plan

    def combine(self, y: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Expert outputs `[M, h]` (as `dispatch` returned the rows) -> `[T, h]`: each
        token's sum of its kept copies weighted by their probabilities (float32 sums, cast
        back to `y`'s dtype); a token with no kept copy gets zeros."""
        if self.ep_size > 1 and not self.replicated:
            if plan.local_order is not None:
                y = y.index_select(0, torch.argsort(plan.local_order))
            y = all_to_all(y, plan.send_splits, plan.recv_splits, self.group)
        if plan.pad_rows is not None:
            y = y.index_select(0, plan.pad_rows)
        weighted = y.float() * plan.probs.unsqueeze(1)
        out = weighted.new_zeros(plan.num_tokens, y.shape[1])
        return out.index_add(0, plan.token_index, weighted).to(y.dtype)
