"""Top-k token-choice router: which experts each token goes to, with what weight, and the
load-balancing losses.

Scores (Megatron-Core's `moe_router_score_function`, logits always in float32):

- softmax: the top-k logits are softmaxed among themselves (Mixtral's routing), or with
  `moe_router_pre_softmax` the softmax over all experts is taken first and the top-k
  probabilities kept as they are (Switch Transformer; needed for top-1);
- sigmoid: each expert scored on its own (DeepSeek-V3), the top-k scores renormalised to sum
  to 1 when k > 1.

`moe_router_topk_scaling_factor` then multiplies the weights (DeepSeek-V3's routed scaling).
With `moe_router_num_groups` / `moe_router_group_topk` (sigmoid only) a token's top-k is
taken among the experts of its best groups only (`_limit_to_groups`).

Load balancing, all per microbatch (the mbs sequences one forward processes; under sequence
parallelism their token counts are summed over the TP ranks, and under context parallelism
over the CP ranks, each of which holds a part of every sequence, so the value does not depend
on the layout; each rank's loss is then its tokens' part of the sum, and the gradients'
reduction over TP / CP adds the parts). Counting over the global batch is not possible in one
pass (a microbatch's backward runs before later microbatches are routed), and summing over
the DP ranks' current microbatches would change the loss with dp: those are different sets
of sequences at dp 1 and dp 2 (training/batches.py hands rank r the r-th mbs of each mbs*dp
chunk). So the
objective is the mean over the global batch's microbatches of:

- the auxiliary loss of Switch Transformer (Fedus et al. 2021, eq. 4) / GShard:
  `E * sum_i f_i P_i` with `f_i = c_i / (k T)` the fraction of the microbatch's T tokens'
  k choices that picked expert i (top-k of the scores without the expert bias, before
  capacity dropping) and `P_i = (1/T) sum_t s_ti` the mean score of expert i over all experts'
  softmax (or the sigmoid normalised over all experts). `c_i` carries no gradient;
- the router z-loss of ST-MoE (Zoph et al. 2022, sec. 3, eq. 5): `(1/T) sum_t
  (logsumexp_i logits_ti)^2`.

Each is multiplied by its coefficient (`moe_aux_loss_coeff`, `moe_z_loss_coeff`) and by
`aux_loss_scale` (1 / the number of microbatches in the global batch: the trainer sets it with
`layers.moe.set_aux_loss_scale`), and enters backward through the MoE layer's output
(`attach_loss`): no second loss tensor travels through the pipeline schedule.

Auxiliary-loss-free balancing (DeepSeek-V3, Liu et al. 2024, sec. 2.1.2; Wang et al. 2024,
"Auxiliary-Loss-Free Load Balancing"): a per-expert bias added to the sigmoid scores for the
top-k choice only (the weights stay the unbiased scores), moved after each step by
`moe_router_bias_update_rate * sign(mean load - load_i)` from the step's global token counts
(`MoELayer.update_expert_bias`). The bias stays float32 when the model is cast to bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallel_state import collectives, get_context_parallel_group, \
    get_context_parallel_world_size, get_tensor_model_parallel_group, \
    get_tensor_model_parallel_world_size

from ..sharding import set_tensor_parallel_attributes


@dataclass
class Routing:
    """A microbatch's routing: `probs [n, k]` float32 weights and `indices [n, k]` int64
    experts of each of the `n` tokens, and `loss` (a 0-dim float32 tensor: the coefficient-
    and scale-weighted auxiliary + z losses of these tokens, partial over TP under sequence
    parallelism) or None when no loss applies (coefficients 0, no grad, eval)."""

    probs: torch.Tensor
    indices: torch.Tensor
    loss: torch.Tensor | None


def recording(module: nn.Module) -> bool:
    """Whether a forward should count its routing: training with grad, and not the
    activation-recompute replay of a forward already counted (that replay runs inside the
    backward pass, where autograd's current graph task id is set)."""
    return module.training and torch.is_grad_enabled() and \
        torch._C._current_graph_task_id() == -1


class TopKRouter(nn.Module):
    """`x [n, h]` -> `Routing`. The weight `[num_experts, h]` (and, with the config's
    `add_bias_linear`, gpt-oss's logit bias `[num_experts]`) is replicated over TP; under
    sequence parallelism `x` is this rank's sequence shard and the weight's gradient is
    partial (tagged `sequence_parallel`, summed over TP after backward like a norm's).

    Accumulates, while `recording`, the raw (coefficient-free) auxiliary and z losses of the
    microbatches it routed (`loss_sums`, partial over TP under SP) and their count.
    """

    def __init__(self, config, sequence_parallel: bool = False):
        super().__init__()
        self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.num_groups = getattr(config, "moe_router_num_groups", None)
        self.group_topk = getattr(config, "moe_router_group_topk", None)
        self.aux_loss_coeff = config.moe_aux_loss_coeff or 0.0
        self.z_loss_coeff = config.moe_z_loss_coeff or 0.0
        self.bias_update_rate = config.moe_router_bias_update_rate
        self.sequence_parallel = sequence_parallel and get_tensor_model_parallel_world_size() > 1
        self.aux_loss_scale = 1.0  # 1 / microbatches per global batch (set_aux_loss_scale)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        set_tensor_parallel_attributes(self.weight, partition_dim=None, init="normal",
                                       sequence_parallel=self.sequence_parallel)
        self.bias = None  # gpt-oss: a learned logit bias `[E]` (config add_bias_linear)
        if getattr(config, "add_bias_linear", False):
            self.bias = nn.Parameter(torch.empty(self.num_experts))
            set_tensor_parallel_attributes(self.bias, partition_dim=None, init="zeros",
                                           sequence_parallel=self.sequence_parallel)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        else:
            self.expert_bias = None
        self.register_buffer("loss_sums", torch.zeros(2, dtype=torch.float64), persistent=False)
        self.register_buffer("num_microbatches", torch.zeros((), dtype=torch.int64),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` casts floating buffers: keep the expert bias float32 (its
        # steps of `bias_update_rate` would round away in bf16) and the loss sums float64,
        # following the device only.
        kept = {name: self._buffers[name] for name in ("expert_bias", "loss_sums")
                if self._buffers.get(name) is not None}
        out = super()._apply(fn, recurse)
        for name, before in kept.items():
            self._buffers[name] = before.to(device=self._buffers[name].device)
        return out

    def forward(self, x: torch.Tensor) -> Routing:
        with torch.autocast(x.device.type, enabled=False):
            logits = x.float() @ self.weight.float().t()  # [n, E]
            if self.bias is not None:
                logits = logits + self.bias.float()
        probs, indices = self._top_k(logits)
        loss = None
        if torch.is_grad_enabled() and self.training and \
                (self.aux_loss_coeff > 0 or self.z_loss_coeff > 0):
            loss = self._losses(logits, indices)
        return Routing(probs, indices, loss)

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.topk
        if self.score_function == "softmax":
            if self.pre_softmax:
                probs, indices = torch.softmax(logits, dim=-1).topk(k, dim=-1)
            else:
                top, indices = logits.topk(k, dim=-1)
                probs = torch.softmax(top, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            if self.num_groups is not None:
                choice = self._limit_to_groups(choice)
            if self.expert_bias is not None or self.num_groups is not None:
                indices = choice.topk(k, dim=-1).indices
                probs = scores.gather(1, indices)
            else:
                probs, indices = scores.topk(k, dim=-1)
            if k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_factor:
            probs = probs * self.scaling_factor
        return probs, indices

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek-V3's n_group / topk_group; V2 report sec.
        2.1.2's device-limited routing): `choice [n, E]` with the experts outside each
        token's `group_topk` best groups set to -inf. The E experts form `num_groups`
        contiguous groups; a group's score is the sum of its two best choice scores
        (transformers' DeepseekV3TopkRouter; ties between groups go to the lower index)."""
        n = choice.shape[0]
        grouped = choice.view(n, self.num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [n, groups]
        best = group_scores.topk(self.group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)

    def _losses(self, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The weighted auxiliary + z losses of these tokens (module docstring)."""
        n, e, k = logits.shape[0], self.num_experts, self.topk
        cp = get_context_parallel_world_size()  # CP ranks hold parts of the same sequences
        tokens = n * cp * (get_tensor_model_parallel_world_size() if self.sequence_parallel else 1)
        aux = z = logits.new_zeros(())
        if self.aux_loss_coeff > 0:
            if self.score_function == "softmax":
                scores = torch.softmax(logits, dim=-1)
            else:
                scores = torch.sigmoid(logits)
                scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
            chosen = indices if self.expert_bias is None else scores.topk(k, dim=-1).indices
            counts = torch.bincount(chosen.reshape(-1), minlength=e).to(logits.dtype)
            if self.sequence_parallel:  # the whole microbatch's choices
                collectives.all_reduce(counts, group=get_tensor_model_parallel_group())
            if cp > 1:
                collectives.all_reduce(counts, group=get_context_parallel_group())
            aux = (counts * scores.sum(dim=0)).sum() * (e / (k * tokens * tokens))
        if self.z_loss_coeff > 0:
            z = torch.logsumexp(logits, dim=-1).square().sum() / tokens
        if recording(self):
            self.loss_sums += torch.stack([aux.detach(), z.detach()]).to(self.loss_sums)
            self.num_microbatches += 1
        return (self.aux_loss_coeff * aux + self.z_loss_coeff * z) * self.aux_loss_scale

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """`expert_bias += rate * sign(mean - tokens_per_expert)` from the step's global
        counts `[E]` (DeepSeek-V3, sec. 2.1.2): under-loaded experts become more likely."""
        if self.expert_bias is None:
            return
        load = tokens_per_expert.to(self.expert_bias.device, torch.float64)
        self.expert_bias += (self.bias_update_rate * torch.sign(load.mean() - load)).float()
