"""FP8 accounting: the FP8 GEMMs' FLOPs counted against the data sheet's FP8 peak (training's
MFU peak, the planner's step time and MFU), and the FP8 buffers in the start-up memory line
and the planner's memory (planner/flops.py, training/mfu.py, planner/memory.py)."""
from __future__ import annotations

import pytest
import torch

BASE = ["--config", "configs/tiny-llama.yaml", "--num-layers", "4", "--seq-length", "32"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16"]


def _config(extra=(), world: int = 1):
    from training.arguments import parse_config

    return parse_config(BASE + list(extra)).validate(world)


def test_fp8_flops_share_and_blended_peak_by_hand(no_grid):
    """tiny-llama's FP8 GEMMs are its layers' QKV / output projections and SwiGLU MLP:
    `2 h (q + 2 kv) + 2 q h + 2 * 3 h f` per token and layer (no attention core, no logits),
    minus the first and last layer under --first-last-layers-bf16; MoE layers (tiny-moe)
    count only their attention linears. The blended peak is FLOPs over the ideal time."""
    from planner.flops import (blended_peak, forward_flops_per_token, fp8_flops_share,
                               fp8_forward_flops_per_token)

    m = _config().model
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv = m.query_projection_size, m.kv_projection_size
    per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * f
    assert fp8_forward_flops_per_token(m) == 4 * per_layer
    assert fp8_forward_flops_per_token(m, 1, 1) == 2 * per_layer
    assert fp8_flops_share(m) == pytest.approx(4 * per_layer / forward_flops_per_token(m))
    assert 0 < fp8_flops_share(m, 1, 1) < fp8_flops_share(m) < 1
    from training.arguments import parse_config

    moe = parse_config(["--model", "tiny-moe"]).validate(1).model
    attention = 2 * moe.hidden_size * (moe.query_projection_size + 2 * moe.kv_projection_size) \
        + 2 * moe.query_projection_size * moe.hidden_size
    dense = sum(not moe.is_moe_layer(n) for n in range(moe.num_layers))
    mlp = 2 * 3 * moe.hidden_size * moe.ffn_hidden_size
    assert fp8_forward_flops_per_token(moe) == moe.num_layers * attention + dense * mlp
    assert blended_peak(989.0, 1979.0, 0.0) == 989.0
    assert blended_peak(989.0, 1979.0, 1.0) == pytest.approx(1979.0)
    assert blended_peak(989.0, 1979.0, 0.5) == pytest.approx(1 / (0.5 / 989 + 0.5 / 1979))
    with pytest.raises(ValueError, match="fp8_share 1.5 must be in"):
        blended_peak(989.0, 1979.0, 1.5)


def test_mfu_peak_counts_fp8_gemms_at_the_fp8_peak(monkeypatch, no_grid):
    """On an H100 / H200 (the data sheet's 989 bf16, 1979 FP8) an FP8 run's MFU peak is the
    blend by the FP8 share; an A100 has no FP8 peak (its 312, said so); a CPU's measured peak
    stays, with the note that it has no FP8 peak; --peak-tflops is taken as given. Before:
    989 for every FP8 run (its FP8 GEMMs counted at the bf16 peak)."""
    from training import mfu

    monkeypatch.setattr(mfu, "measured_matmul_peak", lambda *a, **k: (0.05e12, 1024))
    monkeypatch.setattr(mfu, "cpu_threads_per_rank", lambda: (2.0, "2 threads"))
    cuda = torch.device("cuda")
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d, n=name: n)
        plain = mfu.PeakFlops(cuda, torch.bfloat16)
        fp8 = mfu.PeakFlops(cuda, torch.bfloat16, fp8_share=0.6)
        assert plain.tflops == 989.0 and plain.fp8_share == 0.0
        assert fp8.tflops == pytest.approx(1 / (0.4 / 989 + 0.6 / 1979))
        assert "bf16 989 and FP8 1979 TFLOP/s, weighted by the FP8 GEMMs' 60.0%" in fp8.source
        assert fp8.mfu(1000.0) == pytest.approx(1000.0 / fp8.tflops)  # over 989: still shown
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA A100-SXM4-80GB")
    a100 = mfu.PeakFlops(cuda, torch.bfloat16, fp8_share=0.6)
    assert a100.tflops == 312.0 and "A100 has no FP8 peak" in a100.source
    cpu = mfu.PeakFlops(torch.device("cpu"), torch.float32, fp8_share=0.6)
    assert cpu.tflops == pytest.approx(0.1) and "a CPU has no FP8 peak" in cpu.source
    assert mfu.PeakFlops(cuda, torch.bfloat16, 500.0, fp8_share=0.6).tflops == 500.0


