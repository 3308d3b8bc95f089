"""The planner at context-parallel sizes, in one process, no training run:
activation bytes per rank fall exactly by cp (the sequence-dependent part; what the
start-up meter measures equals it at every cp layout: tests/test_context_parallel_training.py,
and the counted traffic of a cp step equals step_communication's: tests/test_planner.py),
the ring's bytes per step as ring.py documents them, ZeRO and the gradients over dp x cp,
the ring hidden behind the attention's compute in the step time, and tools/plan.py's cp
search and its refusals."""
from __future__ import annotations

import json
import math

import pytest

from planner import search
from planner.communication import context_parallel_communication, step_communication
from planner.flops import training_flops_per_token
from planner.context_parallel import (attention_buffer_bytes, layer_communication,
                                      ring_bytes_per_step)
from planner.memory import rank_memory
from planner.parameters import model_state_prediction
from test_planner import _plan  # tools/plan.py's main, its exit code, stdout and stderr
from training.arguments import parse_config

SEQ = 4096
TINY = ["--model", "tiny-llama", "--seq-length", str(SEQ), "--max-position-embeddings",
        str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "8"]


def _config(world: int, *flags: str, base=TINY):
    config = parse_config(base + list(flags))
    config.validate(world)
    return config


def test_activation_bytes_per_rank_fall_by_cp():
    """Per microbatch and rank (planner/memory.py, the figure the start-up line predicts):
    `L / cp` exactly at cp 1, 2, 4 and 8: every byte depends on the sequence (the cross
    entropy keeps no vocabulary mask: it is applied inside its own autograd function), so
    cp 2 and cp 4 hold exactly 1/2 and 1/4 (the CP attention, like the fused kernel at cp 1,
    returns its output laid out so that the projection's input is a view of it)."""
    per_rank = {cp: rank_memory(_config(cp, "--cp", str(cp)), 0)["activations_per_microbatch"]
                for cp in (1, 2, 4, 8)}
    seq_part = 4 * (per_rank[2] - per_rank[4])  # L, from the cp 2 and cp 4 points
    const = per_rank[2] - seq_part // 2
    assert const == 0
    for cp in (2, 4, 8):
        assert seq_part % cp == 0 and per_rank[cp] == seq_part // cp, cp
    assert per_rank[1] == seq_part


