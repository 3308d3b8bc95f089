"""The mixture-of-experts MLP (layers/moe/) against a dense reference written with loops over
tokens and experts in plain PyTorch: outputs, the gradients of the input and of every
parameter, the auxiliary and z losses against their formulas (Switch Transformer eq. 4;
ST-MoE sec. 3), capacity dropping, an expert that gets no token, the expert bias (DeepSeek-V3)
and its update, the per-step load statistics, and the config's errors. float32, tiny sizes.

Tolerances: tests/tolerances.py with `k` = the terms one value accumulates (router over h,
fc1 over h, fc2 over the expert width, the k choices; twice for backward, plus the tokens a
weight gradient sums over).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from layers import initialize_parameters
from layers.moe import MoELayer, collect_expert_load, set_aux_loss_scale, update_expert_bias
from models import ModelConfig
from distributed import run_distributed
from models.config import ConfigError
from tolerances import fp32_mismatch

S, B, H = 6, 2, 16


def moe_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=24,
                  seq_length=S, activation="swiglu", add_bias_linear=False, num_moe_experts=4,
                  moe_router_topk=2, moe_ffn_hidden_size=12, init_method_std=0.3)
    fields.update(overrides)
    config = ModelConfig(**fields)
    config.validate()
    return config


def build(config: ModelConfig, seed: int = 3) -> MoELayer:
    layer = MoELayer(config, layer_number=0)
    initialize_parameters(layer, seed, config.init_method_std, config.num_layers)
    return layer


# ----------------------------------------------------------------------------- the reference

def _act(v: torch.Tensor, activation: str) -> torch.Tensor:
    if activation in ("swiglu", "geglu"):
        gate, up = v.chunk(2)
        g = F.silu(gate) if activation == "swiglu" else F.gelu(gate, approximate="tanh")
        return g * up
    return F.relu(v) if activation == "relu" else F.gelu(v, approximate="tanh")


def _route_token(logit, config, bias):
    """(experts, weights) of one token, straight from the definitions."""
    k = config.moe_router_topk
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            p = torch.softmax(logit, 0)
            chosen = sorted(range(len(p)), key=lambda i: -float(p[i].detach()))[:k]
            weights = [p[i] for i in chosen]
        else:
            chosen = sorted(range(len(logit)), key=lambda i: -float(logit[i].detach()))[:k]
            weights = list(torch.softmax(torch.stack([logit[i] for i in chosen]), 0))
    else:
        s = torch.sigmoid(logit)
        biased = s if bias is None else s + bias
        chosen = sorted(range(len(s)), key=lambda i: -float(biased[i].detach()))[:k]
        weights = [s[i] for i in chosen]
        if k > 1:
            total = sum(weights) + 1e-20
            weights = [w / total for w in weights]
    factor = config.moe_router_topk_scaling_factor or 1.0
    return chosen, [w * factor for w in weights]


def reference(params: dict, config: ModelConfig, x: torch.Tensor, bias=None):
    """`(y [s, b, h], aux, z)` of the MoE layer by loops over tokens and experts; `params`
    the layer's parameters by name (leaf tensors: autograd gives their gradients)."""
    wr, w1, w2 = (params[n] for n in ("router.weight", "experts.linear_fc1.weight",
                                      "experts.linear_fc2.weight"))
    tokens = x.reshape(-1, x.shape[-1])
    t_count, e_count, k = tokens.shape[0], config.num_moe_experts, config.moe_router_topk
    logits = [wr @ tokens[t] for t in range(t_count)]
    routes = [_route_token(logits[t], config, bias) for t in range(t_count)]
    kept = {(t, j) for t in range(t_count) for j in range(k)}
    if config.moe_expert_capacity_factor is not None:
        capacity = math.ceil(t_count * k / e_count * config.moe_expert_capacity_factor)
        kept = set()
        for e in range(e_count):
            copies = [(t, j) for t in range(t_count) for j in range(k) if routes[t][0][j] == e]
            copies.sort(key=lambda tj: (-float(routes[tj[0]][1][tj[1]].detach()), tj[0] * k + tj[1]))
            kept |= set(copies[:capacity])
    rows = []
    for t in range(t_count):
        y = torch.zeros(x.shape[-1])
        for j, (e, w) in enumerate(zip(*routes[t])):
            if (t, j) in kept:
                y = y + w * (w2[e] @ _act(w1[e] @ tokens[t], config.activation))
        if "shared_experts.linear_fc1.weight" in params:
            shared = params["shared_experts.linear_fc2.weight"] @ _act(
                params["shared_experts.linear_fc1.weight"] @ tokens[t], config.activation)
            if "shared_expert_gate.weight" in params:
                shared = shared * torch.sigmoid(params["shared_expert_gate.weight"][0] @ tokens[t])
            y = y + shared
        rows.append(y)
    return torch.stack(rows).view_as(x), _aux_loss(logits, config), _z_loss(logits)


