"""The compressed KV cache of multi-head latent attention (layers/mla.py; inference/runner.py
`kv_cache_geometry`): on transformers' tiny random DeepseekV3ForCausalLM (both forms of
test_mla.py) at tp 1 and tp 2, the engine's greedy ids with the latent cache equal
transformers' generate and the full-K/V cache's, through fresh prefill, absorbed decode,
chunked prefill (absorbed, and expanded from the cache), prefix-cache hits and speculative
decoding (n-gram and a draft model); decode never expands a latent; the cache's bytes per
token are the config's kv_lora_rank + qk_rope_head_dim against full K/V's, replicated over
TP, and the start-up line says so.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from test_mla import NEW, PROMPTS, save_hf_models

K = 3  # speculative tokens


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return save_hf_models(tmp_path_factory.mktemp("deepseek-cache"))


def _mla_modules(model) -> list:
    from layers.mla import MultiLatentAttention

    return [m for m in model.modules() if isinstance(m, MultiLatentAttention)]


def _run(model, prompts=PROMPTS, engine=None, **kw) -> tuple[list, object]:
    """(greedy ids of `prompts` as one batch, the engine)."""
    from inference.engine import Engine, Request
    from inference.sampling import SamplingParams

    engine = engine or Engine(model, max_batch_size=2, max_seq_length=64, block_size=4, **kw)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=NEW)) for i, p in enumerate(prompts)]
    engine.generate(reqs)
    assert engine.blocks.num_free == engine.blocks.capacity, "KV cache blocks leaked"
    return [r.output for r in reqs], engine


def _count_expansions(model) -> list:
    """Per MLA layer, a list that gets the number of cached latents each call of its
    `W_UKV` up-projection expands (a replaced `forward`: a hook would turn absorption off)."""
    counts = []
    for attn in _mla_modules(model):
        up, seen = attn.linear_kv_up_proj, []
        counts.append(seen)

        def forward(x, weight=None, up=up, seen=seen):
            seen.append(x.shape[0] * x.shape[1])
            return type(up).forward(up, x, weight)
        up.forward = forward
    return counts


def _world(hf_dirs: dict) -> dict:
    """name -> results of this grid's engines (see the tests)."""
    from inference.loading import load
    from inference.spec_decode import DraftModelProposer, SpecDecoder, SpeculativeConfig

    out = {}
    for name, hf_dir in hf_dirs.items():
        model = load(hf=hf_dir)[0]
        draft = load(hf=hf_dir)[0]
        r = {}
        counts = _count_expansions(model)
        r["latent"], engine = _run(model)
        r["expanded_rows"] = [sum(c) for c in counts]
        r["expanding_calls"] = [len(c) for c in counts]
        for attn in _mla_modules(model):
            attn.linear_kv_up_proj.__dict__.pop("forward")
        r["bytes"], r["summary"] = engine.runner.bytes_per_token, engine.cache_summary()
        r["full"], full = _run(model, mla_latent_cache=False)
        r["full_bytes"] = full.runner.bytes_per_token
        assert "multi-head latent" not in full.cache_summary()
        r["chunked"], _ = _run(model, max_num_batched_tokens=4)
        crossover = {attn: attn.absorb_max_queries for attn in _mla_modules(model)}
        for attn in crossover:  # chunks after the first expand the cached latents
            attn.absorb_max_queries = 1
        r["chunked_expanded"], _ = _run(model, max_num_batched_tokens=4)
        for attn, n in crossover.items():
            attn.absorb_max_queries = n
        # prefix caching: the same prompts again on the same engine hit their cached blocks
        _, engine = _run(model)
        r["again"], engine = _run(model, engine=engine)
        r["prefix_hits"] = engine.prefix_hits
        spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=K))
        r["ngram"], engine = _run(model, speculative=spec)
        r["ngram_drafted"] = engine.spec.stats.num_draft_tokens
        spec = SpecDecoder(SpeculativeConfig(method="draft_model", model="self",
                                             num_speculative_tokens=K),
                           DraftModelProposer(draft, model.config, 64))
        r["draft"], engine = _run(model, speculative=spec)
        r["draft_accepted"] = engine.spec.stats.num_accepted_tokens
        r["draft_latent"] = not engine.spec.draft.runner.cache.values
        out[name] = r
    return out


@pytest.fixture(scope="module")
def worlds(hf_dirs):
    return {tp: run_distributed(_world, tp, hf_dirs, tp=tp, timeout=900)[0] for tp in (1, 2)}


def _hf_greedy(hf_dir: str) -> list:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("tp", [1, 2])
def test_latent_cache_generates_transformers_ids_on_every_path(hf_dirs, worlds, tp):
    for name, hf_dir in hf_dirs.items():
        ref, r = _hf_greedy(hf_dir), worlds[tp][name]
        assert all(len(set(ids)) > 3 for ids in ref), ref  # not one repeated id
        for path in ("latent", "full", "chunked", "chunked_expanded", "again", "ngram",
                     "draft"):
            assert r[path] == ref, f"{name} at tp {tp}: {path} differs from transformers'"
        assert r["prefix_hits"] > 0
        # verification forwards of K + 1 tokens ran; the draft (the model itself) is right
        assert r["ngram_drafted"] > 0 and r["draft_accepted"] >= NEW // 2, r
        assert r["draft_latent"]


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_never_expands_the_latents(hf_dirs, worlds, tp):
    """One expansion per layer, the fresh prefill's (both prompts, padded to the longer),
    though every request decoded NEW - 1 more steps."""
    longest = max(len(p) for p in PROMPTS)
    for name in hf_dirs:
        r = worlds[tp][name]
        assert set(r["expanding_calls"]) == {1}, (name, r["expanding_calls"])
        assert set(r["expanded_rows"]) == {len(PROMPTS) * longest}, r["expanded_rows"]


@pytest.mark.parametrize("tp", [1, 2])
def test_bytes_per_token_measured_equal_the_config(hf_dirs, worlds, tp):
    """Latent: layers x (kv_lora_rank + qk_rope_head_dim) float32 values on every TP rank
    (replicated); full K/V: 2 x layers x heads/tp x max(qk_nope + qk_rope, v_head_dim)
    values (one padded head dim); their ratio as the start-up line reports it."""
    from transformers import AutoConfig

    for name, hf_dir in hf_dirs.items():
        c, r = AutoConfig.from_pretrained(hf_dir), worlds[tp][name]
        latent = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
        full = 2 * c.num_hidden_layers * c.num_attention_heads // tp * \
            max(c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim) * 4
        assert (r["bytes"], r["full_bytes"]) == (latent, full), (name, r)
        print(f"{name} tp {tp}: {latent} bytes per token with the latent cache, {full} with "
              f"full K/V: {full / latent:.1f}x")
        assert f"{full / latent:.1f}x fewer bytes than full K/V ({full:,} bytes per token)" \
            in r["summary"], r["summary"]
        assert f"{latent:,} bytes per token" in r["summary"]
