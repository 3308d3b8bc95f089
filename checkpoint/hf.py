"""Hugging Face import and export of native checkpoints (the library under tools/convert_hf.py).

`import_hf(hf_path, out)`: an HF folder or `.gguf` file -> a native checkpoint folder (the
format train.py saves; loads at any tp/pp/vpp/dp) with the tokenizer and the generation config
(stop ids, sampling fields: models/hf/generation.py) inside it.
`export_hf(checkpoint, out, dtype)`: a native checkpoint of any layout (also one saved
mid-training with optimizer state) -> an HF folder: config.json, model.safetensors (sharded
with model.safetensors.index.json above `max_shard_bytes`), generation_config.json (the stored
one, over the tokenizer's ids) and the tokenizer. Both stream tensors: import holds about one
tensor at a time, export one shard.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import shutil

import numpy as np
import torch

import parallel_state as ps
from layers.quantized import install, is_quantized
from models import hf as hfmap
from models.hf import HFConversionError
from models.hf.generation import generation_config, write_generation_config
from models.hf.tokenizer_files import TokenizerFileError, load_hf_tokenizer

from .format import CheckpointError, require_checkpoint
from .progress import ProgressLog, format_duration
from .model_io import (TOKENIZER_DIR, TOKENIZER_MODEL, find_tokenizer, read_dense_weights,
                       stored_generation_config, write_weights_checkpoint)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size, 5 GB


def import_hf(hf_path: str, out: str, log=print) -> str:
    """Convert `hf_path` into the native checkpoint folder `out`; returns `out`.

    Raises `FileNotFoundError`, `models.hf.HFConversionError` (unsupported or malformed config,
    a config the weight files do not back, missing or unused tensors, a bad generation config)
    or `CheckpointError` (`out` exists) before `out` exists.
    """
    if os.path.exists(out):
        raise CheckpointError(f"--out {out} already exists; pass a new folder (nothing was "
                              f"written)")
    src, config = hfmap.open_checked(hf_path, log=log)
    generation = generation_config(src, config.vocab_size)
    config.name = ""
    model_type = src.config["model_type"]
    tensors = hfmap.to_native(config, model_type, src.get, src.names)

    tok = _source_tokenizer(src, log)  # before any weight: a refused file stops the import

    def save_tokenizer(folder: str) -> None:
        if tok is not None:
            tok.save_pretrained(folder)

    return write_weights_checkpoint(
        out, config, tensors, tokenizer=save_tokenizer, generation_config=generation,
        source={"format": src.kind, "path": os.path.abspath(hf_path), "model_type": model_type,
                "architectures": src.config.get("architectures")})


def _source_tokenizer(src, log):
    """The tokenizer of opened HF model `src` (transformers'), or None when it has none (a
    note says so). Raises `HFConversionError` naming a tokenizer file that is refused
    (models/hf/tokenizer_files.py)."""
    where, kw = src.tokenizer_source()
    try:
        return load_hf_tokenizer(where, **kw)
    except TokenizerFileError as e:
        raise HFConversionError(str(e)) from None
    except (OSError, ValueError, TypeError) as e:
        log(f"note: no tokenizer in {where} ({type(e).__name__}); the checkpoint has none, "
            f"pass --tokenizer-model when training on it")
        return None


def _shard_plan(config, max_shard_bytes: int, itemsize: int) -> list[list[tuple[str, tuple]]]:
    """HF tensor names and shapes, in write order, cut into shards of <= max_shard_bytes
    (a tensor larger than that gets a shard of its own). Computed on the meta device."""
    shards: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for name, shape in hfmap.hf_shapes(config).items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def check_export_target(out: str, dtype: str) -> None:
    """Refuse an export `--dtype` not in DTYPES (ValueError) or an `--out` that exists
    (`CheckpointError`), before anything is read or written."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if os.path.exists(out):
        raise CheckpointError(f"--out {out} already exists; pass a new folder (nothing was "
                              f"written)")


