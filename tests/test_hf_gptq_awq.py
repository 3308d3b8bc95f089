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

    inp = 200  # per-channel (group_size -1) over an input no int4 group size divides
    q, zeros, scales = random_layer(gen, out, inp, -1, sym=False, lo_zero=1)
    folder = write_folder(tmp_path / "odd", {"model_type": "llama", "quantization_config":
                                             qconfig("gptq", -1)},
                          packed_tensors("gptq", "l", q, zeros, scales))
    assert torch.equal(open_hf(folder).get("l.weight"),
                       reference(q, zeros, scales, torch.zeros(inp, dtype=torch.long)))
    with pytest.raises(HFConversionError, match="groups of 200 input columns, which int4"):
        open_hf(folder, quantization="keep").get("l.weight")


def _tiny_hf(kind: str):
    """A tiny random transformers model: Llama with GQA and an untied head, or Qwen2 with q/k/v
    biases and a tied head (every linear's input a multiple of 128)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg = (LlamaConfig(tie_word_embeddings=False, **common) if kind == "llama" else
           Qwen2Config(tie_word_embeddings=True, **common))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def quantized_pair(root, kind: str, method: str, group: int = 128):
    """(quantized folder, float folder): every decoder linear of a tiny model replaced by
    random 4-bit values packed as `method` in one, by their exact de-quantization (float32)
    in the other; the other tensors equal."""
    model = _tiny_hf(kind)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(7)
    floats, packed = dict(sd), dict(sd)
    for name, w in sd.items():
        if ".layers." in name and name.endswith("proj.weight"):
            out, inp = w.shape
            q, zeros, scales = random_layer(gen, out, inp, group, sym=False, lo_zero=1)
            g_idx = torch.arange(inp) // group
            floats[name] = reference(q, zeros, scales, g_idx)
            del packed[name]
            packed.update(packed_tensors(method, name[:-len(".weight")], q, zeros, scales,
                                         g_idx if method == "gptq" else None))
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype",
                                                                         "torch_dtype")}
    config["architectures"] = [type(model).__name__]
    qfolder = write_folder(root / f"{kind}-{method}", {**config, "quantization_config":
                                                       qconfig(method, group)}, packed)
    return qfolder, write_folder(root / f"{kind}-{method}-float", config, floats)


@pytest.mark.parametrize("kind,method", [("llama", "gptq"), ("qwen2", "awq")])
def test_tiny_model_loads_like_its_float_twin(tmp_path, kind, method):
    """A Llama/Qwen2-shaped GPTQ/AWQ folder through the HF import path (open_checked: config
    and tensor shapes checked): with quantization "keep" each decoder linear is an int4
    QuantizedWeight that de-quantizes to the float twin's tensor bitwise, the other tensors
    are the twin's; with "none" every native parameter (fused QKV, gate/up) equals the
    twin's bitwise. Before: config.json's quantization_config was refused."""
    from layers.quant import QuantizedWeight
    from models.hf import open_checked, to_native

    qfolder, ffolder = quantized_pair(tmp_path, kind, method)
    fsrc, fconfig = open_checked(ffolder)
    ksrc, kconfig = open_checked(qfolder, quantization="keep")
    assert kconfig == fconfig and sorted(ksrc.names) == sorted(fsrc.names)
    packed = 0
    for name in fsrc.names:
        got, want = ksrc.get(name), fsrc.get(name)
        if isinstance(got, QuantizedWeight):
            packed += 1
            assert got.format == "int4" and got.block_size == 128
            got = got.dequantize()
        assert torch.equal(got, want), name
    assert packed == 14  # 7 linears in each of 2 layers
    nsrc, nconfig = open_checked(qfolder)  # quantization "none"
    ours = to_native(nconfig, kind, nsrc.get, nsrc.names)
    twin = to_native(fconfig, kind, fsrc.get, fsrc.names)
    assert ours.keys() == twin.keys()
    for name in ours:
        assert torch.equal(ours[name](), twin[name]()), name


def _tripwire(*a, **k):
    raise AssertionError("packed data was read for a refused checkpoint")


def test_hostile_and_unsupported_checkpoints_are_refused_in_one_line(tmp_path, monkeypatch):
    """Each broken or unsupported quantized folder gets one HFConversionError line naming the
    tensor / field (and what is supported) from import_hf, before any packed data is read
    (a tripwire on the unpacking and on raw reads; a g_idx is read, in int32 values, and
    checked before the rest) and without creating the output folder."""
    from checkpoint.hf import import_hf
    from models.hf import HFConversionError
    from models.hf import files, quantized
    from safetensors.torch import load_file

    qfolder, _ = quantized_pair(tmp_path, "llama", "gptq")
    cfg = json.load(open(os.path.join(qfolder, "config.json")))
    good = load_file(os.path.join(qfolder, "model.safetensors"))
    p = "model.layers.1.mlp.down_proj"  # [128, 256]: qweight [32, 128], 2 groups

    def variant(name, quant=None, change=None, drop=()):
        t = {k: v for k, v in good.items() if k not in drop}
        t.update(change or {})
        c = dict(cfg, quantization_config={**cfg["quantization_config"], **(quant or {})})
        return write_folder(tmp_path / name, c, t)

    shape_cases = {
        f"'{p}.qzeros' has shape [2, 15]": variant(
            "qzeros", change={f"{p}.qzeros": good[f"{p}.qzeros"][:, :15]}),
        f"'{p}.scales' has dtype I32": variant(
            "scales_dtype", change={f"{p}.scales": good[f"{p}.scales"].int()}),
        f"'{p}.qweight' has dtype F16, not I32": variant(
            "qweight_dtype", change={f"{p}.qweight": good[f"{p}.qweight"].half()}),
        f"'{p}.qzeros' has shape [2, 16], but qweight [16, 128] with group_size 128 "
        f"needs [1, 16]": variant("qweight_rows", change={f"{p}.qweight":
                                                          good[f"{p}.qweight"][:16]}),
        f"'{p}.weight' has shape [128, 128] in the weight files, config.json needs "
        f"[128, 256]": variant("in_128", change={f"{p}.qweight": good[f"{p}.qweight"][:16],
                                                  f"{p}.qzeros": good[f"{p}.qzeros"][:1],
                                                  f"{p}.scales": good[f"{p}.scales"][:1],
                                                  f"{p}.g_idx": good[f"{p}.g_idx"][:128]}),
        "group_size 96 does not divide the input size 128": variant(
            "group96", quant={"group_size": 96}),
        f"'{p}' has no scales tensor": variant("noscales", drop=[f"{p}.scales"]),
        f"'{p}' has no g_idx, which desc_act true needs": variant(
            "no_g_idx", quant={"desc_act": True}, drop=[f"{p}.g_idx"]),
        "bits 8 (only 4-bit checkpoints are read)": variant("bits8", quant={"bits": 8}),
        "checkpoint_format 'marlin'": variant("marlin", quant={"checkpoint_format": "marlin"}),
        "'bitsandbytes') is not supported: a method shardzoo does not read": variant(
            "bnb", quant={"quant_method": "bitsandbytes"}),
        "'compressed-tensors') is not supported": variant(
            "ct", quant={"quant_method": "compressed-tensors"}),
        "fp8 quantization_config but the weight files hold no float8_e4m3fn": variant(
            "fp8", quant={"quant_method": "fp8"}),
        "version 'gemv' (only AWQ's gemm layout is read)": variant(
            "gemv", quant={"quant_method": "awq", "version": "gemv"}),
        "zero_point False": variant("awq_nozero", quant={"quant_method": "awq",
                                                         "zero_point": False}),
    }
    monkeypatch.setattr(quantized, "unpack_int32", _tripwire)
    monkeypatch.setattr(files.HFSource, "raw", _tripwire)
    for expected, folder in shape_cases.items():
        out = tmp_path / f"out-{os.path.basename(folder)}"
        with pytest.raises(HFConversionError) as info:
            import_hf(folder, str(out), log=lambda *a: None)
        msg = str(info.value)
        assert expected in msg and "\n" not in msg, (expected, msg)
        assert "gptq (bits 4" in msg or "nothing was allocated" in msg, msg  # the fix
        assert msg.startswith(folder), msg  # names the checkpoint
        assert not out.exists()
    monkeypatch.undo()
    monkeypatch.setattr(quantized, "unpack_int32", _tripwire)
    g_idx = good[f"{p}.g_idx"].clone()
    g_idx[5] = 2  # the layer has groups 0 and 1
    folder = variant("g_idx", change={f"{p}.g_idx": g_idx})
    for mode in ("keep", "none"):
        with pytest.raises(HFConversionError, match=f"'{p}.g_idx' holds group 2, outside"):
            files.open_hf(folder, quantization=mode).get(f"{p}.weight")
    monkeypatch.undo()  # the layers before it load
    with pytest.raises(HFConversionError, match="outside the layer's 2 groups"):
        import_hf(folder, str(tmp_path / "out-g"), log=lambda *a: None)
    assert not (tmp_path / "out-g").exists()


# run in the python of SHARDZOO_GPTQMODEL_PYTHON: transformers' own reading of a GPTQ/AWQ
# folder (optimum + gptqmodel, CPU kernels), its de-quantized weights and logits saved
_TRANSFORMERS_DUMP = r"""
import sys, torch
from transformers import AutoModelForCausalLM
folder, ids, out = sys.argv[1], torch.tensor(eval(sys.argv[2])), sys.argv[3]
m = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.float32)
res = {"weights": {}}
for name, mod in m.named_modules():
    if hasattr(mod, "qweight"):
        w = mod.dequantize_weight() if hasattr(mod, "dequantize_weight") else \
            mod.awq_weight_dequantize("cpu", torch.float32)
        w = (w[0] if isinstance(w, tuple) else w).float()
        assert tuple(w.shape) == (mod.in_features, mod.out_features), w.shape
        res["weights"][name + ".weight"] = w.t().contiguous()
