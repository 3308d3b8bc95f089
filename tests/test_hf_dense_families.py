"""Hugging Face dense families of 2025 (Qwen3, OLMo 2, Phi-3) against transformers' own
models, tiny random ones built here (nothing downloads):

- logits equal transformers' on a [2, 16] batch at tp 1, tp 2 and tp 2 x pp 2, to the
  project's float32 tolerance (tests/tolerances.py);
- greedy generation of 24 tokens through the Engine at tp 2 (from the imported checkpoint) and
  tp 2 x pp 2 (from the HF folder, as `infer.py --hf`) equals transformers' `generate`;
- import -> export is bitwise, and transformers loads the export with no missing, unexpected
  or mismatched tensor;
- q/k norms (Qwen3's per head, OLMo 2's over the whole projection: its squares summed over
  TP) and OLMo 2's post-only norms: a layer's output and gradients at tp 2 equal one
  process's;
- `train.py --finetune` of each import at tp 2 with SP (one step, lr > 0) exported back:
  transformers loads it cleanly and its logits equal ours from the trained checkpoint, every
  weight moved (the q/k norms' too);
- the planner's activation bytes equal what the q/k and post norms save (float32, bf16);
- the variants we do not build are refused with one line naming the field, nothing written.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from distributed import run_distributed
from launch import REPO, train_in_one_world
from test_hf_conversion import _batch, _hf_logits, pipeline_logits
from test_hf_conversion import test_round_trip_is_bitwise as _round_trip
from tolerances import assert_fp32_close, forward_chain_terms


def export_and_load(save: str, out: str, name: str):
    """Export checkpoint `save` to HF folder `out` and load it with transformers (float32),
    asserting that no tensor is missing, unexpected or of another shape; the model."""
    from checkpoint.hf import export_hf
    from transformers import AutoModelForCausalLM

    export_hf(save, out, log=lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), \
        (name, info)
    return hf

S, MAX_NEW = 16, 24
PROMPT = [5, 17, 99, 3, 42, 8, 61, 2, 11]


def _tiny_models() -> dict:
    """name -> transformers config of a tiny random model of each family here; a large init
    std, so greedy outputs do not collapse into one repeated id."""
    from transformers import Olmo2Config, Phi3Config, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=128, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=None)  # generate runs to max_new_tokens
    return {
        # head_dim 32 != hidden / heads 16, GQA 4:2, untied
        "qwen3": Qwen3Config(vocab_size=451, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-6,
                             **common),
        # 4:4 heads: at tp 2 each rank's k norm covers 2 of the 4 KV heads; llama3 RoPE
        "olmo2": Olmo2Config(vocab_size=421, num_attention_heads=4, num_key_value_heads=4,
                             tie_word_embeddings=True, rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32,
                                              "rope_theta": 5e5}, **common),
        # fused qkv_proj (GQA 8:2) and gate_up_proj; a sliding window of 6 on every layer,
        # shorter than the [2, 16] batch and the 24 generated tokens
        "phi3": Phi3Config(vocab_size=433, num_attention_heads=8, num_key_value_heads=2,
                           tie_word_embeddings=False, sliding_window=6, pad_token_id=None,
                           **common),
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (hf folder, native checkpoint folder) for every tiny model; 1-d weights (norms)
    random around 1, so a swapped or missing norm shows; a 400-token BPE tokenizer (carried
    by the import)."""
    from checkpoint.hf import import_hf
    from test_finetune import _tokenizer
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("dense")
    _tokenizer(str(root / "tokenizer"), open(os.path.join(os.path.dirname(os.__file__),
                                                           "textwrap.py")).read())
    out = {}
    for i, (name, cfg) in enumerate(_tiny_models().items()):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.normal_(1.0, 0.3)
        hf_dir, ckpt = str(root / name), str(root / f"{name}-ckpt")
        model.save_pretrained(hf_dir)
        for f in os.listdir(root / "tokenizer"):
            os.link(root / "tokenizer" / f, os.path.join(hf_dir, f))
        import_hf(hf_dir, ckpt, log=lambda *a: None)
        out[name] = (hf_dir, ckpt)
    return out


def _config(ckpt: str):
    from checkpoint.format import read_metadata
    from models import ModelConfig

    return ModelConfig.from_dict(read_metadata(ckpt)["model"])


