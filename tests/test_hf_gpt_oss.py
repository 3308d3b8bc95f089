"""gpt-oss (models/hf/gpt_oss.py) against transformers' own tiny random GptOssForCausalLM:
attention sinks, alternating sliding-window (4 < S) and full layers, YaRN unrounded, the
biased router and experts with the clamped gated unit (a limit of 0.5, so the clamps bite).

- logits equal transformers' at tp 1, and in one world of 4 ranks at tp 2 (infer.py's
  loader reading the HF folder; also with --enable-expert-parallel: whole experts over the
  TP ranks), tp 2 x pp 2 (the imported checkpoint) and ep 2;
- greedy generation through the Engine (paged cache) at tp 2 equals transformers' generate;
- import -> export is bitwise, and transformers loads the export with nothing missing;
- MXFP4 experts (packed here in transformers' layout) de-quantized on import give the
  logits of transformers' model holding transformers' own de-quantization; bad packs refused;
- the sink's gradient against autograd of a dense float64 reference; a sink is a
  per-head logit in the denominator (probabilities sum below 1);
- tiny-gpt-oss trained 4 steps with hidden and attention dropout 0.1 gives one process's
  losses and gradient norms at tp 2 with SP and at ep 2 (one spawned world of 2);
- named configs: total / active parameters against the published ones and transformers';
- refusals of what the family cannot represent, and of a gpt-oss GGUF file in llama.cpp's
  layout (which the installed transformers cannot read: pinned) with the HF-checkpoint fix.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

import parallel_state as ps
from distributed import run_distributed
from tolerances import assert_fp32_close, assert_losses_close, forward_chain_terms, \
    fp32_mismatch, training_chain_terms

VOCAB, B, S, NEW = 128, 2, 12, 16
PROMPT = [5, 17, 99, 3, 42, 8, 61, 2, 11, 50, 7, 30]


def _hf_config(**kw):
    from transformers import GptOssConfig

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4,
                initializer_range=0.2, swiglu_limit=0.5, bos_token_id=None, eos_token_id=None,
                pad_token_id=None,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 16})
    return GptOssConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(hf folder, native checkpoint folder) of a tiny random gpt-oss."""
    from checkpoint.hf import import_hf
    from transformers import AutoModelForCausalLM

    torch.manual_seed(60)
    hf = AutoModelForCausalLM.from_config(_hf_config())
    with torch.no_grad():  # random norms, biases and sinks, so a swapped one shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif p.dim() == 1 or name.endswith("_bias"):
                p.normal_(0.0, 1.0)
    root = tmp_path_factory.mktemp("gpt-oss")
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    hf.save_pretrained(hf_dir)
    import_hf(hf_dir, ckpt, log=lambda *a: None)
    return hf_dir, ckpt


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))


def _config(ckpt: str):
    from checkpoint.format import read_metadata
    from models import ModelConfig

    return ModelConfig.from_dict(read_metadata(ckpt)["model"])


