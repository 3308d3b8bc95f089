"""Layout-free checkpoint keys: how a sharded parameter maps to the tensors DCP stores.

- `model.<name>` is the float32 value of parameter `<name>` (global layer numbers), a DTensor
  on the TP sub-mesh with `Shard(partition_dim)` when TP-sharded, else a plain tensor.
- A fused weight (`num_fused_parts > 1`, SwiGLU's `[gate; up]`) is stored as `.part0`,
  `.part1`: each part is a clean `Shard(0)` of its own dense tensor.
- Vocab-padded tensors (`full_rows`) may be stored at any padded size >= the real vocabulary
  (the saving layout's, or unpadded); a reader at another padded size reads the dense tensor
  and re-pads it (`read_plan` / `rebuild`).
- The tied embedding's last-stage copy (`output_layer.weight` tagged `shared_embedding`) is
  never stored; it reads `embedding.word_embeddings.weight`.

Training (`training/checkpointing.py`), inference and `tools/` all go through these helpers,
so there is one definition of the format; `expected_tensors` / `tensor_problems` compare a
checkpoint's stored tensors with the model metadata.json describes (missing or extra layers,
shapes) before anything is read.
"""
from __future__ import annotations

import os
import re

import torch
from torch.distributed.tensor import DTensor, Shard

import parallel_state as ps
from layers import shard_tensor
from layers.sharding import full_shape
from models import model_class

from .files import CONFIG, CheckpointError

EMBEDDING = "embedding.word_embeddings.weight"
OPTIMIZER_KINDS = ("optim.exp_avg", "optim.exp_avg_sq")


def _dense_model(config):
    """`config`'s whole model on the meta device, at the current grid's tp (1 without one)."""
    with torch.device("meta"):
        return model_class(config)(config)


def dense_parameters(config) -> dict[str, torch.nn.Parameter]:
    """`{name: meta-device parameter}` of the whole model at tp = 1 (shapes with the padded
    vocab, and the sharding attributes: `num_fused_parts`, `full_rows`). Without a grid."""
    return dict(_dense_model(config).named_parameters())


def dense_tensors(config) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """`expected_tensors` of `config`'s whole model (one process without a grid: tools)."""
    return expected_tensors(entries([_dense_model(config)]))


def expected_tensors(items) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """`{model.* DCP key: (dense shape, real vocab rows or None)}` that the parameters `items`
    (`entries(chunks)`) read; a tied copy reads the embedding's key, left to its owner."""
    out = {}
    for _, p, key_name, tied_copy in items:
        if not tied_copy:
            for key, _, want in _parts(p, "model", key_name, "meta"):
                out[key] = (tuple(want), getattr(p, "full_rows", None))
    return out


def _parts(p, kind: str, key_name: str, device: str) -> list[tuple[str, torch.Tensor, torch.Size]]:
    """`[(DCP key, empty TP-local part, dense shape)]` of parameter `p`'s stored tensors."""
    locals_ = split_parts(torch.empty_like(p, dtype=torch.float32, device=device), p)
    return [(key, local, global_shape(local, p))
            for key, local in zip(part_keys(kind, key_name, p), locals_)]


def _fits(have: tuple, want: tuple, rows: int | None) -> bool:
    """A stored shape `have` serves `want`: equal, or a vocab tensor (`rows` real rows) padded
    to any size >= them."""
    return tuple(have) == tuple(want) or bool(rows) and len(have) == len(want) and \
        tuple(have[1:]) == tuple(want[1:]) and have[0] >= rows


def tensor_problems(expected: dict, stored: dict[str, tuple[int, ...]]) -> list[str]:
    """How a checkpoint's tensors (`stored`: DCP key -> shape) differ from the `model.*`
    tensors a model reads (`expected`, see `expected_tensors`): keys missing or extra (a
    layer count that is not the checkpoint's), shapes, and optimizer moments that are not one
    per stored model tensor. Empty when they match."""
    model = {k: v for k, v in stored.items() if k.startswith("model.")}
    problems = [f"{len(keys)} {what} tensor(s) ({_few(keys)})" for what, keys in (
        ("missing", sorted(set(expected) - set(model))),
        ("extra", sorted(set(model) - set(expected)))) if keys]
    problems += [f"{key} has shape {model[key]}, the model's is {shape}"
                 for key, (shape, rows) in expected.items()
                 if key in model and not _fits(model[key], shape, rows)]
    for kind in OPTIMIZER_KINDS:
        moments = {"model" + k[len(kind):]: v for k, v in stored.items()
                   if k.startswith(kind + ".")}
        if moments and moments != model:
            problems.append(f"the {kind} tensors are not one per model tensor of the same shape")
    return problems


def _few(keys: list[str], n: int = 3) -> str:
    """The first `n` of `keys` and the layer numbers they all span."""
    layers = sorted({int(m.group(1)) for k in keys if (m := re.search(r"\.layers\.(\d+)\.", k))})
    return ((f"layers {', '.join(map(str, layers))}: " if layers else "") + ", ".join(keys[:n])
            + (f", ... (+{len(keys) - n} more)" if len(keys) > n else ""))


