"""Sliding-window attention (Megatron's `window_size` / `window_attn_skip_freq`; Mistral's
`sliding_window`, Qwen2's `use_sliding_window` + `max_window_layers` / `layer_types`).

- tiny random transformers models (a window of 8 in a 48-token context): logits equal
  transformers' at every position, 40 of them past the window, at tp 1, tp 2 and pp 2 (Qwen2's
  full first layers and sliding last layers then sit on different stages), and greedy ids
  equal transformers' `generate` through the Engine (prefill, then decode far past the window,
  rows joining and leaving a batch of 2 slots);
- which input positions reach a logit: exactly the layers' combined windows (and the packed
  document's), through SDPA, the explicit softmax of keyed dropout, selective and full recompute;
- training with a window shorter than the sequence, dropout on: tp 2 with SP and selective
  recompute, pp 2, packed documents with full recompute, each equal to one process; the window
  changes the losses;
- config: flags, validation errors, hostile checkpoint metadata, HF import refusals, export
  round trips (HF -> ours -> HF and ours -> HF -> ours).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from distributed import run_distributed
from tolerances import assert_fp32_close, forward_chain_terms

W, S = 8, 48  # HF sliding_window, context
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 2, 11, 150, 7, 30], [7, 1, 2, 3, 4], [200, 100, 9]]
MAX_NEW = [30, 36, 20]  # every row decodes 2-4 windows past its prompt


def _hf_configs() -> dict:
    from transformers import MistralConfig, Qwen2Config

    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
                  bos_token_id=None, eos_token_id=None)  # generate runs to max_new_tokens
    return {
        "mistral": MistralConfig(num_hidden_layers=2, sliding_window=W,
                                 tie_word_embeddings=False, **common),
        # layers 0, 1 full attention, 2, 3 sliding (transformers: i >= max_window_layers)
        "qwen2": Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=W,
                             max_window_layers=2, tie_word_embeddings=True, **common),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (hf folder, native checkpoint folder); large init std, so greedy outputs do
    not collapse into one repeated id."""
    from test_inference import random_hf_models

    return random_hf_models(tmp_path_factory.mktemp("swa"), _hf_configs(), 20)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, S), generator=torch.Generator().manual_seed(3))


def _ours(models: dict) -> dict:
    """This rank's {name: (logits [2, S, vocab] or None off the last stage, greedy outputs)}:
    the checkpoint's logits, and the Engine's greedy ids for PROMPTS (2 cache slots)."""
    from test_hf_conversion import pipeline_logits

    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams

    out = {}
    for name, (hf_dir, ckpt) in models.items():
        model, _, _ = load(load=ckpt) if name == "mistral" else load(hf=hf_dir)
        logits = pipeline_logits(model, _ids(model.config.vocab_size))
        engine = Engine(model, max_batch_size=2, max_seq_length=S)
        reqs = [Request(str(i), p, SamplingParams(max_new_tokens=n))
                for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
        engine.generate(reqs)
        out[name] = (logits, [r.output for r in reqs])
    ps.destroy_model_parallel()
    return out


def _layouts(models: dict) -> dict:
    """In a world of 2: `_ours` at tp 1 (dp 2), tp 2 and pp 2; {layout: a last stage's
    result}."""
    import torch.distributed as dist

    import parallel_state as ps

    results = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, device="cpu")
        got = _ours(models)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, got)
        results[(tp, pp)] = next(r for r in every if next(iter(r.values()))[0] is not None)
    return results