def _aux_loss(logits, config):
    """Switch Transformer eq. 4: E * sum_i f_i P_i over the microbatch (k-choice fractions of
    the unbiased top-k; mean full-distribution scores)."""
    e_count, k, t_count = config.num_moe_experts, config.moe_router_topk, len(logits)
    counts, mean_scores = [0] * e_count, 0
    for logit in logits:
        if config.moe_router_score_function == "softmax":
            s = torch.softmax(logit, 0)
        else:
            s = torch.sigmoid(logit)
            s = s / s.sum()
        mean_scores = mean_scores + s / t_count
        for i in sorted(range(e_count), key=lambda i: -float(s[i].detach()))[:k]:
            counts[i] += 1
    return e_count * sum(counts[i] / (k * t_count) * mean_scores[i] for i in range(e_count))


def _z_loss(logits):
    """ST-MoE eq. 5: mean over tokens of logsumexp(logits)^2."""
    return sum(torch.logsumexp(logit, 0) ** 2 for logit in logits) / len(logits)


def _terms(config: ModelConfig, tokens: int) -> int:
    forward = 2 * config.hidden_size + config.moe_ffn_hidden_size + config.num_moe_experts + \
        config.moe_router_topk + (config.moe_shared_expert_intermediate_size or 0)
    return 2 * forward + tokens


def check_against_reference(config: ModelConfig, seed: int = 3, x=None, prepare=None,
                            scale: float = 1.0) -> MoELayer:
    """Output and every gradient of `build(config)` vs `reference` (objective: a random
    projection of the output plus scale x (aux_coeff aux + z_coeff z))."""
    layer = build(config, seed)
    if prepare is not None:
        prepare(layer)
    set_aux_loss_scale(layer, scale)
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(S, B, H, generator=gen) if x is None else x
    probe = torch.randn(S, B, H, generator=gen)
    x1 = x.clone().requires_grad_()
    y1 = layer(x1)
    (y1 * probe).sum().backward()

    params = dict(layer.named_parameters())
    leaves = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    x2 = x.clone().requires_grad_()
    y2, aux, z = reference(leaves, config, x2, layer.router.expert_bias)
    loss = (y2 * probe).sum() + scale * ((config.moe_aux_loss_coeff or 0) * aux +
                                         (config.moe_z_loss_coeff or 0) * z)
    loss.backward()
    k = _terms(config, S * B)
    problems = [fp32_mismatch(y1, y2.detach(), k), fp32_mismatch(x1.grad, x2.grad, k)]
    problems += [fp32_mismatch(params[n].grad, leaves[n].grad, k) for n in params]
    names = ["output", "input grad"] + [f"grad {n}" for n in params]
    bad = [f"{n}: {p}" for n, p in zip(names, problems) if p]
    assert not bad, bad
    return layer


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("overrides", [
    dict(),  # softmax after top-2, SwiGLU
    dict(moe_router_topk=1, moe_router_pre_softmax=True, activation="gelu"),  # Switch
    dict(moe_router_pre_softmax=True, activation="relu", moe_router_topk=3),
    dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
         moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
    dict(moe_router_score_function="sigmoid", moe_router_topk=1, activation="geglu",
         moe_shared_expert_intermediate_size=8),
], ids=["softmax-top2", "pre-softmax-top1", "pre-softmax-top3-relu", "sigmoid-shared-gated",
        "sigmoid-top1-shared"])
def test_layer_matches_dense_loops(overrides, no_grid):
    check_against_reference(moe_config(**overrides))


