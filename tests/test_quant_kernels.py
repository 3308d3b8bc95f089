"""The low-bit matmul kernels behind `QuantizedWeight.linear` (layers/quant/kernels.py)
against the float64 product with the exact de-quantized weight.

Tolerance. The kernel multiplies x (float32, or bfloat16 widened exactly) by the weight in
float32, each weight as scale * q plus an offset term (q4_0: -8 d, q4_1: m, int4: -s z,
q4_k: -dmin m_j; the others none), the offset possibly summed separately against the block
sums of x. Every term is a product of such parts, each rounded a few times, and the sum of
K terms in any order (AVX2 lanes, oneDNN's blocking) adds at most K - 1 roundings of partial
sums (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5:
|fl(x.w) - x.w| <= gamma_K sum |x_k||w_k|, gamma_K = K u / (1 - K u)), where the magnitude
is that of the terms actually summed: |scale q| + |offset| <= |w| + 2 |offset|. So with
u = 2^-24 every output is within (K + 3) u sum_k |x_k| (|w_k| + 2 |o_k|) (+ u |y| for the
bias add), o the offset (the weight the block would have with every q zero: `offsets`).
With 8-bit activations each x_k is first replaced by dx round(x_k / dx), dx = max|x_b| / 127
over its 32-block b: at most 0.5 dx (+ float rounding of x / dx: 0.51 dx) away, adding
sum_b 0.51 dx_b sum_{k in b} |w_k| to the error. A bfloat16 result is then rounded once more
to nearest (u_bf16 = 2^-8): + 2^-8 (|y| + the bound). `bound` computes that per output."""
import os
import warnings

import pytest
import torch

from layers.quant import FORMATS, QuantizedWeight, formats, kernels
from test_quant_formats import random_blocks

U32, U16 = 2.0 ** -24, 2.0 ** -8


def make_weight(fmt: str, out: int, inp: int, seed: int = 0, group: int = 32
                ) -> QuantizedWeight:
    """A weight of `fmt`: round-to-nearest of a random float one, or random k-quant blocks."""
    if fmt in ("q4_k", "q6_k"):
        return QuantizedWeight.from_gguf(fmt.upper(), random_blocks(fmt, out, inp, seed),
                                         (out, inp))
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight.quantize(w, fmt, group_size=group, symmetric=seed % 2 == 0)


def offsets(qw: QuantizedWeight) -> torch.Tensor:
    """|o| `[out, in]`: the de-quantized weight with every quantized value q set to 0."""
    zeroed = {k: v.clone() for k, v in qw.tensors.items()}
    payload = {"int4": ("qweight", None), "q4_0": ("blocks", (2, 18, 18)),
               "q4_1": ("blocks", (4, 20, 20)), "q4_k": ("blocks", (16, 144, 144))}
    if qw.format not in payload:
        return torch.zeros(qw.shape, dtype=torch.float64)
    name, span = payload[qw.format]
    t = zeroed[name]
    if span is None:
        t.zero_()
    else:
        start, stop, size = span
        t.view(t.shape[0], -1, size)[..., start:stop] = 0
    return QuantizedWeight(qw.format, tuple(qw.shape), zeroed).dequantize().double().abs()


def bound(x: torch.Tensor, qw: QuantizedWeight, bias, ref: torch.Tensor, dtype) -> torch.Tensor:
    """The per-element error bound of the module docstring."""
    k = x.shape[-1]
    w = qw.dequantize().double().abs()
    xa = x.double().abs().reshape(-1, k)
    mag = xa @ (w + 2 * offsets(qw)).t()
    tol = (k + 3) * U32 * mag
    if kernels.ACTIVATIONS == "int8" and qw.format in kernels.Q8_FORMATS and k % 32 == 0:
        dx = xa.view(xa.shape[0], k // 32, 32).amax(-1) / 127  # [rows, blocks]
        wb = w.view(w.shape[0], k // 32, 32).sum(-1)  # [out, blocks]
        tol = tol + 0.51 * (dx @ wb.t())
    tol = tol.view(ref.shape) + U32 * ref.abs()
    if dtype == torch.bfloat16:
        tol = tol + U16 * (ref.abs() + tol)
    return tol + 1e-30


def check(qw: QuantizedWeight, x: torch.Tensor, bias=None):
    w = qw.dequantize()
    ref = x.double() @ w.double().t()
    if bias is not None:
        ref = ref + bias.double()
    y = qw.linear(x, bias)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], qw.shape[0])
    err = (y.double() - ref).abs()
    tol = bound(x, qw, bias, ref, x.dtype)
    assert (err <= tol).all(), f"{qw}: max excess {(err - tol).max().item():.3g}"
    return y


