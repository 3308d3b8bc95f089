"""What a complete checkpoint folder is, and how to check one (no process group needed).

A checkpoint is a folder `<save>/iter_0000010/` holding:

- `__<rank>_<n>.distcp` shard files and `.metadata`, written by `torch.distributed.checkpoint`
  (DCP) with `FileSystemWriter` (every rank writes its own shards);
- `config.yaml`: the resolved run configuration (`Config.to_yaml()`), readable and reusable as
  `--config`;
- `metadata.json`: iteration, layout, model config, torch version, and every file of the
  folder with its size in bytes and sha256. It is written last, so a folder without it is an
  interrupted save.

`<save>/latest_checkpointed_iteration.txt` holds the iteration of the newest complete
checkpoint (Megatron's marker). Saves go to `iter_XXXXXXX.tmp-<random>/` and are renamed only
after verification, so any folder named `iter_XXXXXXX` was complete when it appeared.

A checkpoint is untrusted input, like a weight file: `read_metadata` refuses a metadata.json
whose model needs more memory than the shard files hold before anything is built from it, and
`verify_files` checks sizes and sha256, reads `.metadata` only after its sha256 matched and
only through `checkpoint.safe_dcp`, and compares the stored tensors with the model before any
tensor is read.

Every failure is a `CheckpointError` naming the file, what is wrong and the fix. The file names,
`CheckpointError` and the one-file check live in files.py, below keys.py and safe_dcp.py
(which need them and which this module uses); they are imported from here as before.
"""
from __future__ import annotations

import os
import re

from models.hf.files import UntrustedJSONError, load_json

from .files import (CONFIG, DCP_METADATA, LATEST, METADATA, SHARD, CheckpointError,
                    file_problem, sha256_file, unlisted_problems)
from .keys import dense_tensors, tensor_problems
from .safe_dcp import read_dcp_metadata

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# metadata.json lists one entry (~130 bytes) per file: 16 MiB is over 100,000 shard files,
# and bounds what parsing a hostile one can allocate
MAX_METADATA_BYTES = 16 * 2**20
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def complete_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """`[(iteration, path)]` of the complete (renamed) checkpoints in `save_dir`, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for name in os.listdir(save_dir):
        m = _ITER_DIR.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            out.append((int(m.group(1)), os.path.join(save_dir, name)))
    return sorted(out)


_DEBRIS = re.compile(r"^(iter_\d{7,}\.(tmp|old)-[0-9a-f]+|"
                     + re.escape(LATEST) + r"\.tmp-[0-9a-f]+)$")


def debris(save_dir: str) -> list[str]:
    """Paths in `save_dir` that interrupted saves left: staging folders `iter_*.tmp-*` (a
    save killed before its rename), `iter_*.old-*` (a replaced folder not yet removed) and
    marker temp files. A job writes one save at a time and renames it before the next, so
    at start-up and after a completed save nothing of this kind belongs to a live save (one
    job per --save folder)."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(os.path.join(save_dir, n) for n in os.listdir(save_dir) if _DEBRIS.match(n))


def newest_verified(save_dir: str) -> str | None:
    """The newest complete checkpoint of `save_dir` whose files match its metadata.json
    (sizes; the loader checks sha256), or None."""
    for _, path in reversed(complete_checkpoints(save_dir)):
        try:
            meta = read_metadata(path, check=False)  # verify_files checks the rest
        except CheckpointError:
            continue
        if not verify_files(path, meta, checksums=False):
            return path
    return None


def describe_files(folder: str, names: list[str]) -> list[dict]:
    """`[{"name", "bytes", "sha256"}]` of `names` in `folder`, read back from disk."""
    out = []
    for name in sorted(names):
        path = os.path.join(folder, name)
        out.append({"name": name, "bytes": os.path.getsize(path), "sha256": sha256_file(path)})
    return out


