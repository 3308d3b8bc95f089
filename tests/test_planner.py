"""The planner (planner/, tools/plan.py) against measurement.

One spawned 4-process world trains one step of six layouts with `--report-comm`:

- predicted model-state bytes per rank equal the measured tensors exactly (ZeRO 0/1/2/3,
  bf16, tied embeddings over pp 2, vpp 2, TP 2 + SP, buckets padded to dp one by one,
  dropout on);
- predicted calls and bytes of the step equal the counted ones exactly, per group and op: TP
  all-reduces (forward and backward, and again under full recompute), SP all-gathers and
  reduce-scatters, the DP all-reduce, ZeRO-1/2 reduce-scatter + all-gather, ZeRO-3's
  per-unit gathers (a steady second step), PP p2p messages (1F1B and interleaved), the
  tied-embedding all-reduce, the gradient-norm and loss scalars;
- ZeRO-3's gathered-parameter peak equals data_parallel/fsdp.py's own prediction;
- predicted activation bytes per microbatch are within 10% of measured (observed: ratio 1.000
  on every layout: the planner uses the layer's term-by-term model, training/memory.py).

Two context-parallel layouts are held to the same standard: cp 2 x dp 2 under
ZeRO-1 with the ring and full recompute (each recomputed layer's ring runs again; gradients
over the dp-cp group), cp 2 x tp 2 with the all_gather type and selective recompute.

The same world trains tiny-moe (8 experts top-2) at expert-parallel layouts: ep 2 x tp 2 with
SP, shared experts, full recompute and MoE in every second layer; ep 2 x dp 4 (edp 2) under
ZeRO-1 in bf16 with the auxiliary and z losses. Their model states, activations and every
group's calls and bytes (the all-to-alls over ep, the expert gradients over edp, the routing
weights over tp/sp) are held to the same standard: dropless, the copies sent are the copies
routed, so the all-to-all bytes summed over the ranks are exact whatever the routing. With
capacity dropping (ep 2 x dp 4, ZeRO-2, factor 1.0) only the all-to-all bytes depend on the
routing: the planner assumes a balanced load, so their ratio is reported (<= 1: a dropped copy
is not sent), the calls and everything else still match.

In the parent: every layout `tools/plan.py` lists for a small GPT on 8 GPUs passes train.py's
validation, every rejected one has a reason, and bad input gets one clear line
(tests/test_planner_moe.py: the MoE accounting in one process, and plan.py's ep search).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys

import pytest

from distributed import run_distributed

COMMON = ["--train-iters", "1", "--eval-interval", "0", "--no-tensorboard", "--peak-tflops",
          "1", "--report-comm", "--lr-warmup-iters", "0", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--num-layers", "4"]
GPT = ["--config", "configs/tiny-gpt.yaml"]  # tied embeddings, LayerNorm, biases, GeLU
LLAMA = ["--config", "configs/tiny-llama.yaml"]  # untied, RMSNorm, SwiGLU, GQA
MOE = ["--model", "tiny-moe", "--seq-length", "64"]  # tiny-llama's attention, 8 experts top-2
STRATEGY = "--data-parallel-sharding-strategy"
LAYOUTS = {
    "tp2 dp2 (TP all-reduces, DP all-reduce)": LLAMA + ["--tp", "2"],
    "tp2 sp dp2 ZeRO-1 bf16": LLAMA + ["--tp", "2", "--sequence-parallel", "--bf16",
                                       "--use-distributed-optimizer"],
    "pp2 dp2 tied ZeRO-2, small buckets": GPT + ["--pp", "2", STRATEGY, "optim_grads",
                                                 "--ddp-bucket-size", "30000"],
    "pp2 vpp2 tp2 tied full recompute": GPT + ["--pp", "2", "--vpp", "2", "--tp", "2",
                                               "--recompute-granularity", "full"],
    "dp4 ZeRO-3 selective recompute, 2 steps": GPT + [
        STRATEGY, "optim_grads_params", "--recompute-granularity", "selective",
        "--train-iters", "2", "--ddp-bucket-size", "30000",  # the second step is counted
        "--profile-pipeline"],  # its timeline gather is not the step's traffic
    "tp2 sp pp2 ZeRO-1 tied, dropout": GPT + ["--tp", "2", "--pp", "2", "--sequence-parallel",
                                              "--use-distributed-optimizer", "--hidden-dropout",
                                              "0.1", "--attention-dropout", "0.1"],
    "cp2 dp2 ZeRO-1, ring, full recompute": LLAMA + [
        "--cp", "2", "--use-distributed-optimizer", "--recompute-granularity", "full"],
    "cp2 tp2 all_gather, selective recompute": LLAMA + [
        "--cp", "2", "--tp", "2", "--cp-comm-type", "all_gather",
        "--recompute-granularity", "selective"],
    "MoE ep2 tp2 sp, shared experts, every 2nd layer, full recompute": MOE + [
        "--ep", "2", "--tp", "2", "--sequence-parallel", "--recompute-granularity", "full",
        "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "2"],
    "MoE ep2 dp4 (edp 2) ZeRO-1 bf16, aux and z losses": MOE + [
        "--ep", "2", "--bf16", "--use-distributed-optimizer", "--moe-z-loss-coeff", "0.001"],
}
MOE_DROPPING = MOE + ["--ep", "2", STRATEGY, "optim_grads", "--moe-expert-capacity-factor", "1.0"]


def _worker(runs: list[list[str]], log_dir: str, cache: str):
    import os

    import torch.distributed as dist

    import parallel_state as ps
    from parallel_state import collectives
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        records = pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))
        assert not collectives._consumers  # counting is off again: the fast path is back
        comm = next(r for r in records if r.get("event") == "comm")
        start = {}
        if os.path.exists(f"{log_dir}/{i}/metrics.jsonl"):
            with open(f"{log_dir}/{i}/metrics.jsonl") as f:
                start = json.loads(f.readline())
        out.append({"comm": comm["comm"], "rank": dist.get_rank(),
                    **{k: v for k, v in start.items()
                       if k.startswith(("planner_", "model_state_total", "activation_bytes",
                                        "model_state_gathered"))}})
    return out


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory, corpus_env):
    tmp = tmp_path_factory.mktemp("planner")
    results = run_distributed(_worker, 4, [COMMON + a for a in LAYOUTS.values()] +
                              [COMMON + MOE_DROPPING], str(tmp),
                              corpus_env["SHARDZOO_CACHE"], timeout=900)
    return results[0]


@pytest.fixture(scope="module")
def runs(all_runs):
    return dict(zip(LAYOUTS, all_runs))


def test_model_states_and_activations_match(runs):
    for name, r in runs.items():
        assert r["planner_model_state_bytes"] == r["model_state_total_bytes"], name
        assert r["planner_model_state_ratio"] == 1.0, name
        assert abs(r["planner_activation_ratio"] - 1) < 0.10, (name, r["planner_activation_ratio"])
        # every rank (the last pipeline stage's output layer and loss too)
        assert r["planner_model_state_ratio_per_rank"] == [1.0] * 4, name
        assert all(abs(x - 1) < 0.10 for x in r["planner_activation_ratio_per_rank"]), \
            (name, r["planner_activation_ratio_per_rank"])
        if "ZeRO-3" in name:  # the gathered units' peak, as data_parallel/fsdp.py predicts it
            assert r["planner_gathered_params_peak_bytes"] == \
                r["model_state_gathered_params_predicted_peak_bytes"] > 0


def test_communication_matches_counted(runs):
    seen = set()
    for name, r in runs.items():
        for row in r["comm"]:
            assert (row["calls"], row["bytes"]) == (row["predicted_calls"],
                                                    row["predicted_bytes"]), (name, row)
            seen.add((row["group"], row["op"]))
    for key in [("tp", "all_reduce"), ("sp", "all_gather_single"),
                ("sp", "reduce_scatter_single"), ("dp", "all_reduce"),
                ("dp", "reduce_scatter_single"), ("dp", "all_gather_single"), ("pp", "send"),
                ("pp", "recv"), ("embedding", "all_reduce"), ("mp", "all_reduce"),
                ("ep", "all_to_all_single"), ("ep", "all_reduce"),
                ("edp", "reduce_scatter_single"), ("edp", "all_gather_single"),
                ("cp", "send"), ("cp", "recv"), ("cp", "all_gather_single"),
                ("cp", "reduce_scatter_single"), ("dp-cp", "reduce_scatter_single"),
                ("dp-cp", "all_gather_single")]:
        assert key in seen, key


def test_moe_capacity_dropping_reports_the_all_to_all_ratio(all_runs):
    """Capacity factor 1.0 drops some routed copies: the all-to-alls carry fewer rows than
    the balanced prediction (ratio below 1, and not far below: most copies fit); their calls
    and every other group's traffic, and the model states, still match exactly."""
    r = all_runs[len(LAYOUTS)]
    assert r["planner_model_state_ratio_per_rank"] == [1.0] * 4
    for row in r["comm"]:
        if (row["group"], row["op"]) == ("ep", "all_to_all_single"):
            assert row["calls"] == row["predicted_calls"]
            assert 0.5 < row["ratio"] < 1, row
        else:
            assert (row["calls"], row["bytes"]) == (row["predicted_calls"],
                                                    row["predicted_bytes"]), row


