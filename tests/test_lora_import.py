"""`tools/convert_hf.py import-adapter` (checkpoint/lora_import.py): an adapter peft's own
`get_peft_model` made on a tiny transformers Llama / Qwen3 becomes a LoRA checkpoint whose
logits are peft's; export-adapter -> import-adapter gives the same tensors bit for bit; every
hostile or unsupported adapter is refused with one line before anything is written.
(Continuing training from an imported adapter at tp 2: tests/test_lora.py
`test_exported_adapter_loads_in_peft_and_merge_folds_it`.)"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from test_lora import _hf_base, _our_logits

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(hf, folder, seed: int = 1, **kw):
    """peft's LoRA on `hf` with random (non-zero) A and B, saved to `folder`; the PeftModel."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = dict(r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False)
    model = get_peft_model(hf, LoraConfig(**{**cfg, **kw})).eval()
    model.save_pretrained(str(folder))
    return model


def _convert(*args: str) -> int:
    from tools.convert_hf import main

    return main(list(args))


def _adapters(ckpt) -> dict:
    from checkpoint.lora_files import read_adapters

    return read_adapters(str(ckpt))[2]


@pytest.mark.parametrize("kind, kw", [
    ("llama", dict(lora_dropout=0.1)),
    ("qwen3", dict(target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True,
                   lora_alpha=16))])
