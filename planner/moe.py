"""Mixture-of-experts accounting: which layers are MoE, the expert-parallel sizes
of a layout, total vs active parameters, FLOPs of an MoE MLP, what one MoE layer saves for
backward, and the collectives it makes. The rest of planner/ calls these where a layer is an
MoE layer (`ModelConfig.is_moe_layer`); a dense model never reaches them.

Conventions (layers/moe/): an MoE MLP is a router `[E, h]` (replicated over TP), `E` routed
experts of width `f = moe_ffn_hidden_size` without biases (fc1 `[E, fc1_out, h]`, fc2
`[E, h, f]`, split over TP like the dense MLP and over EP by experts), optional shared experts
(a dense MLP of width `moe_shared_expert_intermediate_size`) and their gate `[1, h]`. Every
TP rank dispatches the microbatch's `T = s b` tokens (gathered over TP first under sequence
parallelism), `k = moe_router_topk` copies each, over the EP group (layers/moe/moe_layer.py).

Expert-parallel layout (parallel_state/grid.py, Megatron-Core's order tp-ep-dp-pp): each
pipeline stage's `dp x tp` ranks are `etp x ep x edp` for the experts, so
`edp = dp tp / (ep etp)`; `etp` is `tp` (the only expert TP layers/moe builds), so
`edp = dp / ep` (TrainConfig's `expert_model_parallel_size`, `expert_tensor_parallel_size`).
"""
from __future__ import annotations

import dataclasses

import math

from layers.mlp import GATED
from models.config import ConfigError
from run_config.checks import expert_layout as check_expert_parallel

# ----------------------------------------------------------------------------- the model


def is_moe(m) -> bool:
    """Whether `m` (a models.ModelConfig) has any MoE layer."""
    return bool(moe_layer_numbers(m))


def moe_layer_numbers(m) -> list[int]:
    """The 0-based MoE layers of `m` (`ModelConfig.is_moe_layer`: Megatron-Core's
    `moe_layer_freq`)."""
    return [n for n in range(m.num_layers) if m.is_moe_layer(n)]


def _gated(m) -> bool:
    return m.activation in GATED


def mlp_parameters(m, ffn: int) -> int:
    """Weights of one MLP of width `ffn` (an expert, or the shared experts), with their
    biases when the model has `add_bias_linear` (gpt-oss's experts)."""
    n = m.hidden_size * ffn * (3 if _gated(m) else 2)
    if m.add_bias_linear:
        n += ffn * (2 if _gated(m) else 1) + m.hidden_size
    return n


def parameter_counts(m) -> dict:
    """`{"total", "active", "routed_experts", "moe_layers", "mtp"}` of model `m`: `total` is
    `ModelConfig.num_parameters()` (every expert); `active` what one token uses: the total
    less the `E - k` routed experts it is not sent to in each MoE layer (router, shared
    experts, attention, norms, embedding and output layer all count, as in the published
    "active" figures: Mixtral 8x7B 12.9B of 46.7B, Jiang et al. 2024). `routed_experts`: the
    parameters of all routed experts of the model."""
    total = m.num_parameters()
    # multi-token prediction's depths (models/mtp.py): in the total, not active (inference
    # runs the main model; DeepSeek-V3's 37B active leave them out)
    mtp = total - dataclasses.replace(m, mtp_num_layers=0).num_parameters()
    layers = moe_layer_numbers(m)
    if not layers:
        return {"total": total, "active": total - mtp, "routed_experts": 0, "moe_layers": 0,
                "mtp": mtp}
    expert = mlp_parameters(m, m.moe_ffn_hidden_size)
    e, k = m.num_moe_experts, m.moe_router_topk
    return {"total": total, "active": total - mtp - len(layers) * (e - k) * expert,
            "routed_experts": len(layers) * e * expert, "moe_layers": len(layers), "mtp": mtp}


def describe_parameters(m) -> str:
    """`46.70B parameters (12.88B active per token, 8 experts top-2 in 32 of 32 layers)` for
    an MoE model, `6.74B parameters` for a dense one."""
    def size(n):
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    c = parameter_counts(m)
    if not c["moe_layers"]:
        return f"{size(c['total'])} parameters"
    return (f"{size(c['total'])} parameters ({size(c['active'])} active per token, "
            f"{m.num_moe_experts} experts top-{m.moe_router_topk} in {c['moe_layers']} of "
            f"{m.num_layers} layers)")


