"""The low-bit weight formats: how each stores a `[out, in]` weight, and its exact de-quantization.

Every format splits each output row into blocks (groups) of `block` consecutive input
elements, each with its own scale (and offset). Blocks run along the input dimension only, so
a row-parallel split (input dim) keeps whole blocks when `in / tp` is a multiple of `block`,
and a column-parallel split (output rows) always does.

GGUF block formats (ggml's ggml-common.h / ggml-quants.c, the layouts llama.cpp files hold)
are stored verbatim: one `uint8 [out, in / block * block_bytes]` tensor `blocks`, each row the
file's row. Little-endian, as GGUF is:

| format | block | bytes | one block                                                       | weight                 |
|--------|-------|-------|-----------------------------------------------------------------|------------------------|
| q8_0   | 32    | 34    | d f16, q int8[32]                                               | d q                    |
| q4_0   | 32    | 18    | d f16, 16 bytes: low nibbles elements 0-15, high 16-31          | d (q - 8)              |
| q4_1   | 32    | 20    | d f16, m f16, nibbles as q4_0                                   | d q + m                |
| q4_k   | 256   | 144   | d f16, dmin f16, 12 bytes of 6-bit scales/mins for 8 sub-blocks | d sc_j q - dmin m_j    |
|        |       |       | of 32, 128 bytes of nibbles (64 elements per 32 bytes: low, high) |                      |
| q6_k   | 256   | 210   | ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] per 16, d f16 | d sc_j (q - 32)  |

shardzoo's own formats (round-to-nearest on load, `--quantization`; GPTQ/AWQ checkpoints land
in `int4`):

- `int8`: `qweight int8 [out, in]`, `scales float32 [out, 1]`; symmetric per output channel,
  weight = scale q (LLM.int8()'s vector-wise quantization without outliers; Dettmers et al.
  2022, sec. 3.1). `block` is the whole row (`in`); a split of the input dim keeps every
  row's scale (the partial sums of one row share it).
- `int4`: `qweight uint8 [out, in / 2]` (element 2i in the low nibble of byte i, 2i+1 in the
  high one), `scales float32 [out, in / g]`, `zeros float32 [out, in / g]` (the zero point in
  quantized units), weight = scale (q - zero); group size g of 32, 64 or 128 along the input
  dim (GPTQ, Frantar et al. 2022; AWQ, Lin et al. 2023 use the same asymmetric form).
  Symmetric quantization is zero = 8.

`dequantize(fmt, tensors, shape)` is the exact reference (float32); tests compare every kernel
and ggml's own Python de-quantizer (gguf.quants) to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class Format:
    """A low-bit weight format: `block` input elements per block (None: the whole row), and
    for GGUF formats `block_bytes` per block and the ggml type name."""
    name: str
    block: int | None
    block_bytes: int | None = None
    ggml_type: str | None = None
    bits: float = 0.0  # bits per weight, scales included (for docs and the planner)


GGUF_FORMATS = {
    "q8_0": Format("q8_0", 32, 34, "Q8_0", 8.5),
    "q4_0": Format("q4_0", 32, 18, "Q4_0", 4.5),
    "q4_1": Format("q4_1", 32, 20, "Q4_1", 5.0),
    "q4_k": Format("q4_k", QK_K, 144, "Q4_K", 4.5),
    "q6_k": Format("q6_k", QK_K, 210, "Q6_K", 6.5625),
}
OWN_FORMATS = {"int8": Format("int8", None, bits=8.0), "int4": Format("int4", 128, bits=4.5)}
FORMATS = {**OWN_FORMATS, **GGUF_FORMATS}
INT4_GROUP_SIZES = (32, 64, 128)
BY_GGML_TYPE = {f.ggml_type: f for f in GGUF_FORMATS.values()}


def storage_bytes(fmt: str, out: int, inp: int, group_size: int = 128) -> int:
    """Bytes `quantize` (or a GGUF file) stores a `[out, in]` weight of format `fmt` in
    (the module docstring's layouts): int8 `out in + 4 out` (int8 values, float32 row
    scales); int4 `out in / 2 + 8 out in / g` (nibbles, float32 scale and zero point per
    group of `group_size`); a GGUF format `out (in / block) block_bytes`. The planner
    counts a low-bit base with it. Raises KeyError for an unknown format."""
    if fmt == "int8":
        return out * inp + 4 * out
    if fmt == "int4":
        return out * inp // 2 + 8 * out * (inp // group_size)
    f = GGUF_FORMATS[fmt]
    return out * (inp // f.block) * f.block_bytes


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """`uint8 [..., 2]` little-endian half floats -> float32 `[...]`."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`uint8 [..., n]` -> `[..., 2n]`: the n low nibbles, then the n high ones (ggml's order
    within a block of q4_0 / q4_1 and within each 64-element chunk of q4_k)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _q8_0(b):
    return _f16(b[..., 0:2]).unsqueeze(-1) * b[..., 2:34].contiguous().view(torch.int8).float()


