"""Layout-free checkpoint keys: how a sharded parameter maps to the tensors DCP stores.

- `model.<name>` is the float32 value of parameter `<name>` (global layer numbers), a DTensor
  on the TP sub-mesh with `Shard(partition_dim)` when TP-sharded, else a plain tensor.
- A fused weight (`num_fused_parts > 1`, SwiGLU's `[gate; up]`) is stored as `.part0`,
  `.part1`: each part is a clean `Shard(0)` of its own dense tensor.
- Vocab-padded tensors (`full_rows`) may be stored at any padded size >= the real vocabulary
  (the saving layout's, or unpadded); a reader at another padded size reads the dense tensor
  and re-pads it (`read_plan` / `rebuild`).
- The embedding's last-stage copies (the tied `output_layer.weight`, multi-token
  prediction's `mtp.word_embeddings.weight`) are never stored; they read
  `embedding.word_embeddings.weight`.
- An MoE layer's stacked expert weights (`expert_parallel`: `experts.linear_fc1.weight
  [E_local, fc1_out/tp, h]`, dim 0 this EP rank's contiguous block of experts) are stored one
  key per expert under its global index: `...mlp.experts.<e>.linear_fc1.weight` `[fc1_out, h]`
  (`.part0/.part1` when fused), each TP-sharded like the dense MLP's weight. A reader at
  another expert-parallel size asks for the experts it holds (Megatron's
  `singleton_local_shards` keys; Hugging Face's one tensor per expert).
- Persistent buffers (the router's `expert_bias`, DeepSeek-V3's balancing state) are model
  state: `model.<name>`, plain float32, replicated, without optimizer moments.

Training (`training/checkpointing.py`), inference and `tools/` all go through these functions,
so there is one definition of the format; `expected_tensors` / `tensor_problems` compare a
checkpoint's stored tensors with the model metadata.json describes (missing or extra layers,
shapes) before anything is read.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Shard

import parallel_state as ps
from layers import shard_tensor
from layers.sharding import (full_shape, is_embedding_copy, persistent_buffers,
                             tensor_parallel_size_of)
from models import model_class

from .files import CONFIG, CheckpointError

EMBEDDING = "embedding.word_embeddings.weight"
OPTIMIZER_KINDS = ("optim.exp_avg", "optim.exp_avg_sq")

# Persistent buffers a run may resume without: the FP8 amax histories (layers/fp8.py) of a
# delayed-scaling run resumed from a checkpoint saved without them (bf16/fp32, or another
# recipe) start empty, as a fresh run's; a run without them ignores a checkpoint's.
FRESH_IF_ABSENT = (".fp8.amax_history",)


class Expected(NamedTuple):
    """One stored tensor a model reads: its dense `shape`, the real vocab `rows` of a
    vocab-padded tensor (else None), and whether optimizer `moments` are stored beside it
    (a parameter; False for a buffer)."""

    shape: tuple[int, ...]
    rows: int | None = None
    moments: bool = True


def _dense_model(config):
    """`config`'s whole model on the meta device, at the current grid's tp (1 without one)."""
    with torch.device("meta"):
        return model_class(config)(config)


def dense_tensors(config) -> dict[str, Expected]:
    """`expected_tensors` of `config`'s whole model (one process without a grid: tools)."""
    return expected_tensors([_dense_model(config)])


def dense_logical_tensors(config) -> dict[str, tuple[torch.Tensor, int | None]]:
    """`{tensor name: (meta parameter or buffer, expert index or None)}` of `config`'s whole
    model at tp = 1, without a grid: one name per parameter, per expert of a stacked expert
    weight (`...experts.<e>.linear_fc1.weight`, the tensor `param[e]`) and per persistent
    buffer. The names a weights-only checkpoint is written from and read into
    (checkpoint/model_io.py); the model keys are `model.<name>` (+ `.part<i>`)."""
    model = _dense_model(config)
    out = {}
    for name, p in model.named_parameters():
        for tname, j in logical_names(name, p):
            out[tname] = (p, j)
    for name, b in buffer_entries([model]):
        out[name] = (b, None)
    return out


