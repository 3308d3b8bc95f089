"""Mixture-of-experts Hugging Face families (models/hf/moe.py) against transformers' own
tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE models:

- logits on a [2, 16] batch equal transformers' at tp 1, tp 2 (infer.py's loader reading the
  HF folder), tp 2 x pp 2 (the imported checkpoint), ep 2 and ep 2 x tp 2 (a training-style
  model on an expert-parallel grid, loaded both from the HF folder and from the checkpoint),
  Mixtral past its sliding window;
- infer.py's loader at --tp 2 --enable-expert-parallel (whole experts spread over the two TP
  ranks), from the HF folder and from the checkpoint: logits, and the Engine's greedy ids;
- greedy generation of 24 tokens through the Engine at tp 2 equals transformers' generate;
- a Qwen3-MoE GGUF file (tests/gguf_files.py) imported at tp 2 (infer.py's loader) and
  ep 2 x tp 2 gives its original's logits;
- import (from sharded safetensors too) -> export is bitwise, and transformers loads the
  export with no missing, unexpected or mismatched tensor;
- one train.py --finetune step at tp 2 from an import of Mixtral, Qwen2-MoE, Qwen3-MoE and
  OLMoE, exported back bitwise (lr 0);
- refusals: router jitter, a gpt-oss config without its fields, MoE fields on a dense
  family's config, bad Qwen2-MoE layer fields, an MoE model with no HF equivalent.
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
from launch import REPO, read_metrics, train_in_one_world
from tolerances import assert_fp32_close, forward_chain_terms, fp32_mismatch

B, S, VOCAB, NEW = 2, 16, 400, 24  # VOCAB: test_finetune's tokenizer has 400 ids
PROMPT = [5, 17, 99, 3, 42, 8, 61, 2, 11, 150, 7, 30]


def _hf_configs() -> dict:
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=None)
    return {
        # every layer MoE, top-2 renormalised, sliding window 6 < S
        "mixtral": MixtralConfig(intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                                 sliding_window=6, tie_word_embeddings=False, **common),
        # shared expert + gate, no renormalisation (norm_topk_prob false), layer 1 dense
        "qwen2_moe": Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=80, num_hidden_layers=4,
                                    num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                    tie_word_embeddings=True, **common),
        # renormalised top-3, sparse every 2nd layer (1, 3), no q/k/v biases
        "qwen2_moe_norm": Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48,
                                         num_hidden_layers=4, num_experts=6,
                                         num_experts_per_tok=3, norm_topk_prob=True,
                                         decoder_sparse_step=2, qkv_bias=False,
                                         tie_word_embeddings=False, **common),
        # per-head q/k norms, renormalised top-2, layer 0 dense, every layer sliding (6 < S)
        "qwen3_moe": Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                    num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                    norm_topk_prob=True, mlp_only_layers=[0],
                                    use_sliding_window=True, sliding_window=6,
                                    tie_word_embeddings=False, **common),
        # q/k norms over the whole projections (all-reduced over TP), top-2 not renormalised
        "olmoe": OlmoeConfig(intermediate_size=48, num_hidden_layers=2, num_experts=4,
                             num_experts_per_tok=2, tie_word_embeddings=False,
                             pad_token_id=None, **common),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (hf folder, native checkpoint folder); qwen2_moe saved in several safetensors
    shards (its import reads the index)."""
    from checkpoint.hf import import_hf
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf-moe")
    out = {}
    for i, (name, cfg) in enumerate(_hf_configs().items()):
        torch.manual_seed(30 + i)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # random norms and biases, so a swapped one shows
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if "norm" in pname else 0.0, 0.1)
        hf_dir, ckpt = str(root / name), str(root / f"{name}-ckpt")
        model.save_pretrained(hf_dir, max_shard_size="100KB" if name == "qwen2_moe" else "5GB")
        import_hf(hf_dir, ckpt, log=lambda *a: None)
        out[name] = (hf_dir, ckpt)
    assert os.path.exists(os.path.join(out["qwen2_moe"][0], "model.safetensors.index.json"))
    return out


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))


def _config(ckpt: str):
    from checkpoint.format import read_metadata
    from models import ModelConfig

    return ModelConfig.from_dict(read_metadata(ckpt)["model"])