def test_logits_match_transformers_tp1(converted):
    from checkpoint.model_io import load_model_weights
    from models import GPTModel

    for name, (hf_dir, ckpt) in converted.items():
        config = _config(ckpt)
        model = GPTModel(config).eval()
        load_model_weights(ckpt, [model])
        ids = _batch(config.vocab_size)
        with torch.no_grad():
            ours = model(ids)[..., :config.vocab_size]
        ref = _reference_logits(hf_dir, config.vocab_size)
        print(f"{name} tp=1: max |logit - transformers| {float((ours - ref).abs().max()):.2e}")
        assert_fp32_close(ours, ref, forward_chain_terms(config, S, "logits"), f"{name} tp=1")


def _greedy(converted: dict, hf: bool = False) -> dict:
    """In a worker: {name: the Engine's greedy ids for PROMPT} of each checkpoint (`hf`: of
    each HF folder, read directly as `infer.py --hf` does)."""
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams

    out = {}
    for name, (hf_dir, ckpt) in converted.items():
        model, _, _ = load(hf=hf_dir) if hf else load(load=ckpt)
        req = Request("0", PROMPT, SamplingParams(max_new_tokens=MAX_NEW))
        Engine(model, max_batch_size=1, max_seq_length=64).generate([req])
        out[name] = req.output
    return out


