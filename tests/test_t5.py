"""T5Model against transformers' T5ForConditionalGeneration (tiny random v1.0 tied and v1.1
untied models): logits at tp=1 and tp=2 (with and without sequence parallel), greedy
generation against `generate` at tp=1, tp=2 and pp=2, relative position buckets against an
independent implementation, HF import/export round trip."""
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
                 relative_attention_max_distance=20, dropout_rate=0.0, decoder_start_token_id=0,
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


def _greedy_matches_hf() -> list[tuple]:
    """Greedy generation of the engine (continuous batching: 3 prompts, 2 slots) against HF
    `generate`, for v1.0 and v1.1: `(ours, HF)` token lists per prompt."""
    from inference.engine import Engine, Request
    from inference.sampling import SamplingParams

    from checkpoint.hf import load_hf_weights
    from inference.loading import build_model
    from models import hf as hfmap

    out = []
    for v11 in (False, True):
        m = _hf_t5(v11, seed=6)  # a seed whose greedy outputs vary (both versions)
        src = _hf_source(m)
        config = hfmap.config_from_hf(src.config)
        ours = build_model(config).eval()  # this pipeline stage's part
        load_hf_weights(src, config, [ours])
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 3)]
        engine = Engine(ours, eos_token_ids=[1], max_batch_size=2, max_seq_length=16,
                        max_source_length=32)
        requests = [Request(str(i), p, SamplingParams(max_new_tokens=10, temperature=0.0))
                    for i, p in enumerate(prompts)]
        engine.generate(requests)
        for r, p in zip(requests, prompts):
            # use_cache=False: transformers' cache mis-sizes a decoder deeper than the encoder
            hf = m.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, num_beams=1,
                            use_cache=False)[0, 1:].tolist()  # without the start id 0
            out.append((r.output, hf))
    return out


def _tp_suite():
    """At tp=2: logits (with and without SP) and greedy generation; then, on rebuilt grids,
    greedy generation at tp=1 (two replicas) and at pp=2 (encoder | decoder stages)."""
    import parallel_state as ps

    out = {"logits": {sp: _logit_diffs(sp) for sp in (False, True)},
           "generate": {2: _greedy_matches_hf()}}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, device="cpu")
    out["generate"][1] = _greedy_matches_hf()
    ps.destroy_model_parallel()  # pp 2: the encoder on stage 0, the decoder on stage 1
    ps.initialize_model_parallel(1, 2, device="cpu")
    out["generate"]["pp2"] = _greedy_matches_hf()
    return out


def test_logits_match_hf_tp1(no_grid):
    diffs = _logit_diffs(False)
    assert max(diffs.values()) < 1e-4, diffs


def test_logits_and_greedy_generation_match_hf_tp2_tp1_pp2():
    results = run_distributed(_tp_suite, 2, tp=2, timeout=240)
    for rank, result in enumerate(results):
        for sp, diffs in result["logits"].items():
            assert max(diffs.values()) < 1e-4, (rank, sp, diffs)
        for tp, pairs in result["generate"].items():
            for ours, hf in pairs:
                assert ours == hf, (rank, tp, ours, hf)
            for version in (pairs[:3], pairs[3:]):  # v1.0, v1.1: not one repeated token
                assert len({t for ours, _ in version for t in ours}) > 4, (tp, version)


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


def test_engine_refuses_compile_for_t5(no_grid):
    """--compile is for decoder-only models: a T5 engine refuses it, naming the flag, before
    anything is compiled."""
    from inference.engine import Engine

    ours = _ours_from_hf(_hf_t5(False))
    with pytest.raises(ValueError, match="--compile is for decoder-only models"):
        Engine(ours, max_batch_size=1, max_seq_length=8, compile=True)
    assert not any(getattr(m, "_compiled_call_impl", None) for m in ours.modules())


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


def test_infer_serves_t5_checkpoint(tmp_path, corpus_env, no_grid):
    """`infer.py --load` detects an encoder-decoder checkpoint and `--serve` answers
    /v1/completions with HF's greedy continuation of the prompt (EOS appended, as T5's
    tokenizer does); /v1/chat/completions is refused (no chat template)."""
    import signal
    import subprocess
    import sys

    from transformers import T5Config, T5ForConditionalGeneration

    from checkpoint.hf import import_hf
    from distributed import free_port
    from inference.seq2seq import SourceTokenizer
    from models.tokenizer import build_tokenizer
    from tests.test_server import _post
    from data_pipeline import ensure_default_corpus

    _, sp_path = ensure_default_corpus(corpus_env["SHARDZOO_CACHE"], quiet=True)
    sp = build_tokenizer(sp_path)
    vocab = sp.vocab_size + 100  # the sentinels above the tokenizer
    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(T5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, eos_token_id=sp.eod,
        initializer_factor=4.0)).eval()
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), log=lambda *a: None)
    port = free_port()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(repo, "infer.py"), "--load", str(tmp_path / "ckpt"),
         "--tokenizer", sp_path, "--serve", "--port", str(port), "--served-model-name", "t5"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving t5 on" in line:
                break
        else:
            raise AssertionError("server did not start:\n" + "".join(lines[-30:]))
        prompt = "def hello(name):\n    return"
        status, body = _post(port, "/v1/completions", {"model": "t5", "prompt": prompt,
                                                       "max_tokens": 8, "temperature": 0},
                             key=None)
        assert status == 200, body
        source = SourceTokenizer(sp, vocab)
        ids = source.encode(prompt)
        assert ids[-1] == sp.eod and body["usage"]["prompt_tokens"] == len(ids)
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                               num_beams=1)[0, 1:].tolist()
        assert body["choices"][0]["text"] == source.decode(want)
        assert body["usage"]["completion_tokens"] == len(want)
        status, body = _post(port, "/v1/chat/completions", {
            "model": "t5", "messages": [{"role": "user", "content": "hi"}]}, key=None)
        assert status == 400 and "chat template" in body["error"]["message"], body
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_infer_caps_a_t5_checkpoints_lengths(tmp_path, corpus_env, no_grid):
    """T5's relative positions set no hard length, so a metadata.json claiming 16M-token
    sequences (under the 2**24 positions any config may claim) must not size the KV cache
    (1e8 asked for 409 GB): the default is capped at 2048 as a GPT's is. Run under an 8 GB
    address-space limit, so the old code fails fast."""
    import json
    import resource
    import subprocess
    import sys

    from transformers import T5Config, T5ForConditionalGeneration

    from checkpoint.hf import import_hf
    from data_pipeline import ensure_default_corpus

    _, sp_path = ensure_default_corpus(corpus_env["SHARDZOO_CACHE"], quiet=True)
    hf = T5ForConditionalGeneration(T5Config(
        vocab_size=8292, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
        decoder_start_token_id=0, eos_token_id=2))
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), log=lambda *a: None)
    meta_path = tmp_path / "ckpt" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["model"].update(seq_length=16_000_000, decoder_seq_length=16_000_000)
    meta_path.write_text(json.dumps(meta))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(repo, "infer.py"), "--load", str(tmp_path / "ckpt"),
         "--tokenizer", sp_path, "--prompt", "def f(", "--max-new-tokens", "2"],
        cwd=repo, capture_output=True, text=True, preexec_fn=limit, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "### prompt 0" in proc.stdout, proc.stdout[-2000:]