def test_logits_and_generate_match_transformers_past_the_window(models, no_grid):
    from transformers import AutoModelForCausalLM

    from checkpoint.format import read_metadata
    from models import ModelConfig

    results = run_distributed(_layouts, 2, models, timeout=300)[0]
    for name, (hf_dir, ckpt) in models.items():
        config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
        assert config.window_size == (W - 1, 0) and config.seq_length == 128
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ids = _ids(config.vocab_size)
        with torch.no_grad():
            ref = hf(ids).logits
        ref_ids = []
        for prompt, n in zip(PROMPTS, MAX_NEW):
            x = torch.tensor([prompt])
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)
            ref_ids.append(gen[0, len(prompt):].tolist())
        assert all(len(set(r)) > 5 for r in ref_ids), ref_ids  # not one repeated id
        k = forward_chain_terms(config, S, "logits")
        for (tp, pp), got in results.items():
            logits, outputs = got[name]
            where = f"{name} tp={tp} pp={pp}"
            past = float((logits[:, W:] - ref[:, W:]).abs().max())
            print(f"{where}: max |logit - transformers| past the window {past:.2e}")
            assert_fp32_close(logits, ref, k, where)
            assert outputs == ref_ids, f"{where}: greedy ids differ from transformers' generate"


# ---------------------------------------------------------------------- what reaches a logit
def _reach(model, ids, attention_mask=None, sample_ids=None) -> set[int]:
    """Positions j whose embedding output gets a nonzero gradient from the last position's
    logits: the positions that reach it."""
    import parallel_state as ps

    kept = {}
    hook = model.embedding.register_forward_hook(
        lambda _m, _i, out: kept.setdefault("x", out) if out.requires_grad else None)
    with ps.dropout_sample_ids(sample_ids):
        logits = model(ids, attention_mask=attention_mask)
    hook.remove()
    x = kept["x"]
    grad, = torch.autograd.grad(logits[:, -1].sum(), x)  # x: [s, b, h]
    return set(torch.nonzero(grad.abs().sum(dim=(1, 2))).flatten().tolist())


def test_each_attention_path_sees_exactly_the_windows(no_grid):
    """Two layers of window 4 (left 3): the last of 16 positions is reached from the 7 before
    it and itself, through the SDPA path (eval), the explicit softmax (keyed attention
    dropout), selective and full recompute; a full first layer reaches everything; a packed
    document's mask combines with the window."""
    from models import GPTModel, ModelConfig
    from data_pipeline.masks import ltor_masks_and_position_ids
    from layers.recompute import apply_recompute

    s = 16
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                seq_length=s, vocab_size=64, position_embedding_type="rope",
                normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                window_size=(3, 0), attention_dropout=0.2)
    ids = torch.randint(1, 64, (1, s), generator=torch.Generator().manual_seed(0))
    window = set(range(s - 7, s))
    for skip, want in ((None, window), ([0, 1], set(range(s)))):
        model = GPTModel(ModelConfig(**base, window_attn_skip_freq=skip))
        model.init_weights(1)
        assert _reach(model.eval(), ids) == want, ("sdpa", skip)
        model.train()
        for recompute in (None, "selective", "full"):
            apply_recompute(model, recompute, "uniform" if recompute == "full" else None, 1)
            got = _reach(model, ids, sample_ids=torch.tensor([0]))
            assert got == want, ("keyed dropout", skip, recompute, sorted(got))
    ids[0, 12] = 0  # EOD: the last document starts at 13
    mask, _, _ = ltor_masks_and_position_ids(ids, 0, False, True, False)
    model.eval()  # skip [0, 1]: the full layer sees the document, the window cuts nothing more
    assert _reach(model, ids, mask) == {13, 14, 15}
    ids[0, 12] = 5
    ids[0, 5] = 0  # the document starts at 6: the windows cut it to 9..15
    mask, _, _ = ltor_masks_and_position_ids(ids, 0, False, True, False)
    model = GPTModel(ModelConfig(**base))
    model.init_weights(1)
    assert _reach(model.eval(), ids, mask) == window
    # a cache without the engine's masks: each layer cuts its own band (queries last)
    from inference.kv_cache import KVCache

    cache = KVCache(model.layer_numbers, 1, s, 2, 8, torch.float32, "cpu")
    with torch.no_grad():
        full = model(ids)
        steps = []
        for start, stop in ((0, 9), (9, 10), (10, 11), (11, 16)):
            cache.bind(torch.tensor([0]), torch.arange(start, stop)[None], stop)
            steps.append(model(ids[:, start:stop], kv_cache=cache, position_offset=start))
    assert_fp32_close(torch.cat(steps, 1), full, forward_chain_terms(model.config, s, "logits"))


