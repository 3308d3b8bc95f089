"""Validation of the resolved run configuration: `validate(model, train, world_size)`.

Called by `run_config.config.Config.validate` before any process-group work; it checks the
`ModelConfig` and the `TrainConfig` (run_config/train_config.py) and returns the derived sizes,
which `Config` keeps, so this module never needs `Config` itself. Each check
raises `ConfigError` naming the flag and the fix, and some resolve what was left open
(global batch, lr decay iters, vpp from layers per virtual stage, recompute defaults,
TensorBoard on when installed, sequence parallel off at tp 1). Flag definitions and parsing
live in training/arguments.py; add a flag there and its check here.
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import torch

from data_pipeline.data_path import parse_data_path
from layers.lora import resolve_targets
from layers.transformer import cpp_compiler_problem
from models.config import ConfigError, ModelConfig
from .batch_schedule import check_batch_schedule
from .diloco import check_diloco
from .fp8 import check_fp8
from .train_config import TrainConfig


def validate(m: ModelConfig, t: TrainConfig, world_size: int) -> tuple[int, int]:
    """Check the run's model `m` and settings `t` against `world_size`, fill the values left
    open in both (idempotent) and return (data_parallel_size, num_microbatches)."""
    _check_positive(t, world_size)
    dp = _check_grid(t, world_size)
    m.validate(t.tensor_model_parallel_size)
    expert_layout(m, t, dp * t.context_parallel_size)  # ep is carved out of dp x cp
    _check_sequence_parallel(m, t)
    check_context_parallel(m, t)
    if m.is_encoder_decoder:
        _check_t5(m, t)
    else:
        if t.pipeline_model_parallel_split_rank is not None:
            raise ConfigError("--pipeline-model-parallel-split-rank is for encoder-decoder "
                              "models (--model-type t5); drop it for a GPT model")
        _zbv_chunks(m, t)
        _check_pipeline(m, t)
    _check_pipeline_schedule(m, t)
    num_microbatches = _check_batch(t, dp)
    check_batch_schedule(t, t.micro_batch_size * dp,
                         t.pipeline_model_parallel_size,
                         t.pipeline_schedule == "interleaved")
    _check_optimizer(t)
    _check_sharding(t)
    check_diloco(t)
    _check_recompute(m, t)
    _check_data(t)
    _check_run(t)
    _check_profile(t, world_size)
    _check_lora(m, t)
    check_fp8(m, t)
    return dp, num_microbatches


QLORA_FORMATS = ("none", "int8", "int4", "q8_0", "q4_0", "q4_1")  # round-to-nearest makes them
# and "gguf": a GGUF file's blocks as stored (--load model.gguf)


def _check_lora(m: ModelConfig, t: TrainConfig) -> None:
    """The LoRA flags (layers/lora.py): a rank >= 0, a dropout in [0, 1), known targets, a
    decoder-only model, and a QLoRA base format whose blocks divide every layer input."""
    if t.lora_rank < 0:
        raise ConfigError(f"--lora-rank {t.lora_rank} must be >= 1 (or 0: no adapters)")
    _check_choice("lora_base_quantization", t.lora_base_quantization, QLORA_FORMATS + ("gguf",))
    if str(t.load or "").endswith(".gguf") and not (
            t.lora_rank and t.lora_base_quantization == "gguf"):
        raise ConfigError(f"--load {t.load} is a GGUF file: train LoRA adapters on it as it is "
                          f"stored with --lora-rank R --lora-base-quantization gguf, or import "
                          f"it first (tools/convert_hf.py import {t.load} --out DIR) and --load "
                          f"DIR")
    if not t.lora_rank:
        if t.lora_base_quantization != "none":
            raise ConfigError("--lora-base-quantization holds a frozen LoRA base; add "
                              "--lora-rank (a full fine-tune trains float weights)")
        return
    if t.lora_base_quantization not in ("none", "int8"):  # blocks of (at least) 32 inputs
        tp = t.tensor_model_parallel_size
        inputs = {"--hidden-size": m.hidden_size, "--ffn-hidden-size / tp":
                  m.ffn_hidden_size // tp, "query projection size / tp":
                  m.query_projection_size // tp}
        bad = [f"{k} = {v}" for k, v in inputs.items() if v % 32]
        if bad:
            raise ConfigError(f"--lora-base-quantization {t.lora_base_quantization} holds "
                              f"blocks of 32 input columns (or more), which do not divide "
                              f"{', '.join(bad)}; use "
                              + ("another tp" if t.lora_base_quantization == "gguf" else
                                 "--lora-base-quantization int8 or another tp"))
    if not 0.0 <= t.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout {t.lora_dropout} must be in [0, 1)")
    try:
        resolve_targets(t.lora_target_modules)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.is_encoder_decoder:
        raise ConfigError("--lora-rank is built for decoder-only models; drop it for "
                          "--model-type t5")


def _check_positive(t: TrainConfig, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "micro_batch_size", "train_iters", "log_interval", "ddp_bucket_size",
                 "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "global_batch_size", "lr_decay_iters", "save_interval", "keep_last",
                 "exit_interval", "expert_model_parallel_size", "expert_tensor_parallel_size",
                 "context_parallel_size"):
        if getattr(t, name) is not None and getattr(t, name) < 1:  # None: unset, resolved later
            raise ConfigError(f"{flag(name)} must be a positive integer, got {getattr(t, name)}")


def _check_grid(t: TrainConfig, world_size: int) -> int:
    tp, pp, cp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, \
        t.context_parallel_size
    if world_size % (tp * pp * cp):
        cp_part = f"--context-parallel-size {cp} x " if cp > 1 else ""
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"{cp_part}--pipeline-model-parallel-size {pp} = {tp * cp * pp}; launch a multiple "
            f"of {tp * cp * pp} processes or change --tp/{'--cp/' if cp > 1 else ''}--pp")
    return world_size // (tp * pp * cp)


def check_context_parallel(m: ModelConfig, t: TrainConfig) -> None:
    """--context-parallel-size (cp) splits each sequence into 2 x cp chunks over the cp ranks
    (layers/context_parallel/). Raises `ConfigError` naming the flag and the fix for: an
    unknown --cp-comm-type; a --seq-length not divisible by 2 x cp (by 2 x cp x tp under
    sequence parallelism, which shards each rank's part over TP); and, at cp > 1, what is
    not built with it: T5, packed-document attention masks, MoE capacity dropping,
    rank-stream dropout."""
    cp = t.context_parallel_size
    _check_choice("cp_comm_type", t.cp_comm_type, ("p2p", "all_gather"))
    if cp == 1:
        return
    tp = t.tensor_model_parallel_size if t.sequence_parallel else 1
    if m.is_encoder_decoder:
        raise ConfigError(f"--context-parallel-size {cp} is for decoder-only models; T5's "
                          f"encoder-decoder attention is not split over CP ranks: drop "
                          f"--context-parallel-size")
    if m.seq_length % (2 * cp * tp):
        why = (f"2 x --context-parallel-size x --tensor-model-parallel-size = {2 * cp * tp} "
               f"(2 x cp load-balanced chunks, each rank's part split over TP by "
               f"--sequence-parallel)" if tp > 1 else
               f"2 x --context-parallel-size = {2 * cp} (each sequence is cut into 2 x cp "
               f"load-balanced chunks)")
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by {why}; use "
                          f"--seq-length {max(1, round(m.seq_length / (2 * cp * tp))) * 2 * cp * tp}"
                          f" or another --context-parallel-size")
    if t.reset_attention_mask:
        raise ConfigError(f"--reset-attention-mask (attention inside each packed document) is "
                          f"not built with --context-parallel-size {cp}: the ring attends "
                          f"causally over the whole sequence; drop --reset-attention-mask "
                          f"(--reset-position-ids and --eod-mask-loss work) or use cp 1")
    if m.num_moe_experts is not None and m.moe_expert_capacity_factor is not None:
        raise ConfigError(f"--moe-expert-capacity-factor is not built with "
                          f"--context-parallel-size {cp}: capacity drops the lowest-"
                          f"probability copies among all of a microbatch's tokens, which CP "
                          f"splits over ranks; drop the factor (dropless routing) or use cp 1")
    if t.dropout_masks != "sample" and (m.hidden_dropout > 0 or m.attention_dropout > 0):
        raise ConfigError(f"--dropout-masks {t.dropout_masks} draws per-rank streams, which "
                          f"do not follow a sequence split over --context-parallel-size {cp}; "
                          f"use --dropout-masks sample (masks keyed by global position)")


def expert_layout(m: ModelConfig, t: TrainConfig, dp: int) -> tuple[int, int, int]:
    """`(ep, etp, edp)` of the run's experts (parallel_state/grid.py: each stage's dp x tp
    ranks are etp x ep x edp for the expert layers, so edp = dp tp / (ep etp) = dp / ep), after
    checking that they can be built. Raises `ConfigError` naming the flag and the fix when
    --expert-model-parallel-size > 1 on a model without MoE layers, when
    --expert-tensor-parallel-size is not the TP size (not built: layers/moe/ gathers each
    microbatch over TP and splits every expert over the TP ranks like the dense MLP), when
    --num-experts is not divisible by ep, or when ep does not divide `dp` (the data-parallel
    size, times the context-parallel size: expert parallelism is carved out of both)."""
    tp, ep = t.tensor_model_parallel_size, t.expert_model_parallel_size
    etp = tp if t.expert_tensor_parallel_size is None else t.expert_tensor_parallel_size
    experts = m.num_moe_experts
    if ep > 1 and (experts is None or not any(m.is_moe_layer(n) for n in range(m.num_layers))):
        why, fix = (("--num-experts is not set (the model is dense)",
                     f"add --num-experts N (a multiple of {ep})") if experts is None else
                    ("--moe-layer-freq makes no layer an MoE layer",
                     "put a 1 in --moe-layer-freq"))
        raise ConfigError(f"--expert-model-parallel-size {ep} splits the experts of MoE layers "
                          f"over ranks, but {why}; {fix} or drop --expert-model-parallel-size")
    if etp != tp:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp} is not "
            f"built: the MoE layer gathers each microbatch over the TP ranks and splits every "
            f"expert over them like the dense MLP, so the experts' TP size is the TP size; "
            f"leave --expert-tensor-parallel-size unset")
    if experts is not None and experts % ep:
        fits = [d for d in range(1, dp + 1) if dp % d == 0 and experts % d == 0]
        raise ConfigError(f"--num-experts {experts} is not divisible by "
                          f"--expert-model-parallel-size {ep}: every EP rank holds the same "
                          f"number of experts; use --ep one of {fits} (at data-parallel size "
                          f"{dp}) or a multiple of {ep} experts")
    if dp % ep:
        fits = [d for d in range(1, dp + 1) if dp % d == 0 and (experts or 1) % d == 0]
        raise ConfigError(
            f"--expert-model-parallel-size {ep} must divide the data-parallel size {dp} (= dp x "
            f"tp / expert-tensor-parallel-size, with tp {tp} = etp): the expert-parallel ranks "
            f"are carved out of the data-parallel ranks of each pipeline stage; use --ep one "
            f"of {fits}, or launch a multiple of {ep} x tp {tp} x pp "
            f"{t.pipeline_model_parallel_size} = {ep * tp * t.pipeline_model_parallel_size} "
            f"processes")
    return ep, etp, dp // ep


def _check_sequence_parallel(m: ModelConfig, t: TrainConfig) -> None:
    tp = t.tensor_model_parallel_size
    t.sequence_parallel = t.sequence_parallel and tp > 1  # a no-op at tp 1 (as in Megatron)
    if t.sequence_parallel and m.seq_length % tp:
        raise ConfigError(
            f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
            f"--tensor-model-parallel-size {tp}; change one of them or pass --no-sequence-parallel")


def t5_stage_layers(m: ModelConfig, t: TrainConfig) -> list[tuple[list[int], list[int]]]:
    """`(encoder layers, decoder layers)` of each pipeline stage: the encoder split evenly over
    the stages before --pipeline-model-parallel-split-rank, the decoder over the rest
    (Megatron's encoder-and-decoder pipeline). Raises `ConfigError` for an uneven split."""
    pp = t.pipeline_model_parallel_size
    if pp == 1:
        return [(list(range(m.encoder_num_layers)), list(range(m.decoder_num_layers)))]
    split = t.pipeline_model_parallel_split_rank
    out = []
    for stack, n, stages in (("encoder", m.encoder_num_layers, split),
                             ("decoder", m.decoder_num_layers, pp - split)):
        if n % stages:
            raise ConfigError(f"--{stack}-num-layers {n} cannot be split evenly over {stages} "
                              f"{stack} stage(s) (--pipeline-model-parallel-split-rank {split} "
                              f"of --pipeline-model-parallel-size {pp}); change one of them")
        each = n // stages
        out.append([list(range(i * each, (i + 1) * each)) for i in range(stages)])
    return [(enc, []) for enc in out[0]] + [([], dec) for dec in out[1]]


def _check_t5(m: ModelConfig, t: TrainConfig) -> None:
    """An encoder-decoder run: sequence parallel needs both lengths divisible by tp; a
    pipeline needs --pipeline-model-parallel-split-rank; no interleaving, uneven splits or
    packed-document flags (GPT-only); span-corruption settings in range."""
    tp, pp, split = (t.tensor_model_parallel_size, t.pipeline_model_parallel_size,
                     t.pipeline_model_parallel_split_rank)
    if t.sequence_parallel and m.decoder_seq_length % tp:
        raise ConfigError(f"--sequence-parallel needs --decoder-seq-length "
                          f"{m.decoder_seq_length} divisible by --tensor-model-parallel-size "
                          f"{tp}; change one of them or pass --no-sequence-parallel")
    if pp > 1 and (split is None or not 0 < split < pp):
        raise ConfigError(f"a T5 pipeline of {pp} stages needs "
                          f"--pipeline-model-parallel-split-rank between 1 and {pp - 1} (the "
                          f"first decoder stage), got {split}")
    if pp == 1 and split is not None:
        raise ConfigError("--pipeline-model-parallel-split-rank needs "
                          "--pipeline-model-parallel-size > 1")
    for name in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(t, name) is not None:
            raise ConfigError(f"{flag(name)} is not supported for T5 (the encoder and decoder "
                              f"split at --pipeline-model-parallel-split-rank); drop it")
    if t.report_comm:
        raise ConfigError("--report-comm compares against the planner, whose formulas are for "
                          "decoder-only models; T5 is not modelled: drop --report-comm")
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(t, name):
            raise ConfigError(f"{flag(name)} is for GPT's packed documents; T5 samples are "
                              f"span-corrupted windows: drop it")
    if not 0 < t.noise_density < 1:
        raise ConfigError(f"--noise-density must be in (0, 1), got {t.noise_density}")
    if not t.mean_noise_span_length >= 1:
        raise ConfigError(f"--mean-noise-span-length must be >= 1, got "
                          f"{t.mean_noise_span_length}")
    if t.vocab_extra_ids is not None and t.vocab_extra_ids < 1:
        raise ConfigError(f"--vocab-extra-ids must be >= 1 for T5 (the sentinels), got "
                          f"{t.vocab_extra_ids}")
    t5_stage_layers(m, t)


def stage_layers(num_layers: int, t: TrainConfig) -> list[int]:
    pp = t.pipeline_model_parallel_size
    first, last = t.decoder_first_pipeline_num_layers, t.decoder_last_pipeline_num_layers
    fixed = [n for n in (first, last) if n is not None]
    middle, rest = pp - len(fixed), num_layers - sum(fixed)
    if fixed and pp == 1:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need "
                          "--pipeline-model-parallel-size > 1")
    if rest < 0 or (middle == 0 and rest) or (middle and (rest % middle or rest == 0)):
        given = [f"--decoder-{k}-pipeline-num-layers {v}" for k, v in (("first", first),
                                                                      ("last", last)) if v]
        what = f"after {' and '.join(given)}, the remaining " if given else ""
        raise ConfigError(f"{what}--num-layers {rest} cannot be split evenly over {middle} "
                          f"pipeline stage(s) (--pipeline-model-parallel-size {pp}); choose a "
                          f"divisible --num-layers or set --decoder-first/last-pipeline-num-layers")
    each = rest // middle if middle else 0
    return [first if first is not None else each] + [each] * (pp - 2) + \
        ([last if last is not None else each] if pp > 1 else [])


