"""The CPU float32 GEMM behind every weight matmul (layers/gemm.py): oneDNN's, with its own
backward in layers/linear.py, must give F.linear's values and gradients; the switch and the
cases that stay with torch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from layers import gemm
from layers.linear import linear

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_onednn = pytest.mark.skipif(gemm.backend() != "onednn",
                                  reason="this torch build has no oneDNN inner product")


def _reference(x, w, b, grad):
    """float64 F.linear and its gradients: the exact values both GEMMs round."""
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y = F.linear(x64, w64, b64)
    y.backward(grad.double())
    return y, x64.grad, w64.grad, None if b is None else b64.grad


def _close(a, b, what):
    scale = b.abs().max().item() + 1e-12
    err = (a.double() - b).abs().max().item() / scale
    assert err < 1e-5, f"{what}: relative error {err:.2e}"


@needs_onednn
@pytest.mark.parametrize("x_shape,out,bias,transposed", [
    ((7, 3, 16), 24, True, False),    # [s, b, h], n > k: dW^T = X^T dY
    ((40, 48), 8, False, False),      # n < k: dW = dY^T X
    ((1, 1, 16), 300, True, False),   # one row (decode), a wide output
    ((5, 2, 16), 16, True, True),     # an input that is a transposed view
])
def test_onednn_linear_matches_float64(x_shape, out, bias, transposed):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*x_shape, generator=g)
    if transposed:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    x.requires_grad_()
    w = torch.randn(out, x_shape[-1], generator=g, requires_grad=True)
    b = torch.randn(out, generator=g, requires_grad=True) if bias else None
    assert gemm.uses_onednn(x, w)
    y = linear(x, w, b)
    assert type(y.grad_fn).__name__ == "_LinearWithGradBackward"  # oneDNN's backward ran
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad)
    ref_y, ref_x, ref_w, ref_b = _reference(x, w, b, grad)
    _close(y, ref_y, "output")
    _close(x.grad, ref_x, "input grad")
    _close(w.grad, ref_w, "weight grad")
    assert w.grad.shape == w.shape
    if bias:
        _close(b.grad, ref_b, "bias grad")
    with torch.no_grad():
        _close(linear(x, w, b), ref_y, "no-grad output")


@needs_onednn
def test_onednn_linear_frozen_weight_and_constant_input():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(12, 16, generator=g)  # frozen
    linear(x, w).sum().backward()
    _close(x.grad, w.double().sum(0).expand(6, 16), "input grad, frozen weight")
    x2 = torch.randn(6, 16, generator=g)  # constant input
    w2 = torch.randn(12, 16, generator=g, requires_grad=True)
    linear(x2, w2).sum().backward()
    _close(w2.grad, x2.double().sum(0).expand(12, 16), "weight grad, constant input")


@needs_onednn
@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # mkldnn.flags() also sets its TF32 flag
def test_other_dtypes_and_autocast_stay_with_torch():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert gemm.uses_onednn(x, w)
    assert not gemm.uses_onednn(x.bfloat16(), w.bfloat16())
    assert not gemm.uses_onednn(x.double(), w.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gemm.uses_onednn(x, w)
        assert linear(x.requires_grad_(), w).dtype == torch.bfloat16  # autocast's F.linear
    with torch.backends.mkldnn.flags(enabled=False):
        assert not gemm.uses_onednn(x, w)


def _backend_in_subprocess(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{gemm.ENV_SWITCH: value})
    return subprocess.run([sys.executable, "-c", "from layers import gemm; print(gemm.backend())"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_switch_keeps_torch_and_refuses_unknown_values():
    out = _backend_in_subprocess("torch")
    assert out.returncode == 0 and out.stdout.strip() == "torch", out.stderr
    out = _backend_in_subprocess("mkl-please")
    assert out.returncode != 0
    assert "SHARDZOO_CPU_GEMM='mkl-please': expected one of onednn, torch" in out.stderr


@needs_onednn
def test_measured_peak_times_onednn_too(monkeypatch):
    from training import mfu as flops

    calls = []
    real = gemm.linear_nt
    monkeypatch.setattr(gemm, "linear_nt", lambda a, b, bias=None: calls.append(a.shape)
                        or real(a, b, bias))
    rate, size = flops.measured_matmul_peak(torch.float32, torch.device("cpu"), n=256,
                                            repeats=2, max_seconds=0.2)
    assert calls and rate > 0 and size == 256


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 40])
def test_packed_weights_give_the_same_products_until_the_weight_changes(rows):
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    x = torch.randn(rows, 2, 32, generator=g)
    assert gemm.pack(w) == w.numel() * 4 and gemm.packed(w) is not w
    with torch.no_grad():
        _close(linear(x, w, b), F.linear(x.double(), w.double(), b.double()), "packed")
        _close(linear(x.transpose(0, 1), w, b),
               F.linear(x.transpose(0, 1).double(), w.double(), b.double()), "strided input")
    w.mul_(2)  # changed in place: the stale copy must not be read
    assert gemm.packed(w) is w
    with torch.no_grad():
        _close(linear(x, w, b), F.linear(x.double(), w.double(), b.double()), "after change")


@needs_onednn
def test_engine_packs_every_linear_weight_once(no_grid):
    from inference.runner import ModelRunner
    from models import GPTModel, ModelConfig

    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                         ffn_hidden_size=64, vocab_size=96, seq_length=16,
                         position_embedding_type="rope")  # tied output layer (the default)
    model = GPTModel(config)
    model.init_weights(0)
    runner = ModelRunner(model, 2, 16)
    linear_weights = [p for n, p in model.named_parameters()
                      if n.endswith("weight") and p.dim() == 2]  # the tied embedding included
    assert runner.packed_bytes == sum(p.numel() * 4 for p in linear_weights)
    assert all(gemm.packed(p) is not p for p in linear_weights)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_weights_multiply_through_a_float32_copy(dtype, monkeypatch):
    """bf16 / fp16 inference on a CPU without those instructions (`gemm.native` False, as on
    AVX2): `pack` keeps a float32 copy (4 bytes a value), `linear` (2 rows or more) widens
    the input, multiplies, and rounds once: a narrow GEMM accumulating in float32,
    so within one rounding of the exact product; a weight changed in place is read afresh,
    and with gradients on it stays torch's own GEMM."""
    monkeypatch.setattr(gemm, "native", lambda dtype: False)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(40, 24, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    x = torch.randn(3, 2, 24, generator=g).to(dtype)
    assert gemm.packable(w) and gemm.pack(w) == w.numel() * 4
    assert gemm.packed(w).dtype == torch.float32
    exact = F.linear(x.double(), w.double(), b.double())
    with torch.no_grad():
        y = linear(x, w, b)
        assert y.dtype == dtype and y.shape == (3, 2, 40)
        ulp = exact.abs() * torch.finfo(dtype).eps + 1e-6
        assert ((y.double() - exact).abs() <= ulp).all()  # one rounding (half an ulp) + sums
        w.mul_(-1)
        assert gemm.packed(w) is w
        fresh = F.linear(x.double(), w.double(), b.double())  # torch's GEMM, changed weight
        tol = 4 * torch.finfo(dtype).eps * fresh.abs().max()
        assert (linear(x, w, b).double() - fresh).abs().max() <= tol
    assert not gemm.packable(w.double()) and not gemm.packable(torch.randn(2, 3, 4))


@needs_onednn
@pytest.mark.skipif(not gemm.native(torch.bfloat16),
                    reason="this CPU has no bf16 instructions (AVX512-BF16 / AMX): bf16 "
                           "weights take the float32 copy, tested above")
@pytest.mark.parametrize("rows", [1, 5])
def test_bf16_weights_pack_natively_where_the_cpu_has_bf16(rows, monkeypatch):
    """On a CPU with bf16 instructions `pack` keeps the weight packed in bf16 (2 bytes a
    value) and `linear` multiplies bf16 inputs through it at any row count, one row
    included: within a rounding of the exact product, the same values as a float32
    product of the same bf16 numbers rounded once, up to summation order."""
    g = torch.Generator().manual_seed(8)
    w, b = (torch.randn(48, 40, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16())
    x = torch.randn(rows, 2, 40, generator=g).bfloat16()
    assert gemm.pack(w) == w.numel() * 2 and gemm.packed(w).dtype == torch.bfloat16
    exact = F.linear(x.double(), w.double(), b.double())
    with torch.no_grad():
        y = linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 2, 48)
    tol = 2 * torch.finfo(torch.bfloat16).eps * exact.abs() + 1e-3
    assert ((y.double() - exact).abs() <= tol).all()
    calls, real = [], gemm.linear  # the packed bf16 copy is what gets multiplied
    monkeypatch.setattr(gemm, "linear", lambda a, weight, bias=None:
                        calls.append(weight.dtype) or real(a, weight, bias))
    with torch.no_grad():
        linear(x, w, b)
    assert calls == [torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_inference_attention_runs_in_float32(dtype):
    """Under no-grad on CPU a bf16 / fp16 SDPA call runs on float32 copies (additive mask
    widened too) and is rounded once: equal to float32 SDPA of the same inputs, rounded;
    with gradients on it is torch's own narrow kernel."""
    from layers.attention import core_attention

    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 6, 1, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 9, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(2, 1, 1, 9, dtype=dtype)
    mask[0, ..., 5:] = float("-inf")  # row 0 sits at position 4
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                          attn_mask=mask.float(), enable_gqa=True).to(dtype)
    with torch.no_grad():
        got = core_attention(q, k, v, mask, None, None, 0.0)
    assert got.dtype == dtype and torch.equal(got, want)
    trained = core_attention(q.requires_grad_(), k, v, mask, None, None, 0.0)
    assert trained.dtype == dtype and torch.allclose(trained.float(), want.float(), atol=2e-2)