def test_peft_adapter_imports_with_peft_logits_and_round_trips_bitwise(kind, kw, tmp_path,
                                                                        no_grid):
    from safetensors.torch import load_file

    hf = _hf_base(kind, tmp_path / "hf")
    assert _convert("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")) == 0
    peft_model = _peft(hf, tmp_path / "peft", **kw)
    ckpt = tmp_path / "lora"
    assert _convert("import-adapter", "--adapter", str(tmp_path / "peft"), "--base",
                    str(tmp_path / "base"), "--out", str(ckpt)) == 0
    meta = json.loads((ckpt / "metadata.json").read_text())
    base_meta = json.loads((tmp_path / "base" / "metadata.json").read_text())
    from checkpoint.lora_files import base_digest

    lora = meta["lora"]
    assert meta["optimizer_state"] is False and lora["rank"] == 4
    assert lora["base"] == {"path": str(tmp_path / "base"), "sha256": base_digest(base_meta)}
    assert lora["use_rslora"] is kw.get("use_rslora", False)
    assert lora["dropout"] == kw.get("lora_dropout", 0.0)
    assert lora["target_modules"] == ("all-linear" if kind == "llama" else
                                      "q_proj,v_proj,down_proj")
    flags = (ckpt / "config.yaml").read_text()
    assert "lora_rank: 4" in flags and f"use_rslora: {str(lora['use_rslora']).lower()}" in flags

    ids = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs = peft_model(ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(ids).logits
    assert (theirs - plain).abs().max() > 1e-2, "the adapter changes nothing"
    torch.testing.assert_close(_our_logits(str(tmp_path / "base"), str(ckpt), ids), theirs,
                               rtol=1e-5, atol=1e-5)

    stored = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    imported = _adapters(ckpt)
    assert len(imported) * 2 == len(stored)
    for module, (a, b) in imported.items():  # the file's tensors as they are
        assert torch.equal(a, stored[f"base_model.model.{module}.lora_A.weight"]), module
        assert torch.equal(b, stored[f"base_model.model.{module}.lora_B.weight"]), module
    assert _convert("export-adapter", "--load", str(ckpt), "--out", str(tmp_path / "out")) == 0
    assert _convert("import-adapter", "--adapter", str(tmp_path / "out"), "--base",
                    str(tmp_path / "base"), "--out", str(tmp_path / "again")) == 0
    again = _adapters(tmp_path / "again")
    assert again.keys() == imported.keys()
    assert all(torch.equal(again[m][i], imported[m][i]) for m in again for i in (0, 1))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Llama's base checkpoint and a good peft adapter for it (and the HF model)."""
    root = tmp_path_factory.mktemp("import-adapter")
    hf = _hf_base("llama", root / "hf")
    assert _convert("import", "--hf", str(root / "hf"), "--out", str(root / "base")) == 0
    _peft(hf, root / "good")
    return root, hf


def _variant(root, name: str, config: dict | None = None, tensors=None) -> str:
    """A copy of the good adapter with `config` fields set and its tensors edited by
    `tensors(dict) -> dict` (None: the file kept)."""
    from safetensors.torch import load_file, save_file

    folder = root / name
    shutil.copytree(root / "good", folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    if tensors is not None:
        path = str(folder / "adapter_model.safetensors")
        save_file(tensors(load_file(path)), path)
    return str(folder)


def _pickle_only(root, name):
    folder = _variant(root, name)
    from safetensors.torch import load_file

    weights = os.path.join(folder, "adapter_model.safetensors")
    torch.save(load_file(weights), os.path.join(folder, "adapter_model.bin"))
    os.remove(weights)
    return folder


def _truncated(root, name):
    folder = _variant(root, name)
    weights = os.path.join(folder, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 100)
    return folder


def _rank_lie(root, name):  # the config claims r=8, the tensors are rank 4
    return _variant(root, name, {"r": 8})


def _no_such_module(root, name):
    def extra(t):
        t["base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
        return t
    return _variant(root, name, tensors=extra)


def _other_base(root, name):  # made on a Llama with another intermediate size
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False))
    _peft(hf, root / name)
    return str(root / name)


def _one_layer(root, name):  # peft's layers_to_transform=[0], as its file would be
    def drop(t):
        return {k: v for k, v in t.items() if ".layers.1." not in k}
    return _variant(root, name, tensors=drop)


def _nan(root, name):
    def poison(t):
        t["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"][0, 0] = float("nan")
        return t
    return _variant(root, name, tensors=poison)


HOSTILE = {
    "pickle": (_pickle_only, "only a pickle adapter_model.bin, refused"),
    "truncated": (_truncated, "is not a readable safetensors file"),
    "rank-lie": (_rank_lie, r"lora_A.weight. has shape \[4, (\d+)\], the base model and r=8 "
                          r"need \[8, \1\]"),
    "no-such-module": (_no_such_module, "is not a LoRA weight of a linear this model has"),
    "other-base": (_other_base, r"has shape \[(4, 128|128, 4)\], the base model and r=4 "
                                r"need \[(4, 96|96, 4)\]"),
    "some-layers": (_one_layer, "none on model.layers.1.self_attn.q_proj; our LoRA adapts"),
    "layers-to-transform": (lambda r, n: _variant(r, n, {"layers_to_transform": [0]}),
                            "layers_to_transform=.0. is not supported; only plain LoRA"),
    "dora": (lambda r, n: _variant(r, n, {"use_dora": True}),
             "use_dora=True is not supported; only plain LoRA"),
    "loha": (lambda r, n: _variant(r, n, {"peft_type": "LOHA"}),
             "peft_type 'LOHA' is not supported; only plain LoRA adapters"),
    "nan": (_nan, "holds NaN or infinite values"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_or_unsupported_adapters_are_refused_in_one_line(case, made, capsys, no_grid):
    root, _ = made
    make, why = HOSTILE[case]
    folder = make(root, case)
    out = root / f"out-{case}"
    capsys.readouterr()
    assert _convert("import-adapter", "--adapter", folder, "--base", str(root / "base"),
                    "--out", str(out)) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and re.search(why, err), err
    assert not out.exists() and not list(root.glob(f"out-{case}*")), "something was written"


def test_refused_bases_and_outputs(made, capsys, no_grid):
    root, _ = made
    good, base = str(root / "good"), str(root / "base")
    assert _convert("import-adapter", "--adapter", good, "--base", base, "--out",
                    str(root / "ok")) == 0
    before = sorted(os.listdir(root / "ok"))
    capsys.readouterr()
    for args, why in [
        (["--base", base, "--out", str(root / "ok")], "already exists; pass a new folder"),
        (["--base", str(root / "ok"), "--out", str(root / "x")], "is a LoRA run's checkpoint"),
        (["--base", base, "--out", str(root / "x"), "--lora-base-quantization", "gguf"],
         "is not a .gguf file")]:
        assert _convert("import-adapter", "--adapter", good, *args) == 1
        assert why in capsys.readouterr().err
    assert sorted(os.listdir(root / "ok")) == before and not (root / "x").exists()