def mlp_forward_flops(m, layer_number: int) -> float:
    """Forward matmul FLOPs per token of layer `layer_number`'s MLP, active parameters only.

    Dense: `2 h fc1_out + 2 f h`. MoE (Megatron-LM `num_floating_point_operations`,
    megatron/training/training.py, "routed experts" + "Shared Experts"): the `k` experts a
    token is routed to, `k (2 h fc1_out + 2 f h)` with `f = moe_ffn_hidden_size`, plus the
    shared experts at their width; plus, unlike Megatron (which leaves them out), the router's
    `[h] x [h, E]` product `2 h E` and the shared-expert gate's `2 h`, which are matmuls too.
    Capacity dropping and padding do not change it: model FLOPs count the routed work."""
    h = m.hidden_size
    if not m.is_moe_layer(layer_number):
        return 2.0 * mlp_parameters(m, m.ffn_hidden_size)
    flops = 2 * h * m.num_moe_experts + 2 * m.moe_router_topk * mlp_parameters(
        m, m.moe_ffn_hidden_size)
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        flops += 2 * mlp_parameters(m, shared) + (2 * h if m.moe_shared_expert_gate else 0)
    return float(flops)


# ----------------------------------------------------------------------------- the layout


def check_expert_count(m, ep: int) -> None:
    """ConfigError unless `ep` is a positive integer, 1 for a dense model, and divides
    num_moe_experts (every EP rank holds the same number of experts): what an EP size must
    satisfy whatever the GPU count (tools/plan.py's --expert-model-parallel-size)."""
    if type(ep) is not int or ep < 1:
        raise ConfigError(f"--expert-model-parallel-size must be a positive integer, got {ep!r}")
    if not is_moe(m):
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep}: {m.name or 'this model'} has "
                              f"no MoE layers (--num-experts unset); drop it")
        return
    experts = m.num_moe_experts
    if experts % ep:
        fits = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide --num-experts "
                          f"{experts}: every EP rank holds the same number of experts; use one "
                          f"of {fits}")


def expert_layout(config) -> tuple[int, int, int]:
    """(ep, etp, edp) of a run_config.config.Config with its data-parallel size set, checked
    as train.py checks them (run_config/checks.py `expert_layout`: etp = tp, ep divides
    num_moe_experts and dp x cp, edp = dp x cp / ep: expert parallelism is carved out of
    the data- and context-parallel ranks)."""
    return check_expert_parallel(config.model, config.train,
                                 config.data_parallel_size * config.train.context_parallel_size)


def edp_label(tp: int, ep: int, etp: int) -> str:
    """The comm counter's label of the expert-data-parallel group: the grid reuses the dp
    group (label "dp") when its ranks are the same, i.e. `ep etp == tp`."""
    return "dp" if ep * etp == tp else "edp"


# ----------------------------------------------------------------------------- routing


def routed_rows(m, tokens: int) -> tuple[int, int]:
    """(kept copies, expert rows) of one dispatch of `tokens` tokens on a rank: `T k` and `T k`
    dropless; with `moe_expert_capacity_factor` c the capacity is `C = ceil(T k c / E)` per
    expert (token_dispatcher.capacity_keep), so, assuming a balanced load, `min(T k, E C)`
    copies are kept, and the experts run on as many rows, or on `E C` rows when padded to
    capacity. Balanced, a rank receives as many rows as it sends."""
    tk = tokens * m.moe_router_topk
    factor = m.moe_expert_capacity_factor
    if factor is None:
        return tk, tk
    rows = m.num_moe_experts * math.ceil(tk / m.num_moe_experts * factor)
    return min(tk, rows), rows if m.moe_pad_expert_input_to_capacity else min(tk, rows)


# ----------------------------------------------------------------------------- activations


def mlp_saved_bytes(m, rows: int, ffn_local: int, e: int) -> int:
    """What an MLP's activation and fc2 keep for `rows` rows of local width `ffn_local`:
    SwiGLU the fused fc1 output, silu(gate) and fc2's input (`4 f`), GeGLU the fused output,
    gelu(gate) and the product (`4 f`), GeLU its input and fc2's input (`2 f`), ReLU its
    output, which is fc2's input (`1 f`), gpt-oss's clamped quick_geglu the fused output
    (its clamps' inputs), the sigmoid, the clamped gate, their product, `up + offset` and
    the result (`7 f`); `e` bytes per value."""
    per_row = {"swiglu": 4, "geglu": 4, "quick_geglu": 7, "relu": 1}.get(m.activation, 2)
    return e * rows * per_row * ffn_local