def _hf(hf_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def test_configs_and_logits_at_tp1(models):
    from checkpoint.model_io import load_model_weights
    from models import GPTModel

    want = {"mixtral": (4, 2, False, 1, None, (5, 0)),
            "qwen2_moe": (4, 2, True, [1, 0, 1, 1], 80, None),
            "qwen2_moe_norm": (6, 3, False, [0, 1, 0, 1], 48, None),
            "qwen3_moe": (4, 2, False, [0, 1], None, (5, 0)),
            "olmoe": (4, 2, True, 1, None, None)}
    for name, (hf_dir, ckpt) in models.items():
        c = _config(ckpt)
        assert (c.num_moe_experts, c.moe_router_topk, c.moe_router_pre_softmax, c.moe_layer_freq,
                c.moe_shared_expert_intermediate_size, c.window_size) == want[name], name
        assert c.moe_shared_expert_gate == name.startswith("qwen2")
        assert c.add_qkv_bias == (name == "qwen2_moe")
        assert c.qk_layernorm == (name in ("qwen3_moe", "olmoe")) and c.kv_channels == 16
        assert c.qk_norm_over_heads == (name == "olmoe")
        model = GPTModel(c).eval()
        load_model_weights(ckpt, [model])
        with torch.no_grad():
            ours = model(_ids())[..., :VOCAB]
            ref = _hf(hf_dir)(_ids()).logits
        print(f"{name} tp1: max |logit - transformers| {(ours - ref).abs().max():.2e}")
        assert_fp32_close(ours, ref, forward_chain_terms(c, S, "logits"), f"{name} at tp 1")


# ------------------------------------------------------------------ one world of 4 ranks
def _gathered_logits(model, ids):
    """Full `[b, s, vocab]` logits of a one-stage model, gathered over TP."""
    import parallel_state as ps

    with torch.no_grad():
        out = model.eval()(ids)
    return ps.gather_from_tensor_model_parallel_region(out)[..., :VOCAB]


def _mismatch(logits, ref, config) -> tuple[str | None, float]:
    """(tolerances.fp32_mismatch: None when within the forward chain's float32 rounding,
    the largest |logit - transformers'|)."""
    return (fp32_mismatch(logits, ref, forward_chain_terms(config, S, "logits")),
            float((logits - ref).abs().max()))


def _grid(tp: int, pp: int = 1, ep: int = 1) -> None:
    import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, device="cpu", expert_model_parallel_size=ep)