def _check_pipeline(m: ModelConfig, t: TrainConfig) -> None:
    stages, pp = stage_layers(m.num_layers, t), t.pipeline_model_parallel_size
    per_stage, vpp = t.num_layers_per_virtual_pipeline_stage, t.virtual_pipeline_model_parallel_size
    if (vpp is not None or per_stage is not None) and pp == 1:
        raise ConfigError("--virtual-pipeline-model-parallel-size / "
                          "--num-layers-per-virtual-pipeline-stage need "
                          "--pipeline-model-parallel-size > 1; add --pp or drop the vpp flag")
    if per_stage is not None:
        if len(set(stages)) > 1 or stages[0] % per_stage:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {per_stage} must divide the layers "
                f"of every pipeline stage {stages}; use a divisor of {stages[0]} or "
                f"--virtual-pipeline-model-parallel-size")
        derived = stages[0] // per_stage
        if vpp is not None and vpp != derived:
            raise ConfigError(
                f"--virtual-pipeline-model-parallel-size {vpp} disagrees with "
                f"--num-layers-per-virtual-pipeline-stage {per_stage} (which gives vpp "
                f"{derived} = {m.num_layers} layers / (pp {pp} x {per_stage})); pass only one")
        t.virtual_pipeline_model_parallel_size = vpp = derived
    if vpp is not None:
        bad = [n for n in stages if n % vpp]
        if bad:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size {vpp} must divide the "
                              f"layers of each pipeline stage {stages} (not {bad[0]})")
        if t.num_layers_per_virtual_pipeline_stage is None and len(set(stages)) == 1:
            t.num_layers_per_virtual_pipeline_stage = stages[0] // vpp


PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")  # --pipeline-schedule


def _zbv_chunks(m: ModelConfig, t: TrainConfig) -> None:
    """--pipeline-schedule zbv runs 2 chunks per stage: vpp 2 unless a vpp flag is given
    (`_check_pipeline_schedule` refuses another), each stage's layers split in two."""
    if t.pipeline_schedule != "zbv" or t.pipeline_model_parallel_size < 2 or \
            t.virtual_pipeline_model_parallel_size is not None or \
            t.num_layers_per_virtual_pipeline_stage is not None:
        return
    stages = stage_layers(m.num_layers, t)
    if any(n % 2 for n in stages):
        raise ConfigError(f"--pipeline-schedule zbv splits each pipeline stage's layers into 2 "
                          f"chunks, but the stages hold {stages} layers; make every stage's "
                          f"count even (--num-layers, --decoder-first/last-pipeline-num-layers)")
    t.virtual_pipeline_model_parallel_size = 2


def _check_pipeline_schedule(m: ModelConfig, t: TrainConfig) -> None:
    """Resolve --pipeline-schedule (None: interleaved with vpp > 1, else 1f1b) and check it
    against pp, vpp and the model."""
    _check_choice("pipeline_schedule", t.pipeline_schedule, (None,) + PIPELINE_SCHEDULES)
    vpp = t.virtual_pipeline_model_parallel_size or 1
    name = t.pipeline_schedule or ("interleaved" if vpp > 1 else "1f1b")
    if name == "interleaved" and vpp < 2:
        raise ConfigError("--pipeline-schedule interleaved runs several model chunks per "
                          "stage; add --virtual-pipeline-model-parallel-size 2 (or more)")
    if name in ("1f1b", "zb-h1") and vpp > 1:
        raise ConfigError(f"--pipeline-schedule {name} runs one model chunk per stage; drop "
                          f"--virtual-pipeline-model-parallel-size {vpp} or use interleaved")
    if name in ("zb-h1", "zbv"):
        if t.pipeline_model_parallel_size < 2:
            raise ConfigError(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size"
                              f" > 1 (without pipelining there is no bubble to fill)")
        if m.is_encoder_decoder:
            raise ConfigError(f"--pipeline-schedule {name} runs decoder-only models; use 1f1b "
                              f"for an encoder-decoder model")
        if t.compile:
            raise ConfigError(f"--pipeline-schedule {name} splits the backward in the layers' "
                              f"own autograd functions, which a compiled layer traces once; "
                              f"drop --compile or use 1f1b")
    if name == "zbv" and vpp != 2:
        raise ConfigError(f"--pipeline-schedule zbv runs exactly 2 model chunks per stage (a V);"
                          f" drop --virtual-pipeline-model-parallel-size / --num-layers-per-"
                          f"virtual-pipeline-stage (got vpp {vpp}; zbv sets 2) or use "
                          f"interleaved")
    t.pipeline_schedule = name if t.pipeline_model_parallel_size > 1 else t.pipeline_schedule