with torch.no_grad():
    res["logits"] = m(ids).logits.float()
torch.save(res, out)
"""


@pytest.mark.parametrize("kind,method", [("llama", "gptq"), ("qwen2", "awq")])
def test_against_transformers_own_dequantization(tmp_path, kind, method, no_grid):
    """transformers reads GPTQ / AWQ through optimum + gptqmodel, which are not dependencies:
    with SHARDZOO_GPTQMODEL_PYTHON naming a python that has them (a separate virtual
    environment), its de-quantized weights must be ours rounded to float16 (it computes
    scale (q - zero) in float16; ours is the exact float32 value) and its logits within 1e-2
    of ours (it multiplies in bfloat16 on CPU; measured 1.2e-3 on 2026-12-05)."""
    import subprocess
    import sys

    from inference.loading import load
    from models.hf.files import open_hf

    python = os.environ.get("SHARDZOO_GPTQMODEL_PYTHON")
    if not python:
        pytest.skip("SHARDZOO_GPTQMODEL_PYTHON is not set (a python with transformers, "
                    "optimum and gptqmodel, e.g. a virtual environment: pip install optimum "
                    "gptqmodel)")
    qfolder, _ = quantized_pair(tmp_path, kind, method)
    ids = [[1, 5, 9, 33, 100, 7, 250, 3], [2, 4, 6, 8, 10, 12, 14, 16]]
    dump = tmp_path / "theirs.pt"
    proc = subprocess.run([python, "-c", _TRANSFORMERS_DUMP, qfolder, repr(ids), str(dump)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = torch.load(dump, weights_only=True)
    src = open_hf(qfolder, quantization="keep")
    assert len(theirs["weights"]) == 14
    for name, w in theirs["weights"].items():
        assert torch.equal(src.get(name).dequantize().half().float(), w), name
    model, _, _ = load(hf=qfolder)
    with torch.no_grad():
        ours = model(torch.tensor(ids))
    ours = (ours if torch.is_tensor(ours) else ours[0])[..., :theirs["logits"].shape[-1]]
    torch.testing.assert_close(ours, theirs["logits"], rtol=0, atol=1e-2)


def test_unpacking_reads_both_byte_orders_like_the_packers(monkeypatch):
    """`unpack_int32` (the int32s' bytes on a little-endian machine, shifts elsewhere) gives
    back the values the packers above put in, in natural and in AWQ's order, across chunks."""
    from types import SimpleNamespace

    from models.hf import quantized

    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 40), generator=gen)
    zeros = torch.randint(0, 16, (2, 40), generator=gen)
    gptq, _ = pack_gptq(q.numpy(), zeros.numpy(), v1=False)
    awq, _ = pack_awq(q.numpy(), zeros.numpy())
    monkeypatch.setattr(quantized, "_CHUNK", 7)  # several chunks, one ragged
    for order in ("little", "big"):
        monkeypatch.setattr(quantized, "sys", SimpleNamespace(byteorder=order))
        got = quantized.unpack_int32(torch.from_numpy(gptq).t())
        assert torch.equal(got, q.t().to(torch.uint8)), order
        got = quantized.unpack_int32(torch.from_numpy(awq), quantized.AWQ_REVERSE_ORDER)
        assert torch.equal(got, q.to(torch.uint8)), order
