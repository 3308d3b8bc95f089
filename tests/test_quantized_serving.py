"""Serving low-bit weights (layers/quantized.py, inference/low_bit.py): tiny Llama and Mixtral
models whose linear weights are quantized on load (--quantization int8 / int4) or come from
the loader already quantized (q4_1, q8_0 made with `QuantizedWeight.quantize`, as a GGUF
reader hands them over: an HF-named dict of `QuantizedWeight` values), generated greedily at
tp 1 / tp 2 / pp 2 and against the same weights de-quantized to float at tp 1; the refusals
of a tp that cuts blocks; the weight bytes of the start-up line; infer.py --quantization."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from test_data import hf_tokenizer_dir

PROMPTS = [[5, 17, 99, 3, 42], [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [200, 100]]
NEW = 8
LINEAR = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
          "gate_proj.weight", "up_proj.weight", "down_proj.weight", "lm_head.weight",
          ".w1.weight", ".w2.weight", ".w3.weight")
# (folder, --quantization kwargs, format the source hands over, embedding in it too)
VARIANTS = {
    "int8": ("llama", dict(method="int8"), None, False),
    "int4_g32": ("llama", dict(method="int4", group_size=32), None, False),
    "int4_g32_asym": ("llama", dict(method="int4", group_size=32, symmetric=False), None, False),
    "q4_1": ("llama", {}, "q4_1", False),
    "q8_0_tied": ("llama_tied", {}, "q8_0", True),  # a GGUF's token_embd tied to the output
}


def _configs() -> dict:
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=400, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=None)
    return {
        "llama": LlamaConfig(intermediate_size=128, num_hidden_layers=2,
                             tie_word_embeddings=False, **common),
        "llama_tied": LlamaConfig(intermediate_size=128, num_hidden_layers=2,
                                  tie_word_embeddings=True, **common),
        "mixtral": MixtralConfig(intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
                                 num_experts_per_tok=2, tie_word_embeddings=False, **common),
        # q4_k's blocks of 256 input columns: whole at tp 1, cut at tp 2
        "llama_256": LlamaConfig(**{**common, "hidden_size": 256}, intermediate_size=256,
                                 num_hidden_layers=1, tie_word_embeddings=False),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for i, (name, cfg) in enumerate(_configs().items()):
        torch.manual_seed(i)
        path = str(root / name)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        out[name] = path
    hf_tokenizer_dir(out["llama"], [open(os.__file__).read()])  # for infer.py's prompts
    return out


def _quantized_names(name: str, embedding: bool) -> bool:
    return name.endswith(LINEAR) or embedding and name == "model.embed_tokens.weight"


def source(folder: str, fmt: str | None, embedding: bool = False, dequantized: dict | None = None):
    """The HF source of `folder` whose linear weights (and embedding) `get` returns as
    `QuantizedWeight`s of `fmt` (a GGUF reader's seam); with `dequantized` (the
    --quantization kwargs or {"method": fmt}), their exact de-quantized float values instead."""
    from layers.quant import QuantizedWeight
    from models.hf.files import open_hf

    src = open_hf(folder)
    read = src._get
    method = (dequantized or {}).get("method", fmt)

    def quantized(name):
        q = dict(dequantized or {})
        q.pop("method", None)
        return QuantizedWeight.quantize(read(name), method, **q)

    if dequantized is not None:
        src._get = lambda n: quantized(n).dequantize() if _quantized_names(n, embedding) \
            else read(n)
    elif fmt is not None:
        src._get = lambda n: quantized(n) if _quantized_names(n, embedding) else read(n)
        src._weight_format = lambda n: (fmt, 32) if _quantized_names(n, embedding) else None
    return src


def _greedy(engine, prompts=PROMPTS) -> list[list[int]]:
    from inference.engine import Request
    from inference.sampling import SamplingParams

    for i, p in enumerate(prompts):
        engine.add(Request(id=str(i), prompt=p, params=SamplingParams(max_new_tokens=NEW,
                                                                      ignore_eos=True)))
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for e in engine.step():
            out[e.id] += e.token_ids
    return [out[str(i)] for i in range(len(prompts))]


def _load(folders, variant):
    from inference.loading import load
    from layers.quantized import Quantization

    folder, kw, fmt, emb = VARIANTS[variant]
    return load(hf=source(folders[folder], fmt, emb), quantization=Quantization(**kw))[0]


def _layouts(folders: dict) -> dict:
    """In a world of 2: {(variant, layout): greedy ids} and the checks only one layout runs."""
    import parallel_state as ps
    from inference.engine import Engine
    from inference.loading import initialize_serving_grid, load
    from inference.spec_decode import SpeculativeConfig, build_speculative
    from layers.quantized import Quantization, is_quantized

    out = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        ps.destroy_model_parallel()
        initialize_serving_grid(tp, pp)
        for variant in VARIANTS:
            model = _load(folders, variant)
            out[variant, f"tp{tp}pp{pp}"] = _greedy(Engine(model, max_batch_size=3,
                                                           max_seq_length=32))
            if variant == "q8_0_tied" and pp == 1:  # the tied table stays q8_0
                out["tied_is_quantized"] = is_quantized(model.embedding.word_embeddings.weight)
            if variant == "int4_g32" and tp == 2:  # paged KV, prefix caching, chunked prefill
                shared = [[11, 12, 13, 14, 15, 16, 17, 18, 19] + p for p in PROMPTS]
                engine = Engine(model, max_batch_size=3, max_seq_length=32, block_size=4,
                                enable_prefix_caching=True, max_num_batched_tokens=6)
                out["paged"] = _greedy(engine, shared) + _greedy(engine, shared)
                out["paged_ref"] = _greedy(Engine(model, max_batch_size=3, max_seq_length=32),
                                           shared)
            if variant == "q4_1" and tp == 1 and pp == 1:  # speculative: ngram, int8 draft
                ngram = build_speculative(SpeculativeConfig(method="ngram", num_speculative_tokens=3), model, None,
                                          max_seq_length=32)
                out["spec_ngram"] = _greedy(Engine(model, max_batch_size=3, max_seq_length=32,
                                                   speculative=ngram))
                draft = build_speculative(
                    SpeculativeConfig(method="draft_model", model=folders["llama"],
                                      num_speculative_tokens=3),
                    model, None, max_seq_length=32, quantization=Quantization("int8"))
                out["draft_is_quantized"] = is_quantized(
                    draft.draft.model.decoder.layers["0"].mlp.linear_fc1.weight)
                out["spec_draft"] = _greedy(Engine(model, max_batch_size=3, max_seq_length=32,
                                                   speculative=draft))
        if tp == 1 and pp == 1:
            for variant, (folder, kw, fmt, emb) in VARIANTS.items():
                ref = load(hf=source(folders[folder], fmt, emb, kw or {"method": fmt}))[0]
                model = _load(folders, variant)
                out[variant, "dequantized"] = _greedy(Engine(ref, max_batch_size=3,
                                                             max_seq_length=32))
                ids = torch.tensor([PROMPTS[1]])
                with torch.inference_mode():
                    a, b = model(ids), ref(ids)
                out[variant, "logit_error"] = float((a - b).abs().max() / b.abs().max())
    return out if torch.distributed.get_rank() == 0 else None


def test_quantized_greedy_identical_across_layouts_and_dequantized(folders):
    out = run_distributed(_layouts, 2, folders, timeout=540)[0]
    for variant in VARIANTS:
        base = out[variant, "tp1pp1"]
        assert len(base[0]) == NEW and len(set(base[1])) > 1, (variant, base)
        # tp and pp change only how the products are split and summed: the same ids
        assert out[variant, "tp2pp1"] == base, variant
        assert out[variant, "tp1pp2"] == base, variant
        # the same weights in float32 (the exact de-quantized values): the logits differ by
        # the summation order of the float GEMMs only (relative 1e-5 of the largest), and
        # the greedy ids are the same
        assert out[variant, "logit_error"] < 1e-5, (variant, out[variant, "logit_error"])
        assert out[variant, "dequantized"] == base, variant
    # int4 and int8 of the same float weights are different models
    assert out["int8", "tp1pp1"] != out["int4_g32", "tp1pp1"]
    assert out["int4_g32", "tp1pp1"] != out["int4_g32_asym", "tp1pp1"]
    assert out["tied_is_quantized"]
    assert out["paged"] == out["paged_ref"] * 2
    assert out["spec_ngram"] == out["q4_1", "tp1pp1"]
    assert out["draft_is_quantized"]
    assert out["spec_draft"] == out["q4_1", "tp1pp1"]


def _q4_k_source(folder: str):
    """`folder`'s source with every linear weight a random q4_k `QuantizedWeight` whose data
    must never be read (the refusal comes from the header's formats alone)."""
    from models.hf.files import open_hf

    src = open_hf(folder)

    def never(name):
        raise AssertionError(f"{name} was read before the layout was refused")
    src._get = never
    src._weight_format = lambda n: ("q4_k", 256) if n.endswith(LINEAR) else None
    return src


def _int8_bytes(c, tp: int) -> tuple[int, int, int]:
    """(low-bit, float, float32) bytes of tp rank 0 of the int8 llama (from its sizes)."""
    h, f, heads, kv, d = c.hidden_size, c.intermediate_size, 4, 2, 16
    vocab = 512  # 400 padded to a multiple of 128 x tp
    linears = [((heads + 2 * kv) * d // tp, h), (h, heads * d // tp), (2 * f // tp, h),
               (h, f // tp)] * c.num_hidden_layers + [(vocab // tp, h)]
    low = sum(o * i + 4 * o for o, i in linears)
    floats = vocab // tp * h + (2 * c.num_hidden_layers + 1) * h
    return low, 4 * floats, 4 * (floats + sum(o * i for o, i in linears))


def _refusals_experts_bytes(folders: dict) -> dict:
    """In a world of 2: the tp refusals, a quantized Mixtral at tp 1 / tp 2 / ep 2, and the
    weight bytes of the start-up line."""
    import parallel_state as ps
    from inference.engine import Engine
    from inference.loading import initialize_serving_grid, load
    from layers.quantized import Quantization, QuantizedExperts, weight_bytes
    from models.config import ConfigError

    out = {}
    for tp, ep in ((1, False), (2, False), (2, True)):
        ps.destroy_model_parallel()
        initialize_serving_grid(tp, 1, ep)
        model = load(hf=folders["mixtral"], quantization=Quantization("int4", 32))[0]
        experts = model.decoder.layers["1"].mlp.experts
        out["experts", tp, ep] = (type(experts.linear_fc1.weight) is QuantizedExperts,
                                  tuple(experts.linear_fc2.weight.shape))
        out["mixtral", tp, ep] = _greedy(Engine(model, max_batch_size=3, max_seq_length=32))
        lines = []
        model = load(hf=folders["llama"], quantization=Quantization("int8"), log=lines.append)[0]
        out["bytes", tp, ep] = weight_bytes(model)
        out["line", tp, ep] = [x for x in lines if x.startswith("weights on this rank")]
        if tp == 2 and not ep:
            for case, (src, q) in {"q4_k": (_q4_k_source(folders["llama_256"]), None),
                                   "group": (folders["llama"], Quantization("int4", 128))
                                   }.items():
                try:
                    load(hf=src, quantization=q)
                    out[case] = None
                except ConfigError as e:
                    out[case] = str(e)
    return out if torch.distributed.get_rank() == 0 else None


def test_refusals_experts_and_weight_bytes(folders):
    from transformers import AutoConfig

    out = run_distributed(_refusals_experts_bytes, 2, folders, timeout=300)[0]
    assert out["q4_k"] == (
        "--tp 2 would cut the q4_k blocks of 256 input columns of "
        "decoder.layers.0.self_attention.linear_proj.weight (256 inputs, 128 per rank); use "
        "--tp 1, or --quantization none")
    assert out["group"] == ("--quantization int4 with groups of 128 cannot quantize "
                            "decoder.layers.0.self_attention.linear_qkv.weight (input size 64); "
                            "use --quantization-group-size 32 or 64")
    # Mixtral's experts held as one int4 weight each, split over tp (fc2's inputs) or whole
    # at expert parallel 2 (2 of the 4 experts per rank); the same greedy ids everywhere
    assert out["experts", 1, False] == (True, (4, 64, 64))
    assert out["experts", 2, False] == (True, (4, 64, 32))
    assert out["experts", 2, True] == (True, (2, 64, 64))
    base = out["mixtral", 1, False]
    assert len(set(base[0])) > 1
    assert out["mixtral", 2, False] == base and out["mixtral", 2, True] == base
    c = AutoConfig.from_pretrained(folders["llama"])
    for tp, ep in ((1, False), (2, False)):
        low, floats, f32 = _int8_bytes(c, tp)
        assert out["bytes", tp, ep] == (low, floats, f32)
        mib = 2**20
        assert out["line", tp, ep] == [
            f"weights on this rank: {(low + floats) / mib:,.1f} MiB ({low / mib:,.1f} MiB "
            f"low-bit + {floats / mib:,.1f} MiB float; {f32 / mib:,.1f} MiB in float32)"]


def test_infer_quantization_flag(folders):
    """infer.py --quantization int4 on a float model: the start-up line counts low-bit bytes,
    and a flag the file cannot take is one line."""
    run = lambda *flags: subprocess.run(  # noqa: E731
        [sys.executable, "infer.py", "--hf", folders["llama"], "--prompt", "def main",
         "--max-new-tokens", "4", *flags], capture_output=True, text=True, timeout=180,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ok = run("--quantization", "int4", "--quantization-group-size", "32")
    assert ok.returncode == 0, ok.stderr
    line = next(x for x in ok.stderr.splitlines() if "weights on this rank" in x)
    assert "low-bit" in line and "0.0 MiB low-bit" not in line, line
    bad = run("--quantization", "int4")  # groups of 128 do not divide the hidden size 64
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "infer.py: error: --quantization int4 with groups of 128 cannot quantize "
        "decoder.layers.0.self_attention.linear_qkv.weight (input size 64); use "
        "--quantization-group-size 32 or 64")


def _compiled(folders: dict) -> tuple:
    from inference.engine import Engine

    model = _load(folders, "int4_g32")
    eager = _greedy(Engine(model, max_batch_size=3, max_seq_length=32))
    return eager, _greedy(Engine(model, max_batch_size=3, max_seq_length=32, compile=True))


def test_compiled_layers_on_int4_weights(folders):
    """--compile traces the layers through `QuantizedWeight.linear`: the eager greedy ids."""
    eager, compiled = run_distributed(_compiled, 1, folders, timeout=400)[0]
    assert compiled == eager and len(eager[0]) == NEW