def export_hf(load: str, out: str, dtype: str = "float32",
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, log=print, adjust=None) -> str:
    """Write the HF folder `out` from checkpoint `load` (a --save folder or iter_XXXXXXX);
    returns `out`. `adjust(hf name, tensor) -> tensor`, when given, changes each HF tensor
    before its cast (LoRA adapters folded in: checkpoint/lora_files.py). Raises
    `CheckpointError` / `HFConversionError` before `out` exists."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    check_export_target(out, dtype)
    path = require_checkpoint(load)
    config, dense = read_dense_weights(path)
    kwargs = hfmap.config_to_hf(config)  # raises if the model has no HF equivalent
    torch_dtype = DTYPES[dtype]
    plan = _shard_plan(config, max_shard_bytes, torch.empty((), dtype=torch_dtype).itemsize)
    tokenizer = find_tokenizer(path)
    generation = stored_generation_config(path, config.vocab_size)
    tmp = f"{os.path.abspath(out)}.tmp-{secrets.token_hex(4)}"
    os.makedirs(tmp)
    try:
        files = (["model.safetensors"] if len(plan) == 1 else
                 [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
        weight_map, total = {}, 0
        stream = hfmap.to_hf(config, lambda n: dense[n]())
        for fname, names in zip(files, plan):
            shard = {}
            for want, _ in names:
                name, t = next(stream)
                assert name == want, (name, want)
                t = adjust(name, t) if adjust is not None else t
                shard[name] = t.to(torch_dtype).contiguous()
                total += shard[name].numel() * shard[name].element_size()
                weight_map[name] = fname
            save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
            _as_created(os.path.join(tmp, fname))
            del shard
        if len(files) > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
        hf_config = AutoConfig.for_model(**kwargs)
        setattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", dtype)
        special = _save_tokenizer(tokenizer, tmp, log)
        for k, v in special.items():
            setattr(hf_config, k, v)
        hf_config.save_pretrained(tmp)
        write_generation_config(tmp, {**special, **generation})
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"exported {kwargs['architectures'][0]} ({config.num_parameters() / 1e6:.1f}M "
        f"parameters, {dtype}, {len(files)} safetensors file(s)) from {path} to {out}")
    return out


def export_gguf(load: str, out: str, outtype: str = "f16", log=print) -> str:
    """Write the GGUF file `out` (llama.cpp's format, models/hf/gguf_export.py) from
    checkpoint `load` (a --save folder or iter_XXXXXXX); returns `out`. `outtype`: "f32",
    "f16", "q8_0" or "q4_0" (gguf_export.OUTTYPES; norms stay float32, q4_0 keeps the
    embedding / output at q8_0). Streams one tensor at a time: the file is written as
    `out.tmp-*` and renamed when complete. Raises `ValueError` (outtype), `CheckpointError`
    (`out` exists, a damaged checkpoint) or `HFConversionError` (a model or tokenizer GGUF
    export does not write) before anything is written."""
    import gguf

    from models.hf import gguf_export

    if outtype not in gguf_export.OUTTYPES:
        raise ValueError(f"--outtype must be one of {', '.join(gguf_export.OUTTYPES)}, got "
                         f"{outtype!r}")
    if os.path.exists(out):
        raise CheckpointError(f"--out {out} already exists; pass a new file (nothing was "
                              f"written)")
    path = require_checkpoint(load)
    config, dense = read_dense_weights(path)
    gguf_export.check_exportable(config)
    tokenizer = find_tokenizer(path)
    if tokenizer is None or os.path.basename(tokenizer) != TOKENIZER_DIR:
        raise HFConversionError(
            f"{path} holds {'no tokenizer' if tokenizer is None else 'a SentencePiece model'}"
            f"; GGUF export needs an HF byte-level BPE tokenizer folder in the checkpoint "
            f"(llama.cpp reads the vocabulary from the file)")
    try:
        tok = load_hf_tokenizer(tokenizer)  # its files checked before anything parses them
    except (TokenizerFileError, OSError, ValueError) as e:
        raise HFConversionError(f"the checkpoint's tokenizer cannot be exported: {e}") from None
    plan = gguf_export.tensor_plan(config, hfmap.hf_shapes(config), outtype)
    tmp = f"{os.path.abspath(out)}.tmp-{secrets.token_hex(4)}"
    writer = gguf.GGUFWriter(tmp, gguf_export.ARCH)
    try:
        gguf_export.add_metadata(writer, config, os.path.basename(os.path.normpath(path)),
                                 outtype)
        gguf_export.add_vocab(writer, tok, tokenizer, config.vocab_size, log)
        for _, name, shape, kind, _ in plan:
            nbytes = gguf_export.tensor_nbytes(shape, kind)
            quantized = kind not in ("f32", "f16")
            writer.add_tensor_info(
                name, (shape[0], nbytes // shape[0]) if quantized else shape,
                np.dtype(np.uint8 if quantized else np.float32 if kind == "f32" else np.float16),
                nbytes, raw_dtype=gguf.GGMLQuantizationType[kind.upper()] if quantized else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        stream = hfmap.to_hf(config, lambda n: dense[n]())
        for hf_name, name, shape, kind, heads in plan:
            got, t = next(stream)
            assert got == hf_name and tuple(t.shape) == shape, (got, hf_name, t.shape, shape)
            if heads is not None:
                t = gguf_export.permute_rows(t, heads)
            writer.write_tensor_data(gguf_export.encode(t, kind)[0])
        writer.close()
        _as_created(tmp)
        os.rename(tmp, out)
    except BaseException:
        writer.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    kinds = sorted({kind for *_, kind, _ in plan})
    log(f"exported llama ({config.num_parameters() / 1e6:.1f}M parameters, {outtype}: tensors "
        f"{', '.join(kinds)}; {len(plan)} tensors, {os.path.getsize(out) / 2**20:,.1f} MiB) "
        f"from {path} to {out}")
    return out


def _as_created(path: str) -> None:
    """Give `path` the mode `open()` would have (0666 less the umask): safetensors writes
    its files 0600, unlike the rest of the folder."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _save_tokenizer(tokenizer: str | None, folder: str, log) -> dict:
    """Copy the checkpoint's tokenizer into the HF folder; returns its bos/eos/pad ids."""
    if tokenizer is None:
        log("note: the checkpoint holds no tokenizer; the HF folder has none")
        return {}
    if os.path.basename(tokenizer) == TOKENIZER_MODEL:
        shutil.copy(tokenizer, os.path.join(folder, TOKENIZER_MODEL))
        log(f"note: the tokenizer is a SentencePiece model; copied as {TOKENIZER_MODEL}")
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=tokenizer)
        ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
        return {k: v for k, v in ids.items() if v >= 0}
    assert os.path.basename(tokenizer) == TOKENIZER_DIR
    try:
        tok = load_hf_tokenizer(tokenizer)  # verified with the checkpoint; its files checked
    except (TokenizerFileError, OSError, ValueError) as e:
        raise HFConversionError(f"the checkpoint's tokenizer cannot be exported: {e}") from None
    for name in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, name), os.path.join(folder, name))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id}
    return {k: v for k, v in ids.items() if v is not None}