def moe_layer_bytes(m, s: int, b: int, t: int, sp: bool, e: int, ep: int,
                    training: bool = True) -> dict:
    """What one MoE MLP (layers/moe/) saves for backward per microbatch on one rank, in bytes,
    term by term (the MLP part of `planner.activations.model_layer_bytes`, which keeps the
    attention terms and the QKV input). `Tl = s b` local tokens (`s b / t` under SP), `T = s b`
    the microbatch every TP rank dispatches, `K` kept copies and `R` expert rows
    (`routed_rows(T)`: `T k` each when dropless; balanced routing: a rank receives as many
    rows as it sends), `f` moe_ffn_hidden_size:

    - router input: the float32 `[Tl, h]` the router multiplies (the pre-MLP norm's output
      in fp32, a float32 copy in bf16, plus the float32 copy of the weight `[E, h]`);
    - router choice: softmax over the top-k logits keeps the indices (int64 `[Tl, k]`) and
      the weights (float32); pre-softmax or sigmoid the `[Tl, E]` scores, sigmoid with k > 1
      also the un-normalised weights and their sum; the auxiliary loss its own `[Tl, E]`
      scores (+ the sums of the sigmoid's normalisation) and the `[E]` counts (with the
      expert bias, its own unbiased top-k keeps its indices only until its unused values
      are dropped, during the forward: nothing at the peak), the z-loss the
      logits and their log-sum-exp (both only while training with a coefficient > 0);
    - dispatch: the token of each kept copy and the copies' order (int64 `[K]` each); under
      capacity padding their places in the padded rows (int64 `[K]`) and the unpadded rows
      (`e K h`: `index_copy` keeps its source); the local-expert order under EP (int64 `[R]`,
      `ep > 1` and more than one local expert);
    - experts: fc1's input `e R h` and the activation / fc2 input (`mlp_saved_bytes` over `R`
      rows of `f / t`); with biases (`add_bias_linear`, gpt-oss) each linear's row-to-expert
      index for the bias gather (int64 `[R]`, two);
    - combine: the expert outputs in float32 (`4 K h`, for the routing weights' gradient),
      the weights (float32 `[K]`), the weighted outputs (`4 K h`: `index_add` keeps its
      source), the inverse local-expert order under EP (int64 `[R]`);
    - shared experts: a dense MLP's activations at their width (`s b` rows), their input
      (the norm output, shared with the router's in fp32) and, with the gate, its sigmoid and
      the shared output it multiplies.
    """
    h, k, n_exp = m.hidden_size, m.moe_router_topk, m.num_moe_experts
    tl = s * b // t if sp else s * b
    kept, rows = routed_rows(m, s * b)
    out = {"router input": 4 * tl * h + (4 * n_exp * h if e != 4 else 0)}
    sigmoid = m.moe_router_score_function == "sigmoid"
    if sigmoid:
        choice = 4 * tl * n_exp + 8 * tl * k + (4 * tl * k + 4 * tl if k > 1 else 0)
    elif m.moe_router_pre_softmax:
        choice = 4 * tl * n_exp + 8 * tl * k
    else:
        choice = 12 * tl * k
    if training and (m.moe_aux_loss_coeff or 0) > 0:
        choice += 4 * tl * n_exp + (4 * tl if sigmoid else 0) + 4 * n_exp
    if training and (m.moe_z_loss_coeff or 0) > 0:
        choice += 4 * tl * n_exp + 4 * tl
    out["router scores"] = choice
    local_order = ep > 1 and n_exp // ep > 1
    padded = m.moe_expert_capacity_factor is not None and m.moe_pad_expert_input_to_capacity
    out["dispatch"] = 8 * kept * (2 + padded) + (e * kept * h if padded else 0) + \
        (8 * rows if local_order else 0)
    out["experts"] = e * rows * h + mlp_saved_bytes(m, rows, m.moe_ffn_hidden_size // t, e) + \
        (2 * 8 * rows if m.add_bias_linear else 0)
    out["combine"] = 8 * kept * h + 4 * kept + (8 * rows if local_order else 0)
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        out["shared experts"] = mlp_saved_bytes(m, s * b, shared // t, e) + \
            (e * tl * h if e != 4 else 0) + \
            (e * tl * h + e * tl if m.moe_shared_expert_gate else 0)
    return out


# ----------------------------------------------------------------------------- communication


def layer_collectives(m, s: int, b: int, tp: int, sp: bool, e: int, ep: int,
                      recomputed: bool, cp: int = 1) -> dict[tuple[str, str], tuple[int, int]]:
    """`{(group, op): (calls, bytes)}` one MoE MLP adds on one rank per microbatch, beyond the
    dense MLP's collectives that `planner.communication` counts for every layer (an MoE
    layer's TP reductions are the dense MLP's: the routed tokens are gathered (SP) or copied
    over TP before dispatch and the output reduce-scattered or all-reduced, except that SP's
    backward all-gather of fc1's input has no counterpart: `-1` all-gather of `A / t`).
    `recomputed`: the layer is inside a fully recomputed span (its forward runs twice).

    - ep (`ep > 1`): per forward an all-to-all of the token counts (int64 `[E]`), then the
      routed rows `[R, h]` there and back (dispatch, combine); backward the same two
      exchanges of gradients: 4 all-to-alls of `R h e` bytes (payload: every row a rank
      sends, its own split included, as parallel_state.comm_counter counts it), 2 more and a
      count exchange per recomputation. The sum over ranks is exact for dropless routing
      (the copies sent are the copies routed); `R` per rank assumes a balanced load.
    - tp, no SP: the routing weights' gradient `[T, k]` float32 all-reduced in backward.
    - sp: the routing weights (float32 `[T/t, k]`) and choices (int64) all-gathered per
      forward; the weights' gradient (`[T, k]`) reduce-scattered in backward; with the
      auxiliary loss the tokens per expert (float32 `[E]`) all-reduced over tp per forward.
    - cp (`cp > 1`, `s` the rank's part): with the auxiliary loss the tokens per expert
      (float32 `[E]`) all-reduced over cp per forward (each CP rank routed part of the same
      sequences).
    - shared experts: a dense MLP's collectives at width `moe_shared_expert_intermediate_size`
      (tp: 2 all-reduces of `A`, +1 recomputed; sp: 3 all-gathers, 2 reduce-scatters, +1 each
      recomputed).
    """
    out: dict = {}

    def add(key, calls, nbytes):
        c, n = out.get(key, (0, 0))
        out[key] = (c + calls, n + calls * nbytes)
    h, k, n_exp = m.hidden_size, m.moe_router_topk, m.num_moe_experts
    forwards = 1 + recomputed
    if ep > 1:
        _, rows = routed_rows(m, s * b)
        add(("ep", "all_to_all_single"), forwards, 8 * n_exp)
        add(("ep", "all_to_all_single"), 2 + 2 * forwards, rows * h * e)
    if cp > 1 and m.moe_aux_loss_coeff > 0:
        add(("cp", "all_reduce"), forwards, 4 * n_exp)
    if tp == 1:
        return out
    tokens, act = s * b, s * b * h * e
    shared = bool(m.moe_shared_expert_intermediate_size)
    if sp:
        add(("sp", "all_gather_single"), -1, act // tp)
        add(("sp", "all_gather_single"), forwards, 4 * tokens * k // tp)
        add(("sp", "all_gather_single"), forwards, 8 * tokens * k // tp)
        add(("sp", "reduce_scatter_single"), 1, 4 * tokens * k)
        if (m.moe_aux_loss_coeff or 0) > 0:
            add(("tp", "all_reduce"), forwards, 4 * n_exp)
        if shared:
            add(("sp", "all_gather_single"), 3 + recomputed, act // tp)
            add(("sp", "reduce_scatter_single"), 2 + recomputed, act)
    else:
        add(("tp", "all_reduce"), 1, 4 * tokens * k)
        if shared:
            add(("tp", "all_reduce"), 2 + recomputed, act)
    return out


def step_collectives(m, moe_layers: int, dp: int, tp: int, sp: bool, cp: int = 1
                     ) -> dict[tuple[str, str], tuple[int, int]]:
    """`{(group, op): (calls, bytes)}` one rank adds once per step for its `moe_layers` MoE
    layers: `layers.moe.collect_expert_load` (the per-step load statistics and the expert
    bias's input, called after backward as layers/moe/__init__.py says) sums the float64
    tokens and drops per expert, the two loss sums and the microbatch count of every layer
    over dp in one all-reduce, `8 (2 E + 3) L` bytes, after an all-reduce of the loss sums
    (`16 L` bytes) over tp under SP and of the tokens per expert and loss sums
    (`8 (2 E + 2) L` bytes) over cp at cp > 1."""
    out = {}
    if not moe_layers:
        return out
    if sp and tp > 1:
        out[("tp", "all_reduce")] = (1, 16 * moe_layers)
    if cp > 1:
        out[("cp", "all_reduce")] = (1, 8 * (2 * m.num_moe_experts + 2) * moe_layers)
    if dp > 1:
        out[("dp", "all_reduce")] = (1, 8 * (2 * m.num_moe_experts + 3) * moe_layers)
    return out
