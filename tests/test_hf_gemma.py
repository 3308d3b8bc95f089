"""Gemma 3 (Gemma3ForCausalLM, gemma3_text) and Gemma 2 (Gemma2ForCausalLM) import/export
against transformers' own models (tiny random ones built here; nothing is downloaded).

- the layer features one by one against transformers' modules: the (1 + weight) RMSNorm and
  the sqrt(hidden) embedding scale bitwise in float32 and bfloat16;
- logits equal transformers' on a [2, 16] batch with a sliding window of 8 (half the
  positions past it; local and global layers interleaved, Gemma 3's two RoPE bases with
  linear scaling on the global one, Gemma 2's attention and final soft-capping) at tp 1, tp 2
  and tp 2 x pp 2 (global and sliding layers on both stages);
- greedy generation of 24 tokens through the Engine at tp 2 and tp 2 x pp 2 (prefill, then
  decode with the KV cache far past the window, 3 requests in 2 slots) equals transformers'
  `generate`;
- import -> export is bitwise and transformers loads it with no missing, unexpected or
  mismatched tensor, the config fields kept; refusals name the field and write nothing;
- a train.py --finetune step at tp 2 from an imported Gemma 3 (equal to one process's) and
  Gemma 2 changes every tensor and exports back to a model whose transformers logits equal
  the trained checkpoint's.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from distributed import run_distributed
from launch import read_metrics, run_main, train_in_one_world
from tolerances import assert_fp32_close, forward_chain_terms, fp32_mismatch

B, S, W, VOCAB = 2, 16, 8, 400  # batch, tokens, HF sliding_window; test_finetune's tokenizer
NEW = 24  # greedy tokens generated
PROMPTS = [[5, 17, 99, 3, 42, 8], [7, 1, 2], [200, 100, 9, 11]]


def _hf_configs() -> dict:
    from transformers import Gemma2Config, Gemma3TextConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=W,
                  max_position_embeddings=128, initializer_range=0.2, query_pre_attn_scalar=24,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return {
        # layers 0, 2 sliding (base 10^4), 1, 3 global (base 10^6, linear scaling x2); tied
        "gemma3": Gemma3TextConfig(sliding_window_pattern=2, rope_scaling={
            "rope_type": "linear", "factor": 2.0}, **common),
        # Gemma 2: soft-capping of scores and logits (small caps, so they bite), untied
        "gemma2": Gemma2Config(attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                               tie_word_embeddings=False, **common),
    }


def _perturb(model) -> None:
    """Random norm weights around 0 (they are zero-centred), so a norm mapped to the wrong
    place shows; embeddings / sqrt(h), undoing Gemma's scale: else the (tied) embedding
    dominates the residual stream and greedy decoding repeats the last token."""
    for _, p in model.named_parameters():
        if p.dim() == 1:
            p.normal_(0.0, 0.3)
    model.model.embed_tokens.weight.mul_(model.config.hidden_size ** -0.5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (hf folder, native checkpoint folder) of each tiny model (`_perturb`ed)."""
    from test_inference import random_hf_models

    return random_hf_models(tmp_path_factory.mktemp("gemma"), _hf_configs(), 40, _perturb)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(0))


def _terms(config) -> int:
    """forward_chain_terms plus the sandwich norms (2 x h) and q/k norms (d) of each layer."""
    return forward_chain_terms(config, S, "logits") + \
        config.num_layers * (2 * config.hidden_size + config.kv_channels)


