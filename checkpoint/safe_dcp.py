"""Reading a `torch.distributed.checkpoint` (DCP) folder as untrusted input.

Checkpoints are shared like weight files, and DCP trusts its files: `FileSystemReader`
unpickles `.metadata` with `pickle.load`, and `DefaultLoadPlanner.load_bytes` unpickles every
non-tensor entry with `torch.load(weights_only=False)`; a crafted file runs whatever it says.
Every reader of the project goes through this module instead:

- `read_dcp_metadata(path, meta)`: `.metadata`'s size and sha256 are compared with
  metadata.json before anything is unpickled; then `_Unpickler` builds it, creating only the
  classes DCP's metadata is made of (`_ALLOWED`: its dataclasses, `torch.Size`, dtypes, the
  layout and memory-format encodings, `pathlib` paths); then every field is checked
  (`_validate`): plain types, chunks inside their tensor and covering it, each chunk's bytes in
  a shard file metadata.json lists, inside that file, apart from every other chunk's and at
  least as long as the chunk's data. So the tensor sizes read from `.metadata` never make the
  loader allocate more than the files hold. Byte (non-tensor) entries are refused: the
  project stores tensors only.
- `Reader`: a `FileSystemReader` whose `read_metadata` returns that checked metadata.
- `LoadPlanner`: a `DefaultLoadPlanner` that refuses byte entries (a second line behind
  `_validate`).
- `load(sd, path, md)`: `dcp.load` through both; a failure is a `CheckpointError`.

Tensor data itself is read by DCP with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import math
import os
import pathlib
import pickle
import warnings
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from parallel_state import collectives

from .files import (DCP_METADATA, METADATA, SHARD, CheckpointError, damage_fix,
                    file_problem)

_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_META, "Metadata"), (_META, "TensorStorageMetadata"), (_META, "TensorProperties"),
    (_META, "ChunkStorageMetadata"), (_META, "MetadataIndex"), (_META, "StorageMeta"),
    (_META, "BytesStorageMetadata"), (_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
} | {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
_PATHS = {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}  # StorageMeta.checkpoint_id


def _path(*parts: Any) -> pathlib.PurePosixPath:
    """A pickled path, built only from a few short strings (joining one memoized string
    many times would otherwise turn a small file into a huge allocation)."""
    if not all(type(p) is str for p in parts) or sum(map(len, parts)) > 4096:
        raise pickle.UnpicklingError("it holds a path that is not a short string")
    return pathlib.PurePosixPath(*parts)


class _Unpickler(pickle._Unpickler):
    """Builds only the classes of `_ALLOWED` (paths through `_path`); any other global is
    refused unresolved. The pure-Python unpickler (`.metadata` is small), so that BUILD can be
    refused on a class: `BUILD` with a class on the stack would set attributes of the class
    itself (its `__getstate__`, `__repr__`, ...) for the whole process."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def load_build(self) -> None:
        if callable(self.stack[-2]):  # a class, or a function such as a path builder
            raise pickle.UnpicklingError("it sets attributes of a class or function, which "
                                         "DCP checkpoint metadata never does")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PATHS:
            return _path
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP checkpoint "
                                         f"metadata never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference")


def read_dcp_metadata(path: str, meta: dict) -> Metadata:
    """DCP's `Metadata` of checkpoint folder `path`, read as untrusted input (module
    docstring); `meta` is its metadata.json. Raises `CheckpointError` naming the file, the
    problem and the fix."""
    file = os.path.join(path, DCP_METADATA)
    entry = next((f for f in meta["files"] if f["name"] == DCP_METADATA), None)
    if entry is None:
        raise CheckpointError(f"{file} is not listed in {os.path.join(path, METADATA)}; the "
                              f"checkpoint is incomplete; {damage_fix(path)}")
    problem = file_problem(path, entry)  # size and sha256 before a byte is unpickled
    if problem:
        raise CheckpointError(problem)
    try:
        with open(file, "rb") as f:
            md = _Unpickler(f).load()
    except Exception as e:  # noqa: BLE001 - whatever a crafted pickle raises is one problem
        raise CheckpointError(f"{file} was refused: {e} (a checkpoint's .metadata is read "
                              f"with an unpickler that only builds DCP's metadata classes); "
                              f"do not load this folder unless you trust its source; "
                              f"{damage_fix(path)}") from None
    try:
        problem = _validate(md, {f["name"]: f["bytes"] for f in meta["files"]})
    except Exception as e:  # noqa: BLE001 - an object of an allowed class, built oddly
        problem = f"its contents are malformed ({type(e).__name__})"
    if problem:
        raise CheckpointError(f"{file}: {problem}; {damage_fix(path)}")
    return md