def entries(chunks) -> list[tuple[str, torch.nn.Parameter, str, bool]]:
    """`[(name, param, key_name, tied_copy)]` of this rank's chunks; the tied embedding's
    last-stage copy maps to the embedding's key (read from it, never saved)."""
    out = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            tied_copy = getattr(p, "shared_embedding", False) and name.startswith("output_layer")
            out.append((name, p, EMBEDDING if tied_copy else name, tied_copy))
    return out


def num_parts(param) -> int:
    """Fused blocks stored as separate keys (1 unless a TP-sharded fused weight)."""
    if not getattr(param, "tensor_model_parallel", False):
        return 1
    return getattr(param, "num_fused_parts", 1)


def part_keys(kind: str, name: str, param) -> list[str]:
    """The DCP keys of one tensor: `[kind.name]` or `[kind.name.part0, ...]`."""
    n = num_parts(param)
    return [f"{kind}.{name}"] if n == 1 else [f"{kind}.{name}.part{i}" for i in range(n)]


def global_shape(local: torch.Tensor, param) -> torch.Size:
    """Dense shape (padded vocab included) of the tensor whose TP shard is `local`."""
    if getattr(param, "kv_replicas", 1) > 1:  # KV heads replicated over TP (inference)
        return torch.Size(full_shape(param))
    shape = list(local.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= ps.get_tensor_model_parallel_world_size()
    return torch.Size(shape)


def as_saved(local: torch.Tensor, param) -> torch.Tensor:
    """This rank's piece of one logical tensor as DCP sees it (DTensor or plain)."""
    if not getattr(param, "tensor_model_parallel", False) or \
            not ps.model_parallel_is_initialized():  # no grid: one process, dense tensors
        return local
    if getattr(param, "kv_replicas", 1) > 1:
        raise CheckpointError("a model with KV heads replicated over TP (inference layout) "
                              "cannot be saved; save from a tp that divides the KV heads")
    shape = global_shape(local, param)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, ps.get_grid().mesh["tp"], [Shard(param.partition_dim)],
                              run_check=False, shape=shape, stride=stride)


def split_parts(local: torch.Tensor, param) -> list[torch.Tensor]:
    """`local` cut into its stored parts (see `part_keys`)."""
    n = num_parts(param)
    return [local] if n == 1 else [c.contiguous() for c in local.chunk(n, param.partition_dim)]


def read_plan(path: str, saved: dict, items, kinds: tuple[str, ...]):
    """The DCP state dict to load and how to rebuild each value afterwards.

    `items` are `entries(chunks)`; `saved` is the checkpoint's `state_dict_metadata`. Returns
    `(sd, plan)`; after `dcp.load(sd, ...)`, `rebuild(sd, plan)` gives
    `{id(param): {kind: float32 TP-local tensor}}`.

    Raises `CheckpointError` naming the key for a missing tensor or a shape that does not fit.
    """
    sd, plan = {}, []
    for name, p, key_name, _ in items:
        for kind in kinds:
            parts = _parts(p, kind, key_name, "cpu")
            dense = False
            for key, local, want in parts:
                if key not in saved:
                    raise CheckpointError(
                        f"{path}: the checkpoint has no tensor {key!r} (this model's parameter "
                        f"{name}); it was saved from another model or without optimizer state "
                        f"(then pass --no-load-optim); compare {os.path.join(path, CONFIG)} "
                        f"with this run's flags")
                have = torch.Size(saved[key].size)
                if have != want:
                    if not _fits(have, want, getattr(p, "full_rows", None)):
                        raise CheckpointError(
                            f"{path}: tensor {key!r} has shape {tuple(have)}, this model "
                            f"expects {tuple(want)}; the model settings differ from "
                            f"{os.path.join(path, CONFIG)}")
                    dense = True  # vocab padded for another size: read it whole, re-pad
                if getattr(p, "kv_replicas", 1) > 1:
                    dense = True  # replicated KV heads are no Shard(): read whole, then shard
                sd[key] = torch.empty(have) if dense else as_saved(local, p)
            plan.append((p, kind, [key for key, _, _ in parts], dense))
    return sd, plan


def rebuild(sd: dict, plan) -> dict:
    """`{id(param): {kind: float32 TP-local tensor}}` from a loaded `read_plan` state dict."""
    values: dict = {}
    for p, kind, keys, dense in plan:
        pieces = [sd[k].to_local() if isinstance(sd[k], DTensor) else sd[k] for k in keys]
        if dense:
            full = pieces[0]
            rows = getattr(p, "full_rows", None)
            if rows:
                full = torch.zeros(global_shape(p, p), dtype=torch.float32)
                full[:rows] = pieces[0][:rows]
            local = shard_tensor(full, p)
        else:
            local = pieces[0] if len(pieces) == 1 else torch.cat(pieces, p.partition_dim)
        values.setdefault(id(p), {})[kind] = local
    return values
