"""The CPU kernels behind `QuantizedWeight.linear`: built from kernels.cpp at first use.

`linear(fmt, shape, group, tensors, x, bias)` computes `x [M, in] @ w^T (+ bias)` for every
format in formats.py without a float32 copy of the whole weight:

- up to `GEMV_ROWS` rows (decode): kernels.cpp's `gemv` de-quantizes one weight row at a time
  into a float32 buffer of `in` elements and dots it with every input row, so each weight
  byte is read once per call (parallel over output rows, AVX2/FMA/F16C where the CPU has
  them, portable C++ otherwise);
- more rows (prefill): `SLAB_BYTES` of float32 weight rows at a time are de-quantized by the
  same code and multiplied by oneDNN's GEMM (layers/gemm.py), a bounded buffer however wide
  the weight.

Activations stay float32 by default (a bfloat16 input is widened, the result rounded back
once), so the result is the float product with the de-quantized weight up to float32
summation order. `SHARDZOO_QUANT_ACTIVATIONS=int8` takes llama.cpp's scheme instead for the
formats of 32-element blocks (int8 and int4 with `in % 32 == 0`, q8_0, q4_0, q4_1) at every
row count: each input row is rounded to 8 bits per 32-block (scale max|x| / 127) and the
integer dot products run on AVX2's u8 x s8 multiply-adds, about twice as fast at one row,
with an added error of at most half a step per input element (docs/DECISIONS.md, "Low-bit
matmuls keep float activations").

The extension is compiled at first use by layers/cpu_extension.py (g++ and ninja, torch's
extensions cache, once per machine and version of kernels.cpp + q8_tile.h). If it cannot be
built, every call falls back to the de-quantizing slabs of `reference_linear`, after one
warning.

Under `torch.compile` the product is one opaque op, `shardzoo::quant_linear` with a fake
(meta) implementation, so inductor compiles the code around it (as layers/gemm.py does for
oneDNN's GEMM). Its CPU kernel is C++ (quant_op.cpp, registered when the kernels load: the
same choice of kernel as `_kernel_linear`, without a Python frame per call); the Python
implementation here serves before that, where the kernels cannot be built, and on other
devices. Whether the product takes 8-bit activations is decided when tracing (`q8_isa`)
and passed with each call.
"""
from __future__ import annotations

import os

import torch

from .. import cpu_extension, gemm

# input rows up to which the row-by-row kernel beats de-quantized slabs + GEMM (bench/
# quant_matmul.py; docs/PERFORMANCE.md)
GEMV_ROWS = 16
# float32 bytes of weight rows de-quantized at a time for a GEMM (prefill)
SLAB_BYTES = 4 << 20
FORMAT_CODES = {"int8": 0, "int4": 1, "q8_0": 2, "q4_0": 3, "q4_1": 4, "q4_k": 5, "q6_k": 6}
# the formats whose 32-element blocks the 8-bit-activation kernel multiplies
Q8_FORMATS = ("int8", "int4", "q8_0", "q4_0", "q4_1")
ENV_SWITCH = "SHARDZOO_QUANT_ACTIVATIONS"
# compiled into one extension: the kernels and the op's CPU kernel (quant_op.cpp)
COMPILED = ("kernels.cpp", "quant_op.cpp")
# what the build's name hashes: kernels.cpp includes q8_tile.h twice (AVX2 and AVX-512 VNNI)
SOURCES = COMPILED + ("kernels.h", "q8_tile.h")
# the 8-bit-activation tiles: 2 AVX-512 VNNI where the CPU has it (cpuid), 1 AVX2 only
Q8_ISA = 2
ACTIVATION_CHOICES = ("float", "int8")


def _activations() -> str:
    choice = os.environ.get(ENV_SWITCH, "float").strip().lower()
    if choice not in ACTIVATION_CHOICES:
        raise ValueError(f"{ENV_SWITCH}={choice!r}: expected one of "
                         f"{', '.join(ACTIVATION_CHOICES)} (float: exact float32 products, "
                         f"the default; int8: llama.cpp's 8-bit activations, faster decode)")
    return choice


ACTIVATIONS = _activations()

_SIMD = [False]  # whether the built kernels have the AVX2 code (set by `extension`)


def extension_name() -> str:
    """The build's name: `shardzoo_quant_<avx2|generic>_<8 hex of sha256(kernels.cpp +
    q8_tile.h)>`."""
    return cpu_extension.extension_name("shardzoo_quant", os.path.dirname(__file__), SOURCES)


def _build():
    folder = os.path.dirname(__file__)
    ext = cpu_extension.build(extension_name(), [os.path.join(folder, source)
                                                 for source in COMPILED])
    # quant_op.cpp's choices, the ones `_kernel_linear` makes
    ext.configure_op(GEMV_ROWS, SLAB_BYTES, gemm.available())
    return ext


_LAZY = cpu_extension.LazyExtension(
    lambda: _build(), "low-bit matmul kernels",
    "quantized linears de-quantize slabs of rows instead (slower)")


def extension():
    """The compiled kernels, or None when they cannot be built here (warned once)."""
    ext = _LAZY.get()
    _SIMD[0] = bool(ext is not None and ext.simd())
    return ext


