"""The GEMM behind every weight matmul on CPU in float32: oneDNN's, where torch has it.

torch sends a float32 `F.linear` / `matmul` on CPU to MKL's sgemm, and MKL takes its AVX2
code on a CPU that is not Intel's; oneDNN (which torch already uses for bf16 matmuls and
convolutions) picks its kernel from the CPU's instruction set alone. On a 2-core AMD EPYC
Zen 5 (AVX-512), oneDNN's float32 inner product took the bench model's training GEMMs from
~95 to ~210 GFLOP/s on one thread, forward, input gradient and weight gradient alike, and a
SmolLM2 decode step's weight matmuls at 8 rows from 2.1x to 1x the time (measured
2026-12-02); on a 2-core Zen 3 (AVX2 only), with each weight read cold from memory as
in decode, its packed copy (`pack`) took SmolLM2's QKV weight at one row 153 us against
MKL's 207 and the MLP's up-projection 380 against 618 (2026-12-03). Each call has a
fixed cost of ~25-55 us (primitive set-up inside torch's op), which a decode step pays
~120 times. The result differs from MKL's by rounding only (a different summation order),
like any change of thread count.

`SHARDZOO_CPU_GEMM=torch` keeps torch's own choice (MKL) for comparison; the default,
`onednn`, takes oneDNN where torch was built with it. CUDA, bf16/fp16 with gradients,
autocast, and oneDNN turned off by `torch.backends.mkldnn` always go through torch; bf16/fp16
inference reads the weights' packed copies (`pack`).
"""
from __future__ import annotations

import os

import torch

ENV_SWITCH = "SHARDZOO_CPU_GEMM"
CHOICES = ("onednn", "torch")


def available() -> bool:
    """Whether this torch build has oneDNN's inner product (whatever the switch says)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _resolve() -> bool:
    choice = os.environ.get(ENV_SWITCH, "onednn").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{ENV_SWITCH}={choice!r}: expected one of {', '.join(CHOICES)} "
                         f"(onednn: oneDNN's float32 GEMM on CPU, the default; torch: MKL)")
    return choice == "onednn" and available()


_ONEDNN = _resolve()
# the overload itself: calling it skips the op packet's Python dispatch (decode makes ~120
# of these calls a step)
_POINTWISE = torch.ops.mkldnn._linear_pointwise.default if available() else None


def backend() -> str:
    """'onednn' or 'torch': who computes a float32 weight matmul on CPU in this process."""
    return "onednn" if _ONEDNN else "torch"


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight^T` goes to oneDNN: CPU, both float32, no autocast, and oneDNN not
    turned off (`torch.backends.mkldnn.flags(enabled=False)`)."""
    return _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 \
        and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu") \
        and torch.backends.mkldnn.enabled


