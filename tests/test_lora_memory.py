"""Memory of LoRA and QLoRA runs: the planner (planner/parameters.py `lora_parameters`,
`frozen_base_prediction`) against the built model and the trainer's start-up measurement
(training/memory.py `model_state_bytes`): adapters, their gradients and AdamW state, and the
frozen base (float, or its low-bit layer linears) each equal exactly, at tp 2 + SP; tools/plan.py
searches LoRA fine-tunes."""
from __future__ import annotations

import json

import pytest
import torch

from distributed import run_distributed


def _model_config(**kw):
    from models.config import ModelConfig

    return ModelConfig(**{**dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, vocab_size=128, seq_length=16, max_position_embeddings=16,
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        add_bias_linear=False), **kw})


@pytest.mark.parametrize("targets, moe", [("all-linear", False), ("q_proj,v_proj,down_proj",
                                                                   False),
                                          ("all-linear", True), ("linear_fc1", True)])
def test_adapter_list_and_base_bytes_match_the_built_model(targets, moe):
    """The planner's adapters (names, counts, order) are the built model's trainable
    parameters, and its frozen-base bytes are the base's, float and in each QLoRA format."""
    from layers.lora import add_lora
    from layers.quantized import quantize_layer_linears, quantized_weights
    from models import GPTModel
    from planner.parameters import base_bytes, chunk_parameters, lora_parameters

    m = _model_config(**(dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                              moe_layer_freq=2) if moe else {}))
    model = GPTModel(m)
    add_lora(model, rank=4, alpha=8.0, target_modules=targets)
    model.init_weights(1)
    built = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    assert [(s.name, s.count) for s in lora_parameters(m, 1, [0, 1], False, 4, targets)] == built
    base = chunk_parameters(m, 1, [0, 1], True, True, False)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert base_bytes(base, 4) == frozen
    for fmt in ("int8", "int4", "q8_0", "q4_0", "q4_1"):
        q = GPTModel(m)
        add_lora(q, rank=4, alpha=8.0, target_modules=targets)
        q.init_weights(1)
        quantize_layer_linears(q, fmt)
        measured = sum(p.numel() * p.element_size() for p in q.parameters()
                       if not p.requires_grad) + sum(w.nbytes for _, w in quantized_weights(q))
        assert base_bytes(base, 4, fmt) == measured, fmt
        formats = {n: w.format for n, w in quantized_weights(q)}  # a base kept as stored
        assert base_bytes(base, 4, formats=formats) == measured, fmt


BASE = ["--config", "configs/tiny-llama.yaml", "--num-layers", "2", "--seq-length", "32",
        "--train-iters", "2", "--log-interval", "1", "--eval-interval", "0",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--no-tensorboard",
        "--peak-tflops", "1", "--lora-rank", "4", "--lora-alpha", "8", "--tp", "2"]
RUNS = {"float base, tp 2 + SP, ZeRO-1": ["--sequence-parallel", "--use-distributed-optimizer"],
        "int4 base, tp 2, adapter dropout, full recompute": [
            "--lora-base-quantization", "int4", "--lora-dropout", "0.1",
            "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"],
        "q4_0 base, tp 2 + SP, q/v/down only": ["--sequence-parallel",
                                                "--lora-base-quantization", "q4_0",
                                                "--lora-target-modules",
                                                "q_proj,v_proj,down_proj"],
        "float base, tp 2 + SP, o/down only, adapter dropout, selective recompute": [
            "--sequence-parallel", "--lora-target-modules", "o_proj,down_proj",
            "--lora-dropout", "0.1", "--recompute-granularity", "selective"]}


def _start_records(runs: list[list[str]], log_dir: str, cache: str) -> list[dict]:
    """pretrain() per argument list; the run_start record of its metrics.jsonl (rank 0)."""
    import os

    import torch.distributed as dist

    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))
        if dist.get_rank() == 0:
            with open(f"{log_dir}/{i}/metrics.jsonl") as f:
                out.append(json.loads(f.readline()))
    return out


def test_planner_predicts_the_measured_lora_memory_at_tp2(tmp_path, corpus_env, no_grid):
    """The start-up measurement of adapters' model states, the frozen base (float, int4,
    q4_0) and the activations (with and without recompute and adapter dropout, all or some
    linears adapted) equals the planner's prediction exactly on both TP ranks; the adapters'
    states are the ZeRO formula over the adapters alone, and a full fine-tune's prediction is
    larger."""
    from planner.memory import rank_memory
    from training.arguments import parse_config

    records = run_distributed(_start_records, 2, [BASE + r for r in RUNS.values()],
                              str(tmp_path), corpus_env["SHARDZOO_CACHE"], timeout=600)[0]
    for (name, flags), r in zip(RUNS.items(), records, strict=True):
        assert r["planner_model_state_bytes"] == r["model_state_total_bytes"] > 0, name
        assert r["model_state_predicted_total_bytes"] == r["model_state_total_bytes"], name
        frozen = r["model_state_frozen_params_bytes"] + r["model_state_frozen_low_bit_bytes"]
        assert r["planner_frozen_base_bytes"] == frozen > 0, name
        assert r["planner_model_state_ratio_per_rank"] == [1.0, 1.0], name
        # activations: what a frozen base keeps (planner/activations.py _frozen_base_terms)
        assert r["planner_activation_ratio_per_rank"] == [1.0, 1.0], name
        assert r["activation_bytes_layers"] == r["activation_bytes_layers_predicted"], name
        assert (r["model_state_frozen_low_bit_bytes"] > 0) == ("base," in name and
                                                               "float" not in name), name
        config = parse_config(BASE + flags)
        config.validate(2)
        full = parse_config(BASE + flags)
        full.train.lora_rank, full.train.lora_base_quantization = 0, "none"
        full.validate(2)
        ours, theirs = rank_memory(config, 0), rank_memory(full, 0)
        assert ours["model_states"] == r["model_state_total_bytes"], name
        assert theirs["frozen_base"] == 0 and \
            theirs["model_states"] > 3 * (ours["model_states"] + ours["frozen_base"]), name


