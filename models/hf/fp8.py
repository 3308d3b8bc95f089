"""Hugging Face checkpoints with FP8 weights (`quantization_config` in config.json), read as
de-quantized float32 weights.

Each quantized linear `P` stores `P.weight` as float8_e4m3fn (safetensors `F8_E4M3`) `[out,
in]` plus one scale tensor; the linears a checkpoint leaves unquantized (lm_head, routers,
`modules_to_not_convert` / `ignore`) and every other tensor are plain floats:

- quant_method fp8 with weight_block_size [b0, b1] (DeepSeek-V3/R1, Qwen3-FP8):
  `P.weight_scale_inv` `[ceil(out / b0), ceil(in / b1)]`, F32, BF16 or F8_E8M0 (scale_fmt
  ue8m0);
- fp8 with weight_block_size null or absent: one value (`[]`, `[1]`), `P.weight_scale_inv`
  (transformers) or `P.weight_scale` (AutoFP8, vLLM);
- fbgemm_fp8 (per output channel): `P.weight_scale` `[out, 1]`;
- compressed-tensors, format float-quantized, weights num_bits 8 type float: `P.weight_scale`,
  strategy tensor `[1]`, channel `[out, 1]`, block `[ceil(out / b0), ceil(in / b1)]`.

Weight[o, i] = fp8[o, i] * scale[o // b0, i // b1] (per tensor: b0 = out, b1 = in; per channel:
b0 = 1, b1 = in), computed in float32 as transformers' `Fp8Dequantize` / vLLM's de-quantizers
do (the scale multiplies; DeepSeek's `weight_scale_inv` is the inverse of the quantizer's
scale, i.e. already the de-quantizing factor). Activation scales (`input_scale`,
`activation_scale`: activation_scheme "static") are shape-checked and dropped: the imported
model runs its activations in bf16/fp32, which is what transformers' de-quantized model does.

`fp8_scheme(q)` validates a quantization_config (one line naming the field and what is read
for anything else); `open_fp8(src, scheme)` wraps an `HFSource` so that `get("P.weight")` is the
float32 weight. Every scale's dtype and shape is checked against its weight's header (nothing
read) before any data is read; the weight's own shape goes through `shape` to
`models.hf.check_weights` like every tensor's; a scale is read (a few values per 128x128 block)
and refused when not finite or negative before the weight is read, and a de-quantized weight
holding NaN/inf (float8_e4m3fn's NaN code) is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .rules import HFConversionError

METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
SUPPORTED = ("fp8 (weight_block_size [b0, b1] with weight_scale_inv, or per-tensor "
             "weight_scale_inv / weight_scale; activation_scheme dynamic or static), fbgemm_fp8 "
             "(per-channel weight_scale) and compressed-tensors float-quantized (8-bit float "
             "weights, strategy tensor, channel or block)")
WEIGHT_DTYPES = ("F8_E4M3",)
_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
ACTIVATION_SCALES = ("input_scale", "activation_scale")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


@dataclass(frozen=True)
class FP8Scheme:
    """What an FP8 `quantization_config` says about the scale tensors (module docstring)."""

    method: str  # one of METHODS
    granularity: str  # "block" | "tensor" | "channel"
    block: tuple[int, int] | None  # (b0, b1) for "block"
    activation: str  # "dynamic" | "static" | "none" (weight-only)

    def describe(self) -> str:
        g = f"{self.block[0]}x{self.block[1]} blocks" if self.block else \
            f"per {self.granularity}"
        return f"{self.method} float8_e4m3fn weights, {g}, {self.activation} activations"

    def scale_shape(self, out: int, inp: int) -> tuple[int, ...] | None:
        """The scale shape a `[out, inp]` weight needs; None for per-tensor (one value)."""
        if self.granularity == "block":
            b0, b1 = self.block
            return -(-out // b0), -(-inp // b1)
        return (out, 1) if self.granularity == "channel" else None


def _block(value) -> tuple[int, int]:
    if (type(value) not in (list, tuple) or len(value) != 2
            or not all(type(b) is int and 0 < b < 2**31 for b in value)):
        raise ValueError(f"weight_block_size {value!r} (two positive integers)")
    return tuple(value)


def _compressed_tensors(q: dict) -> FP8Scheme:
    """The scheme of a compressed-tensors config (llm-compressor's float-quantized FP8)."""
    m = "compressed-tensors"
    if q.get("format") != "float-quantized":
        raise ValueError(f"format {q.get('format')!r} (only float-quantized, FP8 weights, "
                         f"is read)")
    groups = q.get("config_groups")
    if type(groups) is not dict or not groups:
        raise ValueError("no config_groups object")
    schemes = set()
    for name, g in groups.items():
        w = g.get("weights") if type(g) is dict else None
        if type(w) is not dict:
            raise ValueError(f"config_groups {name!r} has no weights object")
        if (w.get("num_bits"), w.get("type")) != (8, "float"):
            raise ValueError(f"config_groups {name!r} weights num_bits {w.get('num_bits')!r} "
                             f"type {w.get('type')!r} (8-bit float weights are read)")
        if w.get("symmetric", True) is not True or w.get("dynamic", False) is not False:
            raise ValueError(f"config_groups {name!r} weights symmetric "
                             f"{w.get('symmetric')!r} dynamic {w.get('dynamic')!r} "
                             f"(symmetric, stored scales are read)")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"config_groups {name!r} weights strategy {strategy!r} (tensor, "
                             f"channel or block)")
        block = _block(w.get("block_structure")) if strategy == "block" else None
        act = g.get("input_activations")
        if act is not None and (type(act) is not dict or
                                (act.get("num_bits"), act.get("type")) != (8, "float")):
            raise ValueError(f"config_groups {name!r} input_activations {act!r} (8-bit float "
                             f"or none)")
        kind = "none" if act is None else "dynamic" if act.get("dynamic") else "static"
        schemes.add(FP8Scheme(m, strategy, block, kind))
    if len(schemes) != 1:
        raise ValueError(f"{len(schemes)} different weight schemes in config_groups (one is "
                         f"read)")
    return schemes.pop()