def _loaded():
    """`extension()` for the hot paths: the module without a call once it was tried."""
    return _LAZY.module if _LAZY.tried else extension()


def storage(fmt: str, tensors: dict[str, torch.Tensor]) -> tuple:
    """The kernels' storage arguments (t0, t1, t2) of a weight in `fmt`: (qweight, scales,
    None) int8, (qweight, scales, zeros) int4, (blocks, None, None) the GGUF formats."""
    if fmt == "int8":
        return tensors["qweight"], tensors["scales"], None
    if fmt == "int4":
        return tensors["qweight"], tensors["scales"], tensors["zeros"]
    return tensors["blocks"], None, None


def q8_isa(fmt: str, in_features: int) -> int:
    """The op's `q8_isa` argument for a weight in `fmt` with `in_features` columns, from the
    switch (`ACTIVATIONS`): `Q8_ISA` where its products take 8-bit activations, else 0."""
    return Q8_ISA if ACTIVATIONS == "int8" and fmt in Q8_FORMATS and in_features % 32 == 0 \
        else 0


def _kernel_linear(ext, x2, fmt, out_features, group, t0, t1, t2, bias, isa):
    """float32 `[M, in]` -> float32 `[M, out]` by the compiled kernels (quant_op.cpp makes
    the same choice for the op's CPU kernel)."""
    code = FORMAT_CODES[fmt]
    if isa and _SIMD[0]:
        return ext.gemv_q8(x2, code, out_features, group, t0, t1, t2, bias, isa)
    if x2.shape[0] <= GEMV_ROWS:
        return ext.gemv(x2, code, out_features, group, t0, t1, t2, bias)
    inp = x2.shape[1]
    rows = max(64, SLAB_BYTES // (4 * inp))
    y = x2.new_empty(x2.shape[0], out_features)
    for start in range(0, out_features, rows):
        n = min(rows, out_features - start)
        w = ext.dequant(code, inp, group, start, n, t0, t1, t2)
        b = None if bias is None else bias[start:start + n].float()
        y[:, start:start + n] = gemm.linear_nt(x2, w, b) if gemm.available() \
            else torch.nn.functional.linear(x2, w, b)
    return y


def dequantize(fmt: str, in_features: int, group: int, tensors: dict[str, torch.Tensor]
               ) -> torch.Tensor | None:
    """The float32 rows `[n, in]` of the weight storage `tensors` (n rows, formats.py), by
    kernels.cpp's de-quantization (formats.dequantize's values, bit for bit), or None where
    the kernels are not built or the storage is not on CPU."""
    ext = _loaded()
    t0, t1, t2 = storage(fmt, tensors)
    if ext is None or t0.device.type != "cpu":
        return None
    return ext.dequant(FORMAT_CODES[fmt], in_features, group, 0, t0.shape[0], t0, t1, t2)


def _quant_linear_impl(x, fmt, out_features, group, t0, t1, t2, bias, isa=0):
    # a decode step calls this ~120 times: the common case (2-D float32 rows, kernels built)
    # takes no reshape, copy or cast
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.float().contiguous()
    ext = _loaded()
    if ext is None or x2.device.type != "cpu":
        from .weight import reference_linear
        tensors = {"int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros")}.get(
            fmt, ("blocks",))
        y = reference_linear(fmt, (out_features, x2.shape[1]),
                             dict(zip(tensors, (t0, t1, t2))), x2, bias)
    else:
        y = _kernel_linear(ext, x2, fmt, out_features, group, t0, t1, t2, bias, isa)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)


def _quant_linear_fake(x, fmt, out_features, group, t0, t1, t2, bias, isa=0):
    return x.new_empty(*x.shape[:-1], out_features)


_LIB = torch.library.Library("shardzoo", "FRAGMENT")
_LIB.define("quant_linear(Tensor x, str fmt, int out_features, int group, Tensor t0, "
            "Tensor? t1, Tensor? t2, Tensor? bias, int q8_isa=0) -> Tensor")
_LIB.impl("quant_linear", _quant_linear_impl, "CompositeExplicitAutograd")
torch.library.register_fake("shardzoo::quant_linear", _quant_linear_fake, lib=_LIB)
_OP = torch.ops.shardzoo.quant_linear.default


def linear(fmt: str, shape: tuple[int, int], group: int, tensors: dict[str, torch.Tensor],
           x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [..., in] @ w^T (+ bias)` -> `[..., out]` in x's dtype for a weight of `shape`
    `[out, in]` in `fmt` with storage `tensors` (formats.py) and block / group size `group`.
    Under torch.compile: the opaque op `shardzoo::quant_linear`."""
    return product((fmt, shape[0], group) + storage(fmt, tensors), x, bias)


def product(stored: tuple, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with its weight as `(fmt, out, group, t0, t1, t2)` (`storage`), as
    `QuantizedWeight` keeps it: `x [..., in]` -> `[..., out]` in x's dtype."""
    isa = q8_isa(stored[0], x.shape[-1])
    if torch.compiler.is_compiling():
        return _OP(x, *stored, bias, isa)
    return _quant_linear_impl(x, *stored, bias, isa)
