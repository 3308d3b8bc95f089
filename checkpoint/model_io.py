"""Model weights in the native checkpoint format, without a trainer.

- `write_weights_checkpoint(out, config, tensors, ...)`: a complete checkpoint folder (DCP
  shards, config.yaml, metadata.json with checksums, optional tokenizer) from dense tensors
  given as zero-argument functions, written by one process. DCP asks for each tensor only
  when it writes it, so peak memory is about one tensor (streaming conversion).
- `read_dense_weights(path)`: `(config, {name: function})` reading each dense float32
  tensor of a checkpoint (any saving layout, with or without optimizer state) on demand,
  vocab padding trimmed, fused parts joined; an MoE layer's experts one tensor each.
- `load_model_weights(path, chunks)`: load a checkpoint's weights into this rank's sharded
  model chunks at any tp/pp/vpp/ep (collective over the world, like `dcp.load`).

Both readers (and training's `load_checkpoint`) treat the folder as untrusted input: before
any tensor is read, `verify_checkpoint` checks every file's size and sha256 (split over the
ranks), reads `.metadata` through `safe_dcp` and compares the stored tensors with the model
(`model_tensors`: what the ranks' chunks read; `keys.dense_tensors` in one process); tensors
are then read through `safe_dcp.load`.
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from models.config import ModelConfig
from models.hf.generation import GENERATION_CONFIG, generation_config, write_generation_config
from parallel_state import collectives

from . import safe_dcp
from .files import (CONFIG, FORMAT_VERSION, METADATA, CheckpointError, file_problem,
                    unlisted_problems)
from .format import describe_files, read_metadata, verify_files
from .keys import (buffer_entries, dense_logical_tensors, dense_tensors, entries,
                   expected_tensors, load_buffers, part_keys, piece_dim, read_plan, rebuild)

TOKENIZER_DIR = "tokenizer"  # an HF tokenizer folder inside a checkpoint
TOKENIZER_MODEL = "tokenizer.model"  # or a SentencePiece model file


class _LazySavePlanner(DefaultSavePlanner):
    """Resolves each write item by calling its tensor's function just before writing."""

    def __init__(self, lazy: dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self.lazy = lazy

    def resolve_data(self, write_item):
        fn = self.lazy.get(write_item.index.fqn)
        return super().resolve_data(write_item) if fn is None else fn()


def _checked(name: str, fn: Callable[[], torch.Tensor], shape: tuple) -> Callable:
    def run():
        t = fn()
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)}, the model config "
                                  f"needs {shape}; the weights do not match the config")
        return t.detach().to(torch.float32).contiguous()
    return run


def _lazy_state_dict(config: ModelConfig, tensors: dict[str, Callable[[], torch.Tensor]]
                     ) -> tuple[dict, dict[str, Callable[[], torch.Tensor]]]:
    """`(state dict, {key: function})` to save `config`'s dense weights lazily: float32 meta
    tensors under the checkpoint's keys (`model.<name>`, or `model.<name>.part<i>` for a
    fused parameter split along its partition dim; `name` as `keys.dense_logical_tensors`),
    each key's function returning the shape-checked tensor, plus the zero training counters.
    Vocab tensors are stored unpadded (`full_rows` rows); every layout re-pads on load.

    Raises `CheckpointError` if `tensors` lacks a tensor of the model."""
    logical = dense_logical_tensors(config)
    missing = sorted(set(logical) - set(tensors))
    if missing:
        raise CheckpointError(f"no weights for tensor(s) {missing[:3]} of this model")
    sd, lazy = {}, {}
    for name, (p, j) in logical.items():
        shape = list(p.shape if j is None else p.shape[1:])
        if getattr(p, "full_rows", None):
            shape[0] = p.full_rows  # stored unpadded; every layout re-pads on load
        add_lazy_tensor(sd, lazy, name, p, tuple(shape), tensors[name])
    sd.update(ZERO_COUNTERS)
    return sd, lazy


def add_lazy_tensor(sd: dict, lazy: dict, name: str, p, shape: tuple,
                    fn: Callable[[], torch.Tensor]) -> None:
    """Put dense tensor `name` (of parameter `p`, dense `shape`, produced by `fn`) into the
    state dict `sd` as float32 meta tensors under its checkpoint keys (`.part<i>` pieces of a
    fused weight), each key's function in `lazy` returning its shape-checked piece."""
    fn = _checked(name, fn, shape)
    keys = part_keys("model", name, p)
    n, d = len(keys), piece_dim(p)
    part = list(shape)
    if n > 1:
        part[d] //= n
    for i, key in enumerate(keys):
        sd[key] = torch.empty(part, dtype=torch.float32, device="meta")
        lazy[key] = fn if n == 1 else \
            (lambda fn=fn, i=i, n=n, d=d: fn().chunk(n, d)[i].contiguous())