def resolve_checkpoint(load: str, newest_if_no_marker: bool = False) -> str | None:
    """The checkpoint folder that `--load load` means, or None when there is none yet.

    `load` is either a checkpoint folder itself (`.../iter_0000010`, it holds metadata.json or
    has that name) or a `--save` folder whose `latest_checkpointed_iteration.txt` names one.
    Returns None when `load` does not exist or has no marker and no checkpoint folder at all.
    With `newest_if_no_marker` (--load is also --save: a job restarted after a crash between
    a save's rename and its marker write) a folder without a marker resolves to its newest
    verified checkpoint (`newest_verified`). Raises `CheckpointError` for a marker that is
    unreadable or names a missing folder, and for a folder holding checkpoints but no marker
    (or, with `newest_if_no_marker`, none that verifies).
    """
    if os.path.isfile(os.path.join(load, METADATA)) or _ITER_DIR.match(os.path.basename(
            os.path.normpath(load))):
        return load
    marker = os.path.join(load, LATEST)
    if not os.path.isfile(marker):
        found = complete_checkpoints(load)
        newest = newest_verified(load) if found and newest_if_no_marker else None
        if newest:
            return newest
        if found:
            raise CheckpointError(
                f"{marker} does not exist, but {load} holds checkpoints "
                f"{[os.path.basename(p) for _, p in found]}; pass one of them, e.g. "
                f"--load {found[-1][1]}, or write its iteration into {marker}")
        return None
    text = open(marker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker} holds {text!r}, not an iteration number; write the "
                              f"iteration of a complete checkpoint folder into it, or pass "
                              f"--load <folder>/iter_XXXXXXX")
    path = os.path.join(load, iter_dir_name(int(text)))
    if not os.path.isdir(path):
        raise CheckpointError(f"{marker} names iteration {int(text)}, but {path} does not "
                              f"exist; pass --load with an existing iter_XXXXXXX folder")
    return path



def require_checkpoint(load: str) -> str:
    """`resolve_checkpoint(load)` for a reader that needs one (export, inference): raises
    `CheckpointError` naming what to pass when there is none yet."""
    path = resolve_checkpoint(load)
    if path is None:
        raise CheckpointError(
            f"--load {load}: no checkpoint there (no {LATEST} and no iter_XXXXXXX folder); "
            f"pass a folder written by train.py --save or tools/convert_hf.py import")
    return path

