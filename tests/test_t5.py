"""T5Model against transformers' T5ForConditionalGeneration (tiny random v1.0 tied and v1.1
untied models): logits at tp=1 and tp=2 (with and without sequence parallel), relative
position buckets against an independent implementation, HF import/export round trip."""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from distributed import run_distributed

VOCAB = 99


def _hf_t5(v11: bool, seed: int = 0, eos_bias: bool = False):
    """A tiny random T5ForConditionalGeneration: v1.0 (ReLU, tied, rescaled head) or v1.1
    (gated-GeLU, untied head). Weights drawn wider than HF's init so differences show."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    c = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                 num_decoder_layers=3, num_heads=4, relative_attention_num_buckets=8,
                 relative_attention_max_distance=20, dropout_rate=0.0,
                 feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11)
    m = T5ForConditionalGeneration(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
        if v11:  # transformers 5 ties lm_head in memory; give it its own weight
            m.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.3)
    return m


def _hf_source(m):
    sd = dict(m.state_dict())
    return SimpleNamespace(config=m.config.to_dict(), get=sd.__getitem__, names=list(sd))


def _ours_from_hf(m, sequence_parallel: bool = False):
    from checkpoint.hf import load_hf_weights
    from models import T5Model
    from models import hf as hfmap

    src = _hf_source(m)
    config = hfmap.config_from_hf(src.config)
    ours = T5Model(config, sequence_parallel=sequence_parallel).eval()
    load_hf_weights(src, config, [ours])
    return ours


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 30), generator=g)
    dec = torch.randint(0, VOCAB, (2, 24), generator=g)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 21:] = False  # padding in the second encoder row
    return ids, dec, mask


def _logit_diffs(sequence_parallel: bool) -> dict:
    """max |ours - HF| of the logits for v1.0 and v1.1 (full vocabulary gathered over TP)."""
    from parallel_state import gather_from_tensor_model_parallel_region

    ids, dec, mask = _inputs()
    out = {}
    for v11 in (False, True):
        m = _hf_t5(v11)
        ours = _ours_from_hf(m, sequence_parallel)
        with torch.no_grad():
            ref = m(input_ids=ids, decoder_input_ids=dec, attention_mask=mask.long()).logits
            got = gather_from_tensor_model_parallel_region(
                ours(ids, decoder_input_ids=dec, encoder_attention_mask=mask))[..., :VOCAB]
        out["v1.1" if v11 else "v1.0"] = float((ref - got).abs().max())
    return out


def _tp_suite():
    return {sp: _logit_diffs(sp) for sp in (False, True)}


def test_logits_match_hf_tp1(no_grid):
    diffs = _logit_diffs(False)
    assert max(diffs.values()) < 1e-4, diffs


def test_logits_match_hf_tp2():
    results = run_distributed(_tp_suite, 2, tp=2, timeout=180)
    for rank, by_sp in enumerate(results):
        for sp, diffs in by_sp.items():
            assert max(diffs.values()) < 1e-4, (rank, sp, diffs)


def _bucket_reference(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of one relative position, written from the paper's description (Raffel
    et al. 2020, sec. 2.1; Mesh TensorFlow): per direction, half exact, half log-spaced."""
    base = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            base = num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)
    exact = num_buckets // 2
    if n < exact:
        return base + n
    val = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return base + min(val, num_buckets - 1)


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20)])
def test_relative_position_buckets_match_t5(num_buckets, max_distance, no_grid):
    from transformers.models.t5.modeling_t5 import T5Attention

    from layers import RelativePositionBias, relative_position_bucket

    rel = torch.arange(-300, 301)
    for bidirectional in (True, False):  # encoder, decoder
        ours = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
        want = [_bucket_reference(int(r), bidirectional, num_buckets, max_distance) for r in rel]
        assert ours.tolist() == want
        hf = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
        assert torch.equal(ours, hf)
    # the bias reads the table at bucket(key - query); decoding queries sit at the end
    bias = RelativePositionBias(num_buckets, max_distance, 4, bidirectional=False)
    torch.nn.init.normal_(bias.weight)
    full, last = bias(5, 5), bias(1, 5)
    assert full.shape == (1, 4, 5, 5) and torch.equal(last[0, :, 0], full[0, :, 4])
    buckets = relative_position_bucket(torch.arange(5) - 2, False, num_buckets, max_distance)
    assert torch.equal(bias(3, 5)[0, :, 0], bias.weight[buckets].t())


def test_cross_attention_has_no_position_bias(no_grid):
    """HF's old checkpoints carry an EncDecAttention bias table that T5 never reads: import
    ignores it, whatever its value; our cross-attention has no bias table at all."""
    from models import hf as hfmap

    m = _hf_t5(False)
    ours = _ours_from_hf(m)
    assert not [n for n, _ in ours.named_parameters() if "cross_attention" in n and
                "bias" in n]
    src = _hf_source(m)
    table = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
    sd = dict(m.state_dict())
    sd[table] = torch.randn(8, 4) * 100
    tensors = hfmap.to_native(hfmap.config_from_hf(src.config), "t5", sd.__getitem__, list(sd))
    same = hfmap.to_native(hfmap.config_from_hf(src.config), "t5", src.get, src.names)
    assert all(torch.equal(tensors[k](), same[k]()) for k in same)


def test_hf_refuses_unsupported_t5(no_grid):
    from models import hf as hfmap

    d = _hf_t5(False).config.to_dict()
    for change, words in [({"feed_forward_proj": "gated-silu"}, "feed_forward_proj"),
                          ({"decoder_start_token_id": 5}, "decoder_start_token_id"),
                          ({"scale_decoder_outputs": True, "tie_word_embeddings": False},
                           "rescales only a tied head"),
                          ({"architectures": ["T5EncoderModel"]}, "architectures")]:
        with pytest.raises(hfmap.HFConversionError, match=words):
            hfmap.config_from_hf({**d, **change})


@pytest.mark.parametrize("v11", [False, True], ids=["v1.0-tied", "v1.1-untied"])
def test_hf_import_export_round_trip_bitwise(v11, tmp_path, no_grid):
    from safetensors.torch import load_file
    from transformers import T5ForConditionalGeneration

    from checkpoint.hf import export_hf, import_hf

    m = _hf_t5(v11)
    m.save_pretrained(tmp_path / "hf")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    if v11:
        assert "lm_head.weight" in original
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), log=lambda *a: None)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), log=lambda *a: None)
    back = load_file(tmp_path / "out" / "model.safetensors")
    kept = {k: v for k, v in original.items() if not k.endswith("embed_tokens.weight")}
    assert sorted(back) == sorted(kept)
    assert all(torch.equal(back[k], kept[k]) for k in kept)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["scale_decoder_outputs"] is (not v11) and cfg["feed_forward_proj"] == \
        m.config.feed_forward_proj
    again = T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ids, dec, mask = _inputs()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, decoder_input_ids=dec).logits,
                           m(input_ids=ids, decoder_input_ids=dec).logits)
    assert os.path.exists(tmp_path / "out" / "generation_config.json")