def _hf(hf_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def test_norm_and_embedding_scale_are_transformers_bitwise(no_grid):
    """RMSNorm with layernorm_zero_centered_gamma == Gemma3RMSNorm, and the scaled embedding ==
    Gemma3TextScaledWordEmbedding, bitwise in float32 and bfloat16 (float32 inside the norm,
    the scale rounded to the embedding's dtype)."""
    from transformers.models.gemma3.modeling_gemma3 import (
        Gemma3RMSNorm, Gemma3TextScaledWordEmbedding)

    from layers.embedding import LanguageModelEmbedding
    from layers.norm import RMSNorm
    from models import ModelConfig

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = RMSNorm(48, 1e-6, zero_centered_gamma=True), Gemma3RMSNorm(48, 1e-6)
        w = torch.randn(48, generator=g) * 0.5
        with torch.no_grad():
            ours.weight.copy_(w)
            theirs.weight.copy_(w)
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        x = (torch.randn(3, 5, 48, generator=g) * 4).to(dtype)
        assert torch.equal(ours(x), theirs(x)), dtype
        cfg = ModelConfig(hidden_size=48, num_attention_heads=4, vocab_size=100,
                          position_embedding_type="rope", apply_embedding_scaling=True)
        emb = LanguageModelEmbedding(cfg, 128)
        ref = Gemma3TextScaledWordEmbedding(100, 48, 0, embed_scale=48 ** 0.5)
        table = torch.randn(100, 48, generator=g)
        with torch.no_grad():
            emb.word_embeddings.weight[:100].copy_(table)
            ref.weight.copy_(table)
        emb, ref = emb.to(dtype), ref.to(dtype)
        ids = torch.randint(0, 100, (2, 7), generator=g)
        assert torch.equal(emb(ids).transpose(0, 1), ref(ids)), dtype


def test_gemma_fields_are_validated():
    """The Gemma fields may come from untrusted checkpoint metadata: exact types and bounds,
    a ConfigError naming the flag; a local RoPE base needs sliding layers."""
    from models import ModelConfig
    from models.config import ConfigError

    base = dict(position_embedding_type="rope", normalization="RMSNorm", activation="geglu")
    for field, value, words in (
            ("softmax_scale", float("nan"), "--softmax-scale must be a positive finite"),
            ("final_logit_softcapping", 0.0, "--final-logit-softcapping must be a positive"),
            ("attn_logit_softcapping", True, "--attn-logit-softcapping must be a positive"),
            ("post_mlp_layernorm", 1, "--post-mlp-layernorm must be true or false"),
            ("layernorm_zero_centered_gamma", "yes", "--layernorm-zero-centered-gamma must be"),
            ("rope_local_base_freq", 1e4, "--rope-local-base-freq is the RoPE base of the "
                                          "sliding-window layers, but --window-size is not set")):
        with pytest.raises(ConfigError, match=words):
            ModelConfig(**base, **{field: value}).validate()
    ok = ModelConfig(**base, window_size=(7, 0), rope_local_base_freq=1e4, softmax_scale=0.2,
                     post_self_attn_layernorm=True, post_mlp_layernorm=True)
    ok.validate()
    plain = ModelConfig(**base)
    assert ok.num_parameters() - plain.num_parameters() == 2 * ok.num_layers * ok.hidden_size


def test_recompute_with_every_gemma_feature_is_bitwise(no_grid):
    """Full and selective recompute re-run the sandwich and q/k norms, both RoPE tables (a
    4-tuple through the checkpointed span), both soft-caps and the windows: gradients equal
    the plain backward's bitwise, and every norm gets one."""
    import copy

    from layers.recompute import apply_recompute
    from models import GPTModel, ModelConfig

    c = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    kv_channels=16, ffn_hidden_size=96, vocab_size=300, seq_length=S,
                    position_embedding_type="rope", normalization="RMSNorm", activation="geglu",
                    add_bias_linear=False, layernorm_zero_centered_gamma=True,
                    post_self_attn_layernorm=True, post_mlp_layernorm=True,
                    apply_embedding_scaling=True, softmax_scale=0.2, qk_layernorm=True,
                    window_size=(W - 1, 0), window_attn_skip_freq=[1, 0, 1, 0],
                    rope_local_base_freq=1e4, rotary_base=1e6, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0)
    plain = GPTModel(c)
    plain.init_weights(0)
    g = torch.Generator().manual_seed(2)
    ids, labels = (torch.randint(0, 300, (B, S), generator=g) for _ in range(2))

    def grads(model):
        model.train()
        model.zero_grad()
        model(ids, labels=labels).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = grads(plain)
    assert all(ref[n].abs().sum() > 0 for n in ref if "layernorm" in n)
    for granularity in ("full", "selective"):
        model = copy.deepcopy(plain)
        apply_recompute(model, granularity)
        got = grads(model)
        assert all(torch.equal(got[n], ref[n]) for n in ref), granularity