# the training counters of a checkpoint written outside training (iteration 0)
ZERO_COUNTERS = {"iteration": torch.tensor(0), "consumed_samples": torch.tensor(0),
                 "optim.step": torch.tensor(0)}


def _save_lazily(sd: dict, lazy: dict[str, Callable[[], torch.Tensor]], folder: str) -> None:
    """`dcp.save` of `sd` into `folder` by one process, each tensor produced by its `lazy`
    function just before it is written. Re-raises what a tensor function raised (DCP wraps
    it in a CheckpointException)."""
    try:
        with safe_dcp.single_process():
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(folder),
                     planner=_LazySavePlanner(lazy), no_dist=True)
    except CheckpointException as e:  # DCP wraps what the tensor functions raised
        cause = next(iter(e.failures.values()), None)
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback)
        raise (cause if isinstance(cause, BaseException) else e) from None


def _write_model_files(folder: str, config: ModelConfig,
                       tokenizer: Callable[[str], None] | None,
                       generation_config: dict | None, run_flags: dict | None = None) -> None:
    """Write config.yaml (the model's flags, then `run_flags`), the tokenizer and
    generation_config.json (when given) into checkpoint folder `folder`."""
    model_flags = {k: v for k, v in config.to_dict().items() if k not in ("name", "extra")}
    with open(os.path.join(folder, CONFIG), "w") as f:
        f.write("# model of this checkpoint (usable as --config; every key is a --flag)\n")
        f.write(yaml.safe_dump(model_flags, sort_keys=False))
        if run_flags:
            f.write(yaml.safe_dump(run_flags, sort_keys=False))
    if tokenizer is not None:
        tokenizer(os.path.join(folder, TOKENIZER_DIR))
    if generation_config:
        write_generation_config(folder, generation_config)


def _write_metadata(folder: str, config: ModelConfig, source: dict | None,
                    extra: dict | None = None, tensors=dense_tensors) -> None:
    """Write metadata.json for the files now in `folder` (a one-process, tp = pp = dp = 1
    layout at iteration 0, with every file's size and sha256, plus the fields of `extra`),
    then verify the folder against it (`tensors(config)`: the stored tensors the model
    reads). Raises `CheckpointError` listing every problem found."""
    names = [os.path.relpath(os.path.join(d, f), folder)
             for d, _, fs in os.walk(folder) for f in fs]
    meta = {"format_version": FORMAT_VERSION, "iteration": 0, "consumed_samples": 0,
            "layout": {"tp": 1, "pp": 1, "vpp": None, "dp": 1, "world_size": 1,
                       "distributed_optimizer": False, "bf16": False},
            "model": config.to_dict(), "torch_version": torch.__version__,
            "optimizer_state": False, "source": source or {},
            "files": describe_files(folder, names), **(extra or {})}
    with open(os.path.join(folder, METADATA), "w") as f:
        json.dump(meta, f, indent=1)
    problems = verify_files(folder, meta, tensors=tensors)
    if problems:
        raise CheckpointError("the written checkpoint failed verification: " +
                              "; ".join(problems))


def write_weights_checkpoint(out: str, config: ModelConfig,
                             tensors: dict[str, Callable[[], torch.Tensor]], *,
                             tokenizer: Callable[[str], None] | None = None,
                             generation_config: dict | None = None,
                             source: dict | None = None) -> str:
    """Write checkpoint folder `out` holding `config`'s weights and return its path.

    `tensors` maps every dense tensor name (`keys.dense_logical_tensors`: tp = 1, global
    layer numbers; vocab tensors unpadded, `[vocab_size, h]`; an MoE layer's experts one name
    each, `...experts.<e>.linear_fc1.weight` `[fc1_out, h]`; persistent buffers such as the
    router's `expert_bias`) to a function returning it. `tokenizer(folder)`, if given,
    saves the tokenizer into `folder`; a non-empty `generation_config` (checked fields,
    models/hf/generation.py) is stored as generation_config.json. The folder is built as
    `out.tmp-*` and renamed when complete; an existing `out` is never touched.

    Raises `CheckpointError` if `out` exists, a parameter is missing or has the wrong shape.
    """
    if os.path.exists(out):
        raise CheckpointError(f"{out} already exists; pass a new --out folder (nothing was "
                              f"written, and nothing there was changed)")
    sd, lazy = _lazy_state_dict(config, tensors)
    return write_checkpoint_folder(out, config, sd, lazy, tokenizer=tokenizer,
                                   generation_config=generation_config, source=source)