def expected_tensors(chunks, part: str = "saved") -> dict[str, Expected]:
    """`{model.* DCP key: Expected}` that this rank's model `chunks` read (parameters, one key
    per expert and fused part, and persistent buffers; `part` as in `entries`); a tied copy
    reads the embedding's key, left to its owner."""
    out = {}
    for _, p, key_name, tied_copy in entries(chunks, part):
        if not tied_copy:
            for key, _, want in _parts(p, "model", key_name, "meta"):
                out[key] = Expected(tuple(want), getattr(p, "full_rows", None))
    for name, b in buffer_entries(chunks):
        out[f"model.{name}"] = Expected(tuple(b.shape), None, False)
    return out


def _parts(p, kind: str, key_name: str, device: str) -> list[tuple[str, torch.Tensor, torch.Size]]:
    """`[(DCP key, empty TP-local piece, dense shape)]` of parameter `p`'s stored tensors."""
    local = torch.empty_like(p, dtype=torch.float32, device=device)
    return [(key, piece, global_shape(piece, p))
            for key, piece in stored_pieces(kind, key_name, p, local)]


def _fits(have: tuple, want: tuple, rows: int | None) -> bool:
    """A stored shape `have` serves `want`: equal, or a vocab tensor (`rows` real rows) padded
    to any size >= them."""
    return tuple(have) == tuple(want) or bool(rows) and len(have) == len(want) and \
        tuple(have[1:]) == tuple(want[1:]) and have[0] >= rows


def tensor_problems(expected: dict, stored: dict[str, tuple[int, ...]]) -> list[str]:
    """How a checkpoint's tensors (`stored`: DCP key -> shape) differ from the `model.*`
    tensors a model reads (`expected`, see `expected_tensors`): keys missing or extra (a
    layer count that is not the checkpoint's), shapes, and optimizer moments that are not one
    per stored model parameter tensor (buffers have none). Empty when they match."""
    # FP8 amax histories are a run setting's state (read_plan checks their shapes)
    model = {k: v for k, v in stored.items() if k.startswith("model.")
             and not k.endswith(FRESH_IF_ABSENT)}
    expected = {k: v for k, v in expected.items() if not k.endswith(FRESH_IF_ABSENT)}
    problems = [f"{len(keys)} {what} tensor(s) ({_few(keys)})" for what, keys in (
        ("missing", sorted(set(expected) - set(model))),
        ("extra", sorted(set(model) - set(expected)))) if keys]
    problems += [f"{key} has shape {model[key]}, the model's is {want.shape}"
                 for key, want in expected.items()
                 if key in model and not _fits(model[key], want.shape, want.rows)]
    params = {k: v for k, v in model.items() if k not in expected or expected[k].moments}
    for kind in OPTIMIZER_KINDS:
        moments = {"model" + k[len(kind):]: v for k, v in stored.items()
                   if k.startswith(kind + ".")}
        if moments and moments != params:
            problems.append(f"the {kind} tensors are not one per model tensor of the same shape")
    return problems


def _few(keys: list[str], n: int = 3) -> str:
    """The first `n` of `keys` and the layer (and expert) numbers they all span."""
    spans = []
    for what, pattern in (("layers", r"\.layers\.(\d+)\."), ("experts", r"\.experts\.(\d+)\.")):
        found = sorted({int(m.group(1)) for k in keys if (m := re.search(pattern, k))})
        if found:
            spans.append(f"{what} {', '.join(map(str, found))}")
    return ((", ".join(spans) + ": " if spans else "") + ", ".join(keys[:n])
            + (f", ... (+{len(keys) - n} more)" if len(keys) > n else ""))