@pytest.mark.parametrize("overrides", [
    dict(moe_aux_loss_coeff=0.7, moe_z_loss_coeff=0.3),
    dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.2, moe_router_score_function="sigmoid"),
], ids=["softmax", "sigmoid"])
def test_aux_and_z_losses_match_their_formulas(overrides, no_grid):
    """The loss values the layer records, and their gradients through the layer's output
    (scaled by set_aux_loss_scale), against the formulas evaluated by loops."""
    config = moe_config(**overrides)
    layer = check_against_reference(config, scale=0.25)
    collect_expert_load(layer)  # resets the counters
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))
    layer(x.requires_grad_())
    logits = [layer.router.weight.detach() @ t for t in x.detach().reshape(-1, H)]
    aux, z = layer.router.loss_sums.tolist()
    assert math.isclose(aux, float(_aux_loss(logits, config)), rel_tol=1e-5), aux
    assert math.isclose(z, float(_z_loss(logits)), rel_tol=1e-5), z
    (load,) = collect_expert_load(layer)  # one microbatch since the zeroing
    assert math.isclose(load.aux_loss, aux) and math.isclose(load.z_loss, z)
    assert load.tokens_per_expert.sum() == S * B * config.moe_router_topk


@pytest.mark.parametrize("pad", [False, True], ids=["drop", "drop-and-pad"])
def test_capacity_drops_lowest_probabilities(pad, no_grid):
    """Capacity factor 0.5: each expert keeps its ceil(k T / E / 2) most probable copies; the
    load statistics count the dropped ones."""
    config = moe_config(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad)
    layer = check_against_reference(config)
    (load,) = collect_expert_load(layer)
    capacity = math.ceil(S * B * 2 / 4 * 0.5)
    kept = load.tokens_per_expert - load.dropped_per_expert
    assert load.dropped_per_expert.sum() > 0, load
    assert torch.equal(kept, load.tokens_per_expert.clamp(max=capacity)), load


def test_expert_with_no_tokens(no_grid):
    """An expert no token chooses: the output still equals the reference, its weights get a
    zero gradient (a tensor, not None), and its load is 0."""
    def starve_expert_3(layer):
        with torch.no_grad():
            layer.router.weight[3] = 0.0
            layer.router.weight[3, 0] = -50.0  # logit -50 * x0, x0 >= 1 below
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5))
    x[..., 0] = x[..., 0].abs() + 1.0
    layer = check_against_reference(moe_config(), x=x, prepare=starve_expert_3)
    for p in (layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight):
        assert p.grad is not None and torch.count_nonzero(p.grad[3]) == 0
        assert torch.count_nonzero(p.grad[:3]) > 0
    (load,) = collect_expert_load(layer)
    assert load.tokens_per_expert[3] == 0 and load.tokens_per_expert.sum() == 2 * S * B


def test_expert_bias_changes_choice_not_weights(no_grid):
    """A large bias on expert 0 puts it among every token's choices; the weights stay the
    unbiased (renormalised) sigmoid scores, which the reference computes from the definition."""
    config = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)

    def favour_expert_0(layer):
        layer.router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    layer = check_against_reference(config, prepare=favour_expert_0)
    routing = layer.router(torch.randn(S * B, H))
    assert bool((routing.indices == 0).any(dim=1).all())
    unbiased = build(config)
    unbiased.load_state_dict(layer.state_dict())
    unbiased.router.expert_bias.zero_()
    assert not bool((unbiased.router(torch.randn(S * B, H)).indices == 0).any(dim=1).all())