@torch.no_grad()
def load_hf_weights(src, config, chunks, log=None, quantization=None, part: str = "saved"
                    ) -> None:
    """Copy the weights of an opened HF model (`models.hf.files.open_hf`) straight into this
    rank's sharded model `chunks` (any tp/pp; no checkpoint folder is written). Each rank
    reads the dense tensors it needs one at a time and keeps its shard (and the persistent
    buffers, a DeepSeek-V3 router's expert bias, whole); for an MoE layer only
    the experts of its expert-parallel block (one HF tensor per expert, stacked, then split
    over TP). `log`, if given, gets a line of how far it is after 5 s and every 15 s
    (checkpoint/progress.py). Raises `HFConversionError` for missing or unused tensors,
    before any weight is copied.

    Low-bit weights (layers/quantized.py): a tensor the source returns as a
    `QuantizedWeight`, or a float linear weight `quantization` (a
    `layers.quantized.Quantization`) quantizes, is sharded in its packed form and installed
    in its layer in place of the parameter; a parameter still on the meta device (a model
    built with `layers.parameters_on_meta`, so that no float copy of a quantized weight is
    ever allocated) is materialized on `device` as it is filled. Peak memory: the weights
    loaded so far plus one dense source tensor and its quantized copy. `part`: the
    parameters to fill (`checkpoint.keys.entries`: "base" fills a LoRA model's frozen base
    and leaves its adapters as they are)."""
    from layers.quantized import Quantization, holds_quantized

    from .keys import buffer_entries, entries

    quantization = quantization or Quantization()
    tensors = hfmap.to_native(config, src.config["model_type"], src.get, src.names)
    todo = list(entries(chunks, part))
    progress = ProgressLog(log, first=5.0, every=15.0)
    device = ps.get_device() if ps.model_parallel_is_initialized() else torch.device("cpu")
    for done, (name, p, key, tied_copy) in enumerate(todo):
        progress(lambda s: f"weights: {done}/{len(todo)} tensors of this rank copied in "
                           f"{format_duration(s)}")
        chunk = next(c for c in chunks if _has_parameter(c, name))
        module_name, _, attr = name.rpartition(".")
        module = chunk.get_submodule(module_name)
        linear, holds = holds_quantized(module)
        value = _load_one(tensors, key, p, quantization, linear and not tied_copy, holds)
        if is_quantized(value):
            install(module, attr, value)
            continue
        if p.is_meta:
            param = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                       requires_grad=p.requires_grad)
            param.__dict__.update(p.__dict__)
            module._parameters[attr] = p = param
        p.copy_(value.to(p.device, p.dtype))
    for name, b in buffer_entries(chunks):  # model state beside the weights (expert_bias)
        b.copy_(tensors[name]().to(b.device, b.dtype))


