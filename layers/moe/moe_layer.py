"""The mixture-of-experts MLP: `[s, b, h] -> [s, b, h]` like the dense MLP it replaces
(Shazeer et al. 2017; GShard; Switch Transformer; Megatron-Core's MoELayer).

    route (local tokens) -> every TP rank takes the microbatch's tokens and routing
    -> [capacity] -> dispatch -> experts -> combine -> reduce over TP -> + shared experts

Tensor parallelism: the experts are split over TP like the dense MLP (fc1 by columns, fc2 by
rows), so each TP rank needs every token of the microbatch and makes a partial sum. Under
sequence parallelism the tokens arrive as sequence shards; they are all-gathered over TP
before dispatch and the output is reduce-scattered back, exactly as the dense MLP's column
and row layers do (Megatron instead exchanges the shards over EP and all-gathers over the
expert-TP group after the all-to-all; gathering first is simpler, needs the expert-TP group to
be the TP group, and sends each token tp times over EP). The router runs on the local tokens
(shard or replica), so its gradient is counted once; its choices and weights are gathered
with the tokens (their gradient summed over TP, since every rank's partial output uses them).

Per layer the module counts, over the step, the routed copies per expert (before dropping)
and the dropped ones, on the whole microbatch; `collect_expert_load` sums them over the
data-parallel ranks, and `update_expert_bias` feeds them to the router's bias.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import parallel_state as ps
from parallel_state import collectives
from parallel_state.mappings import all_gather_sequence

from ..mlp import MLP
from ..sharding import set_tensor_parallel_attributes
from .experts import Experts
from .router import TopKRouter, recording
from .token_dispatcher import AllToAllDispatcher, capacity_keep


class _AttachLoss(torch.autograd.Function):
    """Identity on `x`; its backward also gives `loss` the gradient 1, so backpropagating the
    model's loss backpropagates `loss` too (Megatron's MoEAuxLossAutoScaler; the scale is
    already inside `loss`)."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_meta = (loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.loss_meta
        return grad, torch.ones((), dtype=dtype, device=device)


def attach_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`x`, with `loss` (0-dim) added to whatever objective `x`'s gradient comes from."""
    return _AttachLoss.apply(x, loss)


