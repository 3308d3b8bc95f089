"""The low-bit weight formats (layers/quant): exact de-quantization against ggml's own Python
de-quantizer (gguf.quants), round-to-nearest quantization bit-identical to ggml's reference,
block-preserving splits, and storage checked against the shape."""
import pytest
import torch

from layers.quant import GGUF_FORMATS, QuantizedWeight
from layers.quant import formats
from tolerances import assert_fp32_close

gguf = pytest.importorskip("gguf", reason="gguf (the test extra) reads ggml's block formats")


def random_blocks(fmt: str, out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """Random block rows of `fmt` whose half-float scale fields are small finite numbers."""
    f = GGUF_FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (out, inp // f.block, f.block_bytes), dtype=torch.uint8,
                        generator=g)
    offsets = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}[fmt]
    for off in offsets:
        halves = (torch.rand(out, inp // f.block, 1, generator=g) * 0.02).half()
        raw[..., off:off + 2] = halves.view(torch.uint8)
    return raw.flatten(1)


@pytest.mark.parametrize("fmt", sorted(GGUF_FORMATS))
def test_gguf_blocks_dequantize_as_ggml_does(fmt):
    raw = random_blocks(fmt, 5, 512)
    ggml_type = getattr(gguf.GGMLQuantizationType, GGUF_FORMATS[fmt].ggml_type)
    ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), ggml_type))
    w = QuantizedWeight.from_gguf(GGUF_FORMATS[fmt].ggml_type, raw, (5, 512))
    assert torch.equal(w.dequantize(), ref)
    rows = torch.tensor([4, 0, 2])
    assert torch.equal(w.dequantize_rows(rows), ref[rows])


def test_round_to_nearest_matches_ggml_and_bounds_the_error():
    w = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    w[3] = 0  # an all-zero row: scale 0, de-quantizes to zeros
    for fmt in ("q8_0", "q4_0", "q4_1"):
        ggml_type = getattr(gguf.GGMLQuantizationType, GGUF_FORMATS[fmt].ggml_type)
        ours = formats.quantize(w, fmt)["blocks"]
        assert torch.equal(ours, torch.from_numpy(gguf.quants.quantize(w.numpy(), ggml_type)))
    for fmt, group, sym, steps in (("int8", None, True, 127), ("int4", 32, True, 7),
                                   ("int4", 64, False, 15), ("int4", 128, True, 7)):
        q = QuantizedWeight.quantize(w, fmt, group or 128, sym)
        back = q.dequantize()
        assert torch.equal(back[3], torch.zeros(256))
        # round to nearest: at most half a step, a step being the group's range / steps
        span = w.abs().amax(1, keepdim=True) if group is None else \
            w.view(7, -1, group).abs().amax(-1).repeat_interleave(group, 1)
        bound = span * (2 if not sym else 1) / steps / 2 * (1 + 1e-5) + 1e-7
        assert ((back - w).abs() <= bound).all(), fmt


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q4_1", "q4_k", "q6_k"])
def test_splits_keep_blocks_whole_and_sum_to_the_whole(fmt):
    inp, g = 512, torch.Generator().manual_seed(3)
    if fmt in GGUF_FORMATS and fmt not in ("q8_0", "q4_1"):
        w = QuantizedWeight.from_gguf(GGUF_FORMATS[fmt].ggml_type, random_blocks(fmt, 64, inp),
                                      (64, inp))
    else:
        w = QuantizedWeight.quantize(torch.randn(64, inp, generator=g), fmt, 64)
    x = torch.randn(3, inp, generator=g)
    full = x @ w.dequantize().t()
    # float32 sums of `inp` products in another order: tests/tolerances.py's bound, scaled
    # by the largest |x| . |w| (the values' own size, whatever the format's scales)
    scale = float((x.abs() @ w.dequantize().abs().t()).max())
    assert_fp32_close(w.linear(x), full, inp, f"{fmt} whole", scale=scale)
    halves = [w.narrow(1, i * inp // 2, inp // 2) for i in range(2)]
    summed = sum(h.linear(x[:, i * inp // 2:(i + 1) * inp // 2]) for i, h in enumerate(halves))
    assert_fp32_close(summed, full, inp, f"{fmt} input halves", scale=scale)
    rows = torch.cat([w.narrow(0, 0, 40).linear(x), w.narrow(0, 40, 24).linear(x)], -1)
    assert_fp32_close(rows, full, inp, f"{fmt} output rows", scale=scale)
    fused = QuantizedWeight.cat_rows([w.narrow(0, 40, 24), w.narrow(0, 0, 40)])
    order = torch.cat([torch.arange(40, 64), torch.arange(40)])
    assert torch.equal(fused.dequantize(), w.dequantize()[order])
    assert torch.equal(w.index_select_rows(order).dequantize(), fused.dequantize())
    cut = 48 if fmt != "int8" else None
    if cut:
        with pytest.raises(ValueError, match="split its blocks"):
            w.narrow(1, 0, cut)
        assert w.split_sizes_ok(1, inp // w.block_size)
        assert not w.split_sizes_ok(1, 2 * inp // w.block_size)


def test_storage_that_does_not_match_the_shape_is_refused():
    with pytest.raises(ValueError, match=r"expected torch.uint8 \[4, 36\]"):
        QuantizedWeight("q4_0", (4, 64), {"blocks": torch.zeros(4, 35, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="not supported as a low-bit weight.*Q8_0"):
        QuantizedWeight.from_gguf("IQ2_XS", torch.zeros(4, 10, dtype=torch.uint8), (4, 64))
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantizedWeight("q8_0", (4, 40), {"blocks": torch.zeros(4, 34, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="0..15"):
        QuantizedWeight.from_int4(torch.full((2, 32), 16), torch.ones(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="cannot quantize to 'q4_k'"):
        QuantizedWeight.quantize(torch.randn(2, 256), "q4_k")
