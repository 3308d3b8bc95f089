"""One table per Hugging Face architecture: which HF tensors make each of our parameters.

A `Rule` names one of our dense parameters (global names, as `GPTModel.named_parameters()` at
tp = 1 gives them), the HF tensors it is made of, and the two exact inverse functions
between them. Import and export read the same table, so they cannot drift apart; every
function only slices, concatenates, reshapes and transposes, so a round trip is bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


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


def transposed(native: str, hf: str) -> Rule:
    """GPT-2's Conv1D stores `[in, out]`; our linears store `[out, in]`."""
    return Rule(native, (hf,), lambda ts: ts[0].t().contiguous(), lambda t: [t.t().contiguous()])


def concat(native: str, hf: tuple[str, ...]) -> Rule:
    """Equal blocks stacked on dim 0 (SwiGLU's fused `[gate; up]`)."""
    return Rule(native, hf, lambda ts: torch.cat(ts, 0),
                lambda t: [c.contiguous() for c in t.chunk(len(hf), 0)])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """`[q; k; v]` (rows: all query heads, then all K heads, then all V heads) -> our fused
    layout: per KV group g, `[q heads of g, k_g, v_g]` (layers/attention.py). Works for a
    weight `[rows, h]` and a bias `[rows]`."""
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
                lambda ts: fuse_qkv(*ts[0].split([q_rows, kv_rows, kv_rows]), groups),
                lambda t: [torch.cat(split_qkv(t, groups, q_rows, kv_rows))])