def test_activation_memory_prediction_with_windows(no_grid):
    """The saved-for-backward bytes of tiny-llama's layers with a window on layers 1 and 3
    equal `model_chunk_bytes` for every attention path and recompute policy: the shared
    sliding mask is kept once (flash kernel, selective recompute) or not at all."""
    from test_recompute_memory import _model

    from parallel_state import model_parallel_seed
    from planner.activations import model_chunk_bytes
    from training.memory import measure_activation_bytes

    s, b = 32, 2
    ids = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))
    for dropout, keyed in ((0.0, False), (0.1, False), (0.1, True)):
        for policy in ((None, None, None), ("selective", None, None), ("full", "block", 1)):
            model = _model("tiny-llama", dropout, policy, s=s)
            model.config.window_size, model.config.window_attn_skip_freq = (7, 0), 2
            for n, layer in model.decoder.layers.items():  # as if built with the window
                layer.self_attention.window_size = model.config.layer_window_size(int(n))
            model_parallel_seed(11, 0)
            batch = {"tokens": ids, "labels": ids, "loss_mask": torch.ones(b, s)}
            if keyed:
                batch["sample_ids"] = torch.arange(b)
            got = measure_activation_bytes([model], batch, None)
            want = model_chunk_bytes(model.config, 4, s, b, 1, False, *policy,
                                     keyed_dropout=keyed, layer_numbers=got["layer_numbers"])
            assert got["layers"] == want, (dropout, keyed, policy, got["layers"], want)


# ---------------------------------------------------------------------- training layouts
WINDOW = ["--window-size", "7,0", "--window-attn-skip-freq", "2"]  # layers 2, 4 full
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def test_training_with_a_window_matches_one_process(tmp_path, corpus_env):
    """tiny-llama (seq 64) with a window of 8 on layers 1 and 3, dropout on: the losses and
    gradient norms of tp 2 + SP + selective recompute, pp 2, and packed documents at tp 2
    with full recompute equal one process's; without the window they differ."""
    from test_dropout import LLAMA, _train
    from test_packed_documents import _short_documents
    from tolerances import assert_losses_close, training_chain_terms

    from models.tokenizer import build_tokenizer
    from data_pipeline import ensure_default_corpus

    cache = corpus_env["SHARDZOO_CACHE"]
    _, sp = ensure_default_corpus(cache, quiet=True)
    docs = str(tmp_path / "short")  # 5..40-token documents: several per sample
    _short_documents(docs, build_tokenizer(sp).vocab_size, build_tokenizer(sp).eod)
    refs = [LLAMA + WINDOW, LLAMA,
            LLAMA + WINDOW + DOCS + ["--data-path", docs, "--tokenizer-model", sp]]
    one = run_distributed(_train, 1, refs, str(tmp_path / "one"), cache, timeout=600)[0]
    runs = [(0, ["--tp", "2", "--sequence-parallel", "--recompute-granularity", "selective"]),
            (0, ["--pp", "2"]),
            (2, ["--tp", "2", "--no-sequence-parallel", "--recompute-granularity", "full",
                 "--recompute-method", "uniform", "--recompute-num-layers", "1"])]
    two = run_distributed(_train, 2, [refs[r] + flags for r, flags in runs],
                          str(tmp_path / "two"), cache, timeout=600)[0]
    (window, _), (full, _) = one[:2]
    assert len(window) == 4 and window[-1] < window[0]
    assert window != full
    for (r, flags), (losses, norms) in zip(runs, two[:3], strict=True):
        k_step = training_chain_terms(refs[r] + flags)
        assert_losses_close(losses, one[r][0], k_step, f"losses with {flags}")
        assert_losses_close(norms, one[r][1], k_step, f"grad norms with {flags}")