def test_ring_bytes_per_step_and_per_layer():
    """ring.py: each step sends K and V, `2 b g s/cp d` elements of the activation dtype,
    forward and backward, and in backward as many float32 (dK, dV); cp - 1 K/V steps each
    way and cp dK/dV steps; only the KV heads of a TP rank travel (g / t, at least 1)."""
    m = _config(1).model  # g = 2 KV heads, d = 16
    b, s, cp = 2, 64, 4
    elements = 2 * b * 2 * (s // cp) * 16
    assert ring_bytes_per_step(m, s, b, 1, cp, 2) == {"forward": 2 * elements,
                                                      "backward": 2 * elements + 4 * elements}
    for tp, heads in ((1, 2), (2, 1), (4, 1)):
        for e in (2, 4):
            kv = e * elements * heads // 2
            sends = layer_communication(m, s, b, tp, cp, e, "p2p")[("cp", "send")]
            assert sends == ((cp - 1) + (cp - 1) + cp,
                             (cp - 1) * kv + (cp - 1) * kv + cp * 4 * kv // e), (tp, e)
            again = layer_communication(m, s, b, tp, cp, e, "p2p", recomputed=True)
            assert again[("cp", "recv")] == (sends[0] + cp - 1, sends[1] + (cp - 1) * kv)
            gather = layer_communication(m, s, b, tp, cp, e, "all_gather")
            assert gather == {("cp", "all_gather_single"): (2, 2 * kv),
                              ("cp", "reduce_scatter_single"): (1, 4 * kv // e * cp)}
    assert layer_communication(m, s, b, 1, 1, 4) == {}
    with pytest.raises(ValueError, match="--cp-comm-type must be p2p or all_gather"):
        layer_communication(m, s, b, 1, 2, 4, "a2a")


def test_step_ring_and_buffers_scale_as_documented():
    """A step's ring traffic is layers x microbatches x ranks x one layer's; the ring holds
    two K/V blocks and float32 scores of s/cp x s/2cp, all_gather the whole sequence's K/V
    and a score block s/2cp x s wide, so at long s the ring's buffers are far smaller."""
    c = _config(4, "--cp", "4", "--recompute-granularity", "selective")
    m, mb = c.model, c.num_microbatches
    one = layer_communication(m, SEQ, 1, 1, 4, 4, "p2p", recomputed=True)
    ring = context_parallel_communication(c)
    assert ring == {k: (calls * m.num_layers * mb * 4, n * m.num_layers * mb * 4)
                    for k, (calls, n) in one.items()}
    assert all(step_communication(c)[k] == v for k, v in ring.items())
    p2p = attention_buffer_bytes(m, SEQ, 1, 1, 4, 4, "p2p")
    gathered = attention_buffer_bytes(m, SEQ, 1, 1, 4, 4, "all_gather")
    assert rank_memory(c, 0)["transient"] == p2p > 0
    assert gathered > 3 * p2p and attention_buffer_bytes(m, SEQ, 1, 1, 1, 4) == 0


def test_zero_and_gradients_over_dp_times_cp():
    """CP ranks hold the same weights: ZeRO shards and gradients reduce over dp x cp, so cp 2
    x dp 2 keeps the model states of dp 4 and moves dp 4's gradient bytes, on the group the
    counter labels dp-cp (cp at dp 1)."""
    for strategy in ("optim", "optim_grads_params"):
        flags = ("--data-parallel-sharding-strategy", strategy)
        cp2dp2 = model_state_prediction(_config(4, "--cp", "2", *flags))
        dp4 = model_state_prediction(_config(4, *flags))
        assert cp2dp2["total"] == dp4["total"] < model_state_prediction(
            _config(2, *flags))["total"]
        assert cp2dp2["dp"] == 4
    flags = ("--data-parallel-sharding-strategy", "optim")  # one reduce-scatter per step
    cp_comm = step_communication(_config(4, "--cp", "2", *flags))
    dp_comm = step_communication(_config(4, *flags))
    assert cp_comm[("dp-cp", "reduce_scatter_single")] == dp_comm[("dp", "reduce_scatter_single")]
    assert cp_comm[("dp-cp", "all_gather_single")] == dp_comm[("dp", "all_gather_single")]
    assert ("cp", "reduce_scatter_single") in step_communication(_config(2, "--cp", "2", *flags))


def test_the_ring_hides_behind_the_attention_compute():
    """Step time: the ring's transfers overlap the attention core's FLOPs (what exceeds them
    is exposed); the all_gather type's are all exposed."""
    c = _config(4, "--cp", "4")
    fast = search.Hardware(gpus=4, gpu_memory=80e9, network=search.Network(
        node_size=4, bandwidth_intra=1e15, latency_intra=0.0))  # a tiny model's ring
    slow = search.Hardware(gpus=4, gpu_memory=80e9, network=search.Network(
        node_size=4, bandwidth_intra=1e3))
    assert search.predict(c, fast)["cp_exposed_seconds"] == 0.0
    p = search.predict(c, slow)
    core = search._attention_core_seconds(c, slow) * c.num_microbatches
    assert p["cp_attention_seconds"] > core > 0
    assert p["cp_exposed_seconds"] == pytest.approx(p["cp_attention_seconds"] - core)
    gathered = search.predict(_config(4, "--cp", "4", "--cp-comm-type", "all_gather"), fast)
    assert gathered["cp_attention_seconds"] > 0
    assert gathered["cp_exposed_seconds"] == pytest.approx(gathered["cp_attention_seconds"])
    # FLOPs and MFU stay the model's: the whole model's FLOPs of the global batch over
    # the step time and every GPU (tp x cp x dp x pp)
    flops = training_flops_per_token(c.model) * c.train.global_batch_size * SEQ
    assert p["mfu"] == pytest.approx(flops / (p["step_seconds"] * 4 * slow.peak_tflops * 1e12))


# ---------------------------------------------------------------------- tools/plan.py
def test_plan_finds_and_ranks_cp_layouts(capsys):
    """A sequence too long for one GPU without TP (one GPU per node): only cp 4 fits,
    fastest first, each layout one train.py accepts; --context-parallel-size keeps one
    size; a cp whose 2 cp x tp does not divide the sequence under SP is rejected with
    train.py's own message."""
    argv = ["--model", "tiny-llama", "--gpus", "4", "--nodes-of", "1", "--seq-length",
            str(SEQ), "--global-batch-size", "4", "--fp32"]
    code, out, _ = _plan(capsys, *argv, "--gpu-memory", "0.12GB", "--json")
    assert code == 0, out
    result = json.loads(out)
    assert result["fits"] and {p["cp"] for p in result["fits"]} == {4}
    keys = [round(math.log(p["step_seconds"]), 3) for p in result["fits"]]
    assert keys == sorted(keys)  # fastest first (times within 0.1% tie: planner/search.py)
    for p in result["fits"]:
        config = parse_config(["--model", "tiny-llama", "--seq-length", str(SEQ),
                               "--max-position-embeddings", str(SEQ), "--global-batch-size",
                               "4", "--log-dir", ""] + p["flags"].split())
        config.validate(4)
        assert config.train.context_parallel_size == 4
    assert any(r["cp"] == 1 and "GB usable" in r["reason"] for r in result["rejected"])
    code, out, _ = _plan(capsys, *argv, "--gpu-memory", "1GB", "--context-parallel-size", "2",
                         "--json")
    assert code == 0 and {p["cp"] for p in json.loads(out)["fits"]} == {2}
    code, out, _ = _plan(capsys, *argv, "--gpu-memory", "0.12GB", "--top", "2")
    assert code == 0 and " cp " in out.splitlines()[1] and "--context-parallel-size 4" in out
    assert "1/4 of every sequence" in out and "gradients reduce over dp x cp" in out, out
    code, out, _ = _plan(capsys, "--model", "tiny-llama", "--gpus", "4", "--seq-length", "4100",
                         "--global-batch-size", "4", "--gpu-memory", "1GB", "--json")
    reasons = [r["reason"] for r in json.loads(out)["rejected"]
               if r["cp"] == 2 and r["sequence_parallel"]]
    assert reasons and all("--seq-length 4100 is not divisible by 2 x --context-parallel-size "
                           "x --tensor-model-parallel-size = 8" in r for r in reasons), reasons


@pytest.mark.parametrize("argv, message", [
    (["--context-parallel-size", "3"], "--context-parallel-size 3 does not divide --gpus 4"),
    (["--context-parallel-size", "0"], "--context-parallel-size must be a positive integer"),
    (["--context-parallel-size", "4", "--seq-length", "4100"],
     "--seq-length 4100 is not divisible by 2 x --context-parallel-size = 8"),
    (["--context-parallel-size", "2", "--model", "tiny-moe"],
     "the planner does not model expert layouts under context parallelism"),
])
def test_plan_refuses_bad_cp(capsys, argv, message):
    base = ["--model", "tiny-llama", "--gpus", "4"]
    code, out, err = _plan(capsys, *base, *argv)
    assert code == 2 and not out
    assert err.startswith("plan.py: error: ") and message in err, err


def test_moe_experts_over_dp_times_cp():
    """train.py carves the experts out of dp x cp: at cp 2 x ep 2 the planner's layout is edp
    1 on 2 ranks (dp 1: the start-up planner line raised there before) and edp 2 on 4; each
    forward sums the router's tokens per expert over cp, and each step the load statistics
    (train.py --report-comm counted 36 calls, 3,328 B on 4 ranks: equal)."""
    from planner.moe import expert_layout

    moe = ["--model", "tiny-moe", "--seq-length", "64", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--cp", "2", "--ep", "2"]
    assert expert_layout(_config(2, base=moe)) == (2, 1, 1)
    c = _config(4, base=moe)
    assert expert_layout(c) == (2, 1, 2)
    m, forwards = c.model, c.model.num_layers * c.num_microbatches  # every layer is MoE
    e, layers = m.num_moe_experts, m.num_layers
    assert step_communication(c)[("cp", "all_reduce")] == (
        4 * (forwards + 1), 4 * (forwards * 4 * e + 8 * (2 * e + 2) * layers)) == (36, 3328)