def _plan(capsys, *argv):
    from tools import plan

    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_searches_lora_fine_tunes(capsys):
    """SmolLM2-135M's shape on 2 GPUs of 1 GB: no full fine-tune fits (without offload), a
    rank-16 LoRA one does, with the frozen base apart and the LoRA flags in its command; a
    q4_1 base predicts less; bad LoRA inputs get one line."""
    import json

    common = ["--model", "llama-style-135m", "--gpus", "2", "--gpu-memory", "1GB",
              "--seq-length", "256", "--global-batch-size", "8", "--no-offload"]
    code, _, err = _plan(capsys, *common)
    assert code == 2 and "no layout of" in err, err
    code, out, _ = _plan(capsys, *common, "--lora-rank", "16", "--top", "2")
    assert code == 0 and " base " in out.splitlines()[1], out
    assert "--lora-rank 16 --lora-target-modules all-linear" in out and "frozen base" in out
    plans = {}
    for fmt in ("none", "q4_1"):
        code, out, _ = _plan(capsys, *common, "--lora-rank", "16", "--json",
                             "--lora-base-quantization", fmt)
        plans[fmt] = {(p["tp"], p["pp"], p["micro_batch_size"], p["sharding"], p["recompute"]):
                      p["memory"] for p in json.loads(out)["fits"]}
    assert plans["none"].keys() <= plans["q4_1"].keys()
    for key, mem in plans["none"].items():
        q = plans["q4_1"][key]
        assert 0 < q["frozen_base"] < 0.6 * mem["frozen_base"], key  # embeddings stay bf16
        assert q["model_states"] == mem["model_states"], key
    for argv, message in [(["--lora-base-quantization", "int4"], "add --lora-rank"),
                          (["--lora-rank", "0"], "--lora-rank must be a positive"),
                          (["--lora-rank", "4", "--lora-base-quantization", "nf4"], "nf4"),
                          (["--lora-rank", "4", "--lora-target-modules", "qkv"], "'qkv'")]:
        code, out, err = _plan(capsys, *common, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1, (argv, err)
        assert message in err, (argv, err)


ONE = ["--num-layers", "2", "--seq-length", "32", "--micro-batch-size", "2",
       "--global-batch-size", "2", "--lora-rank", "4", "--lora-alpha", "8"]
ACTIVATION_CASES = [
    ("tiny-llama", ["--lora-dropout", "0.1"], None),
    ("tiny-llama", ["--lora-target-modules", "q_proj,v_proj", "--recompute-granularity", "full",
                    "--recompute-method", "uniform", "--recompute-num-layers", "1"], "int4"),
    ("tiny-llama", ["--lora-target-modules", "o_proj", "--recompute-granularity",
                    "selective", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"], None),
    ("tiny-llama", ["--lora-target-modules", "down_proj", "--lora-dropout", "0.1",
                    "--recompute-granularity", "selective"], "int4"),
    ("tiny-gpt", ["--lora-target-modules", "o_proj,up_proj", "--hidden-dropout", "0.1",
                  "--attention-dropout", "0.1", "--lora-dropout", "0.1"], None),
]


@pytest.mark.parametrize("model, flags, fmt", ACTIVATION_CASES)
def test_planner_predicts_lora_activations_exactly(model, flags, fmt, no_grid):
    """What one microbatch of a LoRA model saves for backward (the start-up measurement:
    decoder layers and the rest) equals the planner's prediction to the byte: frozen linears
    keep no input, frozen RMSNorms no normalized input, a frozen embedding and output layer
    nothing, the first layer nothing before its first adapter; each adapted part keeps its
    `A x` and its (dropped) input. Float and int4 bases, with and without recompute, model
    and adapter dropout, all or some linears adapted."""
    import parallel_state as ps
    from layers.lora import add_lora
    from layers.quantized import quantize_layer_linears
    from layers.recompute import apply_recompute
    from models import GPTModel
    from planner.memory import chunk_activation_bytes
    from planner.parameters import rank_chunks
    from training.arguments import parse_config
    from training.memory import measure_activation_bytes

    config = parse_config(["--model", model] + ONE + flags)
    config.validate(1)
    m, t = config.model, config.train
    ps.model_parallel_seed(11, 0, dropout_masks="sample")
    net = GPTModel(m)
    add_lora(net, t.lora_rank, t.lora_alpha, t.lora_dropout, t.lora_target_modules)
    net.init_weights(7)
    apply_recompute(net, t.recompute_granularity, t.recompute_method, t.recompute_num_layers)
    net.train()
    if fmt:
        quantize_layer_linears(net, fmt)
    ids = torch.randint(0, m.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": ids, "labels": ids, "loss_mask": torch.ones(2, 32),
             "sample_ids": torch.arange(2)}
    got = measure_activation_bytes([net], batch, None)
    want = chunk_activation_bytes(config, rank_chunks(config, 0, base=True)[0], True, True)
    assert (got["layers"], got["total"]) == (want["layers"], want["total"]), (got, want)
