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

Every failure is a `CheckpointError` naming the file, what is wrong and the fix.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

LATEST = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
CONFIG = "config.yaml"
FORMAT_VERSION = 1
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message names the file and the fix."""


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
            meta = read_metadata(path)
        except CheckpointError:
            continue
        if not verify_files(path, meta, checksums=False):
            return path
    return None


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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

def read_metadata(path: str) -> dict:
    """metadata.json of checkpoint folder `path`; `CheckpointError` if missing or unreadable."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path} does not exist; check --load")
    meta_path = os.path.join(path, METADATA)
    if not os.path.isfile(meta_path):
        raise CheckpointError(
            f"{meta_path} is missing: {path} is not a complete checkpoint (an interrupted or "
            f"partially copied save); load the previous one (--load <save dir> follows "
            f"{LATEST}) or copy it again from the --save-replica location")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        meta["iteration"], meta["files"], meta["layout"], meta["model"]  # noqa: B018
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path} is corrupt ({type(e).__name__}: {e}); restore the "
                              f"checkpoint from --save-replica or load an earlier one") from None
    return meta


def verify_files(path: str, meta: dict, *, rank: int = 0, world: int = 1,
                 checksums: bool = True) -> list[str]:
    """Problems with the files of checkpoint `path` (empty list: OK), each naming the file.

    Rank `rank` of `world` checks every `world`-th file of metadata.json (so a job verifies in
    parallel); rank 0 also checks that every shard `.metadata` refers to is listed and long
    enough. `checksums=False` checks presence and sizes only.
    """
    problems = []
    fix = ("restore it from the --save-replica copy, or load an earlier checkpoint with "
           f"--load {os.path.dirname(os.path.normpath(path)) or '.'}/iter_XXXXXXX")
    files = meta["files"]
    for i, entry in enumerate(files):
        if i % world != rank:
            continue
        fpath = os.path.join(path, entry["name"])
        if not os.path.isfile(fpath):
            problems.append(f"{fpath} is missing (metadata.json lists it); {fix}")
            continue
        size = os.path.getsize(fpath)
        if size != entry["bytes"]:
            problems.append(f"{fpath} has {size} bytes, metadata.json records {entry['bytes']} "
                            f"(truncated or partially written); {fix}")
        elif checksums and sha256_file(fpath) != entry["sha256"]:
            problems.append(f"{fpath}: sha256 differs from metadata.json (the file is "
                            f"corrupt); {fix}")
    if rank == 0:
        problems += _check_dcp_references(path, {f["name"]: f["bytes"] for f in files}, fix)
    return problems


def _check_dcp_references(path: str, listed: dict[str, int], fix: str) -> list[str]:
    """Every byte range DCP's `.metadata` points at lies inside a listed file."""
    if ".metadata" not in listed:
        return [f"{os.path.join(path, '.metadata')} is not listed in metadata.json; the "
                f"checkpoint is incomplete; {fix}"]
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - any unreadable .metadata is the same problem
        return [f"{os.path.join(path, '.metadata')} cannot be read ({type(e).__name__}: {e}); "
                f"{fix}"]
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        if name not in listed:
            problems.append(f"{os.path.join(path, name)} holds shards (per .metadata) but is "
                            f"not listed in metadata.json; {fix}")
        elif listed[name] < end:
            problems.append(f"{os.path.join(path, name)} has {listed[name]} bytes but its "
                            f"shards end at byte {end} (truncated); {fix}")
    return problems


# model fields that must agree between a checkpoint and the model that loads it
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "kv_channels", "vocab_size", "activation", "normalization",
                "position_embedding_type", "add_bias_linear", "add_qkv_bias",
                "untie_embeddings_and_output_weights", "model_type", "encoder_num_layers",
                "decoder_num_layers", "relative_attention_num_buckets")


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
        meta = read_metadata(path)
    except CheckpointError as e:
        return None, [str(e)]
    return meta, verify_files(path, meta, checksums=checksums)
