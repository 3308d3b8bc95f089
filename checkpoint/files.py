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

from models.hf.files import link_outside

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


def unlisted_problems(path: str, files: list[dict], under: str | None = None) -> list[str]:
    """What in checkpoint folder `path` (or only in its file or subfolder `under`) the
    metadata.json entries `files` do not vouch for, each naming the file and the fix: a file
    they do not list (metadata.json aside: no check covers its bytes, and a reader such as
    the tokenizer's would open it), and a link whose target lies outside the folder
    (`models.hf.files.link_outside`, as an HF folder's are refused). Every file a loader
    reads is then listed, and so checked by `file_problem`."""
    listed = {os.path.normpath(f["name"]) for f in files} | {METADATA}
    top = os.path.join(path, under) if under else path
    if not os.path.lexists(top):
        return []
    found = [os.path.relpath(top, path)] if not os.path.isdir(top) or os.path.islink(top) \
        else []
    for d, dirs, names in os.walk(top):  # links to folders are listed, not descended
        found += [os.path.relpath(os.path.join(d, n), path) for n in dirs + names]
    problems, unlisted = [], []
    for rel in sorted(found):
        full = os.path.join(path, rel)
        real = link_outside(path, rel) if os.path.islink(full) else None
        if real is not None:
            problems.append(f"{full} is a link to {real}, outside the checkpoint folder; copy "
                            f"the file into the folder")
        elif rel not in listed and not os.path.isdir(full):
            unlisted.append(full)
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more"
                                           if len(unlisted) > 5 else "")
        problems.append(f"{shown} {'is' if len(unlisted) == 1 else 'are'} not listed in "
                        f"{os.path.join(path, METADATA)} (added after the save: no size or "
                        f"sha256 check covers {'it' if len(unlisted) == 1 else 'them'}); remove "
                        f"{'it' if len(unlisted) == 1 else 'them'}, or {damage_fix(path)}")
    return problems