def _has_parameter(chunk, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    try:
        return attr in chunk.get_submodule(module_name)._parameters
    except AttributeError:
        return False


def _load_one(tensors, key: str, p, quantization, linear: bool, holds: bool):
    """This rank's shard of parameter `p` (checkpoint key `key`): a float tensor, or a
    low-bit `QuantizedWeight` / `QuantizedExperts` (`Quantization.prepare`)."""
    from layers import shard_tensor
    from layers.quantized import QuantizedExperts, zero_rows
    from layers.sharding import full_shape, tensor_parallel_rank_of, tensor_parallel_size_of
    from layers.quant import QuantizedWeight

    from .keys import logical_names

    if getattr(p, "expert_parallel", False):
        experts = [quantization.prepare(tensors[name](), linear, holds)
                   for name, _ in logical_names(key, p)]
        if all(isinstance(e, QuantizedWeight) for e in experts):
            return QuantizedExperts([shard_tensor(e, p, tensor_parallel_rank_of(p),
                                                  tensor_parallel_size_of(p))
                                     for e in experts])
        block = torch.stack([_as_float(e) for e in experts])
        return shard_tensor(block, _WithoutExperts(p), tensor_parallel_rank_of(p),
                            tensor_parallel_size_of(p))
    full = quantization.prepare(tensors[key](), linear, holds)
    if isinstance(full, QuantizedWeight):
        pad = full_shape(p)[0] - full.shape[0] if getattr(p, "full_rows", None) else 0
        if pad:  # the vocabulary's padding rows: zeros
            full = QuantizedWeight.cat_rows([full, zero_rows(full, pad)])
        return shard_tensor(full, p)
    full = full.to(torch.float32)
    if getattr(p, "full_rows", None):  # pad the vocabulary rows with zeros
        padded = torch.zeros(full_shape(p), dtype=torch.float32)
        padded[:full.shape[0]] = full
        full = padded
    return shard_tensor(full, p)


def _as_float(t):
    return t.dequantize(torch.float32) if is_quantized(t) else t.to(torch.float32)


class _WithoutExperts:
    """The TP sharding attributes of stacked expert weight `p` without its expert-parallel
    tag: `shard_tensor` of this rank's block of experts splits it over expert TP only."""

    def __init__(self, p):
        self.tensor_model_parallel = p.tensor_model_parallel
        self.partition_dim = p.partition_dim
        self.num_fused_parts = getattr(p, "num_fused_parts", 1)