def test_logits_match_transformers_tp1(models, no_grid):
    from checkpoint.format import read_metadata
    from checkpoint.model_io import load_model_weights
    from models import GPTModel, ModelConfig

    for name, (hf_dir, ckpt) in models.items():
        config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
        assert config.window_size == (W - 1, 0) and config.window_attn_skip_freq == [1, 0, 1, 0]
        model = GPTModel(config).eval()
        load_model_weights(ckpt, [model])
        ids = _ids(config.vocab_size)
        with torch.no_grad():
            ours = model(ids)[..., :config.vocab_size]
            ref = _hf(hf_dir)(ids).logits
        print(f"{name} tp=1: max |logit - transformers| {float((ours - ref).abs().max()):.2e}, "
              f"past the window {float((ours - ref)[:, W:].abs().max()):.2e}")
        assert_fp32_close(ours, ref, _terms(config), f"{name} at tp=1")
        # the test sees the window (one longer than the batch: full attention) and the local
        # RoPE base: either changes the logits past the window, the window alone none before
        for field, value in (("window_size", (S, 0)), ("rope_local_base_freq", None)):
            if getattr(config, field) is None:
                continue
            other = GPTModel(ModelConfig.from_dict({**config.to_dict(), field: value})).eval()
            other.load_state_dict(model.state_dict())
            with torch.no_grad():
                off = other(ids)[..., :config.vocab_size]
            assert fp32_mismatch(off[:, W:], ref[:, W:], _terms(config)) is not None, \
                (name, field)
            if field == "window_size":
                assert torch.equal(off[:, :W], ours[:, :W]), name


def _parallel(models: dict) -> dict:
    """In a world of 4: {(tp, pp): {name: logits mismatch or None}} at tp 2 x pp 2 and tp 2
    (dp 2), and {(name, "generate"): greedy outputs of PROMPTS} from the Engine (2 slots)."""
    import torch.distributed as dist

    import parallel_state as ps
    from checkpoint.format import read_metadata
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams
    from models import ModelConfig
    from test_hf_conversion import pipeline_logits

    results = {}
    for tp, pp in ((2, 2), (2, 1)):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, device="cpu")
        mine = {}
        for name, (hf_dir, ckpt) in models.items():
            model, _, _ = load(load=ckpt) if name == "gemma3" else load(hf=hf_dir)
            config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
            ids = _ids(config.vocab_size)
            logits = pipeline_logits(model, ids)
            if logits is not None:
                ref = _hf(hf_dir)(ids).logits
                mine[name] = fp32_mismatch(logits, ref, _terms(config))
                mine[name, "max_diff"] = float((logits - ref).abs().max())
            engine = Engine(model, max_batch_size=2, max_seq_length=40)
            reqs = [Request(str(i), p, SamplingParams(max_new_tokens=NEW))
                    for i, p in enumerate(PROMPTS)]
            engine.generate(reqs)
            if ps.is_pipeline_last_stage():
                mine[name, "generate"] = [r.output for r in reqs]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results[tp, pp] = {k: v for r in every for k, v in r.items()}
    ps.destroy_model_parallel()
    return results


def test_parallel_logits_and_generate_match_transformers(models):
    results = run_distributed(_parallel, 4, models, tp=2, pp=2, timeout=420)[0]
    for name, (hf_dir, _) in models.items():
        for layout, got in results.items():
            print(f"{name} tp={layout[0]} pp={layout[1]}: max |logit - transformers| "
                  f"{got[name, 'max_diff']:.2e}")
            assert got[name] is None, f"{name} at tp={layout[0]} pp={layout[1]}: {got[name]}"
        hf = _hf(hf_dir)
        expected = []
        for prompt in PROMPTS:
            x = torch.tensor([prompt])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                              do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
        assert all(len(e) == NEW and len(set(e)) > 4 for e in expected), expected
        for (tp, pp), got in results.items():
            assert got[name, "generate"] == expected, \
                f"{name} at tp={tp} pp={pp}: greedy ids differ from transformers' generate"


def test_round_trip_is_bitwise(models, tmp_path):
    from safetensors.torch import load_file

    from checkpoint.hf import export_hf
    from test_hf_conversion import check_export_loads

    for name, (hf_dir, ckpt) in models.items():
        out = str(tmp_path / name)
        export_hf(ckpt, out, log=lambda *a: None)
        original = load_file(os.path.join(hf_dir, "model.safetensors"))
        back = load_file(os.path.join(out, "model.safetensors"))
        assert set(back) == set(original), sorted(set(back) ^ set(original))[:5]
        for key, t in back.items():
            assert torch.equal(t, original[key]), f"{name}: {key} differs after the round trip"
        keys = ("model_type", "architectures", "rms_norm_eps", "rope_parameters",
                "sliding_window", "layer_types", "head_dim", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings",
                "hidden_activation", "vocab_size", "intermediate_size")
        check_export_loads(name, hf_dir, out, keys)


