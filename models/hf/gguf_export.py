"""What a model becomes in a GGUF file (llama.cpp's format): architecture, metadata, tensor
names, row order, tensor types and the tokenizer, for checkpoint/hf.py's `export_gguf`.

Exported: the Llama architecture (llama.cpp's `llama`: pre-norm RMSNorm, SwiGLU, RoPE of any
base without scaling, GQA, tied or untied output, no biases, no sliding window) with a
byte-level BPE tokenizer (SmolLM2's kind; the SentencePiece-style tokenizers of Llama 2 /
TinyLlama, byte-fallback BPE, are refused). `check_exportable` and `add_vocab` refuse
anything else in one line.

The file is written as llama.cpp's convert_hf_to_gguf.py writes a Llama:

- metadata `llama.*`: context_length (max_position_embeddings), embedding_length,
  block_count, feed_forward_length, attention.head_count(_kv), rope.freq_base,
  attention.layer_norm_rms_epsilon, rope.dimension_count (head_dim), key/value_length when
  head_dim is not hidden / heads, vocab_size; general.file_type and quantization_version;
- tensor names from gguf's own map (`gguf.get_tensor_name_map`), the q and k projections' rows
  reordered per head as llama.cpp's `LlamaModel.permute` does (the two rotate-half halves
  interleaved; transformers' GGUF reader and ggml's RoPE expect that order);
- tensor types by `tensor_type`: 1-D tensors (norms) float32; 2-D weights in the out type
  (`OUTTYPES`), except that q4_0 keeps the token embedding / output at q8_0 (llama-quantize
  gives the output Q6_K at Q4_0, a format shardzoo does not write; SmolLM2's Q4_1 file
  holds its tied embedding at Q8_0 too) and that a row length not a multiple of 32 falls back
  to f16 (as llama.cpp's converter does). q8_0 / q4_0 blocks are layers/quant's round-to-
  nearest, bit-identical to ggml's reference quantizer;
- the tokenizer (byte-level BPE only: GGUF's `gpt2` model) as `tokenizer.ggml.*`: tokens
  (rows past the tokenizer's ids `[PAD<i>]`, type UNUSED), token types (added special tokens
  CONTROL, other added tokens USER_DEFINED), the pre-tokenizer name (`pre_tokenizer_name`),
  and through gguf's `SpecialVocab` the merges, bos/eos/unk/pad ids, add_bos/add_eos and the
  chat template.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from models.config import ModelConfig

from . import llama
from .rules import HFConversionError

OUTTYPES = ("f32", "f16", "q8_0", "q4_0")
ARCH = "llama"
_QUANT_BLOCK = 32  # q8_0 / q4_0 elements per block along a row
_EMBEDDINGS = ("token_embd.weight", "output.weight")


def check_exportable(c: ModelConfig) -> None:
    """Raise `HFConversionError` (one line naming what differs) unless `c` is a model llama.cpp
    reads as architecture `llama` (module docstring)."""
    why = [] if getattr(c, "is_encoder_decoder", False) else llama.conditions(c)
    if getattr(c, "is_encoder_decoder", False):
        why.append("an encoder-decoder (T5)")
    if c.num_moe_experts:
        why.append("mixture-of-experts layers")
    if c.qk_layernorm:
        why.append("q/k norms (Qwen3, OLMo 2)")
    if c.add_qkv_bias or c.add_bias_linear:
        why.append("biases on its linear layers")
    if c.window_size is not None:
        why.append("a sliding window")
    if c.rope_scaling_type is not None:
        why.append(f"RoPE scaling {c.rope_scaling_type!r}")
    if why:
        raise HFConversionError(
            f"GGUF export writes the Llama architecture only (RMSNorm, SwiGLU, RoPE without "
            f"scaling, no biases or sliding window); this model has {'; '.join(why)}: export "
            f"it with `convert_hf.py export` and convert that folder with llama.cpp's "
            f"convert_hf_to_gguf.py")


def tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> str:
    """The type ("f32", "f16", "q8_0", "q4_0") GGUF tensor `name` of `shape` (numpy order,
    rows first) gets in a file of `outtype` (module docstring)."""
    if len(shape) == 1 or outtype == "f32":
        return "f32"
    if outtype == "f16":
        return "f16"
    if shape[-1] % _QUANT_BLOCK:
        return "f16"
    return "q8_0" if outtype == "q4_0" and name in _EMBEDDINGS else outtype


def tensor_nbytes(shape: tuple[int, ...], kind: str) -> int:
    """Bytes of a tensor of `shape` stored as `kind` (`tensor_type`)."""
    from layers.quant.formats import GGUF_FORMATS

    n = int(np.prod(shape))
    if kind in ("f32", "f16"):
        return n * (4 if kind == "f32" else 2)
    f = GGUF_FORMATS[kind]
    return n // f.block * f.block_bytes


def encode(t: torch.Tensor, kind: str) -> tuple[np.ndarray, object]:
    """(array to write, ggml type) of float tensor `t` as `kind`: float32 / float16 arrays of
    `t`'s shape, or a quantized weight's block rows `uint8 [out, row_bytes]`
    (`QuantizedWeight.to_gguf`)."""
    import gguf

    from layers.quant.weight import QuantizedWeight

    if kind == "f32":
        return t.detach().to(torch.float32).contiguous().numpy(), gguf.GGMLQuantizationType.F32
    if kind == "f16":
        return t.detach().to(torch.float16).contiguous().numpy(), gguf.GGMLQuantizationType.F16
    ggml_type, blocks = QuantizedWeight.quantize(t, kind).to_gguf()
    return blocks.numpy(), gguf.GGMLQuantizationType[ggml_type]


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order of a q or k projection `[heads * head_dim, in]` of the `llama`
    architecture (convert_hf_to_gguf.py `LlamaModel.permute`): within each head, rows
    `[0, d/2, 1, d/2 + 1, ...]` of HF's rotate-half order."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tensor_plan(c: ModelConfig, hf_shapes: dict[str, tuple[int, ...]], outtype: str
                ) -> list[tuple[str, str, tuple[int, ...], str, int | None]]:
    """One `(HF name, GGUF name, shape, type, heads to permute by or None)` per HF tensor of
    `c` in `hf_shapes`' order (models.hf.hf_shapes: the order `to_hf` streams them)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_layers)
    plan = []
    for hf_name, shape in hf_shapes.items():
        base, _, suffix = hf_name.rpartition(".")
        target = names.get_name(base)
        if target is None:  # every Llama tensor is in gguf's map
            raise HFConversionError(f"gguf's llama name map has no name for {hf_name}")
        name = f"{target}.{suffix}"
        heads = (c.num_attention_heads if base.endswith(".q_proj") else
                 c.num_query_groups if base.endswith(".k_proj") else None)
        plan.append((hf_name, name, tuple(shape), tensor_type(name, shape, outtype), heads))
    return plan