# ---------------------------------------------------------------------- tools/plan.py
def _plan(capsys, *argv):
    sys.path.insert(0, "tools")
    try:
        import plan as plan_cli
    finally:
        sys.path.pop(0)
    code = plan_cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_lists_only_valid_layouts(capsys):
    from training.arguments import parse_config

    code, out, _ = _plan(capsys, "--model", "tiny-gpt", "--gpus", "8", "--gpu-memory", "2GB",
                         "--global-batch-size", "32", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["fits"] and result["rejected"]
    for p in result["fits"]:  # train.py's parser and validation accept each listed layout
        config = parse_config(["--model", "tiny-gpt", "--global-batch-size", "32",
                               "--bf16", "--log-dir", ""] + p["flags"].split())
        config.validate(8)
        assert (config.data_parallel_size, config.num_microbatches) == (p["dp"],
                                                                        p["num_microbatches"])
    assert all(r["reason"] for r in result["rejected"])
    # fastest first (times within 0.1% tie, see planner/search.py)
    keys = [round(math.log(p["step_seconds"]), 3) for p in result["fits"]]
    assert keys == sorted(keys)
    # the table, the paragraph and the reasons (2 nodes of 4: TP 8 would cross nodes)
    code, out, _ = _plan(capsys, "--model", "tiny-llama", "--gpus", "8", "--nodes-of", "4",
                         "--gpu-memory", "0.05GB", "--global-batch-size", "16", "--top", "3")
    assert code == 0 and "Top choice for tiny-llama on 8 GPUs" in out, out
    assert "exceeds the 4 GPUs of a node" in out and "usable" in out and "Runner-up" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-7", "--gpus", "8"], "did you mean 'llama-7b'"),
    (["--model", "llama-70b", "--gpus", "12"], "--gpus 12 is not a multiple of --nodes-of 8"),
    (["--model", "llama-70b", "--gpus", "8", "--gpu-memory", "80 apples"], "--gpu-memory"),
    (["--model", "llama-7b", "--gpus", "1", "--gpu-memory", "16GB", "--seq-length", "1024",
      "--global-batch-size", "8"], "at least 11 GPUs would fit"),  # pp 11: 10 x 3 + 2 layers
])
def test_plan_bad_input_one_line(capsys, argv, message):
    code, out, err = _plan(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("plan.py: error")
    assert message in err, err


def test_plan_says_what_it_does_on_a_terminal():
    """On a terminal plan.py's first output is a status line, written before torch is
    imported (which took minutes on a loaded machine), then the count of layouts it checks;
    the line is erased before the plan prints. `plan()` reports every layout it checks."""
    import os
    import pty
    import subprocess

    from launch import REPO
    from training.arguments import parse_config
    from planner import search

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "tools/plan.py", "--model",
                             "tiny-gpt", "--gpus", "4", "--gpu-memory", "2GB", "--top", "1"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    out = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, err
    err = err.decode()
    status = err.index("\r\x1b[Kplan.py: loading train.py's checks and the planner (torch)")
    assert status < re.search(r"\| +torch\r\n", err).start()  # said before torch is imported
    assert "plan.py: checking 864 layouts ..." in err and err.endswith("\r\x1b[K")
    assert out.startswith("tiny-gpt: ") and "plan.py:" not in out

    model = parse_config(["--model", "tiny-gpt"]).model
    seen = []
    hw = search.Hardware(gpus=4, gpu_memory=2e9, network=search.Network(node_size=4))
    result = search.plan(model, hw, 16, progress=lambda n, fit: seen.append((n, fit)))
    assert search.layout_count(model, 4) == 864 == len(result["fits"]) + len(result["rejected"])
    assert [n for n, _ in seen] == list(range(864)) and seen[-1][1] <= len(result["fits"])


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "geglu", "relu"])
def test_parameter_list_matches_the_built_model(activation):
    """The planner's per-rank parameter list (names and counts) equals the model's own, for
    every activation (GeGLU's fc1 is fused [gate; up] like SwiGLU's)."""
    import torch

    from models import GPTModel
    from models.config import ModelConfig
    from planner.parameters import chunk_parameters

    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                    seq_length=16, max_position_embeddings=16, vocab_size=128,
                    activation=activation, add_bias_linear=False)
    with torch.device("meta"):
        model = GPTModel(m)
    built = {name: p.numel() for name, p in model.named_parameters()}
    predicted = {s.name: s.count for s in chunk_parameters(m, 1, [0, 1], True, True, False)}
    assert predicted == built


