"""LoRA adapters on the column- and row-parallel linear layers (Hu et al. 2021, sec. 4.1).

A frozen linear `y = W x` becomes `y = W x + s B A dropout(x)` with `A [r, in]`
(Kaiming-uniform, torch's nn.Linear default, as peft), `B [out, r]` (zeros, so training starts
at the base model) and `s = alpha / r`, or `alpha / sqrt(r)` with rsLoRA (Kalajdzievski 2023,
eq. 4). Only A and B train.

Tensor parallelism (as Megatron-Bridge's ParallelLinearAdapter and peft's tp_layer):

- column-parallel base (`W` split on its output): `B` is split on its output like `W`, `A` is
  whole on every TP rank. `u = A x` `[s, b, r]` is the same on every rank; its gradient is
  summed over TP in backward (`copy_to_tensor_model_parallel_region`, an all-reduce of
  `[s, b, r]`), so `A`'s gradient is whole on every rank (no replicated-gradient all-reduce
  afterwards) and the adapter's input gradient `A^T du` is the whole one too, added beside the
  base's own all-reduced input gradient. Under sequence parallelism `A` multiplies the
  sequence shard and `u` is all-gathered (`[s/tp, b, r]`, not the `[s/tp, b, h]` input);
  backward reduce-scatters `du`, and `A`'s gradient, partial over the shards, is summed over
  TP after backward as a norm weight's (its `sequence_parallel` attribute).
- row-parallel base (`W` split on its input): `A` is split on its input like `W`, `B` is
  whole. `u = sum over TP of A_r x_r` (an all-reduce of `[s, b, r]` in forward), then `B u`
  `[s, b, out]` on every rank (its sequence shard kept under sequence parallelism), so `B`'s
  gradient is whole on every rank.

Fused projections get one adapter per HF module, so the adapters are peft's: the QKV weight
(rows per query group `[q heads; k; v]`, layers/attention.py) gets `q_proj`, `k_proj`,
`v_proj`; SwiGLU's `[gate; up]` fc1 gets `gate_proj`, `up_proj`. Each part's `B` is split
over TP as its rows of the fused weight are (whole query groups; each of gate and up in
contiguous blocks), and its output is interleaved into the fused layout. A part that is not
targeted adds nothing to its rows. Adapted: the self-attention and dense-MLP projections of
every transformer layer; MoE layers (routed and shared experts) and cross-attention keep no
adapters.

Dropout on the adapter's input is keyed (layers/dropout.py `hidden_dropout`,
`feature_dropout`): element
`(position, sample, feature)` of part k of a module keeps the same mask at every layout, a
row-parallel input shard drawing its columns of the whole input's mask.

Parameter names: `<linear>.lora.A.<part>`, `<linear>.lora.B.<part>` (e.g.
`decoder.layers.0.self_attention.linear_qkv.lora.A.q_proj`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import parallel_state as ps
from parallel_state import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)

from .context_parallel import local_positions
from .mlp import GATED
from .dropout import (add_dropout_site, assign_dropout_sites, feature_dropout,
                      hidden_dropout, sub_site)
from .sharding import set_tensor_parallel_attributes

# our module -> the HF modules (peft target names) its adapters stand for, in fused order
MODULE_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
ALL_PARTS = tuple(p for parts in MODULE_PARTS.values() for p in parts)
_HOSTS = {"self_attention": ("linear_qkv", "linear_proj"), "mlp": ("linear_fc1", "linear_fc2")}
# the linears of a transformer layer that take adapters, as their module paths end
ADAPTED_LINEARS = tuple(f"{kind}.{attr}" for kind, attrs in _HOSTS.items() for attr in attrs)


def lora_scale(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """`alpha / r` (Hu et al. 2021, sec. 4.1), or `alpha / sqrt(r)` (rsLoRA)."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


