"""The model's multi-token-prediction layer as the speculative draft (inference/mtp_draft.py):
on a tiny DeepSeek-V3-style model (MLA latent cache, MoE, one MTP depth), greedy ids equal
the plain engine's token for token for several prompts and batch sizes with prefix caching
on, the acceptance rate is nonzero when the MTP layer is set to predict what the main model
does, seeded sampling equals the plain engine, and a model without the layer is refused; at
tp 2 and at pp 2 (the layer and the embedding's copy on the last stage, the drafts sent to
the first) the greedy ids equal the plain engine's, at pp 2 with pp 1's acceptance counts."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_spec_decode import one_rank  # noqa: F401  (the module's one-process world)

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11],
           [1, 2, 3, 1, 2, 3, 1, 2], [9, 10, 11], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
MAX_NEW = 12


def _model(mtp_layers: int = 1, main_scale: float = 0.3, mtp_scale: float = 0.1):
    """A tiny DeepSeek-V3-style model (2 layers, the second MoE, one MTP depth) in float32.
    Its layers' output projections are scaled by `main_scale` (the next token depends
    mostly, not only, on the last one) and the MTP depth reads the next token's embedding
    (eh_proj = [I, 0]) with its own layer's outputs scaled by `mtp_scale`, so the MTP layer
    predicts roughly what the main model will: its drafts are often, not always, accepted."""
    from models import GPTModel
    from training.arguments import load_model_config

    c = dataclasses.replace(load_model_config("tiny-deepseek"), mtp_num_layers=mtp_layers,
                            vocab_size=96, num_layers=2, moe_layer_freq=[0, 1])
    torch.manual_seed(0)
    model = GPTModel(c)
    model.init_weights(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                p.mul_(mtp_scale if name.startswith("mtp.") else main_scale)
        if mtp_layers:
            d = model.mtp.layers["0"]
            h = c.hidden_size
            d.eh_proj.weight.zero_()
            d.eh_proj.weight[:, :h] = torch.eye(h)
            d.final_layernorm.weight.copy_(model.decoder.final_layernorm.weight)
    return model.eval()


def _run(model, k: int | None, batch: int, prompts=PROMPTS, temperature: float = 0.0,
         prefix_caching: bool = True, **engine_kw):
    """(ids per request, engine) of one engine run (MTP drafts of `k` tokens, None: plain);
    `engine_kw`: more `Engine` arguments."""
    from inference.engine import Engine, Request
    from inference.mtp_draft import MTPProposer
    from inference.sampling import SamplingParams
    from inference.spec_decode import SpecDecoder, SpeculativeConfig

    spec = None if k is None else SpecDecoder(
        SpeculativeConfig(method="mtp", num_speculative_tokens=k), MTPProposer(model, 64))
    engine = Engine(model, max_batch_size=batch, max_seq_length=64, block_size=4,
                    speculative=spec, enable_prefix_caching=prefix_caching, **engine_kw)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature,
                                              seed=100 + i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine.generate(reqs)
    bm = engine.blocks
    assert bm.num_free == bm.capacity, "KV cache blocks leaked"
    if spec is not None:
        assert not spec.draft.cached and not spec.draft.hidden, "the MTP draft kept a request"
    return [r.output for r in reqs], engine


def test_greedy_equals_the_plain_engine_with_prefix_caching(one_rank):
    """Greedy ids with MTP drafts (k 1 and k 3: the depth reused recursively; k 3 only at
    batch 5) equal the plain engine's for five prompts (two sharing a prefix, one repeated)
    at batch sizes 1 and 5, with prefix caching on (one at a time, the later prompts hit
    the earlier ones' blocks, whose MTP entries they read); the drafts are accepted at a
    nonzero rate."""
    model = _model()
    for batch in (1, 5):
        plain, _ = _run(model, None, batch)
        assert all(len(o) == MAX_NEW for o in plain)
        for k in (1, 3) if batch == 1 else (3,):
            got, engine = _run(model, k, batch)
            assert got == plain, (batch, k)
            st = engine.spec.stats
            assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, (batch, k)
            assert batch > 1 or engine.prefix_hits > 0
            print(f"batch {batch} k {k}: {st.num_accepted_tokens} of {st.num_draft_tokens} "
                  f"accepted ({st.acceptance_rate:.2f})")


def test_acceptance_rate_is_high_when_the_mtp_layer_tracks_the_model(one_rank):
    """A main model whose next token depends on the last one only (layer outputs zeroed)
    and an MTP depth that reads the next token's embedding through the same final norm
    and head: the depth predicts exactly what the main model does, so nearly every draft
    is accepted (float rounding of the two norms aside); a random MTP layer's rarely."""
    tracked = _model(main_scale=0.0, mtp_scale=0.0)
    plain, _ = _run(tracked, None, 2)
    got, engine = _run(tracked, 2, 2)
    assert got == plain
    rate = engine.spec.stats.acceptance_rate
    print(f"tracking MTP layer: acceptance {rate:.2f}")
    assert rate > 0.9


def test_seeded_sampling_equals_the_plain_engine(one_rank):
    """Sampled ids (temperature 0.8, seeded) with MTP drafts equal the plain engine's: the
    verification is drafter-invariant (inference/spec_decode.py)."""
    model = _model()
    plain, _ = _run(model, None, 2, temperature=0.8)
    got, engine = _run(model, 2, 2, temperature=0.8)
    assert got == plain
    assert engine.spec.stats.num_accepted_tokens > 0


def test_a_model_without_an_mtp_layer_is_refused(one_rank):
    """No MTP layer, a draft model path with method "mtp": one-line errors naming the fix."""
    from inference.mtp_draft import MTPProposer
    from inference.spec_decode import SpeculativeConfig, build_speculative

    plain = _model(mtp_layers=0)
    with pytest.raises(ValueError, match="multi-token-prediction layer.*ngram or draft_model"):
        MTPProposer(plain, 64)
    with pytest.raises(ValueError, match="mtp_num_layers"):
        build_speculative(SpeculativeConfig(method="mtp", num_speculative_tokens=2), plain,
                          None, max_seq_length=64)
    with pytest.raises(ValueError, match="drop the model"):
        SpeculativeConfig(method="mtp", model="x").validate()


def _pp_stage(model):
    """This rank's stage of `model` on the current pipeline grid (inference/loading.py
    `build_model`), with its weights; the last stage's embedding copy is the embedding's."""
    from inference.loading import build_model

    full = model.state_dict()
    stage = build_model(model.config)
    stage.load_state_dict({k: full[k if k in full else "embedding.word_embeddings.weight"]
                           for k in stage.state_dict()})
    return stage.eval()


def _tp2_pp2_run() -> dict:
    """In a worker: at tp 2, greedy ids of the plain engine and of MTP drafts (k 2) on three
    prompts at batch 2, with the drafts' counts; then at pp 2 the same with one micro-batch
    in flight (pp 1's schedule) and with two (the engine's default at pp 2)."""
    import parallel_state as ps

    model = _model()
    plain, _ = _run(model, None, 2, prompts=PROMPTS[:3])
    got, engine = _run(model, 2, 2, prompts=PROMPTS[:3])
    out = {"plain": plain, "mtp": got, "stats": engine.spec.stats.as_dict()}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2, device="cpu")
    stage = _pp_stage(_model())  # built at tp 1 (init is layout-independent), then cut
    out["pp plain"], _ = _run(stage, None, 2, prompts=PROMPTS[:3], num_micro_batches=1)
    for m in (1, 2):
        out[f"pp mtp {m}"], engine = _run(stage, 2, 2, prompts=PROMPTS[:3],
                                          num_micro_batches=m)
        out[f"pp stats {m}"] = engine.spec.stats.as_dict()
        out[f"pp in flight {m}"] = engine.max_in_flight
    return out