def _logits(converted: dict, pp: int) -> dict:
    """In a worker: {name: logits [2, S, vocab] of the checkpoint} on a last pipeline stage,
    {} elsewhere (the layers split evenly over pp)."""
    import parallel_state as ps
    from checkpoint.model_io import load_model_weights
    from models import GPTModel
    from models.pipeline import build_model_chunks

    out = {}
    for name, (_, ckpt) in converted.items():
        config = _config(ckpt)
        chunks = build_model_chunks(GPTModel, config, [config.num_layers // pp] * pp,
                                    ps.get_pipeline_model_parallel_rank(), None)
        load_model_weights(ckpt, chunks)
        logits = pipeline_logits(chunks[0], _batch(config.vocab_size))
        if logits is not None:
            out[name] = logits
    return out


def _world(converted: dict, pp: int):
    """In a world at tp 2 x `pp`: (logits of the checkpoint or {} off the last stage, greedy
    ids from the checkpoint at pp 1, from the HF folder at pp 2)."""
    return _logits(converted, pp), _greedy(converted, hf=pp > 1)


def _check_logits(converted: dict, got: dict, where: str) -> None:
    assert set(got) == set(converted)
    for name, (hf_dir, ckpt) in converted.items():
        config = _config(ckpt)
        ref = _reference_logits(hf_dir, config.vocab_size)
        print(f"{name} {where}: max |logit - transformers| "
              f"{float((got[name] - ref).abs().max()):.2e}")
        assert_fp32_close(got[name], ref, forward_chain_terms(config, S, "logits"),
                          f"{name} at {where}")


@functools.cache
def _reference_logits(hf_dir: str, vocab: int) -> torch.Tensor:
    """transformers' logits of `_batch(vocab)` for the model in `hf_dir`, read once per test
    run (the tp 1, tp 2 and tp 2 x pp 2 checks compare with the same tensor)."""
    return _hf_logits(hf_dir, _batch(vocab))


@functools.cache
def _hf_greedy(hf_dir: str) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = torch.tensor([PROMPT])
    gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                      do_sample=False, pad_token_id=0)
    return gen[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("pp", [1, 2])
def test_logits_and_generate_match_transformers_tp2(converted, pp):
    """tp 2 (greedy ids from the imported checkpoint) and tp 2 x pp 2 (from the HF folder)."""
    results = run_distributed(_world, 2 * pp, converted, pp, tp=2, pp=pp, timeout=300)
    logits = {}
    for r, _ in results:
        logits.update(r)
    _check_logits(converted, logits, f"tp=2 pp={pp}")
    for name, (hf_dir, _) in converted.items():
        expected = _hf_greedy(hf_dir)
        assert len(set(expected)) > 5, expected  # not one repeated id
        for rank, (_, greedy) in enumerate(results):
            assert greedy[name] == expected, \
                f"{name} tp=2 pp={pp} rank {rank}: greedy ids differ from transformers'"


def test_round_trip_is_bitwise(converted, tmp_path):
    """Every tensor back bitwise, transformers loads the export with nothing missing,
    unexpected or mismatched, config fields kept (test_hf_conversion's check), and the
    architecture and the fields these families add."""
    _round_trip(converted, tmp_path)
    for name, (hf_dir, _) in converted.items():
        cfg_in = json.load(open(os.path.join(hf_dir, "config.json")))
        cfg_out = json.load(open(os.path.join(tmp_path, name, "config.json")))
        for key in ("architectures", "model_type", "num_key_value_heads", "attention_bias"):
            if cfg_in.get(key) is not None:
                assert cfg_out.get(key) == cfg_in[key], (name, key, cfg_out.get(key))


# ---------------------------------------------------------------- the layer feature at tp 2
def _qk_norm_layer_grads(config_kw: dict) -> dict:
    """In a world of 2 at tp 2 (and in one process first, grid of 1): a TransformerLayer with
    q/k norms; its output and every parameter's full gradient, after the trainer's sum of
    the tagged (`sequence_parallel`) gradients over TP."""
    import parallel_state as ps
    from layers.attention import RotaryEmbedding
    from layers.sharding import full_shape, initialize_parameters, shard_tensor, unshard_tensors
    from layers.transformer import TransformerLayer
    from models.config import ModelConfig

    config = ModelConfig(**config_kw)
    layer = TransformerLayer(config, 0)
    initialize_parameters(layer, seed=5, std=0.3, num_layers=1)
    with torch.no_grad():  # norms away from 1, the same full weights at any tp
        for name, p in layer.named_parameters():
            if "layernorm" in name:
                n = full_shape(p)[0]
                p.add_(shard_tensor(torch.arange(n, dtype=p.dtype) / n, p))
    x = torch.randn(8, 2, config.hidden_size, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    y = layer(x, rotary=RotaryEmbedding(config.kv_channels)(8))
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    ps.all_reduce_sequence_parallel_grads(layer.parameters())
    tp_group = ps.get_tensor_model_parallel_group()
    out = {"y": y.detach(), "x.grad": x.grad}
    for name, p in layer.named_parameters():
        tp = ps.get_tensor_model_parallel_world_size()
        shards = [torch.empty_like(p.grad) for _ in range(tp)]
        torch.distributed.all_gather(shards, p.grad.contiguous(), group=tp_group)
        out[name] = unshard_tensors(shards, p)
    return out


def _layers_grads(kws: list) -> list:
    return [_qk_norm_layer_grads(kw) for kw in kws]


def test_qk_norm_gradients_at_tp2_equal_one_process():
    """Qwen3's per-head q/k norm (one weight shared by all heads: each TP rank's gradient is
    partial and summed, as SP norms' are) and OLMo 2's layer (q/k norms over the whole
    projections, split over TP with their sum of squares all-reduced forward and backward;
    post-only norms) at tp 2: output, input gradient and every parameter gradient equal one
    process's."""
    kw = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              kv_channels=16, ffn_hidden_size=48, normalization="RMSNorm",
              activation="swiglu", add_bias_linear=False, position_embedding_type="rope",
              qk_layernorm=True)
    olmo2 = dict(kw, qk_norm_over_heads=True, pre_layernorm=False,
                 post_self_attn_layernorm=True, post_mlp_layernorm=True)
    ones = run_distributed(_layers_grads, 1, [kw, olmo2], timeout=120)[0]
    twos = run_distributed(_layers_grads, 2, [kw, olmo2], tp=2, timeout=120)[0]
    for name, one, two in zip(("qwen3", "olmo2"), ones, twos):
        assert set(one) == set(two) and "self_attention.q_layernorm.weight" in one
        assert ("input_layernorm.weight" in one) == (name == "qwen3")
        assert ("post_mlp_layernorm.weight" in one) == (name == "olmo2")
        for key in one:
            scale = float(one[key].abs().max())
            assert torch.allclose(one[key], two[key], rtol=1e-5, atol=1e-5 * scale), \
                (name, key, float((one[key] - two[key]).abs().max()))


# ---------------------------------------------------------------------------- refusals
def _refused(tmp_path, hf_dir: str, expected: str, change: dict) -> None:
    """`import_hf` of the model in `hf_dir` with config.json fields `change`d raises one line
    holding `expected`, and writes nothing."""
    from checkpoint.hf import import_hf
    from models.hf import HFConversionError

    d = tmp_path / f"case{len(os.listdir(tmp_path))}"
    d.mkdir()
    cfg = {**json.load(open(os.path.join(hf_dir, "config.json"))), **change}
    json.dump(cfg, open(d / "config.json", "w"))
    os.link(os.path.join(hf_dir, "model.safetensors"), d / "model.safetensors")
    with pytest.raises(HFConversionError) as info:
        import_hf(str(d), str(d / "out"), log=lambda *a: None)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not os.path.exists(d / "out")


def test_refusals(converted, tmp_path):
    qwen3, _ = converted["qwen3"]
    _refused(tmp_path, qwen3, "attention_bias=True is not supported for qwen3",
             {"attention_bias": True})
    _refused(tmp_path, qwen3, "rope_scaling type 'yarn' is not supported",
             {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                  "original_max_position_embeddings": 32}})
    # no head_dim: transformers' Qwen3 default 128 (not hidden / heads), as we read it
    _refused(tmp_path, qwen3, "'model.layers.0.self_attn.q_proj.weight' has shape [128, 64] in "
             "the weight files, config.json needs [512, 64]", {"head_dim": None})
    olmo2, _ = converted["olmo2"]
    _refused(tmp_path, olmo2, "attention_bias=True is not supported for olmo2",
             {"attention_bias": True})
    _refused(tmp_path, olmo2, "hidden_act 'gelu' is not supported",
             {"hidden_act": "gelu"})
    phi3, _ = converted["phi3"]
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4, "original_max_position_embeddings": 32}
    _refused(tmp_path, phi3, "rope_scaling type 'longrope' (Phi-3's long-context LongRoPE",
             {"rope_parameters": longrope})
    _refused(tmp_path, phi3, "rope_scaling type 'su' (Phi-3's long-context LongRoPE",
             {"rope_parameters": None, "rope_scaling": {
                 **{k: v for k, v in longrope.items() if k != "rope_type"}, "type": "su"}})
    _refused(tmp_path, phi3, "partial_rotary_factor 0.5 is not supported",
             {"partial_rotary_factor": 0.5})
    # a Qwen3 file called OLMo 2: its per-head q/k norm weights do not fit
    _refused(tmp_path, qwen3, "'model.layers.0.post_feedforward_layernorm.weight', which this "
             "olmo2 config needs", {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]})