def _is_int(x: Any) -> bool:
    return type(x) is int and x >= 0


def _is_size(x: Any, ndim: int | None = None) -> bool:
    return type(x) is torch.Size and all(_is_int(v) for v in x) and \
        (ndim is None or len(x) == ndim)


def _validate(md: Any, listed: dict[str, int]) -> str | None:
    """The first thing wrong with unpickled DCP metadata `md` (None: fine); `listed` maps the
    files of metadata.json to their sizes."""
    if type(md) is not Metadata:
        return f"it holds a {type(md).__name__}, not DCP's Metadata"
    if type(md.storage_data) is not dict or type(md.state_dict_metadata) is not dict:
        return "its state_dict_metadata or storage_data is not a dict"
    storage: dict[MetadataIndex, _StorageInfo] = md.storage_data
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str or \
                not (index.offset is None or _is_size(index.offset)):
            return f"a storage key ({type(index).__name__}) is malformed"
        if type(info) is not _StorageInfo or type(info.relative_path) is not str or \
                not _is_int(info.offset) or not _is_int(info.length) or \
                info.transform_descriptors:  # the project never writes stream transforms
            return f"the storage entry of {index.fqn!r} is malformed"
        name = info.relative_path
        if not SHARD.match(name) or name not in listed:
            return (f"tensor {index.fqn!r} is stored in {name!r}, which is not a shard file "
                    f"listed in metadata.json")
        if info.offset + info.length > listed[name]:
            return (f"tensor {index.fqn!r} ends at byte {info.offset + info.length} of {name}, "
                    f"which has {listed[name]} bytes (truncated)")
    ranges = sorted((i.relative_path, i.offset, i.offset + i.length) for i in storage.values())
    for (file_a, _, end), (file_b, start, _) in zip(ranges, ranges[1:]):
        if file_a == file_b and start < end:  # shared bytes would multiply what is allocated
            return f"two tensors are stored in overlapping bytes of {file_a}"
    for fqn, tmd in md.state_dict_metadata.items():
        if type(fqn) is not str:
            return f"a state dict key ({type(fqn).__name__}) is not a string"
        if type(tmd) is BytesStorageMetadata:
            return (f"entry {fqn!r} is a pickled object, not a tensor (the project stores "
                    f"tensors only; loading it would run code)")
        if type(tmd) is not TensorStorageMetadata or type(tmd.properties) is not \
                TensorProperties or not isinstance(tmd.properties.dtype, torch.dtype) or \
                not _is_size(tmd.size) or type(tmd.chunks) is not list:
            return f"tensor {fqn!r} has malformed metadata"
        covered = 0
        itemsize = tmd.properties.dtype.itemsize
        for chunk in tmd.chunks:
            if type(chunk) is not ChunkStorageMetadata or \
                    not _is_size(chunk.offsets, len(tmd.size)) or \
                    not _is_size(chunk.sizes, len(tmd.size)) or \
                    any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, tmd.size)):
                return f"tensor {fqn!r} has a chunk outside its size {tuple(tmd.size)}"
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                return f"tensor {fqn!r} has a chunk at {tuple(chunk.offsets)} with no storage"
            if info.length < math.prod(chunk.sizes) * itemsize:
                return (f"tensor {fqn!r}: its chunk of shape {tuple(chunk.sizes)} needs "
                        f"{math.prod(chunk.sizes) * itemsize} bytes but is stored in "
                        f"{info.length} bytes of {info.relative_path}")
            covered += math.prod(chunk.sizes)
        if covered != math.prod(tmd.size):
            return (f"the chunks of tensor {fqn!r} hold {covered} elements, its size "
                    f"{tuple(tmd.size)} has {math.prod(tmd.size)}")
        # disjoint boxes whose volumes add up to the tensor's cover it (an overlap would let
        # a gap through: elements the load never writes)
        boxes = [(c.offsets, c.sizes) for c in tmd.chunks]
        for i, (oa, sa) in enumerate(boxes):
            for ob, sb in boxes[i + 1:]:
                if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)):
                    return (f"tensor {fqn!r} has overlapping chunks at {tuple(oa)} and "
                            f"{tuple(ob)} (some of its elements would not be read)")
    if md.planner_data is not None and not (type(md.planner_data) is dict and all(
            type(k) is str and type(v) is tuple and all(type(x) in (str, int) for x in v)
            for k, v in md.planner_data.items())):
        return "its planner_data is malformed"
    sm = md.storage_meta
    if sm is not None and not (type(sm) is StorageMeta and (
            sm.checkpoint_id is None or isinstance(sm.checkpoint_id, (str, pathlib.PurePath)))
            and all(x is None or type(x) is str for x in (sm.save_id, sm.load_id))
            and type(sm.modules) is list and all(type(x) is str for x in sm.modules)):
        return "its storage_meta is malformed"
    if md.version is not None and type(md.version) is not str:
        return "its version is malformed"
    return None


