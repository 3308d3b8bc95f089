"""The files of a checkpoint folder: their names, the error every check raises, and the check
of one file against its metadata.json entry (present, size, sha256).

The piece that format.py (what a complete folder is), keys.py (layout-free tensor keys) and
safe_dcp.py (reading `.metadata` as untrusted input) all need, so it sits below the three:
format.py uses keys.py and safe_dcp.py to verify a folder, and they use only this module.
format.py re-exports what it uses of it, so `checkpoint.format` stays the one place a reader
of the format imports from.
"""
from __future__ import annotations

import hashlib
import os
import re

LATEST = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
CONFIG = "config.yaml"
FORMAT_VERSION = 1
DCP_METADATA = ".metadata"
SHARD = re.compile(r"^__\d+_\d+\.distcp$")  # DCP FileSystemWriter's shard file names


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message names the file and the fix."""


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def damage_fix(path: str) -> str:
    """The fix for a damaged file of checkpoint folder `path`."""
    return ("restore it from the --save-replica copy or the checkpoint's source, or load an "
            f"earlier checkpoint with --load {os.path.dirname(os.path.normpath(path)) or '.'}"
            f"/iter_XXXXXXX")


def file_problem(path: str, entry: dict, checksums: bool = True) -> str | None:
    """What is wrong with the file metadata.json `entry` of checkpoint `path` (missing, size,
    with `checksums` sha256), naming it and the fix; None when it matches."""
    fix = damage_fix(path)
    fpath = os.path.join(path, entry["name"])
    if not os.path.isfile(fpath):
        return f"{fpath} is missing (metadata.json lists it); {fix}"
    size = os.path.getsize(fpath)
    if size != entry["bytes"]:
        return (f"{fpath} has {size} bytes, metadata.json records {entry['bytes']} "
                f"(truncated or partially written); {fix}")
    if checksums and sha256_file(fpath) != entry["sha256"]:
        return (f"{fpath}: sha256 differs from metadata.json (the file is corrupt or was "
                f"replaced by another); {fix}")
    return None