def linear_nt(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """`a @ b^T (+ bias)` by oneDNN's inner product: `a [m, k]`, `b [n, k]` (either may be a
    transposed view; oneDNN reads the strides) -> `[m, n]`. No autograd: callers give it
    their backward (layers/linear.py). Under `torch.compile` it is one opaque op
    (`shardzoo::onednn_linear_nt`; inductor's own lowering of this kernel wants frozen
    weights), fused around like any extern kernel."""
    if torch.compiler.is_compiling():
        return _onednn_linear_nt(a, b, bias)
    return _POINTWISE(a, b, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`linear_nt` over leading dims: `x [..., k]`, `weight [n, k]` (or its packed copy)
    -> `[..., n]`."""
    y = linear_nt(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def packable(weight: torch.Tensor) -> bool:
    """Whether `pack` keeps a copy of `weight` for oneDNN: a 2-D CPU weight in float32, or in
    bfloat16 / float16 (packed in its own dtype or as a float32 copy: see `pack`), oneDNN
    chosen and not turned off."""
    return _ONEDNN and weight.device.type == "cpu" and weight.dim() == 2 \
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and torch.backends.mkldnn.enabled


def native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` (bf16 / fp16) natively in oneDNN, so `pack` keeps
    the weight in its own dtype: bf16 with AVX512-BF16 or AMX, fp16 with AMX-FP16."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return dtype == torch.float16 and torch.cpu._is_amx_fp16_supported()


def pack(weight: torch.Tensor) -> int:
    """Keep oneDNN's pre-packed (blocked) copy of a `[n, k]` weight beside it, for
    inference: `packed(weight)` returns it while the weight is unchanged. Decode's few-row
    products read it 1.5-2.3x faster than the plain layout (SmolLM2's weights at 4-16 rows;
    prefill and one row: the same or slightly faster), with the same values to rounding.

    A bfloat16 / float16 weight is packed in its own dtype where the CPU has the
    instructions for it (`native`): on a 2-core Zen 4 with AVX512-BF16, SmolLM2's decode
    weight matmuls took 13.8 ms at one row and 18.3 at eight against 22.4 and 32.3 by
    torch's bf16 GEMM and 29.8 and 30.3 through float32 copies (measured
    2026-12-04); `layers.linear.linear` multiplies it at any row count.
    Elsewhere it gets a float32 copy (exact: every such value is a float32), which `linear`
    multiplies by the input widened to float32, rounding the result to the input's dtype
    once. On a CPU without AVX-512 (the Zen 3 measured on 2026-12-03) torch's own bf16 GEMM is
    ATen's fallback and oneDNN refuses to pack bf16 weights: a SmolLM2 decode step at batch
    8 took 418 ms of CPU time in bf16 against 188 ms through the float32 copies (one
    thread, a loaded machine). At one row torch's bf16 matrix-vector product, which reads
    half the bytes, was faster (57 vs 116 ms), so `linear` keeps it there. The values are
    those of a bf16 GEMM with float32 accumulation (the products of two bf16 numbers are
    exact in float32) up to summation order, either way. Returns the bytes the copy takes
    (numel x its element size; inference holds both)."""
    w = weight.detach()
    copy = None
    if w.dtype != torch.float32 and native(w.dtype):
        try:
            copy = torch.ops.mkldnn._reorder_linear_weight(w)
        except RuntimeError:  # this oneDNN build will not pack the narrow dtype after all
            pass
    if copy is None:
        copy = torch.ops.mkldnn._reorder_linear_weight(w.float())
    weight.onednn_packed = (weight._version, copy)
    return weight.numel() * copy.element_size()


def packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight`'s pre-packed copy (see `pack`), or `weight` itself when it has none or was
    changed in place since it was packed. Under `torch.compile` (the engine's --compile) the
    copy is taken without that check (the version counter cannot be traced, and inference
    never writes its weights): a weight changed in place after compiling is not seen."""
    entry = getattr(weight, "onednn_packed", None)
    if entry is not None and torch.compiler.is_compiling():
        return entry[1]
    return entry[1] if entry is not None and entry[0] == weight._version else weight


def weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight gradient `dW = dY^T X` by oneDNN: `grad [m, n]`, `x [m, k]` ->
    `[n, k]`. oneDNN reads a transposed right operand in place but copies a transposed left
    one, so the larger of the two goes on the right: for `n > k` it computes `dW^T = X^T dY`
    and returns its transpose (a view). On the bench model's output layer (`m` 2048, `k` 256,
    `n` 8192) that is 23 ms instead of 70 (MKL: 49)."""
    if grad.shape[1] > x.shape[1]:
        return linear_nt(x.t(), grad.t()).t()
    return linear_nt(grad.t(), x.t())


# `shardzoo::onednn_linear_nt` for torch.compile, registered through `torch.library.Library`
# rather than `torch.library.custom_op`: calling the latter's wrapper cost ~22 us a call more
# here against ~5 us (a compiled decode step makes ~120 such calls). No autograd: its callers
# run it inside their own autograd.Function (layers/linear.py).
_LIB = torch.library.Library("shardzoo", "FRAGMENT")
_LIB.define("onednn_linear_nt(Tensor a, Tensor b, Tensor? bias) -> Tensor")


def _onednn_linear_nt_impl(a, b, bias):
    return _POINTWISE(a, b, bias, "none", [], "")


def _onednn_linear_nt_fake(a, b, bias):
    return a.new_empty(a.shape[0], b.shape[0])


# CompositeExplicitAutograd: the packed weight is an MkldnnCPU tensor, the input a CPU one
_LIB.impl("onednn_linear_nt", _onednn_linear_nt_impl, "CompositeExplicitAutograd")
torch.library.register_fake("shardzoo::onednn_linear_nt", _onednn_linear_nt_fake, lib=_LIB)
_onednn_linear_nt = torch.ops.shardzoo.onednn_linear_nt.default