# ---------------------------------------------------------------------------- fine-tune
@torch.no_grad()
def _native_logits(ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    from checkpoint.model_io import load_model_weights
    from models import GPTModel

    config = _config(ckpt)
    model = GPTModel(config).eval()
    load_model_weights(ckpt, [model])
    return model(ids)[..., :config.vocab_size]


def test_finetune_at_tp2_and_export(converted, tmp_path):
    """One `train.py --finetune` step at tp 2 with SP (lr 1e-2) from each import, exported back:
    transformers loads it with no missing, unexpected or mismatched tensor, every HF weight
    moved (q/k norms, OLMo 2's post norms too: their gradients reached them), and its logits
    equal ours from the trained checkpoint."""
    from safetensors.torch import load_file

    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()
    (tmp_path / "corpus.txt").write_text(text)
    first_ckpt = next(iter(converted.values()))[1]
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input",
                    str(tmp_path / "corpus.txt"), "--output-prefix", str(tmp_path / "data"),
                    "--tokenizer-dir", os.path.join(first_ckpt, "tokenizer"), "--text-unit",
                    "line"], cwd=REPO, check=True, capture_output=True)
    train_in_one_world(2, [  # every family's run in one world of 2: one start-up
        ["--load", ckpt, "--finetune", "--tp", "2", "--train-iters", "1",
         "--lr", "1e-2", "--min-lr", "1e-2", "--lr-warmup-iters", "0",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--eval-interval", "0", "--sequence-parallel",
         "--data-path", str(tmp_path / "data_text_document"),
         "--save", str(tmp_path / f"{name}-save"), "--log-dir", str(tmp_path / f"{name}-log")]
        for name, (_, ckpt) in converted.items()])
    for name, (hf_dir, ckpt) in converted.items():
        save, out = str(tmp_path / f"{name}-save"), str(tmp_path / f"{name}-hf")
        hf = export_and_load(save, out, name)
        arch = [json.load(open(os.path.join(d, "config.json")))["architectures"]
                for d in (hf_dir, out)]
        assert arch[0] == arch[1], (name, arch)  # Phi-3 stays Phi-3 through train.py
        before = load_file(os.path.join(hf_dir, "model.safetensors"))
        after = load_file(os.path.join(out, "model.safetensors"))
        assert set(before) == set(after), name
        unmoved = [k for k in before if torch.equal(before[k], after[k])]
        assert not unmoved, f"{name}: the fine-tune step left {unmoved[:4]} unchanged"
        config = _config(ckpt)
        ids = _batch(config.vocab_size)
        with torch.no_grad():
            ref = hf.eval()(ids).logits
        ours = _native_logits(os.path.join(save, "iter_0000001"), ids)
        assert_fp32_close(ours, ref, forward_chain_terms(config, S, "logits"),
                          f"{name} fine-tuned at tp=2, exported")