def _hf(hf_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _tp1_logits(ckpt: str) -> torch.Tensor:
    from checkpoint.model_io import load_model_weights
    from models import GPTModel

    ps.destroy_model_parallel()
    m = GPTModel(_config(ckpt)).eval()
    load_model_weights(ckpt, [m])
    with torch.no_grad():
        return m(_ids())[..., :VOCAB]


def test_config_and_logits_at_tp1(model):
    hf_dir, ckpt = model
    c = _config(ckpt)
    assert (c.softmax_type, c.activation, c.activation_func_clamp_value,
            c.glu_linear_offset) == ("learnable", "quick_geglu", 0.5, 1.0)
    assert (c.window_size, c.window_attn_skip_freq, c.rope_scaling_type,
            c.rope_yarn_truncate) == ((3, 0), [1, 0], "yarn", False)
    assert c.add_bias_linear and c.add_qkv_bias and c.num_moe_experts == 4
    ours, ref = _tp1_logits(ckpt), _hf(hf_dir)(_ids()).logits.detach()
    print(f"gpt-oss tp1: max |logit - transformers| {(ours - ref).abs().max():.2e}")
    assert_fp32_close(ours, ref, forward_chain_terms(c, S, "logits"), "gpt-oss at tp 1")


# ------------------------------------------------------------------ one world of 4 ranks
def _mismatch(logits, ref, config):
    return fp32_mismatch(logits, ref, forward_chain_terms(config, S, "logits")), \
        float((logits - ref).abs().max())


def _world(hf_dir: str, ckpt: str, ref: torch.Tensor) -> dict:
    """{layout: (`fp32_mismatch`, max |diff|)} on the last stage, and the tp 2 Engine's
    greedy ids."""
    from test_hf_conversion import pipeline_logits

    from checkpoint.hf import load_hf_weights
    from checkpoint.model_io import load_model_weights
    from inference.engine import Engine, Request
    from inference.loading import initialize_serving_grid, load
    from inference.sampling import SamplingParams
    from models import GPTModel
    from models.hf import open_checked
    from models.pipeline import build_model_chunks

    out = {}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1, device="cpu")  # infer.py's loader, dp 2
    model, _, _ = load(hf=hf_dir)
    with torch.no_grad():
        logits = ps.gather_from_tensor_model_parallel_region(model.eval()(_ids()))[..., :VOCAB]
    out["tp2"] = _mismatch(logits, ref, model.config)
    req = Request("0", PROMPT, SamplingParams(max_new_tokens=NEW))
    Engine(model, max_batch_size=2, max_seq_length=64).generate([req])
    out["generate"] = req.output
    ps.destroy_model_parallel()  # infer.py --tp 2 --enable-expert-parallel: whole experts
    initialize_serving_grid(2, 1, enable_expert_parallel=True)  # (and fc2 biases) per rank
    model, _, _ = load(hf=hf_dir)
    with torch.no_grad():
        logits = ps.gather_from_tensor_model_parallel_region(model.eval()(_ids()))[..., :VOCAB]
    out["tp2_expert_parallel"] = _mismatch(logits, ref, model.config)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 2, device="cpu")
    c = _config(ckpt)
    chunks = build_model_chunks(GPTModel, c, [1, 1], ps.get_pipeline_model_parallel_rank(),
                                None)
    load_model_weights(ckpt, chunks)
    logits = pipeline_logits(chunks[0], _ids())
    if logits is not None:
        out["tp2pp2"] = _mismatch(logits, ref, c)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, device="cpu", expert_model_parallel_size=2)
    src, c = open_checked(hf_dir)
    m = GPTModel(c).eval()
    load_hf_weights(src, c, [m])
    experts = next(p.shape[0] for n, p in m.named_parameters()
                   if n.endswith("experts.linear_fc2.bias"))
    with torch.no_grad():
        out["ep2"] = (*_mismatch(m(_ids())[..., :VOCAB], ref, c), experts)
    return out


@pytest.fixture(scope="module")
def world(model):
    hf_dir, ckpt = model
    hf = _hf(hf_dir)
    with torch.no_grad():
        ref = hf(_ids()).logits
    x = torch.tensor([PROMPT])
    generated = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                            do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    results = run_distributed(_world, 4, hf_dir, ckpt, ref, timeout=400)
    merged = {}
    for r in results:
        merged.update(r)
    return merged, generated


@pytest.mark.parametrize("layout", ["tp2", "tp2pp2", "ep2", "tp2_expert_parallel"])
def test_logits_match_transformers_at_layouts(world, layout):
    merged, _ = world
    problem, diff = merged[layout][:2]
    print(f"gpt-oss {layout}: max |logit - transformers| {diff:.2e}")
    assert problem is None, f"gpt-oss at {layout}: {problem}"
    if layout == "ep2":
        assert merged[layout][2] == 2  # half of the 4 experts (and their biases) per rank


def test_greedy_generate_matches_transformers_at_tp2(world):
    merged, generated = world
    assert len(set(generated)) > 3, generated  # not one repeated id
    assert merged["generate"] == generated


# ------------------------------------------------------------------ export, round trip
def _tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def test_round_trip_is_bitwise_and_transformers_loads_it(model, tmp_path):
    from checkpoint.hf import export_hf
    from transformers import AutoModelForCausalLM

    hf_dir, ckpt = model
    out = str(tmp_path / "export")
    export_hf(ckpt, out, log=lambda *a: None)
    theirs, ours = _tensors(hf_dir), _tensors(out)
    assert sorted(theirs) == sorted(ours)
    for name, t in theirs.items():
        assert torch.equal(t, ours[name]), name
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["layer_types"], cfg["sliding_window"], cfg["rope_parameters"]["truncate"],
            cfg["swiglu_limit"]) == (["sliding_attention", "full_attention"], 4, False, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(_ids()).logits, _hf(hf_dir)(_ids()).logits)