def _q4_0(b):
    return _f16(b[..., 0:2]).unsqueeze(-1) * (_nibbles(b[..., 2:18]).float() - 8)


def _q4_1(b):
    return _f16(b[..., 0:2]).unsqueeze(-1) * _nibbles(b[..., 4:20]).float() \
        + _f16(b[..., 2:4]).unsqueeze(-1)


def q4_k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k's 12 bytes of packed 6-bit values `uint8 [..., 12]` -> (scales, mins), each
    `[..., 8]` integers 0..63, one per 32-element sub-block (ggml's get_scale_min_k4)."""
    sc = sc.to(torch.int32)
    lo_s, lo_m = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi_s = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    hi_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return torch.cat([lo_s, hi_s], -1), torch.cat([lo_m, hi_m], -1)


def _q4_k(b):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    scales, mins = q4_k_scales(b[..., 4:16])
    q = _nibbles(b[..., 16:144].unflatten(-1, (4, 32))).flatten(-2)  # [..., 256], sub-blocks of 32
    q = q.unflatten(-1, (8, 32)).float()
    w = (d[..., None] * scales)[..., None] * q - (dmin[..., None] * mins)[..., None]
    return w.flatten(-2)


def _q6_k(b):
    ql, qh = b[..., 0:128].to(torch.int32), b[..., 128:192].to(torch.int32)
    scales = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[..., 208:210])
    halves = []
    for h in range(2):  # each half: 128 elements from ql[64 h: 64 h + 64], qh[32 h: 32 h + 32]
        l, hb = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        q1 = (l[..., :32] & 0xF) | ((hb & 3) << 4)
        q2 = (l[..., 32:] & 0xF) | (((hb >> 2) & 3) << 4)
        q3 = (l[..., :32] >> 4) | (((hb >> 4) & 3) << 4)
        q4 = (l[..., 32:] >> 4) | (((hb >> 6) & 3) << 4)
        halves.append(torch.cat([q1, q2, q3, q4], -1))
    q = torch.cat(halves, -1).float() - 32  # [..., 256], 16 sub-blocks of 16
    w = (d[..., None] * scales)[..., None] * q.unflatten(-1, (16, 16))
    return w.flatten(-2)