class MoELayer(nn.Module):
    """`[s, b, h]` (SP: `[s/tp, b, h]`) -> same shape. Config: `num_moe_experts`,
    `moe_router_*`, `moe_ffn_hidden_size`, `moe_shared_expert_intermediate_size` (+ gate),
    `moe_expert_capacity_factor`, `moe_pad_expert_input_to_capacity`, `activation`.

    Submodules (parameter names): `router.weight [E, h]` (+ buffer `router.expert_bias`),
    `experts.linear_fc1.weight [E, fc1_out, h]` and `experts.linear_fc2.weight [E, h, f]`
    (dense shapes; a rank holds its EP slice of dim 0 and its TP slice), `shared_experts`
    (a dense MLP) and `shared_expert_gate.weight [1, h]`.

    Expert parallelism (the grid's ep group: ranks of one TP rank, carved out of DP) splits
    the experts into contiguous blocks; each rank dispatches its own microbatch. With expert
    TP 1 and ep equal to TP (the ep group is the TP group: serving's
    `--enable-expert-parallel`), the TP ranks hold whole experts of different blocks; each
    runs its own experts on the microbatch it already has, and the reduce over TP that sums
    the partial outputs of split experts sums the blocks' outputs instead: no all-to-all.

    Raises ValueError when num_moe_experts is not divisible by the expert-parallel size, or
    when the expert-tensor-parallel size is neither the TP size nor 1 with ep == TP.
    """

    def __init__(self, config, layer_number: int = 0, sequence_parallel: bool = False):
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.layer_number = layer_number
        self.sequence_parallel = sequence_parallel and tp > 1
        self.num_experts = config.num_moe_experts
        self.capacity_factor = config.moe_expert_capacity_factor
        self.pad_to_capacity = config.moe_pad_expert_input_to_capacity
        etp = ps.get_expert_tensor_parallel_world_size()
        ep = ps.get_expert_model_parallel_world_size()
        # experts over the TP ranks (etp 1, ep == tp: the ep group is the tp group)
        over_tp = tp > 1 and etp == 1 and ep == tp
        if etp != tp and not over_tp:
            raise ValueError(
                f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp} and "
                f"--expert-model-parallel-size {ep} is not built: the MoE layer gathers the "
                f"microbatch over TP and either splits its experts like the dense MLP (expert TP "
                f"= TP: leave --expert-tensor-parallel-size unset) or, with expert TP 1, spreads "
                f"whole experts over the TP ranks (expert-model-parallel-size = TP)")
        self.router = TopKRouter(config, sequence_parallel=self.sequence_parallel)
        self.dispatcher = AllToAllDispatcher(
            self.num_experts, ep, ps.get_expert_model_parallel_group() if ep > 1 else None,
            replicated=over_tp, ep_rank=ps.get_expert_model_parallel_rank())
        self.experts = Experts(config, self.dispatcher.num_local_experts)
        shared = config.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(config, sequence_parallel=self.sequence_parallel,
                                  ffn_hidden_size=shared) if shared else None
        self.shared_expert_gate = None
        if shared and config.moe_shared_expert_gate:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
            set_tensor_parallel_attributes(self.shared_expert_gate.weight, partition_dim=None,
                                           init="normal", sequence_parallel=self.sequence_parallel)
        counts = torch.zeros(2, self.num_experts, dtype=torch.int64)
        self.register_buffer("load_counts", counts, persistent=False)  # [routed; dropped]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, h = hidden.shape[1], hidden.shape[2]
        routing = self.router(hidden.reshape(-1, h))
        x, probs, indices = self._whole_microbatch(hidden, routing.probs, routing.indices)
        keep, pad_to = None, None
        if self.capacity_factor is not None:
            keep, capacity = capacity_keep(indices, probs, self.num_experts, self.capacity_factor)
            pad_to = capacity if self.pad_to_capacity else None
        if recording(self):
            self._count(indices, keep)
        rows, counts, plan = self.dispatcher.dispatch(x, indices, probs, keep, pad_to)
        out = self.dispatcher.combine(self.experts(rows, counts), plan).view(-1, b, h)
        if self.sequence_parallel:
            out = ps.reduce_scatter_to_sequence_parallel_region(out)
        else:
            out = ps.reduce_from_tensor_model_parallel_region(out)
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(F.linear(hidden, self.shared_expert_gate.weight))
            out = out + shared
        return out if routing.loss is None else attach_loss(out, routing.loss)

    def _whole_microbatch(self, hidden, probs, indices):
        """Every TP rank's copy of the microbatch's tokens `[T, h]`, routing weights and
        choices `[T, k]`, in token order (sequence-major, as `[s, b]` flattens)."""
        if self.sequence_parallel:  # shards -> whole; gradients summed over TP
            x = ps.gather_from_sequence_parallel_region(hidden)
            probs = ps.gather_from_sequence_parallel_region(probs)
            indices = all_gather_sequence(indices)
        else:  # identity; gradients summed over TP (each rank's output is partial)
            x = ps.copy_to_tensor_model_parallel_region(hidden)
            probs = ps.copy_to_tensor_model_parallel_region(probs)
        return x.reshape(-1, x.shape[-1]), probs, indices

    @torch.no_grad()
    def _count(self, indices: torch.Tensor, keep: torch.Tensor | None) -> None:
        routed = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        self.load_counts[0] += routed
        if keep is not None:
            self.load_counts[1] += routed - torch.bincount(indices[keep], minlength=self.num_experts)