def test_tensor_and_pipeline_parallel(one_rank):
    """In a spawned world of 2 ranks: at tp 2 (the MTP layer's heads split like the
    model's) greedy ids with MTP drafts equal the plain engine's with drafts accepted; at
    pp 2 (the layer and the embedding's copy on the last stage, which drafts and sends the
    drafts to the first) they equal the plain engine's and pp 1's, with pp 1's acceptance
    counts at one micro-batch in flight, and with two in flight; the same on both ranks."""
    from distributed import run_distributed

    ranks = run_distributed(_tp2_pp2_run, 2, tp=2, timeout=300)
    assert ranks[0] == ranks[1], "ranks disagree"
    got = ranks[0]
    one, engine = _run(_model(), 2, 2, prompts=PROMPTS[:3])  # pp 1, this process
    one_stats = engine.spec.stats.as_dict()
    assert got["mtp"] == got["plain"] == one
    assert got["stats"]["num_accepted_tokens"] > 0
    assert got["pp plain"] == got["pp mtp 1"] == got["pp mtp 2"] == one
    assert got["pp stats 1"] == one_stats, (got["pp stats 1"], one_stats)
    assert got["pp in flight 2"] == 2 and got["pp stats 2"]["num_accepted_tokens"] > 0
    for name in ("stats", "pp stats 1", "pp stats 2"):
        print(f"{name}: {got[name]['num_accepted_tokens']} of {got[name]['num_draft_tokens']} "
              f"accepted (pp 1: {one_stats['num_accepted_tokens']} of "
              f"{one_stats['num_draft_tokens']})")