def entries(chunks, part: str = "saved") -> list[tuple[str, torch.nn.Parameter, str, bool]]:
    """`[(name, param, key_name, tied_copy)]` of this rank's chunks; the tied embedding's
    last-stage copy maps to the embedding's key (read from it, never saved). `part`: "saved",
    what a checkpoint of the model holds (every parameter; a LoRA model's adapters only,
    layers/lora.py: its frozen base stays in the base's checkpoint), or "base", the frozen
    parameters a LoRA model reads from its base checkpoint (every parameter without
    adapters)."""
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
    lora = any(".lora." in n for n, _ in named)
    out = []
    for name, p in named:
        if lora and (".lora." in name) != (part == "saved"):
            continue
        tied_copy = is_embedding_copy(name, p)
        out.append((name, p, EMBEDDING if tied_copy else name, tied_copy))
    return out


def buffer_entries(chunks) -> list[tuple[str, torch.Tensor]]:
    """`[(name, buffer)]` of the persistent buffers of this rank's chunks (model state saved
    beside the parameters, e.g. the router's `expert_bias`; non-persistent counters are not)."""
    return [entry for chunk in chunks for entry in persistent_buffers(chunk)]


def logical_names(name: str, param) -> list[tuple[str, int | None]]:
    """`[(tensor name, expert index or None)]` that parameter `name` is stored as: itself, or
    for a stacked expert weight (`expert_parallel`) one name per expert it holds, under the
    global expert number (this EP rank's block starts at ep_rank x local experts):
    `a.experts.linear_fc1.weight` -> `a.experts.<e>.linear_fc1.weight`, the tensor `param[j]`."""
    if not getattr(param, "expert_parallel", False):
        return [(name, None)]
    head, sep, tail = name.rpartition(".experts.")
    if not sep:
        raise ValueError(f"expert-parallel parameter {name} has no '.experts.' in its name, "
                         f"so its experts have no checkpoint keys")
    first = ps.get_expert_model_parallel_rank() * param.shape[0]
    return [(f"{head}.experts.{first + j}.{tail}", j) for j in range(param.shape[0])]


def num_parts(param) -> int:
    """Fused blocks stored as separate keys (1 unless a TP-sharded fused weight)."""
    if not getattr(param, "tensor_model_parallel", False):
        return 1
    return getattr(param, "num_fused_parts", 1)


def piece_dim(param) -> int | None:
    """The TP-split dim of one stored tensor of `param` (`partition_dim`, less the expert
    dim of a stacked expert weight); None when not TP-sharded."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return param.partition_dim - (1 if getattr(param, "expert_parallel", False) else 0)


def part_keys(kind: str, name: str, param) -> list[str]:
    """The DCP keys of one logical tensor `name` of `param` (see `logical_names`):
    `[kind.name]` or `[kind.name.part0, ...]`."""
    n = num_parts(param)
    return [f"{kind}.{name}"] if n == 1 else [f"{kind}.{name}.part{i}" for i in range(n)]


def split_parts(local: torch.Tensor, param) -> list[torch.Tensor]:
    """One logical tensor's TP-local `local` cut into its stored parts (see `part_keys`)."""
    n = num_parts(param)
    return [local] if n == 1 else [c.contiguous() for c in local.chunk(n, piece_dim(param))]


