"""`context_parallel_attention`: causal self-attention of this rank's queries over the whole
sequence's keys, the sequence split over a CP group (layout.py)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..dropout import attention_dropout_keys
from .all_gather import AllGatherAttention
from .blocks import AttentionSpec
from .ring import RingAttention

COMM_TYPES = {"p2p": RingAttention, "all_gather": AllGatherAttention}


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group,
                               comm_type: str = "p2p", scale: float | None = None,
                               dropout_p: float = 0.0, dropout_site: torch.Tensor | int = 0,
                               window_size: tuple[int, int] | None = None,
                               softcap: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal self-attention over a sequence split over the CP process group `group`.

    q `[b, n, s/cp, d]`, k and v `[b, g, s/cp, d]` (g divides n: grouped-query heads, only
    the g KV heads travel), each this rank's two load-balanced chunks
    (`split_for_context_parallel` along the sequence dim) -> `[b, n, s/cp, d]` in q's dtype,
    equal to rows `local_positions(s, cp, rank)` of one process's
    `layers.attention.core_attention` on the whole sequence. Differentiable w.r.t. q, k, v.

    comm_type: "p2p" (ring.py: K/V blocks passed around the group, overlapped with compute;
    memory O(s/cp)) or "all_gather" (all_gather.py: one all-gather of K/V, then local).
    scale: None = 1/sqrt(d). window_size: `(left, 0)`, key visible when
    `query - left <= key <= query` (layers/attention.py causal_window_mask, HF
    sliding_window = left + 1); None: every earlier key. softcap: scores become
    `softcap * tanh(scores / softcap)` before the mask (Gemma 2, as core_attention).
    sinks: `[n]` (this rank's heads) or None, attention sinks (gpt-oss model card; Xiao et al.
    2023, sec. 3.2): head j's logit joins each query's softmax denominator once, with no
    value (`layers.attention.core_attention`); folded into the merged blocks once
    (blocks.OnlineSoftmax.add_sinks), differentiable (blocks.sink_gradient).
    dropout_p > 0 (training): attention dropout with layout-free masks keyed by the global
    (query, key) positions, the global key count and the sample ids of
    `parallel_state.dropout_sample_ids` (layers/dropout.py), so they equal one process's;
    the backward redraws the same masks.

    Raises ValueError (before any communication) for an unknown comm_type, shapes that do
    not fit together, an odd local length (two chunks per rank), a window with a right
    side, dropout_p outside [0, 1), a non-positive softcap, sinks that are not one per query
    head, or dropout without sample ids
    (`--dropout-masks rank-streams`: stream masks cannot be replayed by position).
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {sorted(COMM_TYPES)}, got "
                         f"{comm_type!r}")
    _check_shapes(q, k, v)
    if window_size is not None and (window_size[1] != 0 or window_size[0] < 0):
        raise ValueError(f"context-parallel attention is causal: window_size must be "
                         f"(left >= 0, 0), got {tuple(window_size)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention dropout must be in [0, 1), got {dropout_p}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (or None), got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must be one logit per query head, [{q.shape[1]}]; got "
                         f"{tuple(sinks.shape)}: pass this rank's slice of the layer's sinks")
    keys = None
    if dropout_p > 0:
        keys = attention_dropout_keys(q.shape[1], dropout_site, q.device)
        if keys is None:
            raise ValueError("attention dropout under context parallelism needs layout-free "
                             "masks: --dropout-masks sample (the default), with the "
                             "microbatch's sample ids set (parallel_state.dropout_sample_ids)")
        if keys.shape[0] != q.shape[0]:
            raise ValueError(f"dropout: {keys.shape[0]} sample ids for a batch of "
                             f"{q.shape[0]}")
    cp = dist.get_world_size(group)
    spec = AttentionSpec(scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
                         softcap=softcap,
                         window_left=None if window_size is None else int(window_size[0]),
                         dropout_p=float(dropout_p), dropout_keys=keys,
                         num_keys=q.shape[2] * cp)
    return COMM_TYPES[comm_type].apply(q, k, v, sinks, group, spec)


def _check_shapes(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"context-parallel attention takes q [b, n, s/cp, d] and k, v "
                         f"[b, g, s/cp, d] of one shape; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, n, sl, d), (bk, g, slk, dk) = q.shape, k.shape
    if (b, sl, d) != (bk, slk, dk) or n % g != 0:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} do not fit: batch, "
                         f"local sequence and head dim must agree and the KV heads "
                         f"(num_query_groups) divide the query heads")
    if sl == 0 or sl % 2 != 0:
        raise ValueError(f"local sequence length {sl} is not two equal chunks: split the "
                         f"sequence with split_for_context_parallel (a multiple of 2 x "
                         f"--context-parallel-size)")
