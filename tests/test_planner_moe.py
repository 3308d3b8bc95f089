"""The planner's mixture-of-experts accounting (planner/moe.py), in one process:

- FLOPs per token count active parameters only, equal to a hand count of the matmuls;
- the planner's parameter list (names, order, local sizes) is the built model's, and total /
  active parameters follow from the real tensors; the shipped MoE shapes match transformers'
  own Mixtral, OLMoE and Qwen3-MoE models (on the meta device) and the published totals;
- model-state bytes per rank at (ep 2, tp 2) equal the ZeRO formula written out by hand, with
  the experts sharded over edp and the rest over dp;
- an MoE layer's saved activations equal the measured saved tensors of the real layer exactly
  (one process: the routing is then the layer's own, nothing is assumed balanced);
- the all-to-all and expert-gradient traffic equal a hand count; the EP groups' ranks are the
  grid's and an EP group spanning two nodes is timed at the inter-node figures;
- tools/plan.py searches ep (every listed layout passes train.py's checks) and refuses an EP
  size that cannot work.

The trainer's counted traffic and measured memory at EP layouts are compared with these
predictions in tests/test_planner.py's world.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from models import GPTModel, ModelConfig
from planner import moe
from planner.activations import model_chunk_bytes
from planner.communication import communication_per_rank, crosses_nodes, group_ranks, \
    step_communication
from planner.flops import forward_flops_per_token
from planner.parameters import chunk_parameters, model_state_prediction
from planner.search import Network
from test_planner import _plan
from training.arguments import load_model_config, parse_config

H, FFN, MOE_FFN, SHARED, E, K, V, S = 32, 64, 24, 16, 4, 2, 256, 16


def small_moe(**overrides) -> ModelConfig:
    """Layers 0, 2 and 3 MoE (4 experts of 24, top-2), layer 1 dense (ffn 64)."""
    fields = dict(num_layers=4, hidden_size=H, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=FFN, seq_length=S, vocab_size=V, position_embedding_type="rope",
                  normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, num_moe_experts=E,
                  moe_router_topk=K, moe_ffn_hidden_size=MOE_FFN, moe_layer_freq=[1, 0, 1, 1])
    fields.update(overrides)
    config = ModelConfig(**fields)
    config.validate()
    return config


def test_flops_count_active_parameters_only():
    m = small_moe(moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True)
    q, kv = 32, 16  # 4 heads and 2 groups of 8
    attention = 2 * H * (q + 2 * kv) + 2 * q * H + 4 * S * q  # QKV, proj, QK^T and AV
    dense_mlp = 2 * (H * 2 * FFN + FFN * H)  # SwiGLU: fc1 [h, 2f], fc2 [f, h]
    expert = 2 * (H * 2 * MOE_FFN + MOE_FFN * H)
    shared = 2 * (H * 2 * SHARED + SHARED * H)
    moe_mlp = 2 * H * E + K * expert + shared + 2 * H  # router, k experts, shared, its gate
    want = 4 * attention + dense_mlp + 3 * moe_mlp + 2 * H * V
    assert forward_flops_per_token(m) == want
    # the E - k experts a token skips cost nothing: more experts add only the router's 2 h E
    wider = small_moe(num_moe_experts=2 * E, moe_shared_expert_intermediate_size=SHARED,
                      moe_shared_expert_gate=True)
    assert forward_flops_per_token(wider) - want == 3 * 2 * H * E


def test_parameter_list_and_counts_are_the_built_models():
    m = small_moe(moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True)
    model = GPTModel(m)
    real = [(name, p.numel()) for name, p in model.named_parameters()]
    planned = [(p.name, p.count) for p in chunk_parameters(m, 1, list(range(4)), True, True,
                                                          False)]
    assert planned == real
    counts = moe.parameter_counts(m)
    assert counts["total"] == m.num_parameters() == sum(n for _, n in real)
    experts = sum(n for name, n in real if ".mlp.experts." in name)
    assert counts["routed_experts"] == experts and counts["moe_layers"] == 3
    assert counts["active"] == counts["total"] - experts * (E - K) // E
    dense = small_moe(num_moe_experts=None, moe_layer_freq=1, moe_router_topk=2,
                      moe_ffn_hidden_size=None)
    assert moe.parameter_counts(dense)["active"] == dense.num_parameters()
    assert moe.describe_parameters(m).endswith("4 experts top-2 in 3 of 4 layers)")


def _hf_parameters(make, layers: int, **kw) -> int:
    """Parameters of a transformers model of `layers` layers, from builds of 1 and 2 layers
    on the meta device (the count is linear in the layers)."""
    from transformers import AutoModelForCausalLM

    def count(n):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(make(num_hidden_layers=n, **kw))
        return sum(p.numel() for p in model.parameters())
    one, two = count(1), count(2)
    return one + (layers - 1) * (two - one)


@pytest.mark.parametrize("name, published_total, published_active, qk_norm", [
    ("mixtral-8x7b", 46.7, 12.9, 0),
    ("olmoe-1b-7b", 6.9, 1.3, 2 * 2048),  # q_norm, k_norm over the q and k projections
    ("qwen3-30b-a3b", 30.5, 3.3, 2 * 128),  # per head
])
def test_shipped_moe_shapes_match_transformers_and_published(name, published_total,
                                                             published_active, qk_norm):
    import transformers

    m = load_model_config(name)
    m.validate()
    hf = {"mixtral-8x7b": (transformers.MixtralConfig, dict(
              num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
              hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)),
          "olmoe-1b-7b": (transformers.OlmoeConfig, dict(
              num_experts=64, num_experts_per_tok=8, intermediate_size=1024, hidden_size=2048,
              num_attention_heads=16, num_key_value_heads=16, vocab_size=50304)),
          "qwen3-30b-a3b": (transformers.Qwen3MoeConfig, dict(
              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
              hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
              vocab_size=151936, tie_word_embeddings=False))}[name]
    counts = moe.parameter_counts(m)
    # shardzoo has no q/k norm: the shape without them
    assert counts["total"] + m.num_layers * qk_norm == _hf_parameters(hf[0], m.num_layers,
                                                                      **hf[1])
    # the published figures are rounded (Mixtral 12.88 -> 12.9) or cut (Qwen3 3.35 -> 3.3)
    assert abs(counts["total"] / 1e9 - published_total) < 0.06
    assert abs(counts["active"] / 1e9 - published_active) < 0.06


def _config(*flags, world=8):
    return parse_config(["--model", "tiny-moe", "--log-dir", "", "--micro-batch-size", "2",
                         "--global-batch-size", "16", *flags]).validate(world)


def test_model_states_at_ep2_tp2_are_the_zero_formula():
    """tiny-moe on 8 ranks at tp 2, ep 2: dp 4, edp 2; one bucket per set (the default
    40M-element buckets), no padding needed at these sizes."""
    h, v_local, layers, experts_local, f_local = 64, 8192 // 2, 4, 8 // 2, 128 // 2
    per_layer = 2 * h + (64 + 2 * 32) // 2 * h + 64 // 2 * h + 8 * h  # norms, QKV, proj, router
    dense = 2 * v_local * h + h + layers * per_layer  # embedding, output layer, final norm
    experts = layers * experts_local * (2 * f_local * h + h * f_local)  # fc1 [2f/t, h], fc2
    for flags, per_param in [  # bytes per element: replicated part, part sharded over N
            (["--bf16", "--use-distributed-optimizer"], (2 + 4, 12)),  # ZeRO-1: W + G, K
            (["--data-parallel-sharding-strategy", "optim_grads_params"], (0, 4 + 4 + 8))]:
        config = _config("--tp", "2", "--ep", "2", *flags)
        assert moe.expert_layout(config) == (2, 2, 2)
        want = sum(r * n + s * n // group for n, group in ((dense, 4), (experts, 2))
                   for r, s in [per_param])
        got = model_state_prediction(config)
        assert (got["total"], got["psi"], got["edp"]) == (want, dense + experts, 2), flags


@pytest.mark.parametrize("dtype, overrides", [
    (torch.float32, {}),
    (torch.bfloat16, {}),
    (torch.bfloat16, dict(moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True)),
    (torch.float32, dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01,
                         moe_z_loss_coeff=0.001)),
    (torch.float32, dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_aux_loss_coeff=0.01)),
    (torch.float32, dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)),
    (torch.float32, dict(activation="gelu", moe_expert_capacity_factor=0.5)),  # C = 4 of 8 rows
    (torch.float32, dict(activation="quick_geglu", activation_func_clamp_value=7.0,  # gpt-oss
                         glu_linear_offset=1.0, add_bias_linear=True)),
    (torch.float32, dict(activation="quick_geglu", activation_func_clamp_value=7.0,
                         glu_linear_offset=1.0, add_bias_linear=True, softmax_type="learnable")),
    (torch.float32, dict(activation="quick_geglu", activation_func_clamp_value=7.0,
                         glu_linear_offset=1.0, add_bias_linear=True, softmax_type="learnable",
                         window_size=(7, 0), window_attn_skip_freq=[1, 0, 1, 0])),  # 0, 2 slide
])
def test_moe_layer_activations_equal_measured(dtype, overrides):
    from training.memory import measure_activation_bytes

    torch.manual_seed(0)
    m = small_moe(**overrides)
    model = GPTModel(m)
    model.init_weights(7)
    model = model.to(dtype).train()
    b = 2
    ids = torch.randint(0, V, (b, S))
    got = measure_activation_bytes([model], {"tokens": ids, "labels": ids,
                                             "loss_mask": torch.ones(b, S)}, None, dtype=dtype)
    want = model_chunk_bytes(m, 4, S, b, 1, False, None, None, None, dtype.itemsize,
                             layer_numbers=[0, 1, 2, 3])
    assert got["layers"] == want, (overrides, got["layers"] - want)


def test_expert_traffic_is_a_hand_count():
    """tiny-moe at ep 2 on 4 ranks (dp 4, edp 2), 2 microbatches of 2 x 64 tokens, fp32."""
    t, k, h, e, n_exp, layers, mb, ranks = 2 * 64, 2, 64, 4, 8, 4, 2, 4
    for flags, extra_forward, rows in [
            ([], 0, t * k),  # dropless: every routed copy
            (["--recompute-granularity", "full"], 1, t * k),  # the forward's exchanges again
            (["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"], 0,
             n_exp * math.ceil(t * k * 1.5 / n_exp))]:  # E blocks of the capacity
        comm = step_communication(_config("--ep", "2", *flags, world=4))
        calls = ranks * mb * layers * (4 + 2 * extra_forward)  # tokens there and back, fwd+bwd
        counts = ranks * mb * layers * (1 + extra_forward)  # the counts exchange per forward
        assert comm[("ep", "all_to_all_single")] == (
            calls + counts, calls * rows * h * e + counts * 8 * n_exp), flags
        experts = layers * (n_exp // 2) * 3 * 128 * h  # this rank's experts' fp32 gradients
        assert comm[("edp", "all_reduce")] == (ranks, ranks * 4 * experts)
        assert comm[("ep", "all_reduce")] == (ranks, ranks * 4)  # the experts' squared norm


def test_expert_groups_and_their_time():
    # the grid's ep groups at tp 2 x dp 4 (tests/test_expert_parallel_grid.py "tp2_ep2")
    assert group_ranks("ep", 2, 4, 1, ep=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks("edp", 2, 4, 1, ep=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert not crosses_nodes("ep", 1, 8, 1, 4, ep=4)
    assert crosses_nodes("ep", 1, 8, 1, 4, ep=8)
    comm = {("ep", "all_to_all_single"): (8, 8 * 1e9)}  # one 1 GB all-to-all per rank
    net = Network(node_size=4, bandwidth_intra=400e9, bandwidth_inter=50e9, latency_intra=0,
                  latency_inter=0)
    inside = communication_per_rank(comm, 1, 8, 1, net, ep=4)["ep"]
    across = communication_per_rank(comm, 1, 8, 1, net, ep=8)["ep"]
    assert inside["sent_bytes"] == 3 / 4 * 1e9 and inside["seconds"] == 3 / 4 * 1e9 / 400e9
    assert across["sent_bytes"] == 7 / 8 * 1e9 and across["seconds"] == 7 / 8 * 1e9 / 50e9


def test_plan_searches_ep(capsys):
    code, out, _ = _plan(capsys, "--model", "tiny-moe", "--gpus", "4", "--gpu-memory", "2GB",
                         "--global-batch-size", "16", "--json")
    assert code == 0
    fits = json.loads(out)["fits"]
    assert {p["ep"] for p in fits} == {1, 2, 4}
    for p in fits:  # train.py's parser and checks accept every listed layout, ep included
        assert p["dp"] % p["ep"] == 0 and 8 % p["ep"] == 0
        config = parse_config(["--model", "tiny-moe", "--global-batch-size", "16", "--bf16",
                               "--log-dir", ""] + p["flags"].split()).validate(4)
        assert config.train.expert_model_parallel_size == p["ep"]
    code, out, _ = _plan(capsys, "--model", "tiny-moe", "--gpus", "4", "--gpu-memory", "2GB",
                         "--global-batch-size", "16", "--expert-model-parallel-size", "4",
                         "--top", "2")
    assert code == 0 and "(1.3M active per token, 8 experts top-2 in 4 of 4 layers)" in out
    header = out.splitlines()[1].split()
    assert header[:4] == ["#", "tp", "pp", "ep"] and out.splitlines()[2].split()[3] == "4"
    assert "--expert-model-parallel-size 4" in out and "all-to-alls over EP 4" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny-moe", "--expert-model-parallel-size", "3"],
     "--expert-model-parallel-size 3 does not divide --num-experts 8"),
    (["--model", "tiny-llama", "--expert-model-parallel-size", "2"], "has no MoE layers"),
    (["--model", "tiny-moe", "--gpus", "2", "--expert-model-parallel-size", "4"],
     "no split of 2 GPUs into tp x pp x dp has a dp divisible by 4"),
])
def test_plan_refuses_impossible_ep(capsys, argv, message):
    argv = argv if "--gpus" in argv else argv + ["--gpus", "8"]
    code, out, err = _plan(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