def stored_pieces(kind: str, key_name: str, param,
                  local: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """`[(DCP key, TP-local piece)]` of `local` (this rank's value of `param`, or its moment,
    `kind` "model" / "optim.exp_avg" / ...): per logical tensor (`logical_names`), per fused
    part. Pieces are views of `local` where they can be; `join_pieces` is the inverse."""
    out = []
    for tname, j in logical_names(key_name, param):
        t = local if j is None else local[j]
        out += zip(part_keys(kind, tname, param), split_parts(t, param))
    return out


def join_pieces(pieces: list[torch.Tensor], param) -> torch.Tensor:
    """This rank's value of `param` from its `stored_pieces` in order (fused parts joined
    along their TP dim, experts stacked)."""
    n = num_parts(param)
    whole = [pieces[i] if n == 1 else torch.cat(pieces[i:i + n], piece_dim(param))
             for i in range(0, len(pieces), n)]
    return torch.stack(whole) if getattr(param, "expert_parallel", False) else whole[0]


def global_shape(local: torch.Tensor, param) -> torch.Size:
    """Dense shape (padded vocab included) of the stored tensor whose TP shard is the piece
    `local` (see `stored_pieces`)."""
    if getattr(param, "kv_replicas", 1) > 1:  # KV heads replicated over TP (inference)
        return torch.Size(full_shape(param))
    shape = list(local.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[piece_dim(param)] *= tensor_parallel_size_of(param)
    return torch.Size(shape)


def as_saved(local: torch.Tensor, param) -> torch.Tensor:
    """This rank's piece of one stored tensor as DCP sees it (DTensor or plain)."""
    if not getattr(param, "tensor_model_parallel", False) or \
            not ps.model_parallel_is_initialized():  # no grid: one process, dense tensors
        return local
    if tensor_parallel_size_of(param) == 1 < ps.get_tensor_model_parallel_world_size():
        return local  # whole experts spread over the TP ranks (expert TP 1): distinct keys
    if getattr(param, "kv_replicas", 1) > 1:
        raise CheckpointError("a model with KV heads replicated over TP (inference layout) "
                              "cannot be saved; save from a tp that divides the KV heads")
    shape = global_shape(local, param)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, ps.get_grid().mesh["tp"], [Shard(piece_dim(param))],
                              run_check=False, shape=shape, stride=stride)


def read_plan(path: str, saved: dict, items, kinds: tuple[str, ...], buffers=()):
    """The DCP state dict to load and how to rebuild each value afterwards.

    `items` are `entries(chunks)`, `buffers` `buffer_entries(chunks)` (read with the "model"
    kind); `saved` is the checkpoint's `state_dict_metadata`. Returns `(sd, plan)`; after
    `dcp.load(sd, ...)`, `rebuild(sd, plan)` gives `{id(param or buffer): {kind: float32
    TP-local tensor}}` (`load_buffers` copies the buffers' values in).

    Raises `CheckpointError` naming the key for a missing tensor or a shape that does not fit.
    """
    sd, plan = {}, []
    for name, b in buffers if "model" in kinds else ():
        key = f"model.{name}"
        if key not in saved and name.endswith(FRESH_IF_ABSENT):
            continue  # the run starts it fresh (load_buffers leaves it as it is)
        if name.endswith(FRESH_IF_ABSENT) and tuple(saved[key].size) != tuple(b.shape):
            raise CheckpointError(
                f"{path}: the checkpoint's FP8 amax history {key!r} has shape "
                f"{tuple(saved[key].size)}, this run's {tuple(b.shape)}; pass the checkpoint's "
                f"--fp8-amax-history-len {saved[key].size[0]} (see {os.path.join(path, CONFIG)})")
        if key not in saved or tuple(saved[key].size) != tuple(b.shape):
            found = f"shape {tuple(saved[key].size)}" if key in saved else "no such tensor"
            raise CheckpointError(
                f"{path}: the checkpoint's tensor {key!r} (this model's buffer {name}, shape "
                f"{tuple(b.shape)}) has {found}; it was saved from another model; compare "
                f"{os.path.join(path, CONFIG)} with this run's flags")
        sd[key] = torch.empty(tuple(b.shape), dtype=torch.float32)
        plan.append((b, "model", [key], False))
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
    """`{id(param or buffer): {kind: float32 TP-local tensor}}` from a loaded `read_plan`
    state dict."""
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
            local = join_pieces(pieces, p)
        values.setdefault(id(p), {})[kind] = local
    return values


@torch.no_grad()
def load_buffers(values: dict, chunks) -> None:
    """Copy the loaded values (`rebuild`'s, read with `buffer_entries(chunks)`) into the
    persistent buffers of `chunks`, keeping each buffer's dtype and device."""
    for _, b in buffer_entries(chunks):
        if id(b) in values:  # absent: a FRESH_IF_ABSENT buffer the checkpoint lacks
            b.copy_(values[id(b)]["model"])
