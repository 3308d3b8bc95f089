"""GPTQ and AWQ checkpoints (config.json quantization_config) read into int4 `QuantizedWeight`
values or de-quantized floats (models/hf/quantized.py).

The checkpoints here are packed by `pack_gptq` / `pack_awq` below: the packing loops of
AutoGPTQ's QuantLinear.pack (rows 8r..8r+7 of the transposed weight ORed into qweight[r] at
bits 4(j - 8r); zero points minus one in its original format) and AutoAWQ's
WQLinear_GEMM.from_linear (columns in the order 0, 2, 4, 6, 1, 3, 5, 7), written out as plain
loops over numpy uint32, independent of the reader's vectorised unpacking. The reference
weight is scale (q - zero) per element in float64.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_gptq(q: np.ndarray, zeros: np.ndarray, v1: bool) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's layout. `q [in, out]` and `zeros [groups, out]` in 0..15 (v1: 1..16, the
    stored value being zero - 1) -> (qweight int32 [in / 8, out], qzeros int32
    [groups, out / 8])."""
    inp, out = q.shape
    intweight = q.astype(np.uint32)
    qweight = np.zeros((inp // 8, out), dtype=np.uint32)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    z = (zeros - 1 if v1 else zeros).astype(np.uint32)
    qzeros = np.zeros((z.shape[0], out // 8), dtype=np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= z[:, j] << (4 * (j - i))
        i += 8
        col += 1
    return qweight.view(np.int32), qzeros.view(np.int32)


def pack_awq(q: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoAWQ's GEMM layout. `q [in, out]`, `zeros [groups, out]` in 0..15 ->
    (qweight int32 [in, out / 8], qzeros int32 [groups, out / 8])."""
    def pack(t):
        t = t.astype(np.uint32)
        packed = np.zeros((t.shape[0], t.shape[1] // 8), dtype=np.uint32)
        for col in range(t.shape[1] // 8):
            for i in range(8):
                packed[:, col] |= t[:, col * 8 + AWQ_PACK_ORDER[i]] << (i * 4)
        return packed.view(np.int32)

    return pack(q), pack(zeros)


def random_layer(gen: torch.Generator, out: int, inp: int, group: int, sym: bool,
                 lo_zero: int = 0):
    """Random 4-bit values `q [in, out]`, zero points `[groups, out]` (8 when `sym`, else
    lo_zero..15) and fp16 scales `[groups, out]` (group -1: one group)."""
    groups = 1 if group == -1 else inp // group
    q = torch.randint(0, 16, (inp, out), generator=gen)
    zeros = torch.full((groups, out), 8) if sym else \
        torch.randint(lo_zero, 16, (groups, out), generator=gen)
    scales = (torch.rand(groups, out, generator=gen) * 0.05 + 0.001).half()
    return q, zeros, scales


def reference(q, zeros, scales, g_idx) -> torch.Tensor:
    """weight [out, in] = scale (q - zero), per element, float64 -> float32."""
    g = g_idx.long()
    w = (q.double() - zeros.double()[g]) * scales.double()[g]
    return w.t().float().contiguous()


def packed_tensors(method: str, prefix: str, q, zeros, scales, g_idx=None, v1=True) -> dict:
    """The checkpoint tensors of one quantized linear `prefix`."""
    if method == "gptq":
        qweight, qzeros = pack_gptq(q.numpy(), zeros.numpy(), v1)
    else:
        qweight, qzeros = pack_awq(q.numpy(), zeros.numpy())
    t = {f"{prefix}.qweight": torch.from_numpy(qweight), f"{prefix}.qzeros":
         torch.from_numpy(qzeros), f"{prefix}.scales": scales}
    if g_idx is not None:
        t[f"{prefix}.g_idx"] = g_idx.int()
    return t


def qconfig(method: str, group: int = 128, **kw) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                "sym": True, "checkpoint_format": "gptq", **kw}
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", **kw}


def write_folder(folder, config: dict, tensors: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(folder, "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("method,fmt,group,sym", [
    ("gptq", "gptq", 128, True), ("gptq", "gptq", 32, False), ("gptq", "gptq_v2", 64, False),
    ("gptq", "gptq", -1, False), ("gptq", "gptq_v2", 256, True),
    ("awq", "gemm", 128, False), ("awq", "gemm", 32, False), ("awq", "gemm", 64, False)])
def test_one_layer_dequantizes_exactly(tmp_path, method, fmt, group, sym):
    """Every layout reads back to exactly scale (q - zero): as an int4 QuantizedWeight of the
    largest int4 group size dividing the file's (-1: whole input; 256: 128, scales repeated),
    and as floats (quantization "none")."""
    from layers.quant import QuantizedWeight
    from models.hf.files import open_hf

    gen = torch.Generator().manual_seed(hash((method, fmt, group, sym)) % 2**31)
    out, inp = 48, 512
    # GPTQ v1 stores zero - 1: zero points 1..15 (a zero of 0 overflows AutoGPTQ's packer)
    q, zeros, scales = random_layer(gen, out, inp, group, sym,
                                    lo_zero=1 if fmt == "gptq" else 0)
    g_idx = torch.arange(inp) // (inp if group == -1 else group)
    extra = {"checkpoint_format": fmt} if method == "gptq" else {}
    tensors = packed_tensors(method, "layer", q, zeros, scales,
                             g_idx if method == "gptq" else None, v1=fmt == "gptq")
    folder = write_folder(tmp_path / "m", {"model_type": "llama", "quantization_config":
                                           qconfig(method, group, **extra)}, tensors)
    want = reference(q, zeros, scales, g_idx)
    kept = open_hf(folder, quantization="keep")
    assert kept.names == ["layer.weight"] and kept.shape("layer.weight") == (out, inp)
    assert kept.quantization == method
    w = kept.get("layer.weight")
    assert isinstance(w, QuantizedWeight) and w.format == "int4" and w.shape == (out, inp)
    assert w.block_size == (128 if group in (-1, 256) else group)
    assert torch.equal(w.dequantize(), want)
    floats = open_hf(folder).get("layer.weight")
    assert floats.dtype == torch.float32 and torch.equal(floats, want)
    x = torch.randn(3, inp, generator=gen)
    torch.testing.assert_close(w.linear(x), x @ want.t(), rtol=1e-5, atol=1e-5)


def test_gptq_zero_offset_and_act_order(tmp_path):
    """checkpoint_format gptq stores zero - 1 (read back + 1, also for a stored 15: zero 16),
    gptq_v2 the zero itself; the same bytes read under the two formats differ by exactly one
    scale. An act-order g_idx (desc_act true) de-quantizes exactly with quantization "none"
    and is refused in one line with "keep"."""
    from models.hf import HFConversionError
    from models.hf.files import open_hf

    gen = torch.Generator().manual_seed(5)
    out, inp, group = 16, 256, 64
    q, zeros, scales = random_layer(gen, out, inp, group, sym=False)
    zeros[0, :8] = 16  # stored as 15 by the v1 packer: the largest a v1 file holds
    tensors = packed_tensors("gptq", "l", q, zeros.clamp(1, 16), scales, v1=True)
    v1 = write_folder(tmp_path / "v1", {"model_type": "llama", "quantization_config":
                                        qconfig("gptq", group)}, tensors)
    v2 = write_folder(tmp_path / "v2", {"model_type": "llama", "quantization_config":
                                        qconfig("gptq", group, checkpoint_format="gptq_v2")},
                      tensors)
    g = torch.arange(inp) // group
    want = reference(q, zeros.clamp(1, 16), scales, g)
    assert torch.equal(open_hf(v1, quantization="keep").get("l.weight").dequantize(), want)
    shifted = reference(q, zeros.clamp(1, 16) - 1, scales, g)
    assert torch.equal(open_hf(v2, quantization="keep").get("l.weight").dequantize(), shifted)

    perm = torch.randperm(inp, generator=gen)
    act_order = (torch.arange(inp) // group)[perm]  # each group: 64 scattered columns
    tensors = packed_tensors("gptq", "l", q, zeros.clamp(1, 16), scales, act_order)
    folder = write_folder(tmp_path / "act", {"model_type": "llama", "quantization_config":
                                             qconfig("gptq", group, desc_act=True)}, tensors)
    assert torch.equal(open_hf(folder).get("l.weight"),
                       reference(q, zeros.clamp(1, 16), scales, act_order))
    with pytest.raises(HFConversionError) as info:
        open_hf(folder, quantization="keep").get("l.weight")
    msg = str(info.value)
    assert "desc_act" in msg and "--quantization none" in msg and "\n" not in msg