# ---------------------------------------------------------------------- configuration
def test_flags_and_validation_errors():
    from models.config import ConfigError, ModelConfig
    from training.arguments import parse_config

    c = parse_config(["--model", "tiny-llama", "--window-size", "4095,0",
                      "--window-attn-skip-freq", "1,0,1,1"]).model
    c.validate()
    assert c.window_size == (4095, 0) and c.window_attn_skip_freq == [1, 0, 1, 1]
    assert [c.layer_window_size(i) for i in range(4)] == [(4095, 0), None, (4095, 0),
                                                          (4095, 0)]
    c = parse_config(["--model", "tiny-llama", "--window-size", "[7, 0]",
                      "--window-attn-skip-freq", "2", "--seq-length", "64"]).model
    c.validate()  # a window shorter than the sequence trains (it was refused)
    assert [c.layer_window_size(i) for i in range(4)] == [(7, 0), None, (7, 0), None]
    assert ModelConfig.from_dict(c.to_dict()) == c and c.to_dict()["window_size"] == [7, 0]
    with pytest.raises(Exception, match="cannot read 'a,b' as integers"):
        parse_config(["--window-size", "a,b"])
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64)
    bad = [  # (fields, what the error says)
        (dict(window_size=4096), "--window-size 4095,0 for HF's sliding_window 4096"),
        (dict(window_size=(7, 0, 1)), "two integers"),
        (dict(window_size=(7.0, 0)), "two integers"),
        (dict(window_size=(True, 0)), "two integers"),
        (dict(window_size=(-1, 0)), "leave --window-size unset"),
        (dict(window_size=(2**31, 0)), "left must be in [0, 2^31)"),
        (dict(window_size=(7, 2)), "right 0"),
        (dict(window_attn_skip_freq=2), "--window-size is not set"),
        (dict(window_size=(7, 0), window_attn_skip_freq=1), "N >= 2"),
        (dict(window_size=(7, 0), window_attn_skip_freq=[1, 0, 1]), "--num-layers 4 entries"),
        (dict(window_size=(7, 0), window_attn_skip_freq=[1, 0, 2, 1]), "each 1 (sliding"),
        (dict(window_size=(7, 0), window_attn_skip_freq=[True, 0, 1, 1]), "each 1 (sliding"),
        (dict(window_size=(7, 0), window_attn_skip_freq="1,0,1,1"), "each 1 (sliding"),
        (dict(window_size=(7, 0), model_type="t5", position_embedding_type="relative"),
         "decoder-only"),
    ]
    for fields, message in bad:
        with pytest.raises(ConfigError) as info:
            ModelConfig(**{**base, **fields}).validate()
        assert message in str(info.value), (fields, str(info.value))


def test_checkpoint_metadata_windows(models, tmp_path):
    """metadata.json's window fields are untrusted: wrong types and lengths are refused
    before anything is built; a window written as one number (HF's sliding_window, as the
    old format stored it) reads as (W - 1, 0)."""
    from checkpoint.format import CheckpointError, read_metadata

    _, ckpt = models["qwen2"]
    meta = read_metadata(ckpt)
    assert meta["model"]["window_size"] == [W - 1, 0]
    assert meta["model"]["window_attn_skip_freq"] == [0, 0, 1, 1]
    hostile = {"window_size": [[7], [0]], "window_attn_skip_freq": [1, 0, 1],
               "window_size ": "7,0", "window_size  ": [7, 0.0],
               "window_attn_skip_freq ": [0, 0, 1, 1e30]}
    for i, (field, value) in enumerate({**hostile, "window_size   ": 8}.items()):
        folder = str(tmp_path / f"c{i}")
        shutil.copytree(ckpt, folder)
        path = os.path.join(folder, "metadata.json")
        m = json.load(open(path))
        m["model"][field.strip()] = value
        json.dump(m, open(path, "w"))
        if value == 8:
            assert read_metadata(folder)["model"]["window_size"] == [7, 0]
            continue
        with pytest.raises(CheckpointError, match="model config is invalid") as info:
            read_metadata(folder)
        assert field.strip().replace("_", "-") in str(info.value), str(info.value)