class Reader(dcp.FileSystemReader):
    """`FileSystemReader` over checkpoint folder `path` that hands DCP the metadata
    `read_dcp_metadata` checked (`md`), and never reads a rank-local `.metadata`."""

    def __init__(self, path: str, md: Metadata):
        super().__init__(path)
        self.md = md

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: rank-local DCP metadata is not read")
        if self.md.storage_meta is None:
            self.md.storage_meta = StorageMeta()
        self.md.storage_meta.load_id = self.load_id
        return self.md


class LoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that refuses pickled (non-tensor) entries instead of
    `torch.load(weights_only=False)`-ing them."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"entry {read_item.dest_index.fqn!r} is a pickled object, not a "
                              f"tensor; the project stores tensors only and does not unpickle "
                              f"checkpoint objects")


@contextmanager
def single_process():
    """DCP warns on every no_dist call that it assumes a single process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load(sd: dict, path: str, md: Metadata, *, no_dist: bool = False,
         process_group=None) -> None:
    """`dcp.load(sd)` from checkpoint folder `path` whose checked metadata is `md`
    (`read_dcp_metadata`), through `Reader` and `LoadPlanner`. Collective unless `no_dist`:
    over `process_group`, by default over a gloo group made for this load, or alone in a
    world of one (`collectives.in_transient_group`: DCP's planning gathers in the world
    group's threads would leave libgomp throttled for the rest of the process). Raises
    `CheckpointError` naming the folder for anything DCP raises."""
    if not no_dist and process_group is None:
        return collectives.in_transient_group("checkpoint load", lambda group: load(
            sd, path, md, no_dist=group is None, process_group=group))
    try:
        with single_process():
            dcp.load(sd, storage_reader=Reader(path, md), planner=LoadPlanner(),
                     process_group=process_group, no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - name the checkpoint, the fix
        cause = e
        if isinstance(e, CheckpointException):  # DCP wraps what a rank raised
            first = next(iter(e.failures.values()), None)
            first = first[0] if isinstance(first, tuple) else first
            cause = first if isinstance(first, BaseException) else e
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"reading checkpoint {path} failed ({type(cause).__name__}: "
                              f"{str(cause)[:500]}); check it with tools/checkpoint_info.py "
                              f"{path}, or load another checkpoint") from e
