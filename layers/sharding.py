"""How a full (dense) tensor maps onto this rank's shard, and layout-independent initialization.

Every parameter of a parallel layer carries a few attributes that say how it is sharded:

- `tensor_model_parallel` (bool): split across TP ranks along `partition_dim`;
- `partition_dim` (int) and `num_fused_parts` (int): a fused weight such as SwiGLU's
  [gate; up] is `num_fused_parts` blocks stacked along `partition_dim`, and each block is split
  separately, so a rank holds [gate_r; up_r];
- `sequence_parallel` (bool): replicated, but used on sequence shards, so its gradient is summed
  over TP after backward;
- `init` (str): "normal", "scaled_normal" (std / sqrt(2 * num_layers), GPT-2 / Megatron
  output projections), "zeros", "ones" or "kaiming_uniform" (U(-1/sqrt(in), 1/sqrt(in)) of
  the dense `[out, in]`: torch's nn.Linear default, a LoRA A's init);
- `full_rows` (int, optional): rows of the real tensor before vocab padding (padding rows are 0);
- `init_key` (str, optional): the name that seeds its init (tied copies share one key).
- `expert_parallel` (bool): dim 0 indexes an MoE layer's experts and is split over the
  expert-model-parallel ranks in contiguous blocks (EP rank r holds experts
  `[r E/ep, (r+1) E/ep)`); the other dims are split as above over the expert-tensor-parallel
  ranks (the TP ranks, or none with expert TP 1: `tensor_parallel_size_of`).
- `kv_replicas` (int, optional) and `qkv_layout` `(groups, heads_per_group, head_dim)`: a fused
  QKV weight/bias whose KV heads are replicated over TP (tp = groups * kv_replicas, inference
  only): rank r holds `[q heads of group r // kv_replicas, share r % kv_replicas; k; v]`.

`initialize_parameters(model, seed, ...)` makes, for every parameter, the full tensor from a
generator seeded by (seed, global name) and keeps this rank's shard (`initial_value`).
Parameter names use global layer numbers, so the same seed gives the same full weights at any
TP/PP/VPP/DP/EP. ZeRO-3 builds the model inside `parameters_on_meta()` (no storage) and makes
each parameter's values with `initial_value` one sharding unit at a time
(data_parallel/fsdp.py), as FSDP2's meta-device init and DeepSpeed's `zero.Init` do: no rank
ever holds the whole model, and the weights are those of the dense build.
"""
from __future__ import annotations

import contextlib
import math
import zlib

import torch
from torch import nn

from .quant import QuantizedWeight
from parallel_state import (
    get_expert_model_parallel_rank,
    get_expert_model_parallel_world_size,
    get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def set_tensor_parallel_attributes(param: nn.Parameter, *, partition_dim: int | None,
                                   init: str, num_fused_parts: int = 1,
                                   sequence_parallel: bool = False,
                                   full_rows: int | None = None) -> nn.Parameter:
    """Tag `param` with how it is sharded and initialized (see the module docstring)."""
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = partition_dim
    param.num_fused_parts = num_fused_parts
    param.sequence_parallel = sequence_parallel
    param.init = init
    param.full_rows = full_rows
    return param


def is_embedding_copy(name: str, param: torch.Tensor) -> bool:
    """Whether parameter `name` is a later pipeline stage's copy of the word embedding (the
    tied output layer's, multi-token prediction's `mtp.word_embeddings`): equal to the
    embedding, so never stored or gathered on its own."""
    return getattr(param, "shared_embedding", False) and \
        name.startswith(("output_layer", "mtp.word_embeddings"))


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`[(name, buffer)]` of the persistent buffers of `model` (model state saved beside the
    parameters, e.g. the MoE router's `expert_bias`; non-persistent counters are not)."""
    out = []
    for prefix, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, b))
    return out


def tensor_parallel_size_of(param: torch.Tensor) -> int:
    """The number of ranks `param`'s `partition_dim` is split over: the expert-tensor-parallel
    size for a routed expert's weight (`expert_parallel`), the TP size otherwise."""
    if getattr(param, "expert_parallel", False):
        return get_expert_tensor_parallel_world_size()
    return get_tensor_model_parallel_world_size()


def tensor_parallel_rank_of(param: torch.Tensor) -> int:
    """This rank's place among the `tensor_parallel_size_of(param)` ranks."""
    if getattr(param, "expert_parallel", False):
        return get_expert_tensor_parallel_rank()
    return get_tensor_model_parallel_rank()


def full_shape(param: torch.Tensor, tp: int | None = None) -> tuple[int, ...]:
    """Shape of the dense tensor this shard belongs to (padded vocab included)."""
    tp = tp or tensor_parallel_size_of(param)
    shape = list(param.shape)
    if getattr(param, "kv_replicas", 1) > 1:
        groups, per_group, d = param.qkv_layout
        shape[0] = groups * (per_group + 2) * d
    elif getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    if getattr(param, "expert_parallel", False):
        shape[0] *= get_expert_model_parallel_world_size()
    return tuple(shape)


