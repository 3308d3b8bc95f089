"""One table per Hugging Face architecture: which HF tensors make each of our parameters.

A `Rule` names one of our dense parameters (global names, as `GPTModel.named_parameters()` at
tp = 1 gives them), the HF tensors it is made of, and the two exact inverse functions
between them. Import and export read the same table, so they cannot drift apart; every
function only slices, concatenates, reshapes and transposes, so a round trip is bitwise.

Import also takes low-bit linear weights (layers/quant `QuantizedWeight`, `[out, in]` as HF's
nn.Linear weight) where a loader keeps a file's quantization: stacking is `cat_rows` and the
fused QKV's row order `index_select_rows`, both exact on the packed blocks (`same`, `concat`,
`qkv`, `fused_qkv`); a transposed weight has no low-bit form (`transposed` refuses it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from layers.quant import QuantizedWeight


class HFConversionError(ValueError):
    """A Hugging Face model or file that cannot be converted; the message names the field or
    tensor and what to do."""


@dataclass(frozen=True)
class Rule:
    """`native = to_native([hf tensors])` and `[hf tensors] = to_hf(native)`."""

    native: str
    hf: tuple[str, ...]
    to_native: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def same(native: str, hf: str) -> Rule:
    return Rule(native, (hf,), lambda ts: ts[0], lambda t: [t])


def _transpose(t: torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(t, QuantizedWeight):
        raise HFConversionError(f"{name} is stored transposed ([in, out], GPT-2's Conv1D) and "
                                f"has no low-bit form; load it with --quantization none")
    return t.t().contiguous()


def transposed(native: str, hf: str) -> Rule:
    """GPT-2's Conv1D stores `[in, out]`; our linears store `[out, in]`."""
    return Rule(native, (hf,), lambda ts: _transpose(ts[0], hf),
                lambda t: [t.t().contiguous()])


def cat_rows(ts: list) -> torch.Tensor | QuantizedWeight:
    """`torch.cat(ts, 0)`, or `QuantizedWeight.cat_rows` of low-bit weights (a float among
    them: HFConversionError, as the fused weight needs one format)."""
    if not any(isinstance(t, QuantizedWeight) for t in ts):
        return torch.cat(ts, 0)
    if not all(isinstance(t, QuantizedWeight) for t in ts):
        raise HFConversionError("the parts of a fused weight are stored partly quantized, "
                                "partly float; load it with --quantization none")
    try:
        return QuantizedWeight.cat_rows(ts)
    except ValueError as e:
        raise HFConversionError(f"{e}; load it with --quantization none") from None


def concat(native: str, hf: tuple[str, ...]) -> Rule:
    """Equal blocks stacked on dim 0 (SwiGLU's fused `[gate; up]`)."""
    return Rule(native, hf, cat_rows,
                lambda t: [c.contiguous() for c in t.chunk(len(hf), 0)])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """`[q; k; v]` (rows: all query heads, then all K heads, then all V heads) -> our fused
    layout: per KV group g, `[q heads of g, k_g, v_g]` (layers/attention.py). Works for a
    weight `[rows, h]` (float or `QuantizedWeight`: its rows gathered in that order) and a
    bias `[rows]`."""
    if isinstance(q, QuantizedWeight) or isinstance(k, QuantizedWeight):
        rows = [q.shape[0], k.shape[0], v.shape[0]]
        index = torch.arange(sum(rows)).split(rows)
        return cat_rows([q, k, v]).index_select_rows(fuse_qkv(*index, groups))
    tail = q.shape[1:]
    q, k, v = (t.reshape(groups, -1, *tail) for t in (q, k, v))
    return torch.cat([q, k, v], 1).reshape(-1, *tail).contiguous()


def split_qkv(fused: torch.Tensor, groups: int, q_rows: int, kv_rows: int):
    """Inverse of `fuse_qkv`: `(q [q_rows, ...], k [kv_rows, ...], v [kv_rows, ...])`."""
    tail = fused.shape[1:]
    per = fused.reshape(groups, -1, *tail)
    q, k, v = per.split([q_rows // groups, kv_rows // groups, kv_rows // groups], 1)
    return tuple(t.reshape(-1, *tail).contiguous() for t in (q, k, v))


def qkv(native: str, hf: tuple[str, str, str], groups: int, q_rows: int, kv_rows: int) -> Rule:
    """Separate q/k/v projections (Llama family) <-> our fused QKV."""
    return Rule(native, hf, lambda ts: fuse_qkv(*ts, groups),
                lambda t: list(split_qkv(t, groups, q_rows, kv_rows)))


def fused_qkv(native: str, hf: str, groups: int, q_rows: int, kv_rows: int) -> Rule:
    """One HF `[q; k; v]` projection (Phi-3's `qkv_proj`: all query heads, then all K heads,
    then all V heads) <-> our fused QKV (per KV group)."""
    return Rule(native, (hf,),
                lambda ts: fuse_qkv(*_split_rows(ts[0], [q_rows, kv_rows, kv_rows]), groups),
                lambda t: [torch.cat(split_qkv(t, groups, q_rows, kv_rows))])


def _split_rows(t, sizes: list[int]) -> list:
    """`t.split(sizes)` on dim 0, for a float tensor or a `QuantizedWeight`."""
    if not isinstance(t, QuantizedWeight):
        return list(t.split(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [t.narrow(0, a, n) for a, n in zip(starts, sizes)]