def test_plan_searches_offload_when_nothing_fits(capsys, tmp_path):
    """GPUs too small for every plain layout of tiny-llama but large enough with ZeRO-
    Infinity's offload: plan() searches offload (ZeRO-2/3 with the optimizer, ZeRO-3 also
    with the parameters, on the host or NVMe); every fit offloads and its flags pass train.py's
    checks; with little host memory only NVMe layouts fit; the offload time is the formula of
    planner/search.py at the assumed bandwidths, which plan.py names."""
    from training.arguments import parse_config
    from planner import search

    model = parse_config(["--model", "tiny-llama"]).model
    big = search.Hardware(gpus=2, gpu_memory=1e12, network=search.Network(node_size=2),
                          memory_headroom=0.0, nvme_bandwidth=2e9, host_bandwidth=4e9)
    plain = min(p["memory"]["total"] for p in search.plan(model, big, 8)["fits"])
    offloaded = [search.predict(c, big) for c, reason in search.enumerate_layouts(
        model, 2, 8, offload=search.offload_choices(True)) if reason is None]
    least = min(p["memory"]["total"] for p in offloaded)
    assert least < plain
    hw = dataclasses.replace(big, gpu_memory=(least + plain) / 2)
    result = search.plan(model, hw, 8)
    assert result["offload"] and result["fits"]
    assert not search.plan(model, hw, 8, offload=False)["fits"]
    for p in result["fits"]:
        assert p["optimizer_offload"] and p["memory"]["total"] <= hw.gpu_memory
        flags = p["flags"] if "flags" in p else search.flags(p)
        parse_config(["--model", "tiny-llama", "--global-batch-size", "8", "--bf16",
                      "--log-dir", ""] + flags.replace("DIR", str(tmp_path)).split()
                     ).validate(2)
    best = result["fits"][0]
    config = parse_config(["--model", "tiny-llama", "--global-batch-size", "8", "--bf16",
                           "--log-dir", ""] + search.flags(best).replace("DIR", "x").split())
    config.validate(2)
    from planner.parameters import model_state_prediction

    states = model_state_prediction(config, best["memory"]["pp_rank"])
    n = states["psi_padded"] // states["dp"]  # the rank's optimizer elements
    expect = n * (4 + 2) / 4e9 + (24 * n / (2e9 / 2) if best["optimizer_offload"] == "nvme"
                                  else 0)
    if best["param_offload"]:
        bw = 4e9 if best["param_offload"] == "cpu" else 1e9
        reads = 2 + (best["recompute"] == "full")
        expect += max(0.0, best["num_microbatches"] * reads * n * 2 / bw
                      - best["pipeline_seconds"]) + n * 2 / bw
    assert best["offload_seconds"] == pytest.approx(expect, rel=1e-12)
    # little host memory: only the NVMe layouts (their host part is the streaming buffers)
    nvme_host = min(p["memory"]["host"] for p in result["fits"]
                    if "nvme" in (p["optimizer_offload"], p["param_offload"]))
    small = dataclasses.replace(hw, host_memory=2 * nvme_host)
    for p in search.plan(model, small, 8)["fits"]:
        assert "nvme" in (p["optimizer_offload"], p["param_offload"]) and \
            2 * p["memory"]["host"] <= small.host_memory
    code, out, _ = _plan(capsys, "--model", "tiny-llama", "--gpus", "2", "--nodes-of", "2",
                         "--gpu-memory", f"{hw.gpu_memory / 1e9:.9f}GB", "--memory-headroom", "0",
                         "--global-batch-size", "8", "--nvme-bandwidth", "2GB/s",
                         "--host-bandwidth", "4GB/s", "--top", "2")
    assert code == 0 and "No layout fits without offload" in out, out
    assert "4 GB/s device-host per GPU (--host-bandwidth)" in out
    assert "NVMe 2 GB/s per node (--nvme-bandwidth)" in out and "--optimizer-offload-device" in out