def _check_batch(t: TrainConfig, dp: int) -> int:
    per_step = t.micro_batch_size * dp
    if t.global_batch_size is None:
        t.global_batch_size = per_step
    if t.global_batch_size % per_step:
        suggest = max(per_step, round(t.global_batch_size / per_step) * per_step)
        raise ConfigError(
            f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp} = {per_step}; use e.g. "
            f"--global-batch-size {suggest}")
    num_microbatches = t.global_batch_size // per_step
    pp, vpp = t.pipeline_model_parallel_size, t.virtual_pipeline_model_parallel_size
    if t.pipeline_schedule == "interleaved" and num_microbatches % pp:  # zbv runs any m
        raise ConfigError(
            f"the interleaved schedule (--virtual-pipeline-model-parallel-size {vpp}) needs the "
            f"number of microbatches ({num_microbatches}) to be a multiple of "
            f"--pipeline-model-parallel-size {pp}; use --global-batch-size "
            f"{per_step * pp * max(1, round(num_microbatches / pp))}")
    return num_microbatches


def _check_optimizer(t: TrainConfig) -> None:
    if t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"need 0 <= --min-lr {t.min_lr} <= --lr {t.lr}: the schedule decays "
                          f"from --lr down to --min-lr")
    if t.lr_warmup_iters < 0 or t.lr_warmup_iters > t.lr_decay_iters:
        raise ConfigError(f"--lr-warmup-iters {t.lr_warmup_iters} must be in [0, "
                          f"--lr-decay-iters {t.lr_decay_iters}] (which defaults to "
                          f"--train-iters); lower --lr-warmup-iters or raise --train-iters")
    _check_choice("lr_decay_style", t.lr_decay_style, ("cosine", "linear", "constant"))
    _check_choice("dropout_masks", t.dropout_masks, ("sample", "rank-streams"))
    if t.max_skipped_iters < 0:
        raise ConfigError(f"--max-skipped-iters must be >= 0 (0: never stop), got "
                          f"{t.max_skipped_iters}")
    interval = t.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval < 1:
        raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval must be >= 1 "
                          f"(steps), got {interval}; drop the flag to turn the check off")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt-param-scheduler and "
                          "--use-checkpoint-opt-param-scheduler contradict each other: pass one "
                          "(this command line's LR schedule, or the checkpoint's)")
    if t.exit_duration_in_mins is not None and not t.exit_duration_in_mins > 0:
        raise ConfigError(f"--exit-duration-in-mins must be positive, got "
                          f"{t.exit_duration_in_mins}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            raise ConfigError(f"{flag(name)} must be in [0, 1), got {getattr(t, name)}")
    for name, value in (("adam_eps", t.adam_eps), ("peak_tflops", t.peak_tflops)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag(name)} must be positive, got {value}")
    for name in ("weight_decay", "clip_grad"):
        if not getattr(t, name) >= 0:  # also rejects nan
            raise ConfigError(f"{flag(name)} must be >= 0 (0 disables it), got {getattr(t, name)}")
    for name in ("lr", "min_lr", "adam_eps", "weight_decay", "clip_grad", "peak_tflops"):
        value = getattr(t, name)
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag(name)} must be a finite number, got {value}")
    _check_choice("recompute_granularity", t.recompute_granularity, (None, "full", "selective"))