def resolve_targets(targets) -> tuple[str, ...]:
    """The HF part names (`ALL_PARTS` order) that `targets` (a comma-separated string or a
    list of peft's names q_proj ... down_proj, ours linear_qkv ... linear_fc2, or
    "all-linear") selects. ValueError naming the valid names for anything else."""
    names = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [n.strip() for n in names if n.strip()]
    chosen = set()
    for n in names:
        if n == "all-linear":
            chosen.update(ALL_PARTS)
        elif n in MODULE_PARTS:
            chosen.update(MODULE_PARTS[n])
        elif n in ALL_PARTS:
            chosen.add(n)
        else:
            raise ValueError(f"--lora-target-modules: unknown module {n!r}; use all-linear or "
                             f"names from {', '.join(ALL_PARTS + tuple(MODULE_PARTS))}")
    if not chosen:
        raise ValueError("--lora-target-modules names no module; use e.g. all-linear")
    return tuple(p for p in ALL_PARTS if p in chosen)


def _cp_positions(rows: int) -> torch.Tensor | None:
    """Global positions of this context-parallel rank's `rows` tokens (None at cp 1)."""
    cp = ps.get_context_parallel_world_size()
    return local_positions(rows * cp, cp, ps.get_context_parallel_rank()) if cp > 1 else None