def test_norm_fields_validation():
    """The q/k-norm and pre-norm fields, as untrusted checkpoint metadata may give them: each
    bad combination is a ConfigError naming the flag and the fix."""
    from models.config import ConfigError, ModelConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                position_embedding_type="rope")
    cases = [
        (dict(qk_layernorm="yes"), {}, "--qk-layernorm must be true or false, got 'yes'"),
        (dict(pre_layernorm=0), {}, "--pre-layernorm must be true or false, got 0"),
        (dict(qk_norm_over_heads=True), {}, "--qk-norm-over-heads says how the q/k norms span "
                                            "the heads, but --qk-layernorm is not set"),
        (dict(qk_layernorm=True, qk_norm_over_heads=True, normalization="LayerNorm"), {},
         "add --normalization RMSNorm"),
        # tp 4 > 2 KV heads: replicas would count the k squares twice
        (dict(qk_layernorm=True, qk_norm_over_heads=True), dict(
            tensor_model_parallel_size=4, kv_replication=True),
         "--qk-norm-over-heads with --num-query-groups 2 at --tensor-model-parallel-size 4"),
    ]
    for fields, args, expected in cases:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            ModelConfig(**{**base, **fields}).validate(**args)
    # per-head norms replicate with their KV heads at inference (each rank normalizes its own)
    ModelConfig(**base, qk_layernorm=True).validate(4, kv_replication=True)
    with pytest.raises(ConfigError, match="for decoder-only models"):
        ModelConfig(model_type="t5", position_embedding_type="relative",
                    qk_layernorm=True).validate()
    # the export's family hint (a Phi-3 import's extra) from untrusted metadata: used only
    # when it names a family that can represent the model
    from models.hf import config_to_hf

    for extra, arch in (({"hf_model_type": "phi3"}, "Phi3ForCausalLM"),
                        ({"hf_model_type": ["phi3"]}, "LlamaForCausalLM"),
                        ({"hf_model_type": "gpt2"}, "LlamaForCausalLM"),
                        ("phi3", "LlamaForCausalLM")):
        assert config_to_hf(ModelConfig(**base, extra=extra))["architectures"] == [arch], extra


def test_planner_counts_what_the_norms_save(no_grid):
    """The planner's activation bytes (planner/activations.py `qk_norm_bytes`, the norm count)
    equal what Qwen3's and OLMo 2's layers save for backward (training.memory's meter), in
    float32 and bfloat16, at two head layouts."""
    from models import GPTModel, ModelConfig
    from planner.activations import model_chunk_bytes
    from training.memory import SavedTensorMeter

    for heads, groups, d, s, b in ((4, 2, 16, 32, 2), (8, 2, 8, 16, 3)):
        base = dict(num_layers=2, hidden_size=64, num_attention_heads=heads,
                    num_query_groups=groups, kv_channels=d, seq_length=s, ffn_hidden_size=96,
                    normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                    position_embedding_type="rope", vocab_size=256, qk_layernorm=True)
        olmo2 = dict(base, qk_norm_over_heads=True, pre_layernorm=False,
                     post_self_attn_layernorm=True, post_mlp_layernorm=True)
        for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
            for kw in (base, olmo2):
                config = ModelConfig(**kw)
                model = GPTModel(config).to(dtype)
                meter = SavedTensorMeter([model])
                with meter:  # the output keeps the graph until the meter closes
                    out = model(torch.randint(0, 256, (b, s)))
                assert meter.bytes("layers") == model_chunk_bytes(config, 2, s, b,
                                                                  bytes_per_value=e), (kw, e)
                del out