def _check_sharding(t: TrainConfig) -> None:
    """Resolve --data-parallel-sharding-strategy (Megatron-FSDP's names; --use-distributed-
    optimizer is the alias of `optim`, and every sharded strategy implies it) and the offload
    fraction (Megatron's default 1.0)."""
    from data_parallel.ddp import resolve_strategy

    try:
        strategy = resolve_strategy(t.data_parallel_sharding_strategy,
                                    t.use_distributed_optimizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t.data_parallel_sharding_strategy = strategy
    t.use_distributed_optimizer = strategy != "no_shard"
    _check_offload(t)


def _check_offload(t: TrainConfig) -> None:
    """Resolve the offload flags: --optimizer-cpu-offload is --optimizer-offload-device cpu
    (and after this check `optimizer_cpu_offload` means "the optimizer is offloaded", to the
    device `optimizer_offload_device` names); the fraction defaults to 1.0 (Megatron's);
    nvme needs --offload-path, which nothing else uses; parameter offload needs ZeRO-3."""
    _check_choice("optimizer_offload_device", t.optimizer_offload_device, (None, "cpu", "nvme"))
    _check_choice("param_offload_device", t.param_offload_device, (None, "cpu", "nvme"))
    if t.optimizer_cpu_offload and t.optimizer_offload_device == "nvme":
        raise ConfigError("--optimizer-cpu-offload contradicts --optimizer-offload-device nvme; "
                          "drop one of them")
    if t.optimizer_cpu_offload and t.optimizer_offload_device is None:
        t.optimizer_offload_device = "cpu"
    t.optimizer_cpu_offload = t.optimizer_offload_device is not None
    f = t.optimizer_offload_fraction
    if f is not None and not t.optimizer_cpu_offload:
        raise ConfigError("--optimizer-offload-fraction needs --optimizer-cpu-offload or "
                          "--optimizer-offload-device; add one or drop the fraction")
    if t.optimizer_cpu_offload:
        t.optimizer_offload_fraction = f = 1.0 if f is None else f
        if not 0.0 <= f <= 1.0:
            raise ConfigError(f"--optimizer-offload-fraction must be in [0, 1] (the share of "
                              f"optimizer state kept in host memory), got {f}")
    if t.param_offload_device and t.data_parallel_sharding_strategy != "optim_grads_params":
        raise ConfigError(f"--param-offload-device moves ZeRO-3's parameter shards off the "
                          f"device; it needs --data-parallel-sharding-strategy "
                          f"optim_grads_params (got {t.data_parallel_sharding_strategy})")
    nvme = "nvme" in (t.optimizer_offload_device, t.param_offload_device)
    if nvme and not t.offload_path:
        raise ConfigError("nvme offload needs --offload-path DIR: a folder on the NVMe drive "
                          "the scratch files go to")
    if t.offload_path and not nvme:
        raise ConfigError("--offload-path is only used by nvme offload; add "
                          "--optimizer-offload-device nvme or --param-offload-device nvme, or "
                          "drop it")
    if t.offload_buffer_count < 2:
        raise ConfigError(f"--offload-buffer-count must be >= 2 (one buffer updated while the "
                          f"next is read), got {t.offload_buffer_count}")
    if t.offload_buffer_size < 1:
        raise ConfigError(f"--offload-buffer-size must be >= 1 element, got "
                          f"{t.offload_buffer_size}")
    if t.offload_io_threads < 1:
        raise ConfigError(f"--offload-io-threads must be >= 1, got {t.offload_io_threads}")


def _check_recompute(m: ModelConfig, t: TrainConfig) -> None:
    """--recompute-method / --recompute-num-layers only with --recompute-granularity full, where
    they default to uniform / 1 (every layer checkpointed on its own); num-layers must fit the
    largest model chunk (a smaller chunk, e.g. an uneven first stage, checkpoints all its
    layers under block)."""
    _check_choice("recompute_method", t.recompute_method, (None, "uniform", "block"))
    if t.compile and t.recompute_granularity == "selective":
        raise ConfigError("--recompute-granularity selective checkpoints core attention inside "
                          "each layer, which a compiled layer cannot trace; with --compile "
                          "use --recompute-granularity full (whole layers), or drop --compile")
    if t.recompute_granularity != "full":
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(t, name) is not None:
                raise ConfigError(f"{flag(name)} applies only to --recompute-granularity full "
                                  f"(got {t.recompute_granularity}); drop it or pass "
                                  f"--recompute-granularity full")
        return
    t.recompute_method = t.recompute_method or "uniform"
    t.recompute_num_layers = 1 if t.recompute_num_layers is None else t.recompute_num_layers
    if m.is_encoder_decoder:  # a T5 stage holds one run of encoder or decoder layers
        chunk = min(max(len(e), len(d)) for e, d in t5_stage_layers(m, t))
    else:
        chunk = max(stage_layers(m.num_layers, t)) // (t.virtual_pipeline_model_parallel_size or 1)
    if not 1 <= t.recompute_num_layers <= chunk:
        raise ConfigError(f"--recompute-num-layers {t.recompute_num_layers} must be in [1, "
                          f"{chunk}] (the layers of a model chunk: --num-layers {m.num_layers} "
                          f"over pp x vpp); pick a value in that range")


def _check_data(t: TrainConfig) -> None:
    for _, prefix in parse_data_path(t.data_path) if t.data_path else []:
        for ext in (".bin", ".idx"):
            if not os.path.exists(prefix + ext):
                raise ConfigError(
                    f"--data-path {prefix}: file {prefix + ext} does not exist; pass a prefix "
                    f"written by tools/preprocess_data.py without .bin/.idx (e.g. "
                    f"data/corpus_text_document from: python tools/preprocess_data.py --input "
                    f"FILE --output-prefix data/corpus --tokenizer-model M.model)")
    try:
        ratios = [float(p) for p in t.split.replace("/", ",").split(",")]
    except ValueError:
        ratios = []
    if not 1 <= len(ratios) <= 3 or min(ratios) < 0 or ratios[0] <= 0:
        raise ConfigError(f"--split {t.split!r} must be 1-3 non-negative comma-separated "
                          f"numbers (train,valid,test) with a positive train share, e.g. "
                          f"--split 969,30,1")
    if t.data_path and t.tokenizer_model is None:
        raise ConfigError("--data-path needs --tokenizer-model: the SentencePiece .model file or "
                          "Hugging Face tokenizer folder that tools/preprocess_data.py used")
    if t.tokenizer_model is not None and not os.path.exists(t.tokenizer_model):
        raise ConfigError(f"--tokenizer-model {t.tokenizer_model} does not exist; pass a "
                          f"SentencePiece .model file or a Hugging Face tokenizer folder")


def _check_run(t: TrainConfig) -> None:
    _check_checkpointing(t)
    for name in ("eval_interval", "eval_iters"):
        if getattr(t, name) < 0:
            raise ConfigError(f"{flag(name)} must be >= 0 (0 disables evaluation), "
                              f"got {getattr(t, name)}")
    _check_choice("device", t.device, ("auto", "cpu", "cuda"))
    if not t.distributed_timeout_minutes > 0 or t.collective_trace_size < 0:
        raise ConfigError(f"need --distributed-timeout-minutes > 0 (got "
                          f"{t.distributed_timeout_minutes}) and --collective-trace-size >= 0 "
                          f"(got {t.collective_trace_size}; 0 turns the trace off)")
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is available; use --device cpu "
                          "(or auto)")
    on_cpu = t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available())
    if t.compile and on_cpu and (problem := cpp_compiler_problem()):
        raise ConfigError(problem)
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"--seed must be in [0, 2**32), got {t.seed}")
    for name in ("log_dir", "save", "save_replica"):
        _check_writable_dir(name, getattr(t, name))
    installed = importlib.util.find_spec("tensorboard") is not None
    t.tensorboard = installed if t.tensorboard is None else t.tensorboard
    if t.tensorboard and not installed:
        raise ConfigError("--tensorboard is on but tensorboard is not installed; "
                          "pip install tensorboard, or pass --no-tensorboard")


