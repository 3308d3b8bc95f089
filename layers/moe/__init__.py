"""Mixture of experts beside the dense MLP: router (router.py), routed experts (experts.py),
token dispatch with capacity and expert parallelism (token_dispatcher.py) and the layer
with its per-step API for the trainer (moe_layer.py):

- `set_aux_loss_scale(model, 1 / microbatches_per_global_batch)` once the batch is known;
- each step, after backward: `loads = collect_expert_load(model)` (a collective over DP:
  per-layer tokens per expert, dropped tokens, mean aux / z loss), and after the optimizer
  step `update_expert_bias(model, loads)`.
"""
from .experts import Experts, GroupedLinear  # noqa: F401
from .moe_layer import (  # noqa: F401
    ExpertLoad,
    MoELayer,
    attach_loss,
    collect_expert_load,
    moe_layers,
    set_aux_loss_scale,
    update_expert_bias,
)
from .router import Routing, TopKRouter  # noqa: F401
from .token_dispatcher import AllToAllDispatcher, capacity_keep  # noqa: F401