def _world(models: dict, refs: dict, gguf: tuple | None) -> dict:
    """Every layout's {name: `_mismatch` against `refs` (ep layouts: also whether the HF and
    checkpoint loads are equal, and the experts a rank holds)} and the tp 2 Engine's greedy
    ids; a last stage's view per layout. `gguf`: (a GGUF file, its original's logits), whose
    import at tp 2 and ep 2 x tp 2 lands in "gguf"."""
    from test_hf_conversion import pipeline_logits

    from checkpoint.hf import load_hf_weights
    from checkpoint.model_io import load_model_weights
    from inference.engine import Engine, Request
    from inference.loading import initialize_serving_grid, load
    from inference.sampling import SamplingParams
    from models import GPTModel
    from models.hf import open_checked
    from models.pipeline import build_model_chunks
    import parallel_state as ps

    out = {"tp2": {}, "tp2pp2": {}, "ep2": {}, "ep2tp2": {}, "tp2_expert_parallel": {},
           "generate": {}, "generate_expert_parallel": {}, "gguf": {}}

    def generate(model):
        engine = Engine(model, max_batch_size=2, max_seq_length=64)
        req = Request("0", PROMPT, SamplingParams(max_new_tokens=NEW))
        engine.generate([req])
        return req.output

    _grid(2)  # infer.py's loader on the HF folder (dp 2)
    for name, (hf_dir, ckpt) in models.items():
        model, _, _ = load(hf=hf_dir)
        out["tp2"][name] = _mismatch(_gathered_logits(model, _ids()), refs[name], model.config)
        out["generate"][name] = generate(model)
    ps.destroy_model_parallel()  # infer.py --tp 2 --enable-expert-parallel: experts over TP
    initialize_serving_grid(2, 1, enable_expert_parallel=True)
    for name, (hf_dir, ckpt) in models.items():
        model, _, _ = load(hf=hf_dir)
        from_ckpt, _, _ = load(load=ckpt)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), from_ckpt.parameters()))
        out["tp2_expert_parallel"][name] = (
            *_mismatch(_gathered_logits(model, _ids()), refs[name], model.config), same,
            _local_experts(model))
        out["generate_expert_parallel"][name] = generate(model)
    _grid(2, 2)  # the imported checkpoint at tp 2 x pp 2
    for name, (hf_dir, ckpt) in models.items():
        c = _config(ckpt)
        chunks = build_model_chunks(GPTModel, c, [c.num_layers // 2] * 2,
                                    ps.get_pipeline_model_parallel_rank(), None)
        load_model_weights(ckpt, chunks)
        logits = pipeline_logits(chunks[0], _ids())
        if logits is not None:
            out["tp2pp2"][name] = _mismatch(logits, refs[name], c)
    for layout, (tp, ep) in {"ep2": (1, 2), "ep2tp2": (2, 2)}.items():
        _grid(tp, ep=ep)  # a training-style model on an expert-parallel grid
        for name, (hf_dir, ckpt) in models.items():
            src, c = open_checked(hf_dir)
            from_hf, from_ckpt = GPTModel(c), GPTModel(c)
            load_hf_weights(src, c, [from_hf])
            load_model_weights(ckpt, [from_ckpt])
            same = all(torch.equal(a, b) for a, b in zip(from_hf.parameters(),
                                                          from_ckpt.parameters()))
            out[layout][name] = (*_mismatch(_gathered_logits(from_hf, _ids()), refs[name], c),
                                 same, _local_experts(from_hf))
        if gguf is not None and layout == "ep2tp2":  # a Qwen3-MoE GGUF file on this grid
            src, c = open_checked(gguf[0])
            model = GPTModel(c)
            load_hf_weights(src, c, [model])
            out["gguf"][layout] = _mismatch(_gathered_logits(model, _ids()), gguf[1], c)
    if gguf is not None:  # and through infer.py's loader (--hf x.gguf) at tp 2
        _grid(2)
        model, _, _ = load(hf=gguf[0])
        out["gguf"]["tp2"] = _mismatch(_gathered_logits(model, _ids()), gguf[1], model.config)
    return out


def _local_experts(model) -> tuple[int, int]:
    """(experts, fc1 rows of one expert) that this rank holds of the first MoE layer."""
    return next(tuple(p.shape[:2]) for n, p in model.named_parameters()
                if n.endswith("experts.linear_fc1.weight"))


@pytest.fixture(scope="module")
def world(models, tmp_path_factory):
    refs, generated, gguf = {}, {}, None
    if importlib.util.find_spec("gguf") is not None:  # Qwen3-MoE from GGUF
        from gguf_files import tiny_gguf

        _, path, original = tiny_gguf("qwen3_moe", tmp_path_factory.mktemp("moe-gguf"))
        with torch.no_grad():
            gguf = (path, original(_ids()).logits)
    for name, (hf_dir, _) in models.items():
        hf = _hf(hf_dir)
        with torch.no_grad():
            refs[name] = hf(_ids()).logits
        x = torch.tensor([PROMPT])
        gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                          do_sample=False, pad_token_id=0)
        generated[name] = gen[0, len(PROMPT):].tolist()
    results = run_distributed(_world, 4, models, refs, gguf, timeout=400)
    merged = {k: {} for k in results[0]}
    for r in results:
        for k, v in r.items():
            merged[k].update(v)
    return merged, generated