def _check_profile(t: TrainConfig, world_size: int) -> None:
    """--profile's window must lie inside the run and its ranks inside the world; resolves
    --profile-ranks to ints (default [0])."""
    if not t.profile:
        return
    if not 0 <= t.profile_step_start < t.profile_step_end <= t.train_iters:
        raise ConfigError(
            f"--profile records the steps after --profile-step-start ({t.profile_step_start}) "
            f"up to --profile-step-end ({t.profile_step_end}); need 0 <= start < end <= "
            f"--train-iters ({t.train_iters}), e.g. --profile-step-start "
            f"{min(2, max(t.train_iters - 1, 0))} --profile-step-end {min(4, t.train_iters)}")
    ranks = t.profile_ranks if t.profile_ranks is not None else [0]
    try:
        ranks = sorted({int(r) for r in ranks})
    except ValueError:
        raise ConfigError(f"--profile-ranks takes global rank numbers, got {ranks}") from None
    if any(not 0 <= r < world_size for r in ranks):
        raise ConfigError(f"--profile-ranks {ranks}: ranks must be in [0, {world_size}) "
                          f"(the world size)")
    t.profile_ranks = ranks


def _check_writable_dir(name: str, path: str | None) -> None:
    """Fail now, not after hours of training, if `path` could not be created or written.
    Nothing is created here (a validated config that never runs leaves no empty folder): the
    writers create it; `path`, or its nearest existing ancestor, must be a writable folder."""
    if not path:
        return
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == os.path.abspath(path) else f"is under the file {existing}"
        raise ConfigError(f"{flag(name)} {path} {what}, not a folder; pass a writable folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == os.path.abspath(path) else f" (its parent {existing} is not)"
        raise ConfigError(f"{flag(name)} {path} is not writable{where}; pass a writable folder")


def _check_checkpointing(t: TrainConfig) -> None:
    """--keep-last / --save-replica / --async-save need --save; a --load folder must exist
    unless it is also --save (a restarted job resumes from it once a checkpoint exists)."""
    for name in ("keep_last", "save_replica", "async_save", "save_interval"):
        if getattr(t, name) not in (None, False) and not t.save:
            raise ConfigError(f"{flag(name)} needs --save DIR (where checkpoints go); add "
                              f"--save or drop {flag(name)}")
    if t.load and not os.path.exists(t.load) and \
            os.path.abspath(t.load) != os.path.abspath(t.save or ""):
        raise ConfigError(f"--load {t.load} does not exist; pass the --save folder of an earlier "
                          f"run (or one of its iter_XXXXXXX folders), or drop --load")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{flag(name)} must be one of {[c for c in choices if c]}, "
                          f"got {value!r}")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")