# (format, out, in): odd output sizes (not multiples of 8 or 16, and 1), inputs of the
# formats' smallest blocks and a tail the kernel's 16-wide loop does not cover (int8: 40)
SHAPES = [("int8", 13, 40), ("int8", 1, 576), ("int4", 13, 96), ("int4", 1, 128),
          ("q8_0", 13, 96), ("q8_0", 1, 64), ("q4_0", 21, 96), ("q4_1", 13, 96),
          ("q4_1", 1, 576), ("q4_k", 13, 512), ("q4_k", 1, 256), ("q6_k", 13, 512),
          ("q6_k", 1, 256)]


@pytest.mark.parametrize("fmt,out,inp", SHAPES)
def test_each_format_matches_the_dequantized_product(fmt, out, inp):
    qw = make_weight(fmt, out, inp)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(out, generator=g)
    for rows in (1, 3, 8, 17, 200):  # the row-by-row kernel (<= 16 rows) and the slabs
        x = torch.randn(rows, inp, generator=g)
        x[rows // 2] = 0  # a zero row: exactly the bias
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            check(qw, xd)
            y = check(qw, xd, bias.to(dtype) if dtype == torch.float32 else bias)
            assert torch.equal(y[rows // 2].float(), bias.to(dtype).float())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_and_leading_dims(group):
    qw = make_weight("int4", 19, 256, seed=1, group=group)
    x = torch.randn(2, 3, 256)  # [..., in]
    y = check(qw, x)
    assert y.shape == (2, 3, 19)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_non_contiguous_inputs_and_column_shards(fmt):
    inp = 512
    qw = make_weight(fmt, 24, inp, seed=2)
    for rows in (5, 40):
        wide = torch.randn(rows, 2 * inp)
        check(qw, wide[:, ::2])  # unit stride broken
        check(qw, wide[:, inp:])  # row stride > in
        check(qw, torch.randn(inp, rows).t())  # transposed
    # a row-parallel shard: the storage is a column view with a longer row stride
    block = 128 if fmt == "int8" else qw.block_size
    check(qw.narrow(1, block, block), torch.randn(3, block))
    check(qw.narrow(0, 5, 7), torch.randn(2, inp))


@pytest.mark.parametrize("fmt", kernels.Q8_FORMATS)
def test_8_bit_activations_stay_within_their_bound(fmt, monkeypatch):
    monkeypatch.setattr(kernels, "ACTIVATIONS", "int8")
    qw = make_weight(fmt, 13, 128, seed=4)
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(13, generator=g)
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, 128, generator=g)
        x[0] = 0
        for dtype in (torch.float32, torch.bfloat16):
            y = check(qw, x.to(dtype), bias)
            assert torch.equal(y[0].float(), bias.to(dtype).float())
    # the rounding is real (not the float path): some output moves by more than float error
    x = torch.randn(4, 128, generator=g)
    monkeypatch.setattr(kernels, "ACTIVATIONS", "float")
    exact = qw.linear(x)
    monkeypatch.setattr(kernels, "ACTIVATIONS", "int8")
    assert (qw.linear(x) - exact).abs().max() > 1e-4 * exact.abs().max()
    check(qw, torch.randn(64, 256)[:, ::2])


@pytest.mark.parametrize("fmt", kernels.Q8_FORMATS)
def test_the_vnni_tiles_equal_the_avx2_tiles(fmt):
    """The 8-bit-activation tiles sum each block's integer products exactly, so the AVX-512
    VNNI build (vpdpbusd) and the AVX2 one (vpmaddubsw + vpmaddwd) give the same bits, at
    every tile remainder (output rows not a multiple of 4, input rows not of the tile's)."""
    ext = kernels.extension()
    if ext is None or ext.q8_isa() < 2:
        pytest.skip("this CPU has no AVX-512 VNNI")
    g = torch.Generator().manual_seed(6)
    for out in (1, 6, 13):
        qw = make_weight(fmt, out, 128, seed=out)
        fmt_, n, group, t0, t1, t2 = qw._product
        code = kernels.FORMAT_CODES[fmt_]
        for rows in (1, 2, 3, 5, 8, 9):
            x, bias = torch.randn(rows, 128, generator=g), torch.randn(out, generator=g)
            assert torch.equal(ext.gemv_q8(x, code, n, group, t0, t1, t2, bias, 2),
                               ext.gemv_q8(x, code, n, group, t0, t1, t2, bias, 1))


@pytest.mark.parametrize("fmt", kernels.Q8_FORMATS)
def test_a_row_alone_gets_the_bits_it_gets_in_a_batch(fmt):
    """With 8-bit activations one input row takes its own kernel for the 8-bit formats (one
    weight row after another, q8_tile.h `row_stream`) and the tiles otherwise; each output
    is the same bits alone as at any place in a batch of 2 to 9 rows, with and without a
    bias, on both instruction sets (so greedy decoding does not depend on the batch)."""
    ext = kernels.extension()
    if ext is None or not ext.simd():
        pytest.skip("the 8-bit-activation kernels need the AVX2 build")
    g = torch.Generator().manual_seed(9)
    for out, inp in ((1, 32), (7, 96), (45, 256)):
        qw = make_weight(fmt, out, inp, seed=out)
        fmt_, n, group, t0, t1, t2 = qw._product
        code = kernels.FORMAT_CODES[fmt_]
        for bias in (None, torch.randn(out, generator=g)):
            for isa in sorted({1, ext.q8_isa()}):
                batch = torch.randn(9, inp, generator=g)
                for rows in (2, 5, 9):
                    together = ext.gemv_q8(batch[:rows], code, n, group, t0, t1, t2, bias, isa)
                    for m in range(rows):
                        alone = ext.gemv_q8(batch[m:m + 1], code, n, group, t0, t1, t2, bias,
                                            isa)
                        assert torch.equal(alone[0], together[m]), (out, rows, m, isa)


def test_a_bad_activation_switch_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.ENV_SWITCH, "fp8")
    with pytest.raises(ValueError, match="SHARDZOO_QUANT_ACTIVATIONS='fp8': expected one of"):
        kernels._activations()


def test_the_compiled_op_matches_eager():
    qw = make_weight("q4_1", 37, 96)
    bias = torch.randn(37)

    def f(x):
        return torch.relu(qw.linear(x, bias)) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    for rows in (1, 20):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_ops_cpu_kernel_takes_the_python_route(fmt):
    """`shardzoo::quant_linear`'s C++ CPU kernel (quant_op.cpp, what compiled code calls)
    chooses the kernel `_kernel_linear` chooses: the same bits on each route (8-bit
    activations, the row-by-row kernel, the slabs + GEMM beyond `GEMV_ROWS`), with a bias,
    in bfloat16, over leading dims and for a strided input."""
    if kernels.extension() is None:
        pytest.skip("the low-bit kernels cannot be built here")
    assert "quant_op.cpp" in torch._C._dispatch_dump_table("shardzoo::quant_linear")
    qw = make_weight(fmt, 37, 256, seed=3)
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(37, generator=g)
    isas = (0, kernels.Q8_ISA) if fmt in kernels.Q8_FORMATS else (0,)
    for rows in (1, 5, kernels.GEMV_ROWS + 1, 70):
        for x in (torch.randn(rows, 256, generator=g),
                  torch.randn(2, rows, 256, generator=g).to(torch.bfloat16),
                  torch.randn(rows, 512, generator=g)[:, ::2]):
            for isa in isas:
                for b in (None, bias):
                    want = kernels._quant_linear_impl(x, *qw._product, b, isa)
                    got = kernels._OP(x, *qw._product, b, isa)
                    assert got.dtype == x.dtype and got.shape == want.shape
                    assert torch.equal(got, want), (rows, x.dtype, isa, b is None)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rows_are_dequantized_bit_for_bit(fmt):
    """An embedding's rows (`dequantize_rows`, by kernels.cpp's de-quantization where it is
    built) are formats.dequantize's values exactly, in any order, repeated."""
    qw = make_weight(fmt, 40, 256, seed=2)
    rows = torch.tensor([3, 0, 39, 3, 17])
    want = formats.dequantize(fmt, {k: v[rows] for k, v in qw.tensors.items()}, (5, 256))
    assert torch.equal(qw.dequantize_rows(rows), want)
    if kernels.extension() is not None:
        assert kernels.dequantize(fmt, 256, qw._group,
                                  {k: v[rows] for k, v in qw.tensors.items()}) is not None


def test_without_a_compiler_it_warns_once_and_falls_back(monkeypatch):
    def no_compiler():
        raise RuntimeError("g++: command not found")
    monkeypatch.setattr(kernels, "_build", no_compiler)
    monkeypatch.setattr(kernels._LAZY, "module", None)
    monkeypatch.setattr(kernels._LAZY, "tried", False)
    monkeypatch.setattr(kernels, "_SIMD", [False])
    qw = make_weight("q8_0", 9, 64)
    with pytest.warns(UserWarning, match="could not be built.*g\\+\\+: command not found"):
        check(qw, torch.randn(2, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(qw, torch.randn(20, 64), torch.randn(9))


def test_a_builder_killed_mid_build_does_not_stall_the_next_one():
    """torch's FileBaton is a `lock` file that only its own builder removes: one killed while
    compiling (a spawned rank stopped by its launcher) left it behind, and every later build
    of the extension on the machine waited on it forever. The next build removes it under its
    flock and finishes."""
    import subprocess
    import sys
    assert kernels.extension() is not None, "the kernels do not build on this machine"
    from layers import cpu_extension
    directory = cpu_extension.build_directory(kernels.extension_name())
    with cpu_extension.build_lock(directory):  # as a killed builder leaves it
        open(os.path.join(directory, "lock"), "w").close()
    code = "from layers.quant import kernels; assert kernels._build() is not None; print('built')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0 and "built" in done.stdout, done.stderr[-2000:]
    assert not os.path.exists(os.path.join(directory, "lock"))