def read_metadata(path: str, check: bool = True) -> dict:
    """metadata.json of checkpoint folder `path`; `CheckpointError` if missing, unreadable or
    malformed (it is read only up to `MAX_METADATA_BYTES`). With `check`, also what is cheap
    to know before anything is built from it: every listed file present at its recorded size
    (`file_problem`), no file it does not list and no link out of the folder
    (`unlisted_problems`), and a model that fits in the shard files (`model_config`)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path} does not exist; check --load")
    meta_path = os.path.join(path, METADATA)
    if not os.path.isfile(meta_path):
        raise CheckpointError(
            f"{meta_path} is missing: {path} is not a complete checkpoint (an interrupted or "
            f"partially copied save); load the previous one (--load <save dir> follows "
            f"{LATEST}) or copy it again from the --save-replica location")
    try:
        meta = load_json(meta_path, MAX_METADATA_BYTES)
        problem = _malformed(meta)
    except UntrustedJSONError as e:  # too large, not JSON, nested too deep
        raise CheckpointError(f"{e}; restore the checkpoint from --save-replica or load an "
                              f"earlier one (nothing was built from it)") from None
    except (ValueError, KeyError, TypeError) as e:
        problem = f"{type(e).__name__}: {e}"
    if problem:
        raise CheckpointError(f"{meta_path} is corrupt ({problem}); restore the checkpoint "
                              f"from --save-replica or load an earlier one")
    window = meta["model"].get("window_size")
    if type(window) is int:  # written when the window was one number: HF's sliding_window
        meta["model"]["window_size"] = [window - 1, 0]
    if check:
        problems = [p for p in (file_problem(path, f, checksums=False) for f in meta["files"])
                    if p] + unlisted_problems(path, meta["files"])
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
        model_config(path, meta)
    return meta


def _malformed(meta) -> str | None:
    """What makes a parsed metadata.json unusable (None: its fields have the right types, and
    every file name stays inside the folder)."""
    if type(meta) is not dict:
        return "not a JSON object"
    meta["iteration"], meta["files"], meta["layout"], meta["model"]  # noqa: B018 - KeyError
    if type(meta["iteration"]) is not int or meta["iteration"] < 0:
        return f"iteration {meta['iteration']!r}"
    if type(meta["layout"]) is not dict or type(meta["model"]) is not dict or \
            type(meta["files"]) is not list:
        return "layout, model or files has the wrong type"
    for f in meta["files"]:
        name = f.get("name") if type(f) is dict else None
        if type(name) is not str or os.path.isabs(name) or \
                os.path.normpath(name).split(os.sep)[0] in ("..", "") or \
                type(f.get("bytes")) is not int or f["bytes"] < 0 or \
                not _SHA256.match(str(f.get("sha256"))):
            return f"file entry {f!r}"
    return None


_NOT_THESE_FILES = ("metadata.json does not describe the files beside it (edited, or from "
                    "another checkpoint); restore the folder from the --save-replica copy or "
                    "the checkpoint's source, or load another checkpoint")


_SCALARS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def _field_type_problem(model: dict) -> str | None:
    """The first field of metadata.json's model whose value is not of the `ModelConfig`
    field's scalar type (`num_layers: 2.0`, `true` for an int), or None. Fields of other
    types (`window_size` pair, `window_attn_skip_freq` int or list) are checked exactly by
    `ModelConfig.validate`."""
    import dataclasses

    from models.config import ModelConfig

    for f in dataclasses.fields(ModelConfig):
        kind, _, optional = str(f.type).partition(" | ")
        if f.name not in model or kind not in _SCALARS or optional not in ("", "None") or \
                (optional and model[f.name] is None):
            continue
        v = model[f.name]
        if type(v) not in _SCALARS[kind]:  # type(), not isinstance: True is not an int here
            return f"{f.name} is {v!r} ({type(v).__name__}), not {f.type}"
    return None


def model_config(path: str, meta: dict):
    """metadata.json's model (`meta["model"]`) as a `ModelConfig`, refused before any model is
    built from it when it is invalid or would need more memory than the checkpoint's shard
    files hold: at least 4 bytes (float32) per parameter of its unpadded model (of its LoRA
    adapters, for a LoRA run's checkpoint: metadata.json `lora`), and a vocab
    padding (`make_vocab_size_divisible_by`) of at most max(vocab, 1024) rows. Raises
    `CheckpointError` with the numbers."""
    from layers.lora import adapter_num_parameters
    from models.config import ConfigError, ModelConfig

    meta_path = os.path.join(path, METADATA)
    fix = f"nothing was built or read; {_NOT_THESE_FILES}"
    try:
        problem = _field_type_problem(meta["model"])
        if problem:
            raise ConfigError(problem)
        config = ModelConfig.from_dict(meta["model"])
        config.validate()
        lora = meta.get("lora")
        params = config.num_parameters() if lora is None else adapter_num_parameters(
            config, lora["rank"], lora["target_modules"])  # a LoRA run's: its adapters only
        pad = config.padded_vocab_size() - config.vocab_size
    except (ConfigError, TypeError, ValueError, ArithmeticError, KeyError) as e:
        raise CheckpointError(f"{meta_path}: its model config is invalid ({e}); {fix}") from None
    held = sum(os.path.getsize(os.path.join(path, f["name"])) for f in meta["files"]
               if SHARD.match(f["name"]) and os.path.isfile(os.path.join(path, f["name"])))
    if 4 * params > held:
        raise CheckpointError(
            f"{meta_path}: its model ({config.num_layers} layers, hidden {config.hidden_size}, "
            f"ffn {config.ffn_hidden_size}, vocab {config.vocab_size}) has {params:,} "
            f"parameters, {4 * params:,} bytes in float32, but the checkpoint's shard files "
            f"hold {held:,} bytes; {fix}")
    if pad > max(config.vocab_size, 1024):
        raise CheckpointError(
            f"{meta_path}: make_vocab_size_divisible_by {config.make_vocab_size_divisible_by} "
            f"pads its vocabulary of {config.vocab_size} by {pad:,} rows (at most "
            f"max(vocab, 1024) = {max(config.vocab_size, 1024)} are accepted); {fix}")
    return config


def verify_files(path: str, meta: dict, *, rank: int = 0, world: int = 1,
                 checksums: bool = True, tensors=None) -> list[str]:
    """Problems with the files of checkpoint `path` (empty list: OK), each naming the file.

    Rank `rank` of `world` checks every `world`-th file of metadata.json (so a job verifies in
    parallel). Rank 0 also refuses files metadata.json does not list and links out of the
    folder (`unlisted_problems`: what a loader reads is then listed and checked), and reads
    `.metadata` as untrusted input (`safe_dcp.read_dcp_metadata`:
    its size and sha256 first, whatever `checksums` says); given `tensors(config)` -> the
    `model.*` tensors a reader of metadata.json's model needs (`keys.expected_tensors`), it
    checks the model fits in the files (`model_config`) and compares those tensors with the
    stored ones. `checksums=False` checks the other files' presence and sizes only.
    """
    problems = [p for i, entry in enumerate(meta["files"])
                if i % world == rank and entry["name"] != DCP_METADATA
                for p in [file_problem(path, entry, checksums)] if p]
    if rank == 0:
        problems += unlisted_problems(path, meta["files"])
        problems += _structure_problems(path, meta, tensors)
    return problems


def _structure_problems(path: str, meta: dict, tensors) -> list[str]:
    """Rank 0's part of `verify_files`: the model, `.metadata` and the stored tensors."""
    if any(file_problem(path, f, checksums=False) for f in meta["files"]
           if f["name"] != DCP_METADATA):
        return []  # a missing or cut file: reported by the rank that checks it
    try:
        config = model_config(path, meta) if tensors else None
        md = read_dcp_metadata(path, meta)
    except CheckpointError as e:
        return [str(e)]
    if tensors is None:
        return []
    stored = {k: tuple(v.size) for k, v in md.state_dict_metadata.items()}
    mismatch = tensor_problems(tensors(config), stored)
    if not mismatch:
        return []
    return [f"{os.path.join(path, METADATA)}: its model ({config.num_layers} layers, hidden "
            f"{config.hidden_size}) does not match the tensors {os.path.join(path, DCP_METADATA)} "
            f"lists: {'; '.join(mismatch)}; {_NOT_THESE_FILES}"]


# model fields that must agree between a checkpoint and the model that loads it
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "kv_channels", "vocab_size", "activation", "normalization",
                "position_embedding_type", "add_bias_linear", "add_qkv_bias",
                "untie_embeddings_and_output_weights", "model_type", "encoder_num_layers",
                "decoder_num_layers", "relative_attention_num_buckets",
                # mixture of experts: which layers, how many experts, their stored tensors
                "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                "moe_router_enable_expert_bias")


def compare_model(meta: dict, model: dict, path: str) -> None:
    """Raise `CheckpointError` listing every shape field where checkpoint and model differ."""
    diffs = [f"{k}: checkpoint {meta['model'][k]!r}, this run {model[k]!r}"
             for k in SHAPE_FIELDS if k in meta["model"] and k in model
             and meta["model"][k] != model[k]]
    if diffs:
        flags = " ".join(f"--{k.replace('_', '-')} {meta['model'][k]}" for k in SHAPE_FIELDS
                         if k in meta["model"] and k in model and meta["model"][k] != model[k])
        raise CheckpointError(
            f"{os.path.join(path, METADATA)}: the checkpoint's model does not match this run's "
            f"({'; '.join(diffs)}); use the checkpoint's model settings ({flags}, or --config "
            f"{os.path.join(path, CONFIG)}) or load a checkpoint of this model")


def summarize(path: str, checksums: bool = True) -> tuple[dict | None, list[str]]:
    """(metadata or None, problems) for `tools/checkpoint_info.py`."""
    try:
        meta = read_metadata(path, check=False)  # verify_files checks (and lists) the rest
    except CheckpointError as e:
        return None, [str(e)]
    return meta, verify_files(path, meta, checksums=checksums, tensors=dense_tensors)