_GGUF_DEQUANT = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q4_k": _q4_k, "q6_k": _q6_k}


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """`uint8 [out, in / 2]` -> `uint8 [out, in]` values 0..15 (element 2i: the low nibble)."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """`[out, in]` integers 0..15 -> `uint8 [out, in / 2]` (the inverse of `unpack_int4`)."""
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def dequantize(fmt: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]
               ) -> torch.Tensor:
    """The exact float32 weight `[out, in]` that `tensors` (the format's storage, module
    docstring) hold. Raises KeyError for an unknown format."""
    out, inp = shape
    if fmt == "int8":
        return tensors["qweight"].float() * tensors["scales"]
    if fmt == "int4":
        q = unpack_int4(tensors["qweight"]).float()
        g = inp // tensors["scales"].shape[1]
        scales = tensors["scales"].repeat_interleave(g, dim=1)
        zeros = tensors["zeros"].repeat_interleave(g, dim=1)
        return (q - zeros) * scales
    f = GGUF_FORMATS[fmt]
    blocks = tensors["blocks"].view(out, inp // f.block, f.block_bytes)
    return _GGUF_DEQUANT[fmt](blocks).reshape(out, inp)


def quantize(weight: torch.Tensor, fmt: str, group_size: int = 128, symmetric: bool = True
             ) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of a float `[out, in]` weight into `fmt`'s storage.

    - int8: scale = max|w| / 127 per row, q = round(w / scale).
    - int4 symmetric: scale = max|w| / 7 per group, zero = 8, q = clamp(round(w / s) + 8,
      0, 15); asymmetric: scale = (max - min) / 15, zero = round(-min / scale) (both in
      [0, 15]), q = clamp(round(w / s) + zero, 0, 15).
    - q8_0 / q4_0 / q4_1: ggml's reference rounding (ggml-quants.c quantize_row_*_ref),
      bit-identical to gguf.quants.quantize.
    A zero row or group gets scale 0 (it de-quantizes to zeros). Raises ValueError for a
    format it cannot make (q4_k, q6_k: import them from a GGUF file) or a shape the format's
    blocks do not divide."""
    w = weight.detach().float()
    out, inp = w.shape
    if fmt == "int8":
        scale = w.abs().amax(1, keepdim=True) / 127
        q = torch.where(scale > 0, w / scale.clamp_min(1e-30), 0).round().clamp(-127, 127)
        return {"qweight": q.to(torch.int8), "scales": scale}
    if fmt == "int4":
        if group_size not in INT4_GROUP_SIZES or inp % group_size:
            raise ValueError(f"int4 group size {group_size} must be one of {INT4_GROUP_SIZES} "
                             f"and divide the input size {inp}")
        g = w.view(out, inp // group_size, group_size)
        if symmetric:
            scale = g.abs().amax(-1) / 7
            zero = torch.full_like(scale, 8.0)
        else:
            lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
            scale = (hi - lo) / 15
            zero = torch.where(scale > 0, (-lo / scale.clamp_min(1e-30)).round(), 0).clamp(0, 15)
        safe = scale.clamp_min(1e-30)[..., None]
        q = torch.where(scale[..., None] > 0, (g / safe).round() + zero[..., None],
                        zero[..., None]).clamp(0, 15)
        return {"qweight": pack_int4(q.view(out, inp)), "scales": scale, "zeros": zero}
    if fmt not in ("q8_0", "q4_0", "q4_1"):
        raise ValueError(f"cannot quantize to {fmt!r}: shardzoo quantizes to int8, int4, q8_0, "
                         f"q4_0 and q4_1 (k-quants are read from GGUF files as they are)")
    if inp % 32:
        raise ValueError(f"{fmt} needs an input size divisible by 32, not {inp}")
    b = w.view(out, inp // 32, 32)
    if fmt == "q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127
        q = torch.where(d > 0, b / d.clamp_min(1e-30), 0).round()
        return {"blocks": _blocks([d], q.to(torch.int8))}
    if fmt == "q4_0":  # the signed value of largest magnitude maps to -8
        idx = b.abs().argmax(-1, keepdim=True)
        d = b.gather(-1, idx) / -8
        inv = torch.where(d != 0, 1 / d.where(d != 0, 1), 0)
        q = (b * inv + 8.5).floor().clamp(0, 15)  # ggml: MIN(15, (int8_t)(x * id + 8.5))
        return {"blocks": _blocks([d], pack_nibbles(q))}
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d != 0, 1 / d.where(d != 0, 1), 0)
    q = ((b - lo) * inv + 0.5).floor().clamp(0, 15)
    return {"blocks": _blocks([d, lo], pack_nibbles(q))}


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """`[..., 32]` values 0..15 -> `uint8 [..., 16]`: element j in the low nibble of byte j,
    element j + 16 in its high nibble (ggml's q4_0 / q4_1 order)."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _blocks(halves: list[torch.Tensor], payload: torch.Tensor) -> torch.Tensor:
    """Block rows `uint8 [out, nb * bytes]` from per-block f16 fields `[out, nb, 1]` and the
    per-block payload `[out, nb, k]` (int8 or uint8)."""
    fields = [h.to(torch.float16).contiguous().view(torch.uint8) for h in halves]
    blocks = torch.cat(fields + [payload.contiguous().view(torch.uint8)], dim=-1)
    return blocks.flatten(1)
