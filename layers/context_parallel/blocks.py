"""Attention of a block of queries against a block of keys, in parts that merge exactly.

Context-parallel attention computes a query's softmax over keys that arrive block by block,
so it keeps, per query row, the running maximum `m`, the running sum `l` of `exp(s - m)` and
the unnormalised output `acc = sum exp(s - m) v`, and rescales them by `exp(m_old - m_new)`
when a block raises the maximum: the online softmax of Milakov & Gimelshein 2018 ("Online
normalizer calculation for softmax", alg. 3) as FlashAttention uses it across key blocks (Dao
et al. 2022, sec. 3.1, eq. for m(x), l(x)). All three are float32; at the end
`out = acc / l` and `lse = m + log l` (the log-sum-exp of each row's scores).

The backward recomputes each block's probabilities from the saved `lse`,
`P = exp(S - lse)`, and needs only `D = rowsum(dO * O)` per row besides (FlashAttention-2,
Dao 2023, sec. 3.1 / alg. 2): `dS = P * (dP - D)`, which holds with dropout too, since
`rowsum(P * dP) = dO . O` when `dP` carries the dropout mask.

Attention sinks (gpt-oss model card, OpenAI 2025; Xiao et al. 2023, "Efficient Streaming
Language Models with Attention Sinks", sec. 3.2): a per-head logit `z` joins each query's
denominator once, `exp(z - m)` added to `l`, with no value. `OnlineSoftmax.add_sinks` folds it
in after every key block is merged, so `lse` includes it and the backward's `P = exp(S -
lse)` are the probabilities with the sink. Its gradient is that of one more softmax column
whose `dP` is 0: `dz = sum over rows of P_sink (0 - D) = -sum_rows exp(z - lse) D`
(`sink_gradient`).

Positions: `query_positions` / `key_positions` are the global positions of the rows and
columns, so masks (causal, sliding window) and dropout keys are those of one process holding
the whole sequence. Shapes: q `[b, n, sq, d]`, k and v `[b, g, sk, d]` (g divides n,
grouped-query heads: the n/g query heads of a group are multiplied as rows of one matrix, so k
and v are never repeated), scores `[b, n, rows, cols]` float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..dropout import apply_keep, attention_keep_mask

NEG_INF = float("-inf")


@dataclass(frozen=True)
class AttentionSpec:
    """What every block of one attention call shares. `window_left`: a key is visible when
    `query - window_left <= key <= query` (None: every earlier key); `dropout_keys` `[b, n]`
    from `layers.dropout.attention_dropout_keys` when `dropout_p > 0`; `num_keys`: the global
    sequence length (the width of the dropout counters)."""

    scale: float
    softcap: float | None
    window_left: int | None
    dropout_p: float
    dropout_keys: torch.Tensor | None
    num_keys: int


@dataclass(frozen=True)
class Block:
    """Local query rows x key columns of the held keys to compute; `full`: every pair is
    visible, so no mask is built."""

    rows: slice
    cols: slice
    full: bool


def plan_blocks(query_chunks: Sequence[range], key_chunks: Sequence[range],
                window_left: int | None) -> list[Block]:
    """The blocks that cover every visible (query, key) pair exactly once and compute no
    block whose pairs are all masked.

    `query_chunks`: the global positions of the local query rows as consecutive ranges (row
    offsets follow in order); `key_chunks`: the same for the held keys, increasing. Query
    chunk [a, z] sees keys in [a - window_left, z] (causal: up to z), a contiguous run of the
    sorted keys, so each query chunk needs one contiguous column slice, or none. Two chunks
    needing the same slice become one block. With the load-balanced layout (layout.py) and
    no window this gives, for a ring step holding rank j's keys at rank r: j == r (diagonal)
    the early query chunk against the early key chunk and the late query chunk against both,
    causal inside; j < r every query against the early key chunk only (the late key chunk
    2cp-1-j lies after both query chunks), no mask; j > r the late query chunk against all
    keys (both key chunks lie before it and after the early query chunk), no mask.
    """
    blocks: list[Block] = []
    row = 0
    for qr in query_chunks:
        lowest = qr.start - window_left if window_left is not None else -1
        first = last = kmin = kmax = None
        col = 0
        for kr in key_chunks:
            a, z = max(kr.start, lowest), min(kr.stop - 1, qr.stop - 1)
            if a <= z:
                if first is None:
                    first, kmin = col + a - kr.start, a
                last, kmax = col + z - kr.start, z
            col += len(kr)
        if first is not None:
            full = kmax <= qr.start and (window_left is None or kmin >= qr.stop - 1 - window_left)
            block = Block(slice(row, row + len(qr)), slice(first, last + 1), full)
            prev = blocks[-1] if blocks else None
            if prev and prev.cols == block.cols and prev.full == full and prev.rows.stop == row:
                blocks[-1] = Block(slice(prev.rows.start, block.rows.stop), block.cols, full)
            else:
                blocks.append(block)
        row += len(qr)
    return blocks


def visible(query_positions: torch.Tensor, key_positions: torch.Tensor,
            window_left: int | None) -> torch.Tensor:
    """`[sq, sk]` bool: key <= query and, with a window, key >= query - window_left (the
    pairs layers/attention.py causal_window_mask allows, at arbitrary global positions)."""
    q, k = query_positions[:, None], key_positions[None, :]
    allowed = k <= q
    if window_left is not None:
        allowed = allowed & (k >= q - window_left)
    return allowed


def _rows(x: torch.Tensor, g: int) -> torch.Tensor:
    """`[b, n, r, e]` -> `[b, g, n/g * r, e]`: a group's query heads as rows of one matrix."""
    b, n, r, e = x.shape
    return x.reshape(b, g, n // g * r, e)


def _grouped(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`x [b, n, r, c] @ y [b, g, c, e]` per KV group -> `[b, n, r, e]`."""
    b, n, r = x.shape[:3]
    return torch.matmul(_rows(x, y.shape[1]), y).view(b, n, r, y.shape[-1])


def scores(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """`q k^T * scale` float32 `[b, n, sq, sk]`, soft-capped as core_attention does
    (`softcap * tanh(s / softcap)`, Gemma 2)."""
    s = _grouped(q, k.transpose(-1, -2)).float()
    if spec.scale != 1.0:
        s = s * spec.scale
    if spec.softcap is not None:
        s = torch.tanh(s / spec.softcap) * spec.softcap
    return s


def _masked(s, block, qpos, kpos, spec):
    if block.full:
        return s
    return s.masked_fill(~visible(qpos[block.rows], kpos[block.cols], spec.window_left), NEG_INF)


def _keep(block, qpos, kpos, spec):
    return attention_keep_mask(spec.dropout_keys, spec.dropout_p, qpos[block.rows],
                               kpos[block.cols], spec.num_keys)


class OnlineSoftmax:
    """The running `m`, `l` `[b, n, sq]` and `acc` `[b, n, sq, d]` (float32) of a query block
    `q [b, n, sq, d]`; `update` folds in one block of keys, `result` gives (out, lse)."""

    def __init__(self, q: torch.Tensor):
        b, n, sq, d = q.shape
        self.dtype = q.dtype
        self.m = torch.full((b, n, sq), NEG_INF, device=q.device)
        self.l = torch.zeros(b, n, sq, device=q.device)
        self.acc = torch.zeros(b, n, sq, d, device=q.device)

    def update(self, q, k, v, qpos, kpos, block: Block, spec: AttentionSpec) -> None:
        """Fold in `block` of q against held keys k, v `[b, g, sk, d]` at global positions
        `qpos [sq]`, `kpos [sk]`."""
        rows, cols = block.rows, block.cols
        s = _masked(scores(q[:, :, rows], k[:, :, cols], spec), block, qpos, kpos, spec)
        m_old = self.m[:, :, rows]
        m_new = torch.maximum(m_old, s.amax(-1))
        m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)  # a row with no visible key yet
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m_old - m_safe)
        self.l[:, :, rows] = self.l[:, :, rows] * alpha + p.sum(-1)
        if spec.dropout_p > 0:  # on the probabilities; l keeps the undropped sum
            p = apply_keep(p, _keep(block, qpos, kpos, spec), spec.dropout_p)
        pv = _grouped(p.to(v.dtype), v[:, :, cols]).float()
        self.acc[:, :, rows] = self.acc[:, :, rows] * alpha[..., None] + pv
        self.m[:, :, rows] = m_new

    def add_sinks(self, sinks: torch.Tensor) -> None:
        """Fold the attention sinks `sinks [n]` (one logit per local head) into every row's
        denominator once, after the last key block (module docstring): the maximum becomes
        `max(m, z)` and `l` gains `exp(z - m)`; `acc` is only rescaled (a sink has no
        value)."""
        z = sinks.detach().float().view(1, -1, 1)
        m_new = torch.maximum(self.m, z)
        alpha = torch.exp(self.m - m_new)
        self.l = self.l * alpha + torch.exp(z - m_new)
        self.acc = self.acc * alpha[..., None]
        self.m = m_new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`out [b, n, sq, d]` in q's dtype and `lse [b, n, sq]` float32. `out` is laid out
        `[b, sq, n, d]` in memory (as the fused SDPA kernels return it), so the attention
        layer's `[s, b, n d]` view of it for the output projection is no copy: the
        projection's saved input and this Function's saved output are one tensor."""
        out = (self.acc / self.l[..., None]).to(self.dtype)
        return out.transpose(1, 2).contiguous().transpose(1, 2), self.m + torch.log(self.l)


def backward_block(q, k, v, dout, lse, delta, qpos, kpos, block: Block, spec: AttentionSpec,
                   dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add `block`'s share of the gradients to the float32 accumulators `dq [b, n, sq, d]`,
    `dk`, `dv [b, g, sk, d]` (those of the held keys). `dout` `[b, n, sq, d]`; `lse`,
    `delta = rowsum(dout * out)` `[b, n, sq]` float32."""
    rows, cols = block.rows, block.cols
    qb, kb, vb, dob = q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows]
    g = k.shape[1]
    s = scores(qb, kb, spec)
    cap = 1 - (s / spec.softcap) ** 2 if spec.softcap is not None else None  # d tanh
    p = torch.exp(_masked(s, block, qpos, kpos, spec) - lse[:, :, rows, None])
    dp = _grouped(dob, vb.transpose(-1, -2)).float()
    p_dropped = p
    if spec.dropout_p > 0:
        keep = _keep(block, qpos, kpos, spec)
        p_dropped, dp = (apply_keep(t, keep, spec.dropout_p) for t in (p, dp))
    dv[:, :, cols] += torch.matmul(_rows(p_dropped.to(v.dtype), g).transpose(-1, -2),
                                   _rows(dob, g)).float()
    ds = p * (dp - delta[:, :, rows, None])
    if cap is not None:
        ds = ds * cap
    if spec.scale != 1.0:
        ds = ds * spec.scale
    ds = ds.to(q.dtype)
    dq[:, :, rows] += _grouped(ds, kb).float()
    dk[:, :, cols] += torch.matmul(_rows(ds, g).transpose(-1, -2), _rows(qb, g)).float()


def save_result(ctx, state: OnlineSoftmax, q, k, v, sinks, group,
                spec: AttentionSpec) -> torch.Tensor:
    """The output of an attention Function's forward, after folding in `sinks` `[n]` (or
    None); saves for its backward only q, k, v, out, lse (no block's probabilities) and the
    sinks, the group and the spec."""
    if sinks is not None:
        state.add_sinks(sinks)
    out, lse = state.result()
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.group, ctx.spec = group, spec
    return out


def backward_inputs(ctx, dout: torch.Tensor):
    """`(q, k, v, dout, lse, delta, dq, sinks, group, spec)` for a backward: `delta =
    rowsum(dout * out)` `[b, n, sq]` and `dq` (zeros `[b, n, sq, d]`) float32; `sinks` the
    saved `[n]` or None. Reads `ctx.saved_tensors` once (selective recompute's checkpoint
    allows one unpack)."""
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # D = rowsum(dO * O)
    return (q, k, v, dout, lse, delta, torch.zeros(q.shape, device=q.device), sinks,
            ctx.group, ctx.spec)


def sink_gradient(sinks: torch.Tensor | None, lse: torch.Tensor,
                  delta: torch.Tensor) -> torch.Tensor | None:
    """The gradient of `sinks` `[n]` (None without sinks) from `lse`, `delta` `[b, n, sq]`:
    `dz = -sum_{b, rows} exp(z - lse) D` (module docstring), this rank's queries only; the
    data-parallel reduction over dp x cp sums the ranks' parts."""
    if sinks is None:
        return None
    p_sink = torch.exp(sinks.detach().float().view(1, -1, 1) - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