def fp8_scheme(q: dict) -> FP8Scheme:
    """The `FP8Scheme` of quantization_config `q` (quant_method in METHODS). Raises
    ValueError naming the field and what is read (quantized.quant_scheme turns it into the
    one-line `HFConversionError` naming every supported method): another fmt than
    e4m3, an activation_scheme other than dynamic / static, a malformed weight_block_size,
    a compressed-tensors format or weights scheme other than 8-bit float."""
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fbgemm_fp8":
        return FP8Scheme(method, "channel", None, "dynamic")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fmt {fmt!r} (float8_e4m3fn weights are read)")
    act = q.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ValueError(f"activation_scheme {act!r} (dynamic or static)")
    if q.get("scale_fmt", "float") not in ("float", "ue8m0", None):
        raise ValueError(f"scale_fmt {q.get('scale_fmt')!r} (float or ue8m0)")
    block = q.get("weight_block_size")
    if block is None:
        return FP8Scheme(method, "tensor", None, act)
    return FP8Scheme(method, "block", _block(block), act)


@dataclass(frozen=True)
class FP8Layer:
    """One FP8 linear of a folder: its weight name, scale name, `[out, inp]` shape and the
    `(rows, cols)` of the weight block each scale value covers (the last blocks partial)."""

    weight: str
    scale: str
    out: int
    inp: int
    block: tuple[int, int]


def check_layer(src, scheme: FP8Scheme, weight: str, names: set[str]) -> FP8Layer:
    """The `FP8Layer` of FP8 tensor `weight` from the file headers of `src` (nothing read):
    exactly one scale tensor, of a float dtype, shaped as `scheme` needs for the weight.
    Raises `HFConversionError` naming the tensor, what it is and what it must be."""
    def fail(what: str) -> HFConversionError:
        return HFConversionError(f"{src.path}: {what} ({scheme.describe()}; nothing was "
                                 f"allocated); the file is corrupt or does not match its "
                                 f"quantization_config, use the model's own files")

    have = [f"{weight}{s[len('weight'):]}" for s in SCALE_SUFFIXES
            if f"{weight}{s[len('weight'):]}" in names]
    if len(have) != 1:
        raise fail(f"the FP8 weight {weight!r} has {len(have)} scale tensors "
                   f"({' and '.join(have) or 'no .weight_scale_inv or .weight_scale'}); it "
                   f"needs one")
    scale = have[0]
    shape = tuple(src.shape(weight))
    if len(shape) != 2 or 0 in shape:
        raise fail(f"the FP8 weight {weight!r} has shape {list(shape)}, not [out, in]")
    if src.dtype(scale) not in _SCALE_DTYPES:
        raise fail(f"{scale!r} has dtype {src.dtype(scale)}, not one of {list(_SCALE_DTYPES)}")
    out, inp = shape
    want = scheme.scale_shape(out, inp)
    got = tuple(src.shape(scale))
    ok = (got in ((), (1,), (1, 1))) if want is None else got == want
    if not ok:
        need = "one value ([] or [1])" if want is None else list(want)
        raise fail(f"{scale!r} has shape {list(got)}, but the weight {list(shape)} "
                   f"({scheme.describe()}) needs {need}")
    block = scheme.block or ((1, inp) if scheme.granularity == "channel" else (out, inp))
    return FP8Layer(weight, scale, out, inp, block)


