"""Hugging Face checkpoints quantized to 4 bits with GPTQ or AWQ (`quantization_config` in
config.json), read into shardzoo's `int4` weights (layers/quant: weight = scale (q - zero),
`[out, in]` like nn.Linear's, groups along the input dim) or de-quantized to float32.

Each quantized linear `P` of such a folder is stored as packed tensors instead of `P.weight`
(bias and the unquantized tensors are plain floats):

| method            | qweight (int32)                 | qzeros (int32)     | scales          | g_idx (int32) |
|-------------------|---------------------------------|--------------------|-----------------|---------------|
| gptq, gptq_v2     | `[in / 8, out]`, packed along in | `[in / G, out / 8]` | `[in / G, out]` | `[in]`, opt.  |
| awq (version gemm)| `[in, out / 8]`, packed along out | `[in / G, out / 8]` | `[in / G, out]` | none          |

Eight 4-bit values per int32, value j at bits 4j..4j+3. GPTQ (AutoGPTQ's / GPTQModel's
packers, vLLM's and transformers' de-quantizers) packs input rows 8r..8r+7 of column o into
qweight[r, o] and output columns 8c..8c+7 of a group into qzeros[g, c], both in natural order;
its original format (checkpoint_format "gptq") stores each zero point minus one (AutoGPTQ's
historic convention: the de-quantizers add 1 back to each 4-bit value), "gptq_v2" stores it as
is. AWQ (AutoAWQ's WQLinear_GEMM) packs output columns 8c..8c+7 into qweight[i, c] and
qzeros[g, c] in the order 0, 2, 4, 6, 1, 3, 5, 7 (value j holds column 8c + AWQ_ORDER[j]),
zero points as is. Input column i belongs to group g_idx[i] (default i // G; G = -1: one
group). Weight[o, i] = scales[g, o] (q[i, o] - zero[g, o]) with g = g_idx[i].

`open_quantized(src, quantization)` wraps an `HFSource` so that it lists `P.weight` in place
of each layer's packed tensors and `get("P.weight")` gives a `QuantizedWeight` (quantization
"keep") or the exact float32 weight ("none"). Every packed tensor's shape and dtype is checked
against the others' (file headers, nothing read) and, through `shape`, against config.json
(`models.hf.check_weights`) before any data is read; a g_idx is read (in int32 values) and
checked to lie in range before it is used. A desc_act (act-order) g_idx that does not assign
consecutive columns to groups cannot be held as int4 groups: "keep" refuses it, "none"
de-quantizes it exactly.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

from layers.quant import QuantizedWeight
from layers.quant.formats import INT4_GROUP_SIZES

from .fp8 import METHODS as FP8_METHODS
from .fp8 import SUPPORTED as FP8_SUPPORTED
from .fp8 import FP8Scheme, fp8_scheme, open_fp8
from .rules import HFConversionError

# how a GPTQ/AWQ folder's quantized linears are read (`open_quantized`, `files.open_hf`)
MODES = ("none", "keep")
SUPPORTED = ("gptq (bits 4; group_size 32, 64, 128, a multiple of 32 or -1; sym true or "
             "false; checkpoint_format gptq or gptq_v2; desc_act true is de-quantized exactly, "
             "kept as int4 when its g_idx keeps columns in group order), awq (version gemm, "
             "bits 4, zero_point true), " + FP8_SUPPORTED)
PACKED = ("qweight", "qzeros", "scales", "g_idx")
_SCALE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value j of an int32 holds column 8c + AWQ_ORDER[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + k is value AWQ_REVERSE_ORDER[k]
NATURAL_ORDER = tuple(range(8))
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# int32 values unpacked at a time (bounds the temporaries of a large layer to ~64 MiB; the
# result, uint8 [out, in], is twice the layer's int4 storage)
_CHUNK = 2**20


@dataclass(frozen=True)
class QuantScheme:
    """What a `quantization_config` says about the packed tensors (module docstring)."""

    method: str  # "gptq" | "awq"
    group_size: int  # input columns per scale in the file; -1: the whole input
    zero_offset: int  # added to each stored zero point: 1 for GPTQ's original format
    desc_act: bool
    checkpoint_format: str

    def describe(self) -> str:
        g = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        extra = f", {self.checkpoint_format}" if self.method == "gptq" else ", gemm"
        return f"{self.method.upper()} 4-bit, {g}{extra}" + (", desc_act" if self.desc_act
                                                              else "")


def _refusal(method, why: str) -> HFConversionError:
    return HFConversionError(f"config.json quantization_config (quant_method {method!r}) is "
                             f"not supported: {why}; shardzoo reads {SUPPORTED} checkpoints, "
                             f"or convert the unquantized (or GGUF) model")


def quant_scheme(d: dict) -> QuantScheme | FP8Scheme | None:
    """The `QuantScheme` of config.json dict `d` (an `FP8Scheme` for FP8 methods:
    models/hf/fp8.py); None when it has no quantization_config or GGUF's marker
    (transformers' GGUF reader). Raises `HFConversionError` in one line naming the method (or
    field) and what is supported, for anything else: another method, bits other than 4, a
    kernel's repacked layout, AWQ without zero points, ..."""
    q = d.get("quantization_config")
    if q is None:
        return None
    if type(q) is not dict:
        raise _refusal(q, f"quantization_config is a {type(q).__name__}, not an object")
    method = q.get("quant_method")
    if method == "gguf":
        return None
    if method in FP8_METHODS:
        try:
            return fp8_scheme(q)
        except ValueError as e:
            raise _refusal(method, str(e)) from None
    if method == "mxfp4":  # gpt-oss's experts, de-quantized on reading (models/hf/mxfp4.py)
        if d.get("model_type") != "gpt_oss":
            raise _refusal(method, "mxfp4 is read for gpt_oss checkpoints only")
        return None
    if method not in ("gptq", "awq"):
        raise _refusal(method, "a method shardzoo does not read")
    bits, group = q.get("bits", 4), q.get("group_size", 128)
    if bits != 4 or type(bits) is not int:
        raise _refusal(method, f"bits {bits!r} (only 4-bit checkpoints are read)")
    if type(group) is not int or not (group == -1 or 0 < group < 2**31 and group % 32 == 0):
        raise _refusal(method, f"group_size {group!r} (a multiple of 32, or -1)")
    pack = q.get("pack_dtype", "int32")
    if pack not in ("int32", "torch.int32"):
        raise _refusal(method, f"pack_dtype {pack!r} (values are packed in int32)")
    desc_act = q.get("desc_act", False)
    if type(desc_act) is not bool:
        raise _refusal(method, f"desc_act {desc_act!r} (true or false)")
    if method == "gptq":
        fmt = q.get("checkpoint_format", q.get("format")) or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise _refusal(method, f"checkpoint_format {fmt!r} (a kernel's layout; only gptq "
                                   f"and gptq_v2 are read)")
        return QuantScheme("gptq", group, 1 if fmt == "gptq" else 0, desc_act, fmt)
    version = q.get("version", q.get("format")) or "gemm"
    if str(version).lower() != "gemm":
        raise _refusal(method, f"version {version!r} (only AWQ's gemm layout is read)")
    if q.get("zero_point", True) is not True:
        raise _refusal(method, f"zero_point {q.get('zero_point')!r} (AWQ gemm checkpoints "
                               f"carry zero points)")
    if desc_act:
        raise _refusal(method, "desc_act true (AWQ keeps columns in order)")
    return QuantScheme("awq", group, 0, False, "gemm")


