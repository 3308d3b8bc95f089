"""The C++ decode attention of compiled CPU inference (attention_kernels.cpp): one query per
row, float32 or bf16 keys and values read in place through their strides, float32
softmax. Built at first use by layers/cpu_extension.py; where it cannot be built (no g++ or
ninja) `extension()` is None after one warning and `layers.attention._decode_attention`
keeps inductor's loops.

Under `torch.compile` it is one opaque op, `shardzoo::decode_attention` (registered through
`torch.library.Library` for a low per-call cost, as layers/gemm.py's GEMM), with a fake for
tracing.
"""
from __future__ import annotations

import os

import torch

from . import cpu_extension

SOURCES = ("attention_kernels.cpp", "cpu_simd.h")
_LAZY = cpu_extension.lazy_source(
    "shardzoo_attention", os.path.dirname(__file__), SOURCES, "decode attention kernel",
    "compiled decode attention runs inductor's loops instead (slower)")
DTYPES = (torch.float32, torch.bfloat16)


def extension():
    """The compiled module (`decode_attention`), or None when it cannot be built here."""
    return _LAZY.get()


def prepare() -> bool:
    """Build or load the kernel now (the engine calls it before compiling: `supports` only
    reads whether it is there, so tracing never waits on a build). Returns whether it is."""
    return extension() is not None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> bool:
    """Whether `decode_attention` takes these inputs: CPU, q / k / v all float32 or all
    bf16 with contiguous last dims for k and v, `mask` None or additive float (not bool),
    and the kernel loaded (`prepare`)."""
    return _LAZY.module is not None and q.device.type == "cpu" and q.dtype in DTYPES and \
        k.dtype == q.dtype and v.dtype == q.dtype and k.stride(-1) == 1 and \
        v.stride(-1) == 1 and (mask is None or mask.dtype != torch.bool)


def _impl(q, k, v, mask, scale):
    return extension().decode_attention(q, k, v, mask, scale)


def _fake(q, k, v, mask, scale):
    return q.new_empty((q.shape[0], q.shape[1], 1, v.shape[-1]))


_LIB = torch.library.Library("shardzoo", "FRAGMENT")
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor")
_LIB.impl("decode_attention", _impl, "CompositeExplicitAutograd")
torch.library.register_fake("shardzoo::decode_attention", _fake, lib=_LIB)
_OP = torch.ops.shardzoo.decode_attention.default


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`softmax(q k^T * scale + mask) v` for one query per row: `q [b, n, 1, d]`, `k [b, g,
    sk, d]`, `v [b, g, sk, dv]` (g divides n: grouped-query heads; any strides but the last
    dim's), `mask` additive (0 or -inf) broadcastable to `[b, 1, 1, sk]`, or None ->
    `[b, n, 1, dv]` in q's dtype. Keys masked with -inf are skipped (a stale or non-finite
    cache entry there never reaches the result); a row with every key masked gets zeros.
    Call `supports` first. Raises `RuntimeError` (the kernel's check) on other shapes."""
    if mask is not None:
        mask = mask.float()
    return _OP(q, k, v, mask, float(scale))
