"""What a `.gguf` file's header says, read before transformers' GGUF loader builds anything.

transformers' `gguf_file=` reader (transformers/modeling_gguf_pytorch_utils.py and
integrations/ggml.py) turns a GGUF file into an HF config and HF-layout tensors; models/hf/
files.py imports through it. It reads only some architectures, and of those it drops some
hyperparameters that llama.cpp's converter writes, taking the config class's default instead
(which describes some real model, not this one). This module reads the header itself (scalar
metadata and tensor names; the format of ggml's docs/gguf.md) and

- `check_architecture` refuses, with one line naming the architecture and the fix, what
  transformers does not read (OLMo 2, OLMoE: import the safetensors folder), a Mixtral
  (llama.cpp writes it as architecture "llama" with experts, which transformers would read
  as a dense Llama without them), gpt-oss (transformers 5.25 cannot read llama.cpp's files:
  docs/guide/hf-import-export.md), and tensors transformers would drop (`rope_freqs`, Phi-3's
  `rope_factors_long` / `_short`: RoPE scaling kept as tensors);
- `dropped_fields` gives the HF config fields transformers leaves at a default although the
  file has them (`_DROPPED`): Qwen3's head_dim, the MoE expert widths, Phi-3's sliding
  window, Gemma 2's soft-caps, Gemma 3's linear RoPE scaling; and the special token ids the
  file does not give (None, not another model's default).

The file is untrusted: every length and count is checked against the file's size before it
is used, and only scalars are kept (arrays are skipped; a string of at most 64 KiB).
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple

from models.config import MAX_POSITIONS

from .rules import HFConversionError

# GGUF value types (ggml's gguf.h): struct format of the fixed-size ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
GGML_MAX_DIMS = 4  # ggml.h: a tensor has at most 4 dimensions
MAX_STRING = 64 * 2**10  # a kept string value (names, types); longer ones are skipped
# llama.cpp architecture -> the HF model type it holds, for those transformers' reader
# does not know by that name (models/hf families; transformers renames these too)
_HF_TYPE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# architectures of our families that transformers' GGUF reader does not read
_NOT_READ = {"olmo2": "OLMo 2", "olmoe": "OLMoE"}
# tensors transformers' reader drops: what they hold
_DROPPED_TENSORS = {"rope_freqs.weight": "llama3-style RoPE frequency factors",
                    "rope_factors_long.weight": "Phi-3 longrope factors",
                    "rope_factors_short.weight": "Phi-3 longrope factors"}
# llama.cpp architecture -> (metadata key after "<arch>.", HF config field) that transformers'
# reader does not map (integrations/ggml.py GGUF_CONFIG_MAPPING, transformers 5.x)
_DROPPED = {
    "qwen3": (("attention.key_length", "head_dim"),),
    "qwen2moe": (("expert_feed_forward_length", "moe_intermediate_size"),
                 ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")),
    "qwen3moe": (("expert_feed_forward_length", "moe_intermediate_size"),),
    "phi3": (("attention.sliding_window", "sliding_window"),),
    "gemma2": (("attn_logit_softcapping", "attn_logit_softcapping"),
               ("final_logit_softcapping", "final_logit_softcapping")),
}
_TOKEN_IDS = {"bos_token_id": "tokenizer.ggml.bos_token_id",
              "eos_token_id": "tokenizer.ggml.eos_token_id",
              "pad_token_id": "tokenizer.ggml.padding_token_id",
              "unk_token_id": "tokenizer.ggml.unknown_token_id"}
_SAFETENSORS_FIX = ("import the model's Hugging Face safetensors folder (config.json + "
                    "model.safetensors) instead")


class _Reader:
    """Little-endian reads from `buf`, each bounded by its size (`HFConversionError`)."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise HFConversionError(f"{self.path}: the GGUF header runs past the end of the "
                                    f"file ({len(self.buf):,} bytes); the file is truncated or "
                                    f"not GGUF, download it again")
        at, self.pos = self.pos, self.pos + n
        return at

    def scalar(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.buf, self.take(size))[0]

    def string(self, keep: bool = True) -> str | None:
        n = self.scalar("Q")
        at = self.take(n)
        if not keep or n > MAX_STRING:
            return None
        return bytes(self.buf[at:at + n]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:  # skipped: only its element count is checked against the file
            item, count = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS:
                self.take(count * struct.calcsize("<" + _SCALARS[item]))
            elif item == _STRING:
                if count > len(self.buf):
                    self.take(count)  # raises: past the end
                for _ in range(count):
                    self.string(keep=False)
            else:
                raise HFConversionError(f"{self.path}: GGUF array of value type {item} (not "
                                        f"one ggml defines); the file is corrupt")
            return None
        raise HFConversionError(f"{self.path}: GGUF value type {kind} is not one ggml "
                                f"defines; the file is corrupt or from a newer format")


def read_header(path: str) -> tuple[dict, list[str], dict, tuple[int, list["TensorInfo"]]]:
    """`({metadata key: scalar value}, [tensor names], {metadata key: array length},
    (end of the tensor table in bytes, [TensorInfo]))` of GGUF file `path` (array values are
    left out, their lengths kept). Raises `HFConversionError` naming the file for what is
    not GGUF v2/v3, and naming the tensor for one of more than ggml's `GGML_MAX_DIMS`
    (4) dimensions."""
    with open(path, "rb") as f:
        if os.path.getsize(path) < 24:
            raise HFConversionError(f"{path} is too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf, path)
            if bytes(buf[:4]) != b"GGUF":
                raise HFConversionError(f"{path} does not start with the GGUF magic bytes; it "
                                        f"is not a GGUF file")
            r.take(4)
            version = r.scalar("I")
            if version not in (2, 3):
                raise HFConversionError(f"{path}: GGUF version {version} (big-endian or other "
                                        f"than 2 and 3) is not supported; convert it again "
                                        f"with a current llama.cpp")
            tensors, kvs = r.scalar("Q"), r.scalar("Q")
            if tensors > len(buf) or kvs > len(buf):
                r.take(len(buf))  # raises: more entries than bytes
            meta, arrays = {}, {}
            for _ in range(kvs):
                key, kind = r.string(), r.scalar("I")
                if kind == _ARRAY and r.pos + 12 <= len(buf):  # item type, element count
                    arrays[key] = struct.unpack_from("<Q", buf, r.pos + 4)[0]
                meta[key] = r.value(kind)
            names, table = [], []
            for _ in range(tensors):
                names.append(r.string())
                dims = r.scalar("I")
                if dims > GGML_MAX_DIMS:
                    raise HFConversionError(f"{path}: tensor {names[-1]!r} has {dims} "
                                            f"dimensions, more than ggml's {GGML_MAX_DIMS}; "
                                            f"the file is corrupt, convert or download it again")
                shape = struct.unpack_from(f"<{dims}Q", buf, r.take(8 * dims))
                table.append(TensorInfo(names[-1], shape, r.scalar("I"), r.scalar("Q")))
            end = r.pos
    return {k: v for k, v in meta.items() if v is not None}, names, arrays, (end, table)


class TensorInfo(NamedTuple):
    """One entry of a GGUF file's tensor table: name, dimensions (ggml order, innermost
    first), ggml type and offset of its data from the start of the data section, in bytes."""

    name: str | None
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


def check_tensor_data(path: str, meta: dict, table: tuple[int, list[TensorInfo]],
                      file_size: int) -> list[tuple[int, int]]:
    """`[(first byte, end byte)]` of each tensor's data in the file, in table order, after
    refusing (`HFConversionError`, one line naming the tensor) a tensor table whose data
    ranges are not exactly the file's data section: each tensor's range, its element count
    (every dimension at least 1) divided by its ggml type's block size and times its block's
    bytes (gguf's `GGML_QUANT_SIZES`: whole blocks along the first dimension), starts at an
    offset aligned to `general.alignment` (default 32), lies within the file and ends where
    the next tensor starts (up to that alignment's padding; the last one at the end of the
    file), so no two overlap. A tensor whose declared type was changed (F32 -> F16: half
    the bytes) leaves a gap and is refused here; transformers' reader would read its bytes
    as the new type. (A tensor under twice the alignment can shrink into its own padding
    unseen.) Nothing is allocated from the table before this returns."""
    import gguf

    header_end, tensors = table
    align = meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise HFConversionError(f"{path}: general.alignment is {align!r}, not a power of two; "
                                f"the file is corrupt, convert or download it again")
    start = -(-header_end // align) * align
    fix = "the file is corrupt or was edited, convert or download it again"
    ranges = []
    for t in tensors:
        try:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        except (ValueError, KeyError):
            raise HFConversionError(f"{path}: tensor {t.name!r} has ggml type {t.ggml_type}, "
                                    f"not one gguf knows; {fix}") from None
        count = 1
        for d in t.dims:
            count *= d
        if not t.dims or min(t.dims) < 1:
            raise HFConversionError(f"{path}: tensor {t.name!r} has dimensions {t.dims}, not "
                                    f"1 to {GGML_MAX_DIMS} sizes of at least 1; {fix}")
        if t.dims[0] % block:
            raise HFConversionError(f"{path}: tensor {t.name!r} of dimensions {t.dims} does not "
                                    f"fill whole blocks of {block} of its type; {fix}")
        if t.offset % align:
            raise HFConversionError(f"{path}: tensor {t.name!r} starts at offset {t.offset}, "
                                    f"not a multiple of the alignment {align}; {fix}")
        kind = gguf.GGMLQuantizationType(t.ggml_type).name
        begin, end = start + t.offset, start + t.offset + count // block * size
        what = f"{t.name!r} ({kind} {list(t.dims)})"
        if end > file_size:
            raise HFConversionError(f"{path}: tensor {what} (bytes {begin:,}-{end:,}) runs "
                                    f"past the end of the file ({file_size:,} bytes); {fix}")
        ranges.append((begin, end, what))
    in_order = [(begin, end) for begin, end, _ in ranges]
    ranges.sort()
    cursor, before = start, "the tensor table"
    for begin, end, what in ranges + [(file_size, file_size, None)]:
        if begin < cursor:
            raise HFConversionError(f"{path}: tensor {what} starts at byte {begin:,}, inside "
                                    f"{before} (ending at byte {cursor:,}): tensors overlap; "
                                    f"{fix}")
        if begin > -(-cursor // align) * align:
            at = f"tensor {what} starts" if what else "the file ends"
            raise HFConversionError(f"{path}: {before} ends at byte {cursor:,} but {at} at "
                                    f"byte {begin:,}: the declared type or dimensions do not "
                                    f"match the data; {fix}")
        cursor, before = end, f"tensor {what}"
    return in_order


def hf_model_type(arch: str) -> str:
    """The HF model_type transformers gives GGUF architecture `arch`."""
    return _HF_TYPE.get(arch, arch)


def check_architecture(path: str, meta: dict, names: list[str]) -> None:
    """Refuse (`HFConversionError`, one line naming the architecture or tensor and the fix)
    a GGUF file transformers' reader would not read, or would read as another model."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = meta.get("general.architecture")
    if type(arch) is not str:
        raise HFConversionError(f"{path} has no general.architecture; it is not a model GGUF "
                                f"file")
    if arch in ("gpt-oss", "gpt_oss"):
        raise HFConversionError(
            f"{path}: GGUF architecture {arch!r} (gpt-oss) is not imported: transformers' "
            f"GGUF reader cannot read llama.cpp's gpt-oss files (it fails on their "
            f"rope.scaling keys and leaves the experts, their biases and the attention sinks "
            f"unloaded), --quantization none included; convert from the HF checkpoint "
            f"instead (the GptOssForCausalLM safetensors folder, MXFP4 experts de-quantized "
            f"on import)")
    if arch in _NOT_READ:
        raise HFConversionError(
            f"{path}: GGUF architecture {arch!r} ({_NOT_READ[arch]}) is not one transformers' "
            f"GGUF reader reads, and --hf reads .gguf files through it; {_SAFETENSORS_FIX}")
    if arch == "llama" and meta.get("llama.expert_count"):
        raise HFConversionError(
            f"{path}: GGUF architecture 'llama' with llama.expert_count "
            f"{meta['llama.expert_count']} is a mixture of experts (Mixtral): transformers' "
            f"GGUF reader reads it as a dense Llama and drops the experts; {_SAFETENSORS_FIX}")
    readable = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general",
                                                                            "tokenizer"))
    if arch not in readable and hf_model_type(arch) not in readable:
        raise HFConversionError(f"{path}: GGUF architecture {arch!r} is not one transformers' "
                                f"GGUF reader reads (it reads {', '.join(readable)}); "
                                f"{_SAFETENSORS_FIX}")
    dropped = next((n for n in names if n in _DROPPED_TENSORS), None)
    if dropped:
        raise HFConversionError(f"{path}: tensor {dropped!r} ({_DROPPED_TENSORS[dropped]}) is "
                                f"dropped by transformers' GGUF reader, so the model would "
                                f"differ; {_SAFETENSORS_FIX}")
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none") and not (arch == "gemma3" and kind == "linear"):
        raise HFConversionError(f"{path}: {arch}.rope.scaling.type {kind!r} is dropped by "
                                f"transformers' GGUF reader, so the model would differ; "
                                f"{_SAFETENSORS_FIX}")


def check_counts(path: str, meta: dict, names: list[str], arrays: dict) -> None:
    """Refuse (`HFConversionError`, one line) header counts no file of `names` can back, before
    transformers reads them: `<arch>.block_count` not an integer in [1, number of tensors]
    (every block holds tensors; transformers' config builds per-layer lists of that length
    first), `<arch>.context_length` not an integer in [1, `MAX_POSITIONS`], and a special
    token id (`_TOKEN_IDS`) not an integer below the length of `tokenizer.ggml.tokens`
    (transformers' tokenizer indexes the token list with it)."""
    arch = meta["general.architecture"]
    blocks = meta.get(f"{arch}.block_count")
    if type(blocks) is not int or not 1 <= blocks <= len(names):
        raise HFConversionError(f"{path}: {arch}.block_count is {blocks!r}, but the file holds "
                                f"{len(names)} tensors (at least one per block); the file is "
                                f"corrupt, convert or download it again")
    positions = meta.get(f"{arch}.context_length")
    if positions is not None and (type(positions) is not int or
                                  not 1 <= positions <= MAX_POSITIONS):
        raise HFConversionError(f"{path}: {arch}.context_length is {positions!r}, not a count "
                                f"of positions in [1, {MAX_POSITIONS:,}] (2**24, past any real "
                                f"model's context); the file is corrupt, convert or download "
                                f"it again")
    tokens = arrays.get("tokenizer.ggml.tokens")
    for key in _TOKEN_IDS.values():
        value = meta.get(key)
        if value is not None and (type(value) is not int or value < 0 or
                                  (tokens is not None and value >= tokens)):
            raise HFConversionError(f"{path}: {key} is {value!r}, not a token id of its "
                                    f"{tokens} tokens (tokenizer.ggml.tokens); the file is "
                                    f"corrupt, convert or download it again")


def dropped_fields(meta: dict, config: dict) -> dict:
    """`{HF config field: value}` to set on transformers' config dict `config` of a GGUF file
    whose header is `meta`: what transformers' reader left at its default although the file
    has it (`_DROPPED`; Gemma 3's linear RoPE scaling on the global layers), and the special
    token ids the file does not give (None)."""
    arch = meta["general.architecture"]
    out = {}
    for key, field in _DROPPED.get(arch, ()):
        if f"{arch}.{key}" in meta:
            out[field] = meta[f"{arch}.{key}"]
    if arch == "gemma3" and meta.get("gemma3.rope.scaling.type") == "linear":
        rope = dict(config.get("rope_parameters") or {})
        full = dict(rope.get("full_attention") or {})
        factor = meta.get("gemma3.rope.scaling.factor")
        if type(factor) is not float:
            raise HFConversionError(f"gemma3.rope.scaling.type is linear but "
                                    f"gemma3.rope.scaling.factor is {factor!r}, not a number")
        full.update(rope_type="linear", factor=factor)
        out["rope_parameters"] = {**rope, "full_attention": full}
    for field, key in _TOKEN_IDS.items():
        if key not in meta:
            out[field] = None
    return out


def check_tensor_names(path: str, meta: dict, names: list[str]) -> None:
    """Refuse (`HFConversionError`, one line) a tensor whose name is not one of the
    architecture's in gguf's own name map (`gguf.get_tensor_name_map` for
    `<arch>.block_count` blocks, plus `.weight` / `.bias`): transformers' reader skips such a
    tensor without a word, so a renamed `output.weight` would silently make an untied output
    layer the tied embedding."""
    arch = meta["general.architecture"]
    known = {name for _, name in tensor_name_map(path, meta).mapping.values()}
    for name in names:
        base, dot, suffix = (name or "").rpartition(".")
        if not (dot and suffix in ("weight", "bias") and base in known):
            raise HFConversionError(f"{path}: tensor {name!r} is not a tensor of a {arch} "
                                    f"model (gguf's name map), so transformers' reader would "
                                    f"drop it; the file is corrupt or was edited, convert or "
                                    f"download it again")


def tensor_name_map(path: str, meta: dict):
    """gguf's own `TensorNameMap` (HF module names -> GGUF tensor names, the table llama.cpp's
    converter and transformers' reader use) of the architecture and `<arch>.block_count` in
    header `meta`; `HFConversionError` when the installed gguf package lacks the
    architecture."""
    import gguf

    arch = meta["general.architecture"]
    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:  # check_architecture admits only what transformers reads
        raise HFConversionError(f"{path}: GGUF architecture {arch!r} is not one the installed "
                                f"gguf package names; pip install -U gguf")
    return gguf.get_tensor_name_map(arch_id, meta[f"{arch}.block_count"])