class LoRA(nn.Module):
    """The adapters of one parallel linear layer (`host`: a ColumnParallelLinear or
    RowParallelLinear, which calls `forward(x)` on its own input and adds the result to its
    output before its bias).

    `parts`: `(name, rows_per_group)` of each block of a column-parallel output, this rank's
    rows (`groups` groups of `[part 0; part 1; ...]`: a QKV weight's local query groups, 1
    otherwise); a row-parallel layer has one part whose rows are its output size. `targets`:
    the part names that get adapters. Shapes: column `A [r, in]`, `B [groups * rows, r]`
    (this rank's rows); row `A [r, in/tp]`, `B [out, r]`.
    """

    def __init__(self, host: nn.Module, parts: list[tuple[str, int]], groups: int,
                 targets: tuple[str, ...], rank: int, alpha: float, dropout: float = 0.0,
                 use_rslora: bool = False):
        super().__init__()
        if rank < 1:
            raise ValueError(f"--lora-rank must be >= 1 (got {rank})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1) (got {dropout})")
        self.column = not hasattr(host, "input_size_per_partition")
        # a column base under SP: A meets sequence shards, so its gradient is summed over TP
        # after backward as a norm weight's (parallel_state.all_reduce_sequence_parallel_grads)
        self.sp = self.column and host.sequence_parallel
        self.parts, self.groups, self.rank = parts, groups, rank
        self.scale, self.dropout = lora_scale(rank, alpha, use_rslora), dropout
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.in_local = host.input_size if self.column else host.input_size_per_partition
        dtype = host.weight.dtype
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for name, rows in parts:
            if name not in targets:
                continue
            a = nn.Parameter(torch.empty(rank, self.in_local, dtype=dtype))
            b = nn.Parameter(torch.empty(groups * rows, rank, dtype=dtype))
            set_tensor_parallel_attributes(a, partition_dim=None if self.column else 1,
                                           init="kaiming_uniform", sequence_parallel=self.sp)
            set_tensor_parallel_attributes(b, partition_dim=0 if self.column else None,
                                           init="zeros")
            self.A[name], self.B[name] = a, b
        add_dropout_site(self)

    def _input(self, x: torch.Tensor, k: int, positions) -> torch.Tensor:
        """Part k's dropped-out input (keyed masks: a sequence shard's rows, or the row
        layer's columns, of the whole input's mask)."""
        if self.column:
            return hidden_dropout(x, self.dropout, self.training, sub_site(self.dropout_site, k),
                                  self.sp, positions)
        off = self.in_local * ps.get_tensor_model_parallel_rank()
        return feature_dropout(x, self.dropout, self.training, sub_site(self.dropout_site, k),
                               off, self.in_local * self.tp, positions)

    def forward(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """`x`: the host's input (`[s(/tp), b, in]` column, `[s, b, in/tp]` row) -> the
        adapters' term of the host's output, shaped as the host's output before its bias."""
        seq = x.shape[0] * (self.tp if self.sp else 1)  # the whole sequence (of this CP rank)
        positions = _cp_positions(seq) if self.dropout and self.training else None
        if not self.column:
            name = self.parts[0][0]
            u = F.linear(self._input(x, 0, positions), self.A[name])
            u = reduce_from_tensor_model_parallel_region(u) if self.tp > 1 else u
            y = F.linear(u * self.scale, self.B[name])
            return scatter_to_sequence_parallel_region(y) if sequence_parallel else y
        pieces = []
        for k, (name, width) in enumerate(self.parts):
            if name not in self.A:
                pieces.append(x.new_zeros(seq, *x.shape[1:-1], self.groups, width))
                continue
            u = F.linear(self._input(x, k, positions), self.A[name]) * self.scale
            if self.sp:  # [s/tp, b, r] -> [s, b, r]; backward reduce-scatters dL/du
                u = gather_from_sequence_parallel_region(u)
            elif self.tp > 1:  # the whole dL/du on every rank: A's gradient is whole
                u = copy_to_tensor_model_parallel_region(u)
            pieces.append(F.linear(u, self.B[name]).unflatten(-1, (self.groups, width)))
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        return y.flatten(-2)

    def extra_repr(self) -> str:
        return (f"rank={self.rank}, scale={self.scale:g}, dropout={self.dropout}, "
                f"parts={[n for n, _ in self.parts if n in self.A]}")


def _host_parts(parent: nn.Module, attr: str, host: nn.Module) -> tuple[list, int]:
    """(parts, groups) of `parent.<attr>` (see LoRA)."""
    if attr == "linear_qkv":
        if getattr(parent, "kv_replicas", 1) > 1:
            raise ValueError("LoRA on a QKV projection whose KV heads are replicated over TP "
                             "(tensor-model-parallel-size > num_query_groups) is not supported; "
                             "use a tp that divides num_query_groups")
        d = parent.head_dim
        return [("q_proj", parent.heads_per_group * d), ("k_proj", d), ("v_proj", d)], \
            parent.num_groups
    if attr == "linear_fc1":
        if host.num_fused_parts == 2:
            half = host.output_size_per_partition // 2
            return [("gate_proj", half), ("up_proj", half)], 1
        return [("up_proj", host.output_size_per_partition)], 1
    rows = host.output_size_per_partition if hasattr(host, "output_size_per_partition") \
        else host.output_size
    return [(MODULE_PARTS[attr][0], rows)], 1


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
             target_modules="all-linear", use_rslora: bool = False) -> int:
    """Give the targeted linear layers of `model`'s transformer layers (self-attention and
    dense MLPs; not MoE layers or cross-attention) LoRA adapters,
    and freeze everything else (`requires_grad` False). Call before `init_weights`: the
    adapters are initialized from the seed like every parameter (layers/sharding.py). Returns
    the number of adapted layers; ValueError when none matches `target_modules`."""
    targets = resolve_targets(target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for parent in list(model.modules()):
        for kind, attrs in _HOSTS.items():
            for attr in attrs:
                host = getattr(getattr(parent, kind, None), attr, None)
                if host is None or getattr(host, "lora", None) is not None or \
                        not any(p in targets for p in MODULE_PARTS[attr]):
                    continue
                parts, groups = _host_parts(getattr(parent, kind), attr, host)
                if not any(n in targets for n, _ in parts):
                    continue
                host.lora = LoRA(host, parts, groups, targets, rank, alpha, dropout, use_rslora)
                count += 1
    if count == 0:
        raise ValueError(f"--lora-target-modules {target_modules!r} matches no linear layer of "
                         f"this model")
    assign_dropout_sites(model)
    return count


def adapter_num_parameters(config, rank: int, target_modules="all-linear") -> int:
    """How many parameters `add_lora(model, rank, ..., target_modules)` adds to a model of
    `config` (a ModelConfig): `rank * (in + out)` per adapted HF module, the attention's in
    every layer, the MLP's in dense (not MoE) layers. ValueError for unknown targets."""
    targets = resolve_targets(target_modules)
    h, f = config.hidden_size, config.ffn_hidden_size
    q, kv = config.query_projection_size, config.kv_projection_size
    attention = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    mlp = {"up_proj": h + f, "down_proj": f + h}
    if config.activation in GATED:
        mlp["gate_proj"] = h + f
    dense = sum(not config.is_moe_layer(i) for i in range(config.num_layers))
    return int(rank) * (config.num_layers * sum(n for k, n in attention.items() if k in targets)
                        + dense * sum(n for k, n in mlp.items() if k in targets))


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter parameters of `model` by name (`...lora.A.<part>` / `...lora.B.<part>`)."""
    return {n: p for n, p in model.named_parameters() if ".lora." in n}