# ------------------------------------------------------------------ MXFP4
def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's float expert tensor `w [E, cols, rows]` -> (`blocks [E, rows, cols/32, 16]`,
    `scales [E, rows, cols/32]`) uint8 as gpt-oss checkpoints store them: per block of 32
    the power of two that brings its largest |value| to at most 6, each value rounded to the
    nearest E2M1 code, two codes a byte (the first in the low nibble)."""
    from models.hf.mxfp4 import FP4_VALUES

    t = w.transpose(1, 2).float()
    e, rows, cols = t.shape
    g = t.reshape(e, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-100) / 6)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)[..., None]
    magnitude = (scaled.abs()[..., None] - torch.tensor(FP4_VALUES[:8])).abs().argmin(-1)
    code = magnitude + 8 * (scaled < 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def _mxfp4_folder(hf_dir: str, out: str, *, damage=None) -> dict:
    """A copy of `hf_dir` with every layer's expert weights packed to MXFP4 (`damage(tensors)`
    edits the packed tensors first); {name: transformers' de-quantization of each}."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(hf_dir, out)
    tensors, want = _tensors(hf_dir), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = pack_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        want[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    if damage is not None:
        damage(tensors)
    os.remove(os.path.join(out, "model.safetensors"))
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    return want


def test_mxfp4_experts_are_dequantized_on_import(model, tmp_path):
    from checkpoint.hf import import_hf
    from models.hf import HFConversionError

    hf_dir, _ = model
    packed = str(tmp_path / "mxfp4")
    want = _mxfp4_folder(hf_dir, packed)
    ckpt = str(tmp_path / "mxfp4-ckpt")
    import_hf(packed, ckpt, log=lambda *a: None)
    hf = _hf(hf_dir)
    with torch.no_grad():  # transformers' model holding transformers' own de-quantization
        params = dict(hf.named_parameters())
        for name, t in want.items():
            assert not torch.equal(params[name], t)  # 4 bits lost something
            params[name].copy_(t)
        ref = hf(_ids()).logits
    ours = _tp1_logits(ckpt)
    print(f"gpt-oss mxfp4: max |logit - transformers| {(ours - ref).abs().max():.2e}")
    assert_fp32_close(ours, ref, forward_chain_terms(_config(ckpt), S, "logits"), "mxfp4")

    def wrong_shape(t):
        name = next(n for n in t if n.endswith("gate_up_proj_scales"))
        t[name] = t[name][:, :-1].contiguous()

    def wrong_dtype(t):
        name = next(n for n in t if n.endswith("down_proj_blocks"))
        t[name] = t[name].to(torch.int16)

    def no_scales(t):
        del t[next(n for n in t if n.endswith("down_proj_scales"))]

    for i, (damage, words) in enumerate([(wrong_shape, "are not"), (wrong_dtype, "not U8"),
                                         (no_scales, "has no")]):
        bad = str(tmp_path / f"bad{i}")
        _mxfp4_folder(hf_dir, bad, damage=damage)
        with pytest.raises(HFConversionError, match=words):
            import_hf(bad, str(tmp_path / f"bad{i}-ckpt"), log=lambda *a: None)
        assert not os.path.exists(str(tmp_path / f"bad{i}-ckpt", ))


# ------------------------------------------------------------------ the sink itself
def test_sink_gradient_equals_autograd_of_a_dense_float64_reference(no_grid):
    """`core_attention` with sinks (the explicit softmax, causal and with a sliding-window
    mask, and the decode form) against `softmax([q k^T * scale, sink]) v` written out in
    float64: output and the gradients of q, k, v and the sinks."""
    from layers.attention import causal_window_mask, core_attention

    g = torch.Generator().manual_seed(3)
    b, n, groups, s, d = 2, 4, 2, 7, 8
    q, k, v = (torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
               for heads in (n, groups, groups))
    sinks = torch.randn(n, generator=g, dtype=torch.float64) * 2

    def reference(q, k, v, sinks, mask):
        kk, vv = (t.repeat_interleave(n // groups, 1) for t in (k, v))
        scores = (q @ kk.transpose(-1, -2)) / d ** 0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        full = torch.cat([scores, sinks.view(1, n, 1, 1).expand(b, n, s, 1)], -1)
        return torch.softmax(full, -1)[..., :-1] @ vv

    grad_out = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
    for window in (None, (2, 0)):
        mask = causal_window_mask(torch.arange(s), s, window)
        ins = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        ours = core_attention(*ins[:3], None if window is None else mask, None, None, 0.0,
                              causal=window is None, sinks=ins[3])
        ours.backward(grad_out)
        refs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        want = reference(*refs, mask)
        want.backward(grad_out)
        torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)
        for name, a, r in zip("qkv", ins, refs):
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(ins[3].grad, refs[3].grad, rtol=1e-12, atol=1e-12)
        assert ins[3].grad.abs().min() > 0  # every head's sink learns
    assert torch.autograd.gradcheck(
        lambda sk: core_attention(q, k, v, None, None, None, 0.0, causal=True, sinks=sk),
        (sinks.clone().requires_grad_(),))
    # the decode form (one query over the cache; float32 inside) and the rows' mass: below
    # 1, by the sink's
    from layers.attention import _decode_attention
    one = _decode_attention(q[:, :, -1:], k, v, None, None, None, sinks)
    torch.testing.assert_close(one, reference(q, k, v, sinks, mask.new_ones(s, s))[:, :, -1:],
                               rtol=1e-5, atol=1e-6)
    probs = core_attention(q, k, torch.eye(s, dtype=torch.float64).expand(b, groups, s, s),
                           None, None, None, 0.0, causal=True, sinks=sinks)
    assert (probs.sum(-1) < 1).all()


def test_sinks_split_over_tensor_parallel_heads():
    """Two TP ranks hold heads 0-1 and 2-3 of the sinks (partition_dim 0, tagged), and the
    planner lists every local parameter of tiny-gpt-oss (sinks, router and expert biases),
    in registration order, with its size."""
    results = run_distributed(_sink_shards, 2, tp=2)
    assert [r[0] for r in results] == [[0, 1], [2, 3]]
    assert all(r[1] for r in results)


def _sink_shards():
    from layers import shard_tensor
    from models import GPTModel
    from planner.parameters import chunk_parameters
    from training.arguments import load_model_config

    c = load_model_config("tiny-gpt-oss")
    m = GPTModel(c)
    local = shard_tensor(torch.arange(4.0),
                         m.get_submodule("decoder.layers.0.self_attention").sinks)
    planned = [(p.name, p.count) for p in chunk_parameters(c, 2, list(range(c.num_layers)),
                                                           True, True, False)]
    return [int(x) for x in local], planned == [(n, p.numel()) for n, p in
                                                m.named_parameters()]


# ------------------------------------------------------------------ named configs, refusals
@pytest.mark.parametrize("name, layers, experts, total, active", [
    ("gpt-oss-20b", 24, 32, 20.9, 3.6), ("gpt-oss-120b", 36, 128, 116.8, 5.1)])
def test_named_configs_against_published_and_transformers(name, layers, experts, total,
                                                          active):
    """OpenAI's model card counts the unembedding but not the embedding among the active
    parameters (20b: 3.61B, 120b: 5.13B); transformers' count on the meta device."""
    from transformers import AutoModelForCausalLM

    from planner import moe
    from training.arguments import load_model_config

    m = load_model_config(name)
    m.validate(8)
    counts = moe.parameter_counts(m)
    assert abs(counts["total"] / 1e9 - total) < 0.05, counts
    assert abs((counts["active"] - m.vocab_size * m.hidden_size) / 1e9 - active) < 0.05, counts
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(_hf_config(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880,
            num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
            head_dim=64, num_local_experts=experts, num_experts_per_tok=4))
    assert counts["total"] == sum(p.numel() for p in hf.parameters())


def test_unsupported_fields_are_refused(model, tmp_path):
    from models.config import ConfigError
    from models.hf import HFConversionError, config_from_hf

    hf_dir, ckpt = model
    d = json.load(open(os.path.join(hf_dir, "config.json")))
    for change, words in ((dict(swiglu_alpha=1.5), "swiglu_alpha"),
                          (dict(attention_bias=False), "attention_bias"),
                          (dict(num_experts_per_tok=1), "num_experts_per_tok 1"),
                          (dict(layer_types=["full_attention"]), "layer_types"),
                          (dict(swiglu_limit="7"), "swiglu_limit"),
                          (dict(quantization_config={"quant_method": "bitsandbytes"}), "bitsandbytes")):
        with pytest.raises(HFConversionError, match=words):
            config_from_hf({**d, **change})
    c = _config(ckpt)
    import dataclasses
    for change, words in ((dict(softmax_type="off-by-one"), "--softmax-type"),
                          (dict(activation="swiglu"), "--activation-func-clamp-value"),
                          (dict(activation_func_clamp_value=-1.0), "clamp-value"),
                          (dict(rope_yarn_truncate="no"), "--rope-yarn-truncate")):
        with pytest.raises(ConfigError, match=words):
            dataclasses.replace(c, **change).validate()


# ------------------------------------------------------------------ training layouts
def _gpt_oss_runs():
    from test_dropout import DROPOUT

    return ["--config", "configs/tiny-llama.yaml", "--model", "tiny-gpt-oss",
            "--peak-tflops", "1"] + DROPOUT


TRAIN_LAYOUTS = [["--tp", "2", "--sequence-parallel"], ["--ep", "2"]]


def test_training_with_dropout_matches_one_process_at_tp2_and_ep2(corpus_env, tmp_path):
    from test_dropout import _train

    base, cache = _gpt_oss_runs(), corpus_env["SHARDZOO_CACHE"]
    off = base + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    (ref_losses, ref_norms), (off_losses, _) = run_distributed(
        _train, 1, [base, off], str(tmp_path / "one"), cache, timeout=600)[0][:2]
    assert ref_losses[-1] < ref_losses[0], ref_losses  # it learns
    assert off_losses != ref_losses  # dropout is on: the layouts compare masks
    runs = run_distributed(_train, 2, [base + f for f in TRAIN_LAYOUTS],
                           str(tmp_path / "two"), cache, timeout=600)[0][:-1]
    for flags, (losses, norms) in zip(TRAIN_LAYOUTS, runs, strict=True):
        k_step = training_chain_terms(base + flags)
        print(f"gpt-oss {flags}: losses {losses}")
        assert len(losses) == 4, (flags, losses)
        assert_losses_close(losses, ref_losses, k_step, f"losses at {flags}")
        assert_losses_close(norms, ref_norms, k_step, f"grad norms at {flags}")


def _refusal(path: str, out: str, monkeypatch) -> str:
    """`import_hf`'s one-line refusal of GGUF file `path`, checked to come from the header:
    transformers' GGUF loader is never called and nothing is written."""
    import transformers.modeling_gguf_pytorch_utils as reader

    from checkpoint.hf import import_hf
    from models.hf import HFConversionError

    def called(*a, **k):
        raise AssertionError("transformers' GGUF reader was called")

    monkeypatch.setattr(reader, "load_gguf_checkpoint", called)
    with pytest.raises(HFConversionError) as info:
        import_hf(path, out, log=lambda *a: None)
    msg = str(info.value)
    assert "\n" not in msg and not os.path.exists(out)
    return msg


def test_gpt_oss_gguf_transformers_cannot_read_is_refused_with_the_fix(model, tmp_path,
                                                                        monkeypatch):
    """A gpt-oss GGUF file in llama.cpp's layout (tests/gguf_files.py `write_gpt_oss_gguf`,
    float32) is not read by the installed transformers (5.25): `from_pretrained(gguf_file=)`
    fails on the rope.scaling keys llama.cpp always writes (its gpt-oss branch reads
    `field.parts[0]`, the key's length, as the value: TypeError); without them it leaves the
    experts (`gate_up_proj`, `down_proj`, their biases) and the sinks MISSING (its gpt_oss
    tensor processor is registered under "gpt_oss", the file says "gpt-oss", and expects
    `ffn_*_projs` names llama.cpp does not write). Pinned, so a transformers that reads it
    fails here. `import_hf` refuses the file, and a truncated or lying one (the embedding's
    declared rows doubled), in one line from the header, writing nothing."""
    pytest.importorskip("gguf")
    from gguf_files import write_gpt_oss_gguf
    from transformers import AutoModelForCausalLM

    hf = _hf(model[0])
    for scaling, error, what in ((True, TypeError, "0-dimensional"),
                                 (False, RuntimeError, "ignore_mismatched_sizes")):
        folder = tmp_path / f"scaling-{scaling}"
        folder.mkdir()
        write_gpt_oss_gguf(hf, str(folder / "tiny-gpt-oss.gguf"), rope_scaling=scaling)
        with warnings.catch_warnings(), pytest.raises(error, match=what):
            warnings.simplefilter("ignore")
            AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="tiny-gpt-oss.gguf")
    data = open(str(tmp_path / "scaling-True" / "tiny-gpt-oss.gguf"), "rb").read()
    name = b"token_embd.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4
    assert int.from_bytes(data[at + 8:at + 16], "little") == VOCAB  # dims: [32, VOCAB]
    crafted = {"cut": data[:-4096], "lying": data[:at + 8] + (2 * VOCAB).to_bytes(8, "little")
               + data[at + 16:]}
    for case, content in crafted.items():
        open(tmp_path / f"{case}.gguf", "wb").write(content)
    for case in ("scaling-True/tiny-gpt-oss", "cut", "lying"):
        msg = _refusal(str(tmp_path / f"{case}.gguf"), str(tmp_path / "out"), monkeypatch)
        assert "GGUF architecture 'gpt-oss'" in msg and "convert from the HF checkpoint" in msg
        assert "rope.scaling keys" in msg and "--quantization none" in msg