def shard_tensor(full: torch.Tensor, param: torch.Tensor, rank: int | None = None,
                 size: int | None = None) -> torch.Tensor:
    """This rank's shard of the dense tensor `full`, following `param`'s attributes (`rank`,
    `size`: TP's, or expert TP's for an expert weight; an expert-parallel tensor's EP block
    is this rank's). `full` may be a low-bit weight `[out, in]` (layers/quant
    `QuantizedWeight`, one expert's for an expert weight): `_shard_quantized`."""
    if isinstance(full, QuantizedWeight):
        return _shard_quantized(full, param, rank, size)
    if getattr(param, "expert_parallel", False):
        ep = get_expert_model_parallel_world_size()
        full = full.chunk(ep, dim=0)[get_expert_model_parallel_rank()] if ep > 1 else full
    size = size or tensor_parallel_size_of(param)
    rank = tensor_parallel_rank_of(param) if rank is None else rank
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    if getattr(param, "kv_replicas", 1) > 1:
        groups, per_group, d = param.qkv_layout
        blocks = full.reshape(groups, per_group + 2, d, *full.shape[1:])[rank // param.kv_replicas]
        q = blocks[:per_group].chunk(param.kv_replicas)[rank % param.kv_replicas]
        return torch.cat([q, blocks[per_group:]]).flatten(0, 1)
    dim, parts = param.partition_dim, getattr(param, "num_fused_parts", 1)
    blocks = full.chunk(parts, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim)


def _shard_quantized(full: QuantizedWeight, param, rank: int | None, size: int | None
                     ) -> QuantizedWeight:
    """`shard_tensor` of a low-bit weight: the output rows this rank holds (a fused QKV's
    with its GQA layout and replicated KV heads, a fused [gate; up]'s parts: whatever
    `shard_tensor` keeps of a row index, `index_select_rows`), or its block of input columns
    (`narrow`; ValueError when that would cut a quantization block). An expert weight's
    `partition_dim` counts the stacked experts' dim: one expert's weight is split on
    `partition_dim - 1`."""
    size = size or tensor_parallel_size_of(param)
    rank = tensor_parallel_rank_of(param) if rank is None else rank
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim = param.partition_dim - (1 if getattr(param, "expert_parallel", False) else 0)
    if dim == 0:
        rows = torch.arange(full.shape[0])
        if getattr(param, "expert_parallel", False):
            rows = rows[None]  # one expert of the stack; its EP block is the caller's
            rows = shard_tensor(rows, _OneExpert(param), rank, size)[0]
        else:
            rows = shard_tensor(rows, param, rank, size)
        return full.index_select_rows(rows)
    if getattr(param, "num_fused_parts", 1) != 1:
        raise ValueError("a fused weight split on its input dim has no low-bit form")
    per = full.shape[1] // size
    return full.narrow(1, rank * per, per)


class _OneExpert:
    """The TP attributes of an expert weight without its expert-parallel tag, for one
    expert's `[1, out, ...]` row index."""

    def __init__(self, p):
        self.tensor_model_parallel = True
        self.partition_dim = p.partition_dim
        self.num_fused_parts = getattr(p, "num_fused_parts", 1)


def unshard_tensors(shards: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """Inverse of `shard_tensor` over TP: the dense tensor from the shards of ranks 0..tp-1
    (an expert-parallel tensor's EP blocks are then concatenated along dim 0)."""
    if not getattr(param, "tensor_model_parallel", False) or len(shards) == 1:
        return shards[0]
    if getattr(param, "kv_replicas", 1) > 1:
        groups, per_group, d = param.qkv_layout
        rep, local_q = param.kv_replicas, per_group // param.kv_replicas
        pieces = [s.reshape(local_q + 2, d, *s.shape[1:]) for s in shards]
        dense = [torch.cat([p[:local_q] for p in pieces[g * rep:(g + 1) * rep]] +
                           [pieces[g * rep][local_q:]]) for g in range(groups)]
        return torch.cat(dense).flatten(0, 1)
    dim, parts = param.partition_dim, getattr(param, "num_fused_parts", 1)
    per_rank = [s.chunk(parts, dim=dim) for s in shards]
    return torch.cat([torch.cat([r[p] for r in per_rank], dim=dim) for p in range(parts)], dim=dim)


def _seed_for(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


def make_full_tensor(param: torch.Tensor, key: str, seed: int, std: float,
                     num_layers: int) -> torch.Tensor:
    """The dense float32 tensor for parameter `key`, identical for any parallel layout."""
    shape = full_shape(param)
    kind = getattr(param, "init", "normal")
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "kaiming_uniform":  # torch's nn.Linear default, a = sqrt(5): U(+-1/sqrt(in))
        bound = 1.0 / math.sqrt(shape[-1])
        gen = torch.Generator().manual_seed(_seed_for(seed, key))
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    if kind not in ("normal", "scaled_normal"):
        raise ValueError(f"unknown init {kind!r} for parameter {key}")
    if kind == "scaled_normal":
        std = std / math.sqrt(2.0 * num_layers)
    rows = getattr(param, "full_rows", None) or shape[0]
    gen = torch.Generator().manual_seed(_seed_for(seed, key))
    full = torch.zeros(shape)
    full[:rows].normal_(0.0, std, generator=gen)
    return full


def initial_value(name: str, param: torch.Tensor, seed: int, std: float,
                  num_layers: int) -> torch.Tensor:
    """This rank's shard of parameter `name`'s seeded full tensor (its `init_key` when it has
    one), shaped and typed as `param` (which may be on the meta device); on the CPU."""
    key = getattr(param, "init_key", None) or name
    full = make_full_tensor(param, key, seed, std, num_layers)
    return shard_tensor(full, param).to(param.dtype)


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Fill every parameter with its shard of the seeded full tensor (layout-independent)."""
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, param, seed, std, num_layers))


@contextlib.contextmanager
def parameters_on_meta():
    """Inside, every parameter a module registers is replaced by a meta-device one of the same
    shape, dtype, `requires_grad` and attributes (no storage); buffers stay real. Tied weights
    stay tied (a registered meta parameter is kept as is). For ZeRO-3, which materializes
    them unit by unit (data_parallel/fsdp.py `ParameterUnits.build`)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