def test_expert_bias_update_and_load_statistics(no_grid):
    """Two microbatches' counts add up; update_expert_bias moves each bias by
    rate * sign(mean load - load); eval, no-grad and recompute forwards are not counted; a
    bf16 cast keeps the bias float32."""
    config = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_bias_update_rate=0.01)
    layer = build(config)
    xs = [torch.randn(S, B, H, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    expected = torch.zeros(4, dtype=torch.int64)
    for x in xs:
        routing = layer.router(x.reshape(-1, H))
        expected += torch.bincount(routing.indices.reshape(-1), minlength=4)
        layer(x.requires_grad_()).sum().backward()
    x = torch.randn(S, B, H, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    expected += torch.bincount(layer.router(x.reshape(-1, H)).indices.reshape(-1), minlength=4)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    layer.train()
    (load,) = collect_expert_load(layer)
    assert torch.equal(load.tokens_per_expert, expected), (load.tokens_per_expert, expected)
    assert math.isclose(load.imbalance, float(expected.max()) / float(expected.double().mean()))
    update_expert_bias(layer, [load])
    mean = expected.double().mean()
    assert torch.equal(layer.router.expert_bias, (0.01 * torch.sign(mean - expected)).float())
    assert collect_expert_load(layer)[0].tokens_per_expert.sum() == 0  # reset
    layer.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32
    assert layer.router.weight.dtype == torch.bfloat16


def test_transformer_picks_moe_layers_by_freq(no_grid):
    """moe_layer_freq as a list and as N; num_parameters counts every expert."""
    from models import GPTModel

    for freq, moe in (([0, 1, 1], [1, 2]), (2, [0, 2])):
        config = moe_config(num_layers=3, moe_layer_freq=freq, moe_shared_expert_intermediate_size=8,
                            moe_shared_expert_gate=True)
        model = GPTModel(config)
        found = [n for n, layer in model.decoder.layers.items() if isinstance(layer.mlp, MoELayer)]
        assert found == [str(n) for n in moe]
        dense = GPTModel(moe_config(num_layers=3, num_moe_experts=None, moe_router_topk=2,
                                    moe_ffn_hidden_size=None))
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        assert count(model) - count(dense) == config.num_parameters() - dense.config.num_parameters()


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_router_topk=5), "--moe-router-topk must be an integer in [1, --num-experts 4]"),
    (dict(moe_router_topk=0), "--moe-router-topk"),
    (dict(num_moe_experts=0), "--num-experts must be a positive integer"),
    (dict(moe_router_score_function="sparsemax"), "softmax or sigmoid"),
    (dict(moe_router_topk=1), "add --moe-router-pre-softmax"),
    (dict(moe_router_pre_softmax=True, moe_router_score_function="sigmoid"), "drop one"),
    (dict(moe_router_enable_expert_bias=True), "--moe-router-score-function sigmoid"),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
          moe_router_bias_update_rate=float("nan")), "--moe-router-bias-update-rate"),
    (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be a positive"),
    (dict(moe_expert_capacity_factor=float("inf")), "--moe-expert-capacity-factor"),
    (dict(moe_pad_expert_input_to_capacity=True), "--moe-pad-expert-input-to-capacity"),
    (dict(moe_aux_loss_coeff=-1.0), "--moe-aux-loss-coeff must be a finite number >= 0"),
    (dict(moe_z_loss_coeff=float("nan")), "--moe-z-loss-coeff"),
    (dict(moe_ffn_hidden_size=13), "--moe-ffn-hidden-size must be a positive integer divisible"),
    (dict(moe_shared_expert_intermediate_size=-8), "--moe-shared-expert-intermediate-size"),
    (dict(moe_shared_expert_gate=True), "--moe-shared-expert-intermediate-size or drop it"),
    (dict(moe_layer_freq=0), "--moe-layer-freq 0"),
    (dict(moe_layer_freq=[1, 2]), "each 1 (MoE) or 0 (dense MLP); got [1, 2]"),
    (dict(moe_layer_freq=[1]), "--num-layers 2 entries"),
    (dict(moe_layer_freq="1"), "--moe-layer-freq must be"),
    (dict(moe_token_dispatcher_type="allgather"), "use alltoall"),
    (dict(num_moe_experts=None, moe_router_topk=2, moe_aux_loss_coeff=0.1),
     "--moe-aux-loss-coeff configure mixture-of-experts layers, but --num-experts is not set"),
    (dict(num_moe_experts=True), "--num-experts must be a positive integer"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        config = moe_config(**{**overrides, "num_moe_experts": overrides.get("num_moe_experts", 4)})
        config.validate(tensor_model_parallel_size=2)
    assert message in str(info.value), str(info.value)


def test_config_errors_at_tp():
    with pytest.raises(ConfigError, match="divisible by --tensor-model-parallel-size 4"):
        moe_config(moe_ffn_hidden_size=6).validate(tensor_model_parallel_size=4)
    with pytest.raises(ConfigError, match="decoder-only"):
        ModelConfig(model_type="t5", position_embedding_type="relative", add_bias_linear=False,
                    num_moe_experts=4).validate()


# ----------------------------------------------------------------------------- expert parallelism

# (name, tp, ep, expert tp (None: tp), sequence parallel, config overrides, starve expert 3,
#  preset expert bias)
EP_CASES = [
    ("ep2", 1, 2, None, False, dict(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.1,
                              moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
     False, None),
    ("ep4-expert3-starved-bias", 1, 4, None, False,
     dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), True,
     [0.0, 0.3, 0.0, 0.0]),
    ("ep2-capacity", 1, 2, None, False, dict(moe_expert_capacity_factor=0.5), False, None),
    ("ep4-capacity-pad", 1, 4, None, False,
     dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True), False, None),
    ("ep2xtp2-sp", 2, 2, None, True,
     dict(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.1, moe_shared_expert_intermediate_size=8,
          moe_router_pre_softmax=True, moe_router_topk=1), False, None),
    ("ep2xtp2-capacity-pad", 2, 2, None, False,
     dict(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True,
          moe_aux_loss_coeff=0.2, activation="gelu"), False, None),
    # whole experts spread over the TP ranks (expert TP 1, ep = tp: infer.py
    # --enable-expert-parallel), with a shared expert and capacity padding
    ("tp2-experts-over-tp", 2, 2, 1, False,
     dict(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True,
          moe_shared_expert_intermediate_size=8, moe_aux_loss_coeff=0.2), False, None),
    ("tp2-sp", 2, 1, None, True, dict(moe_shared_expert_intermediate_size=8,
                                moe_shared_expert_gate=True, moe_z_loss_coeff=0.1), True, None),
]


def _microbatch(d: int, starve: bool):
    """Data-parallel rank d's microbatch and output probe (x0 >= 1 where expert 3 starves)."""
    gen = torch.Generator().manual_seed(100 + d)
    x, probe = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    if starve:
        x[..., 0] = x[..., 0].abs() + 1.0
    return x, probe


def _prepare(layer, starve, bias):
    with torch.no_grad():
        if starve:  # logit of expert 3 = -50 x0: no token chooses it
            layer.router.weight[3] = 0.0
            layer.router.weight[3, 0] = -50.0
        if bias is not None:
            layer.router.expert_bias.copy_(torch.tensor(bias))


def _dense(p, g, reduce: bool):
    """The dense tensor of `g` (parameter `p` or its gradient): TP shards and EP blocks
    joined; with `reduce` (a gradient) first summed over DP (dense parameters) or expert DP
    (expert parameters), as the step's reductions do."""
    import parallel_state as ps
    from layers import unshard_tensors
    from layers.sharding import tensor_parallel_size_of

    g = g.detach().clone()
    expert = getattr(p, "expert_parallel", False)
    group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
    if reduce and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(g, group=group)
    split = tensor_parallel_size_of(p)  # expert weights: expert TP (1: whole experts)
    if getattr(p, "tensor_model_parallel", False) and split > 1:
        parts = [torch.empty_like(g) for _ in range(split)]
        torch.distributed.all_gather(parts, g, group=ps.get_expert_tensor_parallel_group()
                                     if expert else ps.get_tensor_model_parallel_group())
        g = unshard_tensors(parts, p)
    if expert and ps.get_expert_model_parallel_world_size() > 1:
        blocks = [torch.empty_like(g) for _ in range(ps.get_expert_model_parallel_world_size())]
        torch.distributed.all_gather(blocks, g, group=ps.get_expert_model_parallel_group())
        g = torch.cat(blocks)
    return g


def _ep_case(name, tp, ep, etp, sp, overrides, starve, bias):
    import parallel_state as ps
    from parallel_state.mappings import all_reduce_sequence_parallel_grads

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, device="cpu", expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    config = moe_config(**overrides)
    config.validate(tp)
    layer = MoELayer(config, 0, sequence_parallel=sp)
    initialize_parameters(layer, 3, config.init_method_std, config.num_layers)
    _prepare(layer, starve, bias)
    x, probe = _microbatch(ps.get_data_parallel_rank(), starve)
    if sp:
        x, probe = (t.chunk(tp)[ps.get_tensor_model_parallel_rank()] for t in (x, probe))
    x.requires_grad_()
    y = layer(x)
    (y * probe).sum().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None]
    all_reduce_sequence_parallel_grads(list(layer.parameters()))
    grads = {n: _dense(p, p.grad, True) for n, p in layer.named_parameters()}
    weights = {n: _dense(p, p, False) for n, p in layer.named_parameters()}
    (load,) = collect_expert_load(layer)
    update_expert_bias(layer, [load])
    return dict(y=y.detach(), x_grad=x.grad, missing=missing,
                grads=grads if torch.distributed.get_rank() == 0 else None,
                weights=weights if torch.distributed.get_rank() == 0 else None,
                load=(load.tokens_per_expert, load.dropped_per_expert, load.aux_loss, load.z_loss),
                bias=layer.router.expert_bias, local_experts=layer.experts.num_local_experts)