def write_checkpoint_folder(out: str, config: ModelConfig, sd: dict,
                            lazy: dict[str, Callable[[], torch.Tensor]], *,
                            tokenizer: Callable[[str], None] | None = None,
                            generation_config: dict | None = None, source: dict | None = None,
                            extra: dict | None = None, run_flags: dict | None = None,
                            tensors=dense_tensors) -> str:
    """Write checkpoint folder `out` from DCP state dict `sd` (meta tensors resolved by
    `lazy`, plus `ZERO_COUNTERS`), config.yaml (+ `run_flags`), the tokenizer, the
    generation config and metadata.json (+ `extra`), verified against `tensors(config)`.
    Built as `out.tmp-*` and renamed when complete; removed on any failure. Raises
    `CheckpointError` if `out` exists or the written folder fails verification."""
    if os.path.exists(out):
        raise CheckpointError(f"{out} already exists; pass a new --out folder (nothing was "
                              f"written, and nothing there was changed)")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{os.path.abspath(out)}.tmp-{secrets.token_hex(4)}"
    os.makedirs(tmp)
    try:
        _save_lazily(sd, lazy, tmp)
        _write_model_files(tmp, config, tokenizer, generation_config, run_flags)
        _write_metadata(tmp, config, source, extra, tensors)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def verify_checkpoint(path: str, meta: dict, tensors=None, group=None) -> None:
    """Check checkpoint folder `path` against its metadata.json `meta` before any tensor is
    read (`format.verify_files`: sizes, sha256, `.metadata` as untrusted input, with
    `tensors` the stored tensors against the model), its files split over the ranks of the
    world when there is one (then collective, gathered over `group`, a group of the whole
    world; None: the world group). Raises the same `CheckpointError` on every rank, listing
    every problem with its file."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = verify_files(path, meta, rank=rank, world=world, tensors=tensors)
    if world > 1:
        everyone = [None] * world
        collectives.all_gather_object(everyone, problems, group=group)
        problems = [p for part in everyone for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))


def model_tensors(chunks, part: str = "saved", group=None) -> dict:
    """`keys.expected_tensors` of the model whose chunks the ranks of the world hold (each
    rank passes its own; gathered over `group`, a group of the whole world, None: the world
    group; so collective when there is a process group)."""
    mine = expected_tensors(chunks, part)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone = [None] * dist.get_world_size()
    collectives.all_gather_object(everyone, mine, group=group)
    return {k: v for part in everyone for k, v in part.items()}


def open_checkpoint(path: str, tensors, group=None) -> tuple[dict, "safe_dcp.Metadata"]:
    """`(metadata.json, checked DCP metadata)` of checkpoint folder `path`, verified first
    (`verify_checkpoint` with `tensors` and `group`; collective when there is a process
    group). Raises `CheckpointError`."""
    meta = read_metadata(path)
    verify_checkpoint(path, meta, tensors, group)
    return meta, safe_dcp.read_dcp_metadata(path, meta)


def read_dense_weights(path: str) -> tuple[ModelConfig, dict[str, Callable[[], torch.Tensor]]]:
    """`(model config, {name: function -> dense float32 tensor})` of checkpoint folder `path`
    (one process, no process group), verified first (`open_checkpoint`). The names are
    `keys.dense_logical_tensors`': a parameter's, one per expert of an MoE layer
    (`...experts.<e>.linear_fc1.weight` `[fc1_out, h]`), a persistent buffer's. Vocab
    padding rows are cut off and fused parts joined, so the tensors are the same whatever
    layout saved them. Raises `CheckpointError`."""
    meta, md = open_checkpoint(path, dense_tensors)
    config = ModelConfig.from_dict(meta["model"])
    saved = md.state_dict_metadata
    out = {}
    for name, (p, _) in dense_logical_tensors(config).items():
        keys = part_keys("model", name, p)
        absent = [k for k in keys if k not in saved]
        if absent:
            raise CheckpointError(f"{path}: the checkpoint has no tensor {absent[0]!r}; it is "
                                  f"damaged or not a checkpoint of the model in metadata.json")

        out[name] = functools.partial(read_dense_tensor, path, md, keys, p)
    return config, out


def read_dense_tensor(path: str, md, keys: list[str], p) -> torch.Tensor:
    """The dense float32 tensor of parameter `p` (its fused parts joined, vocab padding cut)
    stored under DCP `keys` (`keys.part_keys`) in checkpoint `path` whose checked DCP
    metadata is `md`; one process."""
    saved = md.state_dict_metadata
    sd = {k: torch.empty(saved[k].size, dtype=torch.float32) for k in keys}
    with safe_dcp.single_process():
        safe_dcp.load(sd, path, md, no_dist=True)
    t = sd[keys[0]] if len(keys) == 1 else torch.cat([sd[k] for k in keys], piece_dim(p))
    rows = getattr(p, "full_rows", None)
    return t[:rows].contiguous() if rows else t


@torch.no_grad()
def load_model_weights(path: str, chunks, part: str = "saved") -> dict:
    """Load checkpoint folder `path`'s weights (and persistent buffers) into this rank's
    model `chunks` (any tp/pp/ep layout; `part` "base": a LoRA model's frozen base, from its
    base checkpoint; keys.entries), verified first (`open_checkpoint`); returns its
    metadata. Collective: every rank of the world calls it (the verification's gather,
    DCP's load), over a group made for it (`collectives.in_transient_group`: the world
    group's worker threads would keep OpenMP teams of their copies, and the model's every
    parallel region would then wait the short way)."""
    meta, items, sd, plan = collectives.in_transient_group(
        "checkpoint load", lambda group: _read_weights(path, chunks, part, group))
    values = rebuild(sd, plan)
    for _, p, _, _ in items:
        p.copy_(values[id(p)]["model"].to(p.device, p.dtype))
    load_buffers(values, chunks)
    return meta


def _read_weights(path: str, chunks, part: str, group) -> tuple:
    """`load_model_weights`' collective part over `group` (None: alone): `(metadata, the
    parameters' entries, the loaded state dict, its plan)`."""
    expected = model_tensors(chunks, part, group)
    meta, md = open_checkpoint(path, lambda config: expected, group)
    items = entries(chunks, part)
    sd, plan = read_plan(path, md.state_dict_metadata, items, ("model",), buffer_entries(chunks))
    safe_dcp.load(sd, path, md, no_dist=group is None, process_group=group)
    return meta, items, sd, plan