def test_refusals(models, tmp_path):
    """Each unsupported variant is one HFConversionError naming the field; nothing written."""
    from safetensors.torch import load_file, save_file

    from checkpoint.hf import import_hf
    from models.hf import HFConversionError

    hf_dir, _ = models["gemma3"]
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    local = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}

    def variant(name, change=None, drop=()):
        d = tmp_path / name
        d.mkdir()
        json.dump({**cfg, **(change or {})}, open(d / "config.json", "w"))
        sd = load_file(os.path.join(hf_dir, "model.safetensors"))
        for k in drop:
            sd.pop(k)
        save_file(sd, str(d / "model.safetensors"))
        return str(d)

    cases = {
        "use_bidirectional_attention=true": variant("bidir", {"use_bidirectional_attention":
                                                              True}),
        "attention_bias=true": variant("bias", {"attention_bias": True}),
        "hidden_activation 'relu'": variant("relu", {"hidden_activation": "relu"}),
        "rope_parameters.sliding_attention rope_type 'linear'": variant(
            "local_rope", {"rope_parameters": {**cfg["rope_parameters"],
                                               "sliding_attention": local}}),
        "rope_scaling type 'yarn'": variant("yarn", {"rope_parameters": {
            **cfg["rope_parameters"], "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                         "rope_theta": 1e6}}}),
        "model_type 'gemma3'": variant("multimodal", {"model_type": "gemma3"}),
        "layer_types must list 4 entries": variant("types", {"layer_types": ["full_attention"]}),
        "query_pre_attn_scalar -1 must be a positive": variant("qpas", {"query_pre_attn_scalar": -1}),
        "'model.layers.1.self_attn.q_norm.weight'": variant(
            "no_qnorm", drop=["model.layers.1.self_attn.q_norm.weight"]),
        "quantization_config": variant("quant", {"quantization_config": {"quant_method":
                                                                         "fp8"}}),
    }
    for expected, folder in cases.items():
        out = tmp_path / f"out-{os.path.basename(folder)}"
        with pytest.raises(HFConversionError) as info:
            import_hf(folder, str(out), log=lambda *a: None)
        assert expected in str(info.value), (expected, str(info.value))
        assert not os.path.exists(out)
    g2_dir, _ = models["gemma2"]
    g2 = json.load(open(os.path.join(g2_dir, "config.json")))
    from models.hf import config_from_hf, config_to_hf
    with pytest.raises(HFConversionError, match="rope type 'linear' is not supported for gemma2"):
        config_from_hf({**g2, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 1e4}})
    with pytest.raises(HFConversionError, match="attn_logit_softcapping=50.0 is not supported "
                                                "for gemma3_text: transformers' Gemma 3"):
        config_from_hf({**cfg, "attn_logit_softcapping": 50.0})
    # ours -> HF: a q/k-normed model with score capping has no Gemma form (3 ignores the cap)
    c = config_from_hf(cfg)
    c.attn_logit_softcapping = 50.0
    with pytest.raises(HFConversionError, match="attn_logit_softcapping with qk_layernorm"):
        config_to_hf(c)
    assert config_to_hf(config_from_hf({**cfg, "final_logit_softcapping": 30.0}))[
        "final_logit_softcapping"] == 30.0


def test_finetune_step_at_tp2_exports_back(models, tmp_path):
    """One --finetune step (lr 1e-2) from the imported Gemma 3 at tp 2 with sequence
    parallelism equals one process (loss and every exported weight, Adam eps 1e-4 as
    tests/tolerances.py asks); the same step at tp 2 from the imported Gemma 2 (both
    soft-caps in the loss); every weight of each moves (norms, q/k and post norms get
    gradients); each export loads in transformers with the Gemma fields kept, and its logits
    there equal the trained checkpoint's in GPTModel."""
    from test_finetune import _tokenizer
    from tools import preprocess_data

    from checkpoint.format import read_metadata, resolve_checkpoint
    from checkpoint.hf import export_hf, import_hf
    from checkpoint.model_io import load_model_weights
    from models import GPTModel, ModelConfig
    from test_hf_conversion import check_export_loads
    from test_hf_moe_families import _tensors
    from tolerances import assert_losses_close, training_chain_terms, weights_mismatch

    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()
    (tmp_path / "corpus.txt").write_text(text)
    ckpts = {}
    for name in models:
        hf, ckpts[name] = str(tmp_path / f"{name}-hf"), str(tmp_path / f"{name}-ckpt")
        shutil.copytree(models[name][0], hf)
        _tokenizer(hf, text)
        import_hf(hf, ckpts[name], log=lambda *a: None)
    prep = run_main(preprocess_data.cli, [
        "--input", tmp_path / "corpus.txt", "--output-prefix", tmp_path / "data",
        "--tokenizer-dir", os.path.join(ckpts["gemma3"], "tokenizer"), "--text-unit", "line"])
    assert prep.returncode == 0, prep.stderr
    args = ["--finetune", "--train-iters", "1", "--lr", "1e-2", "--min-lr", "1e-2",
            "--adam-eps", "1e-4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--eval-interval", "0", "--log-interval", "1",
            "--data-path", str(tmp_path / "data_text_document")]
    back, losses = {}, {}
    # Gemma 2 at tp 2 only: its soft-caps act per element on scores and logits, which TP
    # does not split differently from Gemma 3's layers; the tp 2 runs share one world
    runs = (("gemma3", 1), ("gemma3", 2), ("gemma2", 2))
    saves = {run: ["--save", str(tmp_path / f"{run[0]}-save{run[1]}"),
                   "--log-dir", str(tmp_path / f"{run[0]}-log{run[1]}")] for run in runs}
    train_in_one_world(1, [["--load", ckpts["gemma3"]] + args + saves["gemma3", 1]])
    train_in_one_world(2, [["--load", ckpts[name]] + args + ["--tp", "2", "--sequence-parallel"]
                           + saves[name, tp] for name, tp in runs if tp == 2])
    for name, tp in runs:
        save, log = str(tmp_path / f"{name}-save{tp}"), tmp_path / f"{name}-log{tp}"
        losses[name, tp] = [r["loss"] for r in read_metrics(log) if "loss" in r]
        back[name, tp] = str(tmp_path / f"{name}-back{tp}")
        export_hf(save, back[name, tp], log=lambda *a: None)
    print(f"finetune step: gemma3 loss {losses['gemma3', 1]} (tp 1), {losses['gemma3', 2]} "
          f"(tp 2, SP); gemma2 loss {losses['gemma2', 2]} (tp 2, SP)")
    k = training_chain_terms(["--load", ckpts["gemma3"]] + args)  # Gemma 3's model chain
    assert_losses_close(losses["gemma3", 2], losses["gemma3", 1], k,
                        "tp 2 + SP against one process")
    one, two = _tensors(back["gemma3", 1]), _tensors(back["gemma3", 2])
    assert set(one) == set(two)
    assert not weights_mismatch(two, one, k), weights_mismatch(two, one, k)[:3]
    for name in models:
        hf_dir = models[name][0]
        assert len(losses[name, 2]) == 1 and torch.isfinite(torch.tensor(losses[name, 2])).all()
        original, trained_hf = _tensors(hf_dir), _tensors(back[name, 2])
        assert set(trained_hf) == set(original), name
        unchanged = [key for key, t in trained_hf.items() if torch.equal(t, original[key])]
        assert not unchanged, f"{name} not trained: {unchanged}"
        check_export_loads(name, hf_dir, back[name, 2], (
            "layer_types", "rope_parameters", "sliding_window", "query_pre_attn_scalar",
            "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings"))
        trained = resolve_checkpoint(str(tmp_path / f"{name}-save2"))
        config = ModelConfig.from_dict(read_metadata(trained)["model"])
        model = GPTModel(config).eval()
        load_model_weights(trained, [model])
        ids = _ids(config.vocab_size)
        with torch.no_grad():
            ours = model(ids)[..., :config.vocab_size]
        assert_fp32_close(ours, _hf(back[name, 2])(ids).logits, _terms(config),
                          f"{name} after a step")