def unpack_int32(packed: torch.Tensor, order: tuple[int, ...] = NATURAL_ORDER) -> torch.Tensor:
    """`int32 [rows, cols]` -> `uint8 [rows, cols * 8]` 4-bit values: column 8c + k of the
    result is value `order[k]` (bits 4 order[k] .. +3) of `packed[:, c]`. Read through the
    int32s' bytes (byte b holds values 2b, 2b + 1 in its low and high nibble: little-endian),
    `_CHUNK` int32s at a time; `packed` may be a non-contiguous view."""
    rows, cols = packed.shape
    out = torch.empty(rows, cols * 8, dtype=torch.uint8)
    idx = None if order == NATURAL_ORDER else torch.tensor(order)
    step = max(1, _CHUNK // max(cols, 1))
    for r in range(0, rows, step):
        part = packed[r:r + step].contiguous()
        n = part.shape[0]
        if sys.byteorder == "little":
            b = part.view(torch.uint8)  # [n, cols * 4]
            values = torch.stack([b & 0xF, b >> 4], -1).view(n, cols, 8)
        else:
            values = ((part.unsqueeze(2) >> _SHIFTS) & 0xF).to(torch.uint8)
        if idx is not None:
            values = values.index_select(2, idx)
        out[r:r + n] = values.reshape(n, -1)
    return out


@dataclass(frozen=True)
class PackedLayer:
    """One quantized linear `prefix` of an HF folder: its `[out, inp]` weight and the group
    size `group` it is held in as int4 (the largest of INT4_GROUP_SIZES dividing the file's;
    None when none does: de-quantized only)."""

    prefix: str
    out: int
    inp: int
    groups: int  # scale rows in the file
    group: int | None
    has_g_idx: bool


def check_layer(src, scheme: QuantScheme, prefix: str, names: set[str]) -> PackedLayer:
    """The `PackedLayer` of `prefix` from the file headers of `src` (an `HFSource` whose
    tensor names are `names`; nothing read), every packed tensor's dtype and shape checked
    against qweight's and the scheme's.
    Raises `HFConversionError` naming the tensor, what it is and what it must be."""
    def fail(what: str) -> HFConversionError:
        return HFConversionError(f"{src.path}: {what} ({scheme.describe()} checkpoint; "
                                 f"nothing was allocated); the file is corrupt or does not "
                                 f"match its quantization_config, use the model's own files")

    have = {p: f"{prefix}.{p}" for p in PACKED if f"{prefix}.{p}" in names}
    for part in ("qzeros", "scales"):
        if part not in have:
            raise fail(f"the quantized layer {prefix!r} has no {part} tensor")
    if scheme.desc_act and "g_idx" not in have:
        raise fail(f"the quantized layer {prefix!r} has no g_idx, which desc_act true needs "
                   f"(its columns' groups)")
    if scheme.method == "awq" and "g_idx" in have:
        raise fail(f"{have['g_idx']!r} is a GPTQ tensor in an AWQ checkpoint")
    shapes = {p: tuple(src.shape(n)) for p, n in have.items()}
    dtypes = {p: src.dtype(n) for p, n in have.items()}
    for part in ("qweight", "qzeros") + (("g_idx",) if "g_idx" in have else ()):
        if dtypes[part] != "I32":
            raise fail(f"{have[part]!r} has dtype {dtypes[part]}, not I32 (int32)")
    if dtypes["scales"] not in _SCALE_DTYPES:
        raise fail(f"{have['scales']!r} has dtype {dtypes['scales']}, not one of "
                   f"{sorted(_SCALE_DTYPES)}")
    for p, s in shapes.items():
        if len(s) != (1 if p == "g_idx" else 2) or 0 in s:
            raise fail(f"{have[p]!r} has shape {list(s)}")
    rows, cols = shapes["qweight"]
    inp, out = (rows * 8, cols) if scheme.method == "gptq" else (rows, cols * 8)
    if out % 8:
        raise fail(f"{have['qweight']!r} {list(shapes['qweight'])} gives {out} output "
                   f"columns, not a multiple of 8 (qzeros packs 8 per int32)")
    g = inp if scheme.group_size == -1 else scheme.group_size
    if inp % g:
        raise fail(f"group_size {g} does not divide the input size {inp} of {prefix!r}")
    groups = inp // g
    want = {"qzeros": (groups, out // 8), "scales": (groups, out), "g_idx": (inp,)}
    for p, s in want.items():
        if p in shapes and shapes[p] != s:
            raise fail(f"{have[p]!r} has shape {list(shapes[p])}, but qweight "
                       f"{list(shapes['qweight'])} with group_size {scheme.group_size} needs "
                       f"{list(s)}")
    ours = next((s for s in sorted(INT4_GROUP_SIZES, reverse=True) if g % s == 0), None)
    return PackedLayer(prefix, out, inp, groups, ours, "g_idx" in have)


def _group_index(src, layer: PackedLayer, scheme: QuantScheme) -> torch.Tensor | None:
    """The layer's g_idx (int64 `[in]`), checked to lie in [0, groups); None when the file
    has none or it is the default i // group_size."""
    if not layer.has_g_idx:
        return None
    name = f"{layer.prefix}.g_idx"
    g_idx = src.raw(name).long()
    bad = g_idx[(g_idx < 0) | (g_idx >= layer.groups)]
    if bad.numel():
        raise HFConversionError(
            f"{src.path}: {name!r} holds group {int(bad[0])}, outside the layer's "
            f"{layer.groups} groups (nothing was de-quantized); the file is corrupt, use the "
            f"model's own files")
    default = torch.arange(layer.inp) // (layer.inp // layer.groups)
    return None if torch.equal(g_idx, default) else g_idx


def unpack_layer(src, scheme: QuantScheme, layer: PackedLayer):
    """`(q uint8 [out, in] 0..15, scales float32 [out, groups], zeros float32 [out, groups],
    g_idx int64 [in] or None)` of `layer`: the file's values, zero points with the format's
    offset (GPTQ's original format: + 1 on each 4-bit value), in output-row order."""
    p = layer.prefix
    g_idx = _group_index(src, layer, scheme)  # checked before the packed data is read
    qweight, qzeros = src.raw(f"{p}.qweight"), src.raw(f"{p}.qzeros")
    if scheme.method == "gptq":
        q = unpack_int32(qweight.t())  # [out, in / 8] views -> [out, in]
        zeros = unpack_int32(qzeros)
    else:
        q = unpack_int32(qweight, AWQ_REVERSE_ORDER).t()
        zeros = unpack_int32(qzeros, AWQ_REVERSE_ORDER)
    zeros = zeros.t().float() + scheme.zero_offset
    scales = src.raw(f"{p}.scales").t().float()
    return q, scales.contiguous(), zeros.contiguous(), g_idx


def dequantize_layer(src, scheme: QuantScheme, layer: PackedLayer) -> torch.Tensor:
    """The exact float32 weight `[out, in]` of `layer`: scale (q - zero) of each column's
    group (its g_idx, act-order included)."""
    q, scales, zeros, g_idx = unpack_layer(src, scheme, layer)
    if g_idx is None:
        g_idx = torch.arange(layer.inp) // (layer.inp // layer.groups)
    return (q.float() - zeros[:, g_idx]) * scales[:, g_idx]


def quantized_layer(src, scheme: QuantScheme, layer: PackedLayer) -> QuantizedWeight:
    """`layer` as an int4 `QuantizedWeight` (groups of `layer.group`: a file group of G
    columns repeats its scale and zero point G / group times, exactly). Raises
    `HFConversionError` for an act-order g_idx (columns of one group not consecutive)."""
    if layer.group is None:
        raise HFConversionError(
            f"{src.path}: {layer.prefix!r} has groups of {layer.inp // layer.groups} input "
            f"columns, which int4 groups of {INT4_GROUP_SIZES} do not divide; load it "
            f"de-quantized (--quantization none: exact)")
    q, scales, zeros, g_idx = unpack_layer(src, scheme, layer)
    if g_idx is not None:
        raise HFConversionError(
            f"{src.path}: {layer.prefix}.g_idx assigns input columns to groups out of order "
            f"(desc_act / act-order), which int4 groups of consecutive columns cannot hold; "
            f"load it de-quantized (--quantization none: exact) or use a desc_act false "
            f"checkpoint")
    per = layer.inp // layer.groups // layer.group
    return QuantizedWeight.from_int4(q, scales.repeat_interleave(per, 1),
                                     zeros.repeat_interleave(per, 1))


def open_quantized(src, quantization: str = "none"):
    """`src` (an HF folder's `HFSource`) with each GPTQ/AWQ layer's packed tensors listed as
    its `P.weight`: `get` gives a `QuantizedWeight` (`quantization` "keep"; the source's
    `quantization` becomes the method) or the exact float32 weight ("none"); `shape` its
    `[out, in]` after `check_layer`. `src` itself when config.json has no GPTQ/AWQ config.
    Raises `HFConversionError` for an unsupported config (`quant_scheme`), no packed layer,
    or a layer also holding a float weight; ValueError for another `quantization`."""
    from .files import HFSource

    if quantization not in MODES:
        raise ValueError(f"quantization {quantization!r} is not one of {MODES}")
    q = src.config.get("quantization_config")
    if type(q) is dict and q.get("quant_method") == "mxfp4" and \
            src.config.get("model_type") == "gpt_oss":
        from .mxfp4 import open_mxfp4

        return open_mxfp4(src)
    try:
        scheme = quant_scheme(src.config)
    except HFConversionError as e:
        raise HFConversionError(f"{src.path}: {e}") from None
    if scheme is None:
        return src
    if isinstance(scheme, FP8Scheme):
        return open_fp8(src, scheme)  # de-quantized in either mode
    names = src.names
    name_set = set(names)
    prefixes = [n[:-len(".qweight")] for n in names if n.endswith(".qweight")]
    if not prefixes:
        raise HFConversionError(f"{src.path}: config.json has a {scheme.method} "
                                f"quantization_config but the weight files hold no .qweight "
                                f"tensor; use the model's own files")
    both = [p for p in prefixes if f"{p}.weight" in name_set]
    if both:
        raise HFConversionError(f"{src.path}: {both[0]!r} has both a float weight and packed "
                                f"{scheme.method} tensors; use the model's own files")
    layers = {f"{p}.weight": p for p in prefixes}
    packed = {f"{p}.{part}" for p in prefixes for part in PACKED}
    listed = [f"{n[:-len('.qweight')]}.weight" if n.endswith(".qweight") else n
              for n in names if n.endswith(".qweight") or n not in packed]
    checked: dict[str, PackedLayer] = {}

    def layer(name: str) -> PackedLayer:
        if name not in checked:
            checked[name] = check_layer(src, scheme, layers[name], name_set)
        return checked[name]

    read: Callable = quantized_layer if quantization == "keep" else dequantize_layer

    def get(name: str):
        return read(src, scheme, layer(name)) if name in layers else src.get(name)

    def shape(name: str) -> tuple[int, ...]:
        if name in layers:
            return layer(name).out, layer(name).inp
        return src.shape(name)

    return HFSource(src.path, src.config, src.kind, listed, get, _shape=shape,
                    _dtype=src._dtype, _raw=src._raw,
                    quantization=scheme.method if quantization == "keep" else "none")
