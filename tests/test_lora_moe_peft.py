"""peft on an MoE family: the adapters of a LoRA run (all-linear, tp 2) on a tiny Qwen3-MoE
export with tools/convert_hf.py export-adapter and load with `peft.PeftModel.from_pretrained`
on transformers' model, giving our logits. Adapters sit on every layer's attention; MoE layers'
routers and experts (and shared experts) keep none (layers/lora.py), and adapter_config.json's
`exclude_modules` names the MoE blocks so that peft adds none there either.

Dense MLP layers of an MoE model (Qwen3-MoE's `mlp_only_layers`) get gate/up/down adapters,
exported under their HF names; peft 0.21 on transformers 5 reads every gate_proj / up_proj /
down_proj target of a qwen2_moe-type model as the fused experts' parameters
(peft/utils/transformers_weight_conversion.py), so those adapters do not load there: this test
uses a model whose every layer is MoE."""
from __future__ import annotations

import json

import torch

from test_lora import _import_and_train, _our_logits


def _qwen3_moe(folder):
    """A tiny random transformers Qwen3-MoE (vocab 8192: the test corpus's), every layer MoE."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, tie_word_embeddings=False))
    model.save_pretrained(folder)
    return model


def test_moe_adapter_loads_in_peft_with_our_logits(tmp_path, corpus_env, no_grid):
    from peft import PeftModel

    from tools.convert_hf import main as convert

    hf = _qwen3_moe(tmp_path / "hf")
    ckpt = tmp_path / "lora"
    run = _import_and_train(tmp_path, corpus_env, "all-linear")
    assert isinstance(run[0], list), run[0]
    out = tmp_path / "adapter"
    assert convert(["export-adapter", "--load", str(ckpt), "--out", str(out)]) == 0
    from safetensors.torch import load_file

    names = sorted(load_file(str(out / "adapter_model.safetensors")))
    assert len(names) == 2 * 2 * 4 and not any(".mlp." in n for n in names), names  # attention
    ids = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = _our_logits(str(tmp_path / "base"), str(ckpt), ids)
    with torch.no_grad():
        base_logits = hf(ids).logits
        peft_model = PeftModel.from_pretrained(hf, str(out)).eval()
        peft_logits = peft_model(ids).logits
    adapted = sorted(n for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    assert len(adapted) == 8 and not any(".mlp." in n for n in adapted), adapted
    assert (peft_logits - base_logits).abs().max() > 1e-3, "the adapters change nothing"
    torch.testing.assert_close(peft_logits, ours, rtol=1e-4, atol=1e-4)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["exclude_modules"] == r"(model\.layers\.0\.mlp|model\.layers\.1\.mlp)(\..*)?"