@pytest.mark.parametrize("layout", ["tp2", "tp2pp2", "ep2", "ep2tp2", "tp2_expert_parallel"])
def test_logits_match_transformers_at_layouts(models, world, layout):
    merged, _ = world
    assert set(merged[layout]) == set(models)
    for name, got in merged[layout].items():
        problem, diff = got[:2]
        print(f"{name} {layout}: max |logit - transformers| {diff:.2e}")
        if len(got) > 2:  # expert-parallel layouts: half the experts, each whole or TP-split
            same, (experts, rows) = got[2:]
            c = _config(models[name][1])
            assert same, f"{name} at {layout}: HF and checkpoint loads differ"
            split = 2 if layout == "ep2tp2" else 1
            assert (experts, rows) == (c.num_moe_experts // 2,
                                       2 * c.moe_ffn_hidden_size // split), (name, layout)
        assert problem is None, f"{name} at {layout}: {problem}"


def test_qwen3_moe_from_gguf_at_tp2_and_ep2(world):
    """A Qwen3-MoE GGUF file (tests/gguf_files.py, as llama.cpp writes it: stacked experts)
    through infer.py's loader at tp 2 and into a model at ep 2 x tp 2: the original's logits."""
    merged, _ = world
    if not merged["gguf"]:
        pytest.skip("GGUF files need the gguf package: pip install gguf")
    assert set(merged["gguf"]) == {"tp2", "ep2tp2"}
    for layout, (problem, diff) in merged["gguf"].items():
        print(f"qwen3_moe from GGUF at {layout}: max |logit - original| {diff:.2e}")
        assert problem is None, f"qwen3_moe from GGUF at {layout}: {problem}"


@pytest.mark.parametrize("layout", ["generate", "generate_expert_parallel"])
def test_greedy_generate_matches_transformers_at_tp2(world, layout):
    merged, generated = world
    for name, ids in generated.items():
        assert len(set(ids)) > 3, (name, ids)  # not one repeated id
        assert merged[layout][name] == ids, f"{name} ({layout}): greedy ids differ from HF's"


# ------------------------------------------------------------------ export, round trip
def _tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def _assert_loads_cleanly(folder: str) -> None:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_round_trip_is_bitwise_and_transformers_loads_it(models, tmp_path):
    from checkpoint.hf import export_hf

    for name, (hf_dir, ckpt) in models.items():
        out = str(tmp_path / name)
        export_hf(ckpt, out, max_shard_bytes=200_000 if name == "mixtral" else 5 * 10**9,
                  log=lambda *a: None)
        original, back = _tensors(hf_dir), _tensors(out)
        assert set(back) == set(original) - {"lm_head.weight"} or set(back) == set(original), \
            (name, sorted(set(back) ^ set(original))[:5])
        for key, t in back.items():
            assert torch.equal(t, original[key]), f"{name}: {key} differs after the round trip"
        _assert_loads_cleanly(out)
        cfg_in = json.load(open(os.path.join(hf_dir, "config.json")))
        cfg_out = json.load(open(os.path.join(out, "config.json")))
        experts = [cfg.get("num_experts") or cfg.get("num_local_experts")
                   for cfg in (cfg_in, cfg_out)]  # transformers may write either spelling
        assert experts[0] == experts[1] == _config(ckpt).num_moe_experts, (name, experts)
        for key in ("model_type", "num_experts_per_tok",
                    "moe_intermediate_size", "shared_expert_intermediate_size", "sliding_window",
                    "norm_topk_prob", "qkv_bias", "intermediate_size", "rms_norm_eps",
                    "tie_word_embeddings"):
            if key in cfg_in and (key != "sliding_window" or name in ("mixtral", "qwen3_moe")):
                assert cfg_out.get(key) == cfg_in[key], (name, key, cfg_out.get(key))
        if name.startswith("qwen"):  # the same layers are sparse, whatever the spelling
            dense, step = cfg_in["mlp_only_layers"] or [], cfg_in["decoder_sparse_step"]
            n = cfg_in["num_hidden_layers"]
            layers = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
            assert cfg_out["decoder_sparse_step"] == 1
            assert [int(i not in cfg_out["mlp_only_layers"]) for i in range(n)] == layers
    assert len([f for f in os.listdir(tmp_path / "mixtral") if f.endswith(".safetensors")]) > 1


def test_finetune_step_at_tp2_from_an_import_exported_back(models, tmp_path):
    """Per family: its HF folder with a tokenizer imported, one train.py --finetune step at
    tp 2 (lr 0, so the weights must come back bitwise), exported; transformers loads it."""
    import shutil

    from test_finetune import _tokenizer

    from checkpoint.hf import export_hf, import_hf

    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()
    (tmp_path / "corpus.txt").write_text(text)
    data = str(tmp_path / "data_text_document")
    names, argvs = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"), []
    for name in names:
        hf_dir, hf, ckpt = models[name][0], str(tmp_path / name), str(tmp_path / f"{name}-ckpt")
        shutil.copytree(hf_dir, hf)
        _tokenizer(hf, text)  # the same trained tokenizer for every family
        import_hf(hf, ckpt, log=lambda *a: None)
        if name == "mixtral":
            subprocess.run([sys.executable, "tools/preprocess_data.py", "--input",
                            str(tmp_path / "corpus.txt"), "--output-prefix",
                            str(tmp_path / "data"), "--tokenizer-dir",
                            os.path.join(ckpt, "tokenizer"), "--text-unit", "line"],
                           cwd=REPO, check=True, capture_output=True)
        argvs.append(["--load", ckpt, "--finetune", "--tp", "2", "--train-iters", "1",
                      "--lr", "0", "--min-lr", "0", "--seq-length", "32",
                      "--micro-batch-size", "2", "--global-batch-size", "4",
                      "--eval-interval", "0", "--log-interval", "1", "--data-path", data,
                      "--save", str(tmp_path / f"{name}-save"),
                      "--log-dir", str(tmp_path / f"{name}-log")])
    train_in_one_world(2, argvs)  # the four runs in one world of 2: one start-up
    for name in names:
        hf_dir, save = models[name][0], str(tmp_path / f"{name}-save")
        log = tmp_path / f"{name}-log"
        losses = [r["loss"] for r in read_metrics(log) if "loss" in r]
        print(f"{name} finetune step at tp 2: loss {losses}")
        assert len(losses) == 1 and torch.isfinite(torch.tensor(losses)).all(), (name, losses)
        out = str(tmp_path / f"{name}-back")
        export_hf(save, out, log=lambda *a: None)
        original, back = _tensors(hf_dir), _tensors(out)
        assert set(back) == set(original) - {"lm_head.weight"} or set(back) == set(original)
        for key, t in back.items():  # lr 0: the trained weights are the imported ones
            assert torch.equal(t, original[key]), (name, key)
        _assert_loads_cleanly(out)


# ------------------------------------------------------------------ refusals
def test_unsupported_moe_configs_are_refused(models, tmp_path):
    from models.hf import HFConversionError, config_from_hf, config_to_hf

    mixtral = json.load(open(os.path.join(models["mixtral"][0], "config.json")))
    qwen = json.load(open(os.path.join(models["qwen2_moe"][0], "config.json")))
    qwen3 = json.load(open(os.path.join(models["qwen3_moe"][0], "config.json")))
    olmoe = json.load(open(os.path.join(models["olmoe"][0], "config.json")))
    cases = [
        (dict(mixtral, router_jitter_noise=0.1), "router_jitter_noise=0.1"),
        (dict(mixtral, num_local_experts=None), "has no num_local_experts"),
        (dict(mixtral, num_experts=8), "num_experts=8 and num_local_experts=4 disagree"),
        (dict(mixtral, num_local_experts=0), "num_local_experts is 0"),
        (dict(qwen, num_experts=None), "has no num_experts"),
        (dict(qwen, mlp_only_layers=[7]), "mlp_only_layers"),
        (dict(qwen, decoder_sparse_step=0), "decoder_sparse_step is 0"),
        (dict(qwen, norm_topk_prob="yes"), "norm_topk_prob is 'yes'"),
        (dict(qwen, num_experts_per_tok=9), "--moe-router-topk"),
        (dict(mixtral, model_type="mistral", architectures=["MistralForCausalLM"]),
         "num_local_experts=4: mixture-of-experts"),
        (dict(qwen, model_type="deepseek_v3", architectures=None),  # no MLA fields
         "has no kv_lora_rank, which a deepseek_v3 model needs"),
        (dict(qwen, model_type="gpt_oss", architectures=None),  # Qwen2-MoE's expert field
         "has no num_local_experts, which a gpt_oss model needs"),
        (dict(mixtral, architectures=["Qwen2MoeForCausalLM"]), "architectures"),
        (dict(qwen3, attention_bias=True), "attention_bias=True"),
        (dict(qwen3, moe_intermediate_size=None), "has no moe_intermediate_size"),
        (dict(olmoe, clip_qkv=8.0), "clip_qkv=8.0"),
        (dict(olmoe, attention_bias=True), "attention_bias=True"),
    ]
    for d, expected in cases:
        with pytest.raises(HFConversionError) as e:
            config_from_hf(d)
        assert expected in str(e.value) and "\n" not in str(e.value), (expected, str(e.value))
    c = config_from_hf(mixtral)
    import dataclasses

    for change, expected in [(dict(moe_router_score_function="sigmoid"), "sigmoid"),
                             (dict(moe_router_pre_softmax=True), "moe_router_pre_softmax"),
                             (dict(moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor=2.5"),
                             (dict(moe_layer_freq=[1, 0]), "dense-MLP layers")]:
        with pytest.raises(HFConversionError, match="no Hugging Face equivalent") as e:
            config_to_hf(dataclasses.replace(c, **change))
        assert expected in str(e.value), (change, str(e.value))
    c3 = config_from_hf(qwen3)
    with pytest.raises(HFConversionError, match="Qwen3-MoE slides every layer or none"):
        config_to_hf(dataclasses.replace(c3, window_attn_skip_freq=[1, 0]))
    with pytest.raises(HFConversionError, match="OLMoE has no sliding window"):
        config_to_hf(dataclasses.replace(config_from_hf(olmoe), window_size=(5, 0)))
    with pytest.raises(HFConversionError, match="qk_layernorm with biases"):
        config_to_hf(dataclasses.replace(c, qk_layernorm=True, moe_shared_expert_gate=True,
                                         moe_shared_expert_intermediate_size=8))
