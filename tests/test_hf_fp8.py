"""FP8 Hugging Face checkpoints (quantization_config fp8 / fbgemm_fp8 / compressed-tensors)
de-quantized to float32 on import (models/hf/fp8.py).

The folders are written here in each format's layout: `quantize` below rounds a float weight
to float8_e4m3fn with per-block / per-tensor / per-channel scales amax / 448 (DeepSeek-V3's
and llm-compressor's weight quantizers: the stored scale is the de-quantizing factor), and
`reference` de-quantizes element by element in float64, independent of the reader's code.
transformers (no GPU here) loads fp8 folders de-quantized (FineGrainedFP8 `dequantize`); its
weights and logits are the comparison for that method; fbgemm_fp8 and compressed-tensors need
GPU kernels or an uninstalled package in transformers, so their reference is transformers'
float model holding `reference`'s weights.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_hf_gptq_awq import write_folder

E4M3_MAX = 448.0


def quantize(w: torch.Tensor, rows: int, cols: int):
    """`w [out, in]` -> (float8_e4m3fn `[out, in]`, float32 scales `[ceil(out / rows),
    ceil(in / cols)]`): each rows x cols block (the last ones partial) divided by its
    amax / 448 and rounded to FP8."""
    out, inp = w.shape
    grid = (-(-out // rows), -(-inp // cols))
    scales = torch.empty(grid)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for r in range(grid[0]):
        for c in range(grid[1]):
            blk = w[r * rows:(r + 1) * rows, c * cols:(c + 1) * cols].double()
            s = float(blk.abs().max().clamp(min=1e-12)) / E4M3_MAX
            scales[r, c] = s
            q[r * rows:(r + 1) * rows, c * cols:(c + 1) * cols] = \
                (blk / torch.tensor(s, dtype=torch.float32).double()).float().to(q.dtype)
    return q, scales


def reference(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """fp8 * the scale of its rows x cols block, element by element in float64 (exact), as
    float32."""
    out, inp = q.shape
    w = torch.empty(out, inp, dtype=torch.float64)
    for o in range(out):
        for b in range(scales.shape[1]):
            sl = slice(b * cols, (b + 1) * cols)
            w[o, sl] = q[o, sl].double() * float(scales[o // rows, b])
    return w.float()


# (quantization_config, scale name, how a [out, in] weight is quantized -> (rows, cols),
#  how the scale is stored)
FORMATS = {
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [128, 128]}, "weight_scale_inv",
                  lambda o, i: (128, 128), lambda s: s),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_scale",
                   lambda o, i: (o, i), lambda s: s.reshape(1)),
    "fbgemm": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head"]}, "weight_scale",
               lambda o, i: (1, i), lambda s: s),
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "quantization_status": "compressed", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                    "symmetric": True, "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float",
                                              "strategy": "token", "dynamic": True}}}},
                   "weight_scale", lambda o, i: (1, i), lambda s: s),
}


def fp8_pair(root, model, fmt: str, block=None):
    """(fp8 folder, float folder) of transformers `model`: every decoder linear (2-D weights
    under `.layers.`, experts included, the MoE router not) quantized as `fmt` in the first,
    its exact de-quantization
    in the second; the other tensors equal. `block` overrides fp8-block's [128, 128]."""
    qcfg, scale_name, grid, store = FORMATS[fmt]
    if block is not None:
        qcfg = dict(qcfg, weight_block_size=list(block))
        grid = lambda o, i: tuple(block)  # noqa: E731
    plain = root / f"{fmt}-saved"  # the on-disk names (DeepSeek: one tensor per expert)
    model.save_pretrained(plain)
    sd = load_file(os.path.join(plain, "model.safetensors"))
    floats, packed = dict(sd), dict(sd)
    for name, w in sd.items():
        if ".layers." in name and w.dim() == 2 and not name.endswith("mlp.gate.weight"):
            q, scales = quantize(w, *grid(*w.shape))
            floats[name] = reference(q, scales, *grid(*w.shape))
            packed[name] = q
            packed[name[:-len("weight")] + scale_name] = store(scales)
            if qcfg.get("activation_scheme") == "static":
                packed[name[:-len("weight")] + "input_scale"] = torch.tensor([0.02])
    config = json.load(open(os.path.join(plain, "config.json")))
    return (write_folder(root / fmt, {**config, "quantization_config": qcfg}, packed),
            write_folder(root / f"{fmt}-float", config, floats))


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def tiny_deepseek():
    """DeepSeek-V3 with MLA (low-rank query), a dense first layer, 8 routed experts and a
    shared one; every linear a multiple of 8 (transformers' de-quantizer needs whole
    blocks)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=320, hidden_size=64, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=4,
                           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                           max_position_embeddings=256, num_hidden_layers=2, q_lora_rank=24,
                           v_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=1,
                           rope_interleave=True, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(cfg)


IDS = [[1, 5, 9, 33, 100, 7, 250, 3], [2, 4, 6, 8, 10, 12, 14, 16]]


def _ours(folder) -> torch.Tensor:
    from inference.loading import load

    model, _, _ = load(hf=folder)
    with torch.no_grad():
        out = model(torch.tensor(IDS))
    return (out if torch.is_tensor(out) else out[0])[..., :320].float()


def _theirs(folder):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return m, m(torch.tensor(IDS)).logits.float()


def test_partial_blocks_and_every_scale_layout_dequantize_exactly(tmp_path):
    """One [200, 300] linear in each layout (128x128 blocks: the last row and column blocks
    partial, as DeepSeek-V3's kv_a_proj_with_mqa [576, 7168]; per tensor; per channel) reads
    back as exactly fp8 * scale (the float64 reference); activation scales are dropped; a
    pytorch_model.bin folder reads like safetensors; a ue8m0 (float8_e8m0fnu) block scale
    reads like its float32 value."""
    from models.hf.files import open_hf

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 300, generator=gen)
    for fmt, (qcfg, scale_name, grid, store) in FORMATS.items():
        q, scales = quantize(w, *grid(200, 300))
        t = {"l.weight": q, f"l.{scale_name}": store(scales), "l.bias": torch.randn(200)}
        if fmt == "fp8-tensor":
            t["l.input_scale"] = torch.tensor([0.5])
        src = open_hf(write_folder(tmp_path / fmt, {"model_type": "llama",
                                                     "quantization_config": qcfg}, t))
        assert sorted(src.names) == ["l.bias", "l.weight"], fmt
        got = src.get("l.weight")
        want = reference(q, scales, *grid(200, 300))
        assert got.dtype == torch.float32 and torch.equal(got, want), fmt
        assert (got - w).abs().max() <= w.abs().max() / 16, fmt  # e4m3: 3 mantissa bits
    q, scales = quantize(w, 128, 128)  # a pytorch_model.bin folder reads the same
    os.makedirs(tmp_path / "bin")
    torch.save({"l.weight": q, "l.weight_scale_inv": scales}, tmp_path / "bin" /
               "pytorch_model.bin")
    with open(tmp_path / "bin" / "config.json", "w") as f:
        json.dump({"model_type": "llama", "quantization_config": FORMATS["fp8-block"][0]}, f)
    assert torch.equal(open_hf(str(tmp_path / "bin")).get("l.weight"),
                       reference(q, scales, 128, 128))
    pow2 = torch.exp2(torch.randint(-8, 0, (2, 3), generator=gen).float())
    q = (w / pow2.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]).to(
        torch.float8_e4m3fn)
    src = open_hf(write_folder(tmp_path / "ue8m0", {"model_type": "llama", "quantization_config":
                                                    dict(FORMATS["fp8-block"][0],
                                                         scale_fmt="ue8m0")},
                               {"l.weight": q, "l.weight_scale_inv":
                                pow2.to(torch.float8_e8m0fnu)}))
    assert torch.equal(src.get("l.weight"), reference(q, pow2, 128, 128))


def test_fp8_llama_and_deepseek_match_transformers(tmp_path):
    """A tiny Llama (128x128 blocks) and a tiny DeepSeek-V3 (MLA, routed and shared experts;
    8x8 blocks) in the fp8 block layout of DeepSeek-V3 / Qwen3-FP8: transformers loads the
    folder de-quantized (CPU), its weights equal ours bitwise (both fp8 * scale in float32)
    and our logits its logits within 1e-4; fbgemm_fp8 / compressed-tensors / per-tensor fp8
    Llamas give the logits of their float twins (transformers' float model with the
    reference weights: its own fp8 readers need a GPU or compressed-tensors) within 1e-4.
    Before: config.json's quantization_config fp8 was refused as not supported yet."""
    from models.hf.files import open_hf

    cases = [("llama", tiny_llama(), "fp8-block", None),
             ("deepseek", tiny_deepseek(), "fp8-block", (8, 8))]
    for kind, model, fmt, block in cases:
        qfolder, ffolder = fp8_pair(tmp_path / kind, model, fmt, block)
        theirs, logits = _theirs(qfolder)
        src, state = open_hf(qfolder), theirs.state_dict()
        compared = 0
        for name in src.names:
            if name in state and src.dtype(name) == "F8_E4M3":
                assert torch.equal(src.get(name), state[name]), (kind, name)
                compared += 1
        # every decoder linear but the routed experts (fused in transformers' model)
        assert compared == (14 if kind == "llama" else 16), (kind, compared)
        experts = [n for n in src.names if ".experts." in n]
        assert len(experts) == (0 if kind == "llama" else 24), kind  # 8 x 3 in layer 1
        torch.testing.assert_close(_ours(qfolder), logits, rtol=0, atol=1e-4)
    llama = tiny_llama()
    for fmt in ("fp8-tensor", "fbgemm", "ct-channel"):
        qfolder, ffolder = fp8_pair(tmp_path / "llama", llama, fmt)
        torch.testing.assert_close(_ours(qfolder), _theirs(ffolder)[1], rtol=0, atol=1e-4)


def _tripwire(*a, **k):
    raise AssertionError("tensor data was read for a refused checkpoint")


def test_hostile_and_unsupported_fp8_checkpoints_are_refused_in_one_line(tmp_path,
                                                                          monkeypatch):
    """Each broken or unsupported FP8 folder gets one HFConversionError line from import_hf
    naming the tensor or field and what is read, before any tensor data is read (a tripwire
    on raw reads) and without creating the output folder: a scale whose header lies about
    its shape (a truncated grid), a missing or doubled scale, an integer scale, a scale
    without an FP8 weight, an activation scale of many values, an FP8 fused tensor, another
    fmt / activation scheme / block size, a non-FP8 compressed-tensors format. Non-finite
    or negative scales, NaN FP8 values and a truncated file are refused when read."""
    from checkpoint.hf import import_hf
    from models.hf import HFConversionError
    from models.hf import files

    model = tiny_llama()
    qfolder, _ = fp8_pair(tmp_path, model, "fp8-block")
    cfg = json.load(open(os.path.join(qfolder, "config.json")))
    good = load_file(os.path.join(qfolder, "model.safetensors"))
    p = "model.layers.1.mlp.down_proj"  # weight [128, 256]: scale [1, 2]
    s = f"{p}.weight_scale_inv"

    def variant(name, quant=None, change=None, drop=()):
        t = {k: v for k, v in good.items() if k not in drop}
        t.update(change or {})
        c = dict(cfg, quantization_config={**cfg["quantization_config"], **(quant or {})})
        if quant and "quant_method" in quant and quant["quant_method"] != "fp8":
            c["quantization_config"] = quant
        return write_folder(tmp_path / name, c, t)

    cases = {
        f"'{s}' has shape [1, 1], but the weight [128, 256] (fp8 float8_e4m3fn weights, "
        f"128x128 blocks, dynamic activations) needs [1, 2]":
            variant("short", change={s: good[s][:, :1]}),
        f"'{s}' has dtype I32": variant("int", change={s: good[s].int()}),
        f"the FP8 weight '{p}.weight' has 0 scale tensors": variant("none", drop=[s]),
        f"the FP8 weight '{p}.weight' has 2 scale tensors": variant(
            "two", change={f"{p}.weight_scale": good[s].clone()}),
        "'model.layers.0.input_layernorm.weight_scale' is an FP8 scale, but":
            variant("orphan", change={"model.layers.0.input_layernorm.weight_scale":
                                      torch.ones(1)}),
        f"'{p}.input_scale' has shape [128], but an activation scale is one value":
            variant("act", change={f"{p}.input_scale": torch.ones(128)}),
        "'model.layers.0.mlp.experts.gate_up_proj' is a float8_e4m3fn tensor but not a":
            variant("fused", change={"model.layers.0.mlp.experts.gate_up_proj":
                                     good[f"{p}.weight"].clone()}),
        "fmt 'e5m2' (float8_e4m3fn weights are read)": variant("e5m2", {"fmt": "e5m2"}),
        "activation_scheme 'tensor' (dynamic or static)": variant(
            "actscheme", {"activation_scheme": "tensor"}),
        "weight_block_size [128] (two positive integers)": variant(
            "blk", {"weight_block_size": [128]}),
        "format 'pack-quantized' (only float-quantized": variant(
            "ct", {"quant_method": "compressed-tensors", "format": "pack-quantized"}),
        "weights num_bits 4 type 'int'": variant(
            "ct4", {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                        "strategy": "group"}}}}),
        "'bitsandbytes') is not supported: a method shardzoo does not read": variant(
            "bnb", {"quant_method": "bitsandbytes"}),
    }
    monkeypatch.setattr(files.HFSource, "raw", _tripwire)
    for expected, folder in cases.items():
        out = tmp_path / f"out-{os.path.basename(folder)}"
        with pytest.raises(HFConversionError) as info:
            import_hf(folder, str(out), log=lambda *a: None)
        msg = str(info.value)
        assert expected in msg and "\n" not in msg, (expected, msg)
        assert "fbgemm_fp8 (per-channel" in msg or "nothing was allocated" in msg \
            or "use the model's own files" in msg or "unquantized model" in msg, msg
        assert msg.startswith(folder), msg
        assert not out.exists()
    monkeypatch.undo()
    nan = good[f"{p}.weight"].clone()
    nan.view(torch.uint8)[3, 5] = 0x7F  # float8_e4m3fn's NaN
    read_cases = {
        "holds the scale inf": variant("inf", change={s: good[s] * float("inf")}),
        "holds the scale -": variant("neg", change={s: -good[s]}),
        "holds NaN or infinite FP8 values": variant("nan", change={f"{p}.weight": nan}),
    }
    for expected, folder in read_cases.items():
        out = tmp_path / f"out-{os.path.basename(folder)}"
        with pytest.raises(HFConversionError, match=expected):
            import_hf(folder, str(out), log=lambda *a: None)
        assert not out.exists()
    truncated = variant("truncated")
    path = os.path.join(truncated, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 1000)  # the header lists more bytes
    with pytest.raises(HFConversionError, match="not a readable safetensors file"):
        import_hf(truncated, str(tmp_path / "out-t"), log=lambda *a: None)
    assert not (tmp_path / "out-t").exists()