def test_hf_round_trips_and_refusals(models, tmp_path):
    """HF -> ours -> HF keeps every field that decides the attention (sliding_window,
    use_sliding_window, max_window_layers, layer_types); ours -> HF -> ours keeps
    window_size and each layer's kind; what no HF family represents is refused."""
    from transformers import AutoConfig, Qwen2Config

    from checkpoint.format import read_metadata
    from checkpoint.hf import export_hf
    from models import ModelConfig
    from models.hf import HFConversionError, config_from_hf, config_to_hf

    for name, (hf_dir, ckpt) in models.items():
        out = str(tmp_path / name)
        export_hf(ckpt, out, log=lambda *a: None)
        cfg_in = json.load(open(os.path.join(hf_dir, "config.json")))
        cfg_out = json.load(open(os.path.join(out, "config.json")))
        for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"):
            assert cfg_out.get(key) == cfg_in.get(key), (name, key, cfg_out.get(key))
        assert AutoConfig.from_pretrained(out).to_dict().get("layer_types") == \
            AutoConfig.from_pretrained(hf_dir).to_dict().get("layer_types")
        assert config_from_hf(cfg_out) == ModelConfig.from_dict(read_metadata(ckpt)["model"])
    qwen_shape = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64,
                      position_embedding_type="rope", normalization="RMSNorm",
                      activation="swiglu", add_bias_linear=False, add_qkv_bias=True)
    every_other = ModelConfig(**qwen_shape, window_size=(5, 0), window_attn_skip_freq=2)
    d = config_to_hf(every_other)  # a Gemma-like pattern: Qwen2's layer_types carries it
    assert d["layer_types"] == Qwen2Config(**d).layer_types == \
        ["sliding_attention", "full_attention"] * 2 and d["sliding_window"] == 6
    back = config_from_hf(d)
    assert [back.layer_window_size(i) for i in range(4)] == \
        [every_other.layer_window_size(i) for i in range(4)]
    no_qkv_bias = ModelConfig(**{**qwen_shape, "add_qkv_bias": False}, window_size=(5, 0),
                              window_attn_skip_freq=2)
    gpt2_shape = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                             seq_length=64, window_size=(5, 0))
    for c, why in ((no_qkv_bias, "Mistral slides every layer"),
                   (gpt2_shape, "GPT-2 has no sliding window")):
        with pytest.raises(HFConversionError, match=why):
            config_to_hf(c)
    mistral = json.load(open(os.path.join(models["mistral"][0], "config.json")))
    qwen2 = json.load(open(os.path.join(models["qwen2"][0], "config.json")))
    refused = {
        "sliding_window 0": {**mistral, "sliding_window": 0},
        "sliding_window '8'": {**mistral, "sliding_window": "8"},
        "use_sliding_window 'yes'": {**qwen2, "use_sliding_window": "yes"},
        "layer_types must list 4": {**qwen2, "layer_types": ["full_attention"] * 3},
        "layer_types must list 4 ": {**qwen2, "layer_types": ["full_attention"] * 3 + ["x"]},
        "max_window_layers -1": {**qwen2, "layer_types": None, "max_window_layers": -1},
    }
    for match, d in refused.items():
        with pytest.raises(HFConversionError, match=match.strip()):
            config_from_hf(d)
    assert config_from_hf({**qwen2, "use_sliding_window": False}).window_size is None
    assert config_from_hf({**qwen2, "layer_types": None, "max_window_layers": 4}) \
        .window_size is None  # no layer slides