@dataclass
class ExpertLoad:
    """One MoE layer's load over a step, summed over the data-parallel ranks (so over the
    whole global batch): `tokens_per_expert [E]` routed copies (top-k choices, before
    capacity dropping), `dropped_per_expert [E]`, and the mean over the step's microbatches of
    the raw (coefficient-free) auxiliary and z losses (None where its coefficient is 0)."""

    layer_number: int
    tokens_per_expert: torch.Tensor
    dropped_per_expert: torch.Tensor
    aux_loss: float | None
    z_loss: float | None

    @property
    def imbalance(self) -> float:
        """max / mean of tokens_per_expert (1.0: perfectly balanced; 0 when nothing routed)."""
        mean = self.tokens_per_expert.double().mean()
        return float(self.tokens_per_expert.max() / mean) if mean > 0 else 0.0


def moe_layers(modules) -> list[MoELayer]:
    """The MoELayers inside `modules` (a module or a list of them, e.g. pipeline chunks), in
    module order."""
    modules = modules if isinstance(modules, (list, tuple)) else [modules]
    return [m for chunk in modules for m in chunk.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(modules, scale: float) -> None:
    """Weight of one microbatch's auxiliary and z losses in the gradient: 1 / the number of
    microbatches in the global batch (over all DP ranks), so the objective is their mean."""
    for layer in moe_layers(modules):
        layer.router.aux_loss_scale = float(scale)


def collect_expert_load(modules) -> list[ExpertLoad]:
    """Each MoE layer's load since the last call, summed over the data-parallel group (one
    all-reduce for all layers; under sequence parallelism the loss sums are first summed over
    TP, and under context parallelism the counts and loss sums over CP: each CP rank routed
    its part of the same microbatches), and the counters reset. Every rank of the DP x CP
    group must call it (a collective)."""
    layers = moe_layers(modules)
    if not layers:
        return []
    counts = torch.stack([m.load_counts for m in layers]).double()  # [L, 2, E]
    losses = torch.stack([m.router.loss_sums for m in layers])  # [L, 2]
    if any(m.sequence_parallel for m in layers):  # partial over TP (SP: shards' sums)
        collectives.all_reduce(losses, group=ps.get_tensor_model_parallel_group())
    if ps.get_context_parallel_world_size() > 1:  # partial over CP (sequence parts)
        both = torch.cat([counts.reshape(-1), losses.reshape(-1).double()])
        collectives.all_reduce(both, group=ps.get_context_parallel_group())
        counts = both[:counts.numel()].view(counts.shape)
        losses = both[counts.numel():].view(losses.shape).to(losses.dtype)
    microbatches = torch.stack([m.router.num_microbatches for m in layers]).double()
    flat = torch.cat([counts.reshape(-1), losses.reshape(-1), microbatches])
    if ps.get_data_parallel_world_size() > 1:
        collectives.all_reduce(flat, group=ps.get_data_parallel_group())
    n, e = len(layers), layers[0].num_experts
    counts = flat[:n * 2 * e].view(n, 2, e).round().long()
    losses = flat[n * 2 * e: n * 2 * e + 2 * n].view(n, 2)
    microbatches = flat[n * 2 * e + 2 * n:]
    out = []
    for i, m in enumerate(layers):
        mb = float(microbatches[i])
        aux, z = (float(v) / mb if mb and coeff > 0 else None
                  for v, coeff in zip(losses[i], (m.router.aux_loss_coeff, m.router.z_loss_coeff)))
        out.append(ExpertLoad(m.layer_number, counts[i, 0], counts[i, 1], aux, z))
        m.load_counts.zero_()
        m.router.loss_sums.zero_()
        m.router.num_microbatches.zero_()
    return out


def update_expert_bias(modules, loads: list[ExpertLoad]) -> None:
    """After the optimizer step: move each layer's expert bias (where enabled) by its step
    load (`collect_expert_load`'s result for the same modules)."""
    by_layer = {load.layer_number: load for load in loads}
    for m in moe_layers(modules):
        if m.router.expert_bias is not None:
            m.router.update_expert_bias(by_layer[m.layer_number].tokens_per_expert)