def find_tokenizer(path: str) -> str | None:
    """The tokenizer stored inside checkpoint folder `path` (HF folder or SentencePiece
    model), or None."""
    for name in (TOKENIZER_DIR, TOKENIZER_MODEL):
        if os.path.exists(os.path.join(path, name)):
            return os.path.join(path, name)
    return None


def verify_stored_tokenizer(tokenizer: str | None) -> None:
    """When `tokenizer` is the one stored in a checkpoint folder (`find_tokenizer`), check its
    files' sizes and sha256 against the folder's metadata.json before anything parses them
    (a checkpoint is untrusted input). Raises `CheckpointError` naming the file."""
    if not tokenizer:
        return
    folder, name = os.path.split(os.path.normpath(tokenizer))
    if name in (TOKENIZER_DIR, TOKENIZER_MODEL):
        _verify_stored(folder, name)


def _verify_stored(folder: str, name: str) -> None:
    """Check file or subfolder `name` of checkpoint folder `folder` against its metadata.json
    (every file listed, at its size and sha256), when the folder has one (a checkpoint)."""
    if not os.path.isfile(os.path.join(folder, METADATA)):
        return
    files = read_metadata(folder, check=False)["files"]
    unlisted = unlisted_problems(folder, files, under=name)
    if unlisted:
        raise CheckpointError(unlisted[0])
    for entry in (f for f in files if f["name"] == name or f["name"].startswith(name + "/")):
        problem = file_problem(folder, entry)
        if problem:
            raise CheckpointError(problem)


def stored_generation_config(path: str, vocab_size: int) -> dict:
    """The generation config stored in checkpoint folder `path` (`import_hf` writes it), its
    size and sha256 checked against metadata.json first, then its fields
    (models/hf/generation.py); `{}` when there is none (train.py's checkpoints). Raises
    `CheckpointError` / `HFConversionError` naming the file."""
    if not os.path.exists(os.path.join(path, GENERATION_CONFIG)):
        return {}
    _verify_stored(path, GENERATION_CONFIG)
    return generation_config(path, vocab_size)


def read_tokenizer(tokenizer: str | None) -> dict[str, bytes]:
    """The files of a tokenizer (an HF folder, or a SentencePiece model file) as they go into
    a checkpoint folder: `{relative path: bytes}` (`tokenizer/...` or `tokenizer.model`);
    empty when None. Read once at start-up, so that a tokenizer that came from a checkpoint
    `--keep-last` later deletes is still written into every new checkpoint."""
    if not tokenizer:
        return {}
    if not os.path.isdir(tokenizer):
        with open(tokenizer, "rb") as f:
            return {TOKENIZER_MODEL: f.read()}
    files = {}
    for d, _, names in os.walk(tokenizer):
        for name in names:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                files[os.path.join(TOKENIZER_DIR, os.path.relpath(path, tokenizer))] = f.read()
    return files


def write_tokenizer(files: dict[str, bytes], folder: str) -> None:
    """Write `read_tokenizer`'s files into checkpoint folder `folder`."""
    for rel, data in files.items():
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