def test_plan_splits_layers_unevenly_over_the_pipeline(capsys, tmp_path):
    """A decoder whose layers do not divide over pp (DeepSeek-V3's 61) gets stages of
    ceil(L / pp) and the rest on the last (`--decoder-last-pipeline-num-layers`): 5 layers
    over pp 2 as 3 + 2, which train.py accepts; over pp 4 no such split (2 x 3 > 5)."""
    import yaml

    from training.arguments import parse_config

    model = yaml.safe_load(open("configs/models/tiny-deepseek.yaml"))
    model.update(num_layers=5, moe_layer_freq=[0, 1, 1, 1, 1])
    path = tmp_path / "five.yaml"
    path.write_text(yaml.safe_dump(model))
    code, out, _ = _plan(capsys, "--model", str(path), "--gpus", "4", "--global-batch-size",
                         "8", "--json")
    assert code == 0
    result = json.loads(out)
    uneven = [p for p in result["fits"] if p["pp"] == 2]
    assert uneven and all(p["last_stage_layers"] == 2 for p in uneven)
    for p in uneven[:3]:
        assert "--decoder-last-pipeline-num-layers 2" in p["flags"]
        config = parse_config(["--model", str(path), "--global-batch-size", "8", "--bf16",
                               "--log-dir", ""] + p["flags"].split())
        config.validate(4)
        assert config.stage_num_layers() == [3, 2]
    assert not any(p["pp"] == 4 for p in result["fits"])
    assert any(r["pp"] == 4 and "cannot be split evenly" in r["reason"]
               for r in result["rejected"])
