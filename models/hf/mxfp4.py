"""MXFP4 expert weights of gpt-oss checkpoints (`quantization_config` quant_method "mxfp4";
OCP Microscaling Formats spec v1.0, sec. 5.3 (MXFP4: FP4 E2M1 elements, one E8M0 scale per
block of 32), as OpenAI's gpt-oss checkpoints and transformers' `integrations/mxfp4.py`
store them), read as the float tensors of an unquantized checkpoint.

A quantized HF tensor `X [E, rows, cols]` is stored as `X_blocks [E, rows, cols/32, 16]`
uint8 (two E2M1 codes a byte, the low nibble first) and `X_scales [E, rows, cols/32]` uint8
(the block's power of two, biased by 127); element j of a block is
`FP4[code_j] * 2^(scale - 127)`. The de-quantized `[E, rows, cols]` is then transposed to the
unquantized checkpoint's `[E, cols, rows]` (transformers' `convert_moe_packed_tensors`), so
the family's rules (models/hf/gpt_oss.py) read both forms alike. Shapes and dtypes are
checked from the headers before any data is read or anything allocated. Export writes the
float form (no quantization_config).
"""
from __future__ import annotations

import torch

from .rules import HFConversionError

# E2M1 codes 0..15: sign bit 3, then exponent 2 bits, mantissa 1 bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # elements per scale
_FIX = "use the model's own files"


def open_mxfp4(src):
    """`src` (an HF folder's `HFSource` whose config.json says mxfp4) with every
    `X_blocks` / `X_scales` pair listed as float tensor `X` (`dequantize` on `get`; `shape`
    from the headers). Raises `HFConversionError` for a pair with a part missing or of the
    wrong dtype or shape, or for a float `X` beside it."""
    from .files import HFSource

    names = set(src.names)
    packed = sorted(n[:-len("_blocks")] for n in names if n.endswith("_blocks"))
    if not packed:
        raise HFConversionError(f"{src.path}: config.json has an mxfp4 quantization_config "
                                f"but the weight files hold no *_blocks tensor; {_FIX}")
    for x in packed:
        if x + "_scales" not in names:
            raise HFConversionError(f"{src.path}: {x}_blocks has no {x}_scales beside it; "
                                    f"{_FIX}")
        if x in names:
            raise HFConversionError(f"{src.path}: {x!r} is stored both as a float tensor and "
                                    f"as mxfp4 blocks; {_FIX}")
    parts = {f"{x}_{p}" for x in packed for p in ("blocks", "scales")}
    listed = [n for n in src.names if n not in parts] + packed
    checked: dict[str, tuple[int, ...]] = {}

    def shape(name: str) -> tuple[int, ...]:
        if name not in packed_set:
            return src.shape(name)
        if name not in checked:
            checked[name] = _checked_shape(src, name)
        return checked[name]

    def get(name: str):
        if name not in packed_set:
            return src.get(name)
        shape(name)  # headers checked before the data is read
        return dequantize(src.raw(name + "_blocks"), src.raw(name + "_scales"))

    packed_set = set(packed)
    return HFSource(src.path, src.config, src.kind, listed, get, _shape=shape,
                    _dtype=src._dtype, _raw=src._raw)


def _checked_shape(src, name: str) -> tuple[int, ...]:
    """The de-quantized, transposed shape `[E, cols, rows]` of pair `name`, from the headers;
    `HFConversionError` when the parts do not fit together."""
    blocks, scales = src.shape(name + "_blocks"), src.shape(name + "_scales")
    for part in ("blocks", "scales"):
        dtype = src.dtype(f"{name}_{part}")
        if dtype is not None and dtype != "U8":
            raise HFConversionError(f"{src.path}: {name}_{part} is {dtype}, not U8 (mxfp4 "
                                    f"stores bytes); {_FIX}")
    if len(blocks) != 4 or blocks[-1] != BLOCK // 2 or tuple(blocks[:-1]) != tuple(scales):
        raise HFConversionError(
            f"{src.path}: {name}_blocks {list(blocks)} and {name}_scales {list(scales)} are not "
            f"[E, rows, cols/32, 16] and [E, rows, cols/32]; {_FIX}")
    e, rows, groups = scales
    return e, groups * BLOCK, rows


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`blocks [E, rows, G, 16]` uint8, `scales [E, rows, G]` uint8 -> float32
    `[E, G * 32, rows]` (module docstring), one expert at a time (peak: the output plus one
    expert's codes)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise HFConversionError(f"mxfp4 blocks and scales must be uint8, got {blocks.dtype} "
                                f"and {scales.dtype}")
    e, rows, groups, half = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(e, groups * BLOCK, rows, dtype=torch.float32)
    for i in range(e):
        codes = torch.stack([blocks[i] & 0x0F, blocks[i] >> 4], dim=-1)  # low nibble first
        values = lut[codes.long()].view(rows, groups, BLOCK)
        values = torch.ldexp(values, scales[i].to(torch.int32).sub(127)[..., None])
        out[i] = values.view(rows, groups * BLOCK).t()
    return out