def test_planner_runs_fp8_gemms_at_the_fp8_peak_and_counts_the_buffers(no_grid):
    """The planner's microbatch time under --fp8-format is the FP8 GEMMs at the FP8 rate plus
    the rest at the bf16 rate, its MFU divides by the blended peak (no FP8 peak: the bf16
    rate and peak, as before); its FP8 buffers (delayed: [16 + 1] x 3 float32 per FP8
    linear, 4 per layer outside the kept ones) equal what the built model's Fp8State
    buffers hold (layers/fp8.py `fp8_state_bytes`), and are 0 for the other recipes."""
    from layers.fp8 import apply_fp8, fp8_state_bytes
    from models import GPTModel
    from planner import search
    from planner.flops import blended_peak, fp8_flops_share, layer_forward_flops
    from planner.memory import fp8_buffer_bytes, rank_memory
    from planner.parameters import rank_chunks
    from run_config.fp8 import fp8_layers_kept, fp8_recipe

    hw = search.Hardware(gpus=1, gpu_memory=80e9, network=search.Network(node_size=1))
    plain, fp8 = _config(), _config(FP8)
    m, t = plain.model, plain.train
    t_plain = search._compute_seconds_per_microbatch(plain, hw)
    t_fp8 = search._compute_seconds_per_microbatch(fp8, hw)
    share = fp8_flops_share(m)  # every layer in FP8 (no --first-last-layers-bf16)
    logits = 2.0 * m.hidden_size * m.padded_vocab_size(1)
    total = sum(layer_forward_flops(m, n) for n in range(m.num_layers)) + logits
    assert share == pytest.approx(1 - (total - share * total) / total)
    expected = 3 * total * ((1 - share) / 989e12 + share / 1979e12) / 0.7 \
        * t.micro_batch_size * m.seq_length
    assert t_fp8 == pytest.approx(expected) and t_fp8 < t_plain
    assert search.mfu_peak_tflops(fp8, hw) == pytest.approx(blended_peak(989, 1979, share))
    assert search.mfu_peak_tflops(plain, hw) == 989.0
    no_fp8 = search.Hardware(gpus=1, gpu_memory=80e9, network=search.Network(node_size=1),
                             fp8_peak_tflops=None)
    assert search._compute_seconds_per_microbatch(fp8, no_fp8) == pytest.approx(t_plain)
    assert search.mfu_peak_tflops(fp8, no_fp8) == 989.0
    for extra, layers in ((FP8, 4), (FP8 + ["--first-last-layers-bf16"], None)):
        c = _config(extra)
        kept = fp8_layers_kept(c.model, c.train)
        n_fp8 = layers or c.model.num_layers - sum(kept)
        predicted = fp8_buffer_bytes(c, rank_chunks(c, 0))
        assert predicted == n_fp8 * 4 * 3 * 4 * 17 and predicted > 0
        model = GPTModel(c.model)
        apply_fp8(model, fp8_recipe(c.train), c.model.num_layers, *kept)
        assert fp8_state_bytes([model]) == predicted
        assert rank_memory(c, 0)["fp8_buffers"] == predicted
    tensorwise = _config(["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    model = GPTModel(tensorwise.model)
    apply_fp8(model, fp8_recipe(tensorwise.train), tensorwise.model.num_layers)
    assert fp8_state_bytes([model]) == 0 == rank_memory(tensorwise, 0)["fp8_buffers"]


def _one_step(runs, log_dir, cache):
    import json
    import os

    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))
        with open(f"{log_dir}/{i}/metrics.jsonl") as f:
            out.append(next(r for r in map(json.loads, f) if "peak_source" in r))
    return out


def test_start_up_records_the_fp8_share_and_buffers(tmp_path, corpus_env, capsys):
    """One delayed-FP8 step of tiny-llama: the start-up memory line names the FP8 buffers in
    KiB (4 layers x 4 linears x 17 x 3 float32 = 3.2 KiB), the planner's line predicts them
    with ratio 1.000, and the run_start record holds the FP8 share of the model FLOPs and
    the measured / predicted bytes."""
    from distributed import run_distributed

    args = BASE + FP8 + ["--train-iters", "1", "--micro-batch-size", "1",
                         "--global-batch-size", "1", "--no-tensorboard", "--peak-tflops", "1",
                         "--eval-interval", "0", "--lr-warmup-iters", "0"]
    rec = run_distributed(_one_step, 1, [args], str(tmp_path), corpus_env["SHARDZOO_CACHE"],
                          timeout=300)[0][0]
    from planner.flops import fp8_flops_share

    assert rec["fp8_flops_share"] == pytest.approx(fp8_flops_share(_config(FP8).model))
    assert rec["model_state_fp8_buffers_bytes"] == 4 * 4 * 17 * 3 * 4
    assert rec["planner_fp8_buffer_bytes"] == 4 * 4 * 17 * 3 * 4
    assert rec["planner_fp8_buffer_ratio"] == 1.0
    from training.trainer import memory_line

    state = {k[len("model_state_"):].removesuffix("_bytes"): v for k, v in rec.items()
             if k.startswith("model_state_")}
    line = memory_line(_config(FP8), state, rec, rec["memory_bytes_per_rank"])
    assert "FP8 buffers 3.2 KiB (delayed: amax histories, no cached FP8 weight copies)" in line
    line = memory_line(_config(["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]),
                       dict(state, fp8_buffers=0), rec, rec["memory_bytes_per_rank"])
    assert "FP8 buffers 0.0 KiB (rowwise: scales computed per GEMM" in line
    assert "FP8" not in memory_line(_config(), state, rec, rec["memory_bytes_per_rank"])


def test_plan_cli_takes_fp8_format_and_peak(no_grid):
    """tools/plan.py --fp8-format sets the planned run's FP8 (the run file's otherwise),
    --fp8-peak-tflops the FP8 peak (default 1979; 0: none); a negative one is refused."""
    from tools import plan

    def inputs(*extra):
        return plan._inputs(plan.build_parser().parse_args(
            ["--model", "tiny-llama", "--gpus", "2", *extra]))

    _, train, hw, _ = inputs()
    assert train.fp8_format is None and hw.fp8_peak_tflops == 1979.0
    _, train, hw, _ = inputs("--fp8-format", "hybrid", "--fp8-peak-tflops", "0")
    assert train.fp8_format == "hybrid" and hw.fp8_peak_tflops is None
    with pytest.raises(plan.PlanError, match="--fp8-peak-tflops must be >= 0"):
        inputs("--fp8-peak-tflops", "-1")