def add_metadata(w, c: ModelConfig, name: str, outtype: str) -> None:
    """The `general.*` and `llama.*` keys of model `c` on gguf writer `w`."""
    import gguf

    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.ffn_hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_query_groups)
    w.add_rope_freq_base(float(c.rotary_base))
    w.add_layer_norm_rms_eps(float(c.layernorm_epsilon))
    w.add_rope_dimension_count(c.kv_channels)
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        w.add_key_length(c.kv_channels)
        w.add_value_length(c.kv_channels)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[outtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def pre_tokenizer_name(pre: dict | None) -> str | None:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json `pre_tokenizer` object: "gpt-2"
    for byte-level with GPT-2's split rule, "smollm" for that after single digits (SmolLM2's
    own tokenizer); None for another rule (llama.cpp then uses its default one)."""
    def byte_level(p):
        return isinstance(p, dict) and p.get("type") == "ByteLevel" and p.get("use_regex", True)

    if byte_level(pre):
        return "gpt-2"
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and \
        pre.get("type") == "Sequence" else None
    if isinstance(steps, list) and len(steps) == 2 and byte_level(steps[1]) and \
            steps[0].get("type") == "Digits" and steps[0].get("individual_digits"):
        return "smollm"
    return None


def add_vocab(w, tok, folder: str, vocab_size: int, log) -> None:
    """Tokenizer `tok` (transformers', loaded from the checked folder `folder`) as GGUF's
    `tokenizer.ggml.*` keys for a model of `vocab_size` rows (module docstring). Raises
    `HFConversionError` for a tokenizer that is not byte-level BPE or has ids past the
    model's rows."""
    import gguf

    backend = getattr(tok, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = decoder.get("type") == "ByteLevel" or any(
        isinstance(p, dict) and p.get("type") == "ByteLevel" for p in steps)
    if model.get("type") != "BPE" or not byte_level or model.get("byte_fallback"):
        raise HFConversionError(
            f"the checkpoint's tokenizer ({type(tok).__name__}, model {model.get('type')!r}, "
            f"decoder {decoder.get('type')!r}) is not a byte-level BPE "
            f"tokenizer, the only one GGUF export writes (tokenizer.ggml.model gpt2); export "
            f"to HF and convert with llama.cpp's convert_hf_to_gguf.py")
    by_id = {i: t for t, i in tok.get_vocab().items()}
    top = max(by_id, default=-1)
    if top >= vocab_size:
        raise HFConversionError(f"the checkpoint's tokenizer has token id {top}, past the "
                                f"model's {vocab_size} embedding rows; use the model's own "
                                f"tokenizer")
    added = tok.added_tokens_decoder
    types, tokens = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        types.append(gguf.TokenType.NORMAL if i not in added else
                     gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    pre = pre_tokenizer_name(spec.get("pre_tokenizer"))
    if pre is None:
        log(f"note: the tokenizer's pre-tokenizer ({json.dumps(spec.get('pre_tokenizer'))[:120]}"
            f") has no llama.cpp name here; llama.cpp will split raw text by its default "
            f"rule (token ids given to it are unaffected)")
    w.add_tokenizer_pre(pre or "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise HFConversionError(f"the tokenizer in {folder} has no BPE merges; use the model's "
                                f"own tokenizer")
    special.add_to_gguf(w, quiet=True)