def _ep_errors():
    import parallel_state as ps

    errors = []
    for tp, ep, etp, experts in ((2, 1, 1, 4), (1, 4, None, 6)):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, device="cpu", expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp)
        try:
            MoELayer(moe_config(num_moe_experts=experts), 0)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _ep_worker(cases):
    return {"cases": {case[0]: _ep_case(*case) for case in cases}, "errors": _ep_errors()}


def test_expert_parallel_layouts_match_one_process(no_grid):
    """One world of 4 ranks, each layout built in turn: EP 2 and 4, EP 2 x TP 2 (with and
    without sequence parallelism), TP 2 alone; dropless, capacity dropping (with and without
    padding), aux + z losses, expert bias; an expert no rank sends a token to (EP 4: its rank
    receives nothing at all). Each DP rank's microbatch through the layer equals one process
    running that microbatch (outputs, input gradients); the parameter gradients summed over the
    microbatches equal one process's; the initialized full weights are bitwise the same; the
    step's load counts and losses, and the updated bias, are the same numbers."""
    results = run_distributed(_ep_worker, 4, EP_CASES, timeout=600)
    for name, tp, ep, _, sp, overrides, starve, bias in EP_CASES:
        config = moe_config(**overrides)
        layer = build(config)
        _prepare(layer, starve, bias)
        dp = 4 // tp
        ref = []
        for d in range(dp):
            x, probe = _microbatch(d, starve)
            x.requires_grad_()
            y = layer(x)
            (y * probe).sum().backward()
            ref.append((y.detach(), x.grad))
        (load,) = collect_expert_load(layer)
        update_expert_bias(layer, [load])
        k = _terms(config, S * B * dp)
        bad = []
        for rank, result in enumerate(r["cases"][name] for r in results):
            d, t = divmod(rank, tp)
            y, x_grad = ref[d]
            if sp:
                y, x_grad = y.chunk(tp)[t], x_grad.chunk(tp)[t]
            for what, a, e in (("output", result["y"], y), ("input grad", result["x_grad"], x_grad)):
                problem = fp32_mismatch(a, e, k)
                if problem:
                    bad.append(f"{name} rank {rank} {what}: {problem}")
            if result["missing"]:
                bad.append(f"{name} rank {rank}: no gradient for {result['missing']}")
            tokens, dropped, aux, z = result["load"]
            if not (torch.equal(tokens, load.tokens_per_expert) and
                    torch.equal(dropped, load.dropped_per_expert)):
                bad.append(f"{name} rank {rank} load {tokens} {dropped} != {load}")
            for got, want in ((aux, load.aux_loss), (z, load.z_loss)):
                if (got is None) != (want is None) or (want is not None and
                                                       not math.isclose(got, want, rel_tol=1e-5)):
                    bad.append(f"{name} rank {rank} losses {aux} {z} != {load}")
            if bias is not None and not torch.equal(result["bias"], layer.router.expert_bias):
                bad.append(f"{name} rank {rank} bias {result['bias']} != {layer.router.expert_bias}")
            assert result["local_experts"] == 4 // ep
        for n, p in layer.named_parameters():
            if not torch.equal(results[0]["cases"][name]["weights"][n], p.detach()):
                bad.append(f"{name} {n}: layout-free init differs")
            problem = fp32_mismatch(results[0]["cases"][name]["grads"][n], p.grad, k)
            if problem:
                bad.append(f"{name} grad {n}: {problem}")
        if starve:
            assert load.tokens_per_expert[3] == 0, load
        if "capacity" in name:
            assert load.dropped_per_expert.sum() > 0, load
        assert not bad, bad
    errors = results[0]["errors"]
    assert "--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2" in errors[0]
    assert "--num-experts 6 is not divisible by --expert-model-parallel-size 4" in errors[1]