def dequantize_layer(src, layer: FP8Layer) -> torch.Tensor:
    """The float32 weight `[out, in]` of `layer`: fp8 * scale of its block, in float32.
    Raises `HFConversionError` for a non-finite or negative scale (before the weight is
    read) or a weight with NaN/inf values."""
    scale = src.raw(layer.scale).float()
    bad = scale[~torch.isfinite(scale) | (scale < 0)]
    if bad.numel():
        raise HFConversionError(
            f"{src.path}: {layer.scale!r} holds the scale {float(bad[0])} (a scale is finite "
            f"and not negative; the weight was not read); the file is corrupt, use the "
            f"model's own files")
    w = src.raw(layer.weight).float()
    b0, b1 = layer.block
    if scale.numel() == 1:
        w.mul_(scale.reshape(()))
    else:  # rows of scales expanded to rows of the weight, broadcast over each block's columns
        rows = scale.repeat_interleave(b0, 0)[:layer.out]
        full, rem = divmod(layer.inp, b1)
        w[:, :full * b1].view(layer.out, full, b1).mul_(rows[:, :full, None])
        if rem:
            w[:, full * b1:].mul_(rows[:, full:])
    if not torch.isfinite(w).all():
        raise HFConversionError(
            f"{src.path}: {layer.weight!r} holds NaN or infinite FP8 values; the file is "
            f"corrupt, use the model's own files")
    return w


def open_fp8(src, scheme: FP8Scheme):
    """`src` (an HF folder's `HFSource`) whose `get` de-quantizes each FP8 weight to float32
    (module docstring), the scale and activation-scale tensors no longer listed. Raises
    `HFConversionError` for a folder without FP8 weights, a scale without an FP8 weight, or an
    activation scale of more than one value."""
    from .files import HFSource

    names = src.names
    name_set = set(names)
    fp8 = [n for n in names if src.dtype(n) in WEIGHT_DTYPES]
    odd = [n for n in fp8 if not n.endswith(".weight")]
    if odd:
        raise HFConversionError(f"{src.path}: {odd[0]!r} is a float8_e4m3fn tensor but not a "
                                f"linear's .weight ({scheme.describe()}: fused expert tensors "
                                f"are not read); convert the unquantized model")
    if not fp8:
        raise HFConversionError(f"{src.path}: config.json has a {scheme.method} "
                                f"quantization_config but the weight files hold no "
                                f"float8_e4m3fn (F8_E4M3) weight (nothing was allocated); use "
                                f"the model's own files")
    fp8_set = set(fp8)
    layers = {n: check_layer(src, scheme, n, name_set) for n in fp8}
    scales = {layer.scale for layer in layers.values()}
    listed = []
    for n in names:
        prefix, _, leaf = n.rpartition(".")
        if n in scales:
            continue
        if leaf in SCALE_SUFFIXES or leaf in ACTIVATION_SCALES:
            if f"{prefix}.weight" not in fp8_set:
                raise HFConversionError(
                    f"{src.path}: {n!r} is an FP8 scale, but {prefix + '.weight'!r} is not a "
                    f"float8_e4m3fn weight ({scheme.describe()}); the file is corrupt, use "
                    f"the model's own files")
            if tuple(src.shape(n)) not in ((), (1,), (1, 1)):  # static activation scale
                raise HFConversionError(
                    f"{src.path}: {n!r} has shape {list(src.shape(n))}, but an activation "
                    f"scale is one value; the file is corrupt, use the model's own files")
            continue
        listed.append(n)

    def get(name: str):
        return dequantize_layer(src, layers[name]) if name in layers else src.get(name)

    return HFSource(src.path, src.config, src.kind, listed, get, _shape=src._shape,
                    _dtype=src._dtype, _raw=src._raw, quantization="none")
