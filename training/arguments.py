"""The one resolved run configuration: ``cfg = parse_config(); cfg.validate(world_size)``.

Sources, lowest precedence first: the model file (``model: NAME`` / ``--model NAME`` loads
configs/models/NAME.yaml) < the run file (``--config FILE.yaml``, one flat mapping keyed by flag
names, ``seq_length`` or ``seq-length``, aliases tp/pp/vpp) < command-line flags. Every
`ModelConfig` and `TrainConfig` field is a flag; booleans have ``--no-xxx`` twins. Defaults are
Megatron-LM's (seed 1234, weight decay 0.01, adam beta2 0.999, DDP bucket 40M elements) except
``--log-interval 10`` and ``--log-dir runs/latest``. `Config.validate` raises `ConfigError`
before any process-group work and resolves what was left open: global batch (micro × dp), lr
decay iters (train iters), both vpp spellings, TensorBoard (on when installed), and sequence
parallel (off at tp 1, where it is a no-op, as Megatron does).

This file defines the flags and reads them into `Config` (run_config/config.py); the training
fields are `TrainConfig` in run_config/train_config.py, the checks in run_config/checks.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from models.config import ConfigError, ModelConfig

from run_config.checks import flag
from run_config.config import MODEL_DIR, Config, model_flag_names
from run_config.finetune_defaults import finetune_defaults
from run_config.train_config import TrainConfig

ALIASES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
           "vpp": "virtual_pipeline_model_parallel_size", "ep": "expert_model_parallel_size",
           "cp": "context_parallel_size",
           "num_experts": "num_moe_experts"}  # the last: Megatron's flag for the field


# ---------------------------------------------------------------------------- parsing
@functools.cache
def _field_types() -> dict[str, tuple[type, bool]]:
    """field name -> (base type, may be None) for every flag-backed field."""
    out = {}
    for cls, names in ((ModelConfig, model_flag_names()),
                       (TrainConfig, [f.name for f in dataclasses.fields(TrainConfig)])):
        hints = typing.get_type_hints(cls)
        for name in names:
            args = typing.get_args(hints[name])
            nullable = type(None) in args
            kinds = [a for a in args if a is not type(None)] if args else [hints[name]]
            base = kinds[0]
            if len(kinds) > 1 or typing.get_origin(base) is tuple:  # int | list[int], a pair
                base = tuple
            out[name] = (list if typing.get_origin(base) is list else base, nullable)
    return out


def _int_or_ints(value: Any) -> int | list[int]:
    """One integer, or several (`4095,0`, `[1, 1, 0]`, `1 1 0`, a YAML list) as a list."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = str(value).strip().strip("[]()").replace(",", " ").split()
    if not items or any(isinstance(v, bool) for v in items):
        raise ValueError(value)
    ints = [int(v) if isinstance(v, int) else int(str(v), 10) for v in items]
    return ints[0] if len(ints) == 1 and not isinstance(value, (list, tuple)) else ints


def _convert(name: str, value: Any) -> Any:
    """Coerce a YAML or command-line value to the field's type; raise ConfigError if not."""
    base, nullable = _field_types()[name]
    if value is None or (nullable and isinstance(value, str) and value.lower() in ("none", "null")):
        if nullable:
            return None
        raise ConfigError(f"{flag(name)} cannot be empty")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
                return str(value).lower() in ("true", "yes", "on", "1")
        elif base is int and not isinstance(value, bool):
            if float(value) == int(float(value)):  # also "4e7" and "40_000_000"
                return int(float(value))
        elif base is float and not isinstance(value, bool):
            return float(value)  # also reads "1e-3", which YAML 1.1 leaves a string
        elif base is str and isinstance(value, (str, int, float)):
            return str(value)
        elif base is list:
            return value.split() if isinstance(value, str) else [str(v) for v in value]
        elif base is tuple:  # window_size (left, right), window_attn_skip_freq N or 0/1 list
            return _int_or_ints(value)
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{flag(name)}: cannot read {value!r} as "
                      f"{'integers' if base is tuple else base.__name__}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # argparse would print and exit(2)
        raise ConfigError(message)


FLAG_HELP = {
    # model
    "num_layers": "transformer layers", "hidden_size": "model width h",
    "num_attention_heads": "query heads", "ffn_hidden_size": "MLP inner width",
    "num_query_groups": "KV heads (grouped-query attention); = heads for MHA",
    "kv_channels": "per-head dim (default h / heads)", "seq_length": "tokens per sample",
    "max_position_embeddings": "rows of the learned position table",
    "vocab_size": "replaced by the tokenizer's at run time",
    "make_vocab_size_divisible_by": "pad the vocab to a multiple of this x tp",
    "position_embedding_type": "learned_absolute | rope | relative (T5) | none",
    "rotary_base": "RoPE theta",
    "rope_scaling_type": "RoPE frequency scaling: linear | llama3 | yarn (default none)",
    "rope_scaling_factor": "RoPE context extension factor",
    "rope_low_freq_factor": "llama3 RoPE scaling: low-frequency factor",
    "rope_high_freq_factor": "llama3 RoPE scaling: high-frequency factor",
    "rope_original_max_position_embeddings": "llama3 / yarn RoPE scaling: pretraining context",
    "rope_beta_fast": "yarn: pairs turning more often than this over the original context "
    "keep their frequency",
    "rope_beta_slow": "yarn: pairs turning less often than this are interpolated",
    "rope_mscale": "yarn: attention temperature's mscale (cos/sin x mscale(f, m) / "
    "mscale(f, m_all))",
    "rope_mscale_all_dim": "yarn: mscale_all_dim; multi-latent attention's softmax scale x "
    "mscale(f, m_all)^2",
    # multi-head latent attention (layers/mla.py; HF's DeepSeek-V3 names)
    "q_lora_rank": "MLA: rank of the low-rank query (unset: one query projection)",
    "kv_lora_rank": "MLA: rank of the joint KV compression; set to use multi-latent attention",
    "qk_nope_head_dim": "MLA: per-head query/key dims without RoPE",
    "qk_rope_head_dim": "MLA: per-head query/key dims with RoPE (one shared RoPE key)",
    "v_head_dim": "MLA: per-head value dim",
    "window_size": "LEFT,RIGHT sliding-window attention: a query sees the LEFT keys before it "
    "and itself (HF's sliding_window W is W-1,0; RIGHT must be 0)",
    "window_attn_skip_freq": "with --window-size: N (every Nth layer, 1-based, keeps full "
    "attention) or a 0/1 list per layer (1 = sliding, e.g. 1,1,0,1)",
    # gpt-oss (models/config_oss.py)
    "softmax_type": "vanilla | learnable (a learned sink logit per head in the softmax)",
    "glu_linear_offset": "quick_geglu: added to the gated unit's linear half (gpt-oss: 1)",
    "activation_func_clamp_value": "quick_geglu: gate clamped above, linear half both sides "
    "(gpt-oss: 7)",
    "rope_yarn_truncate": "yarn: round the correction range to whole dims (gpt-oss: false)",
    "normalization": "LayerNorm | RMSNorm",
    "activation": "gelu | swiglu | relu | geglu | quick_geglu (gpt-oss's x sigmoid(1.702 x) "
    "x (up + offset))", "add_bias_linear": "biases in linear layers (MoE: router and experts "
    "too)",
    "untie_embeddings_and_output_weights": "separate output layer weight",
    "hidden_dropout": "dropout on residual branches", "attention_dropout": "dropout on scores",
    "init_method_std": "std of the normal init (output projections / sqrt(2 L))",
    # mixture of experts (layers/moe/)
    "num_moe_experts": "routed experts per MoE layer (alias --num-experts); unset: dense",
    "moe_router_topk": "experts each token is routed to",
    "moe_router_score_function": "softmax | sigmoid",
    "moe_router_pre_softmax": "softmax over all experts before the top-k (Switch)",
    "moe_router_topk_scaling_factor": "multiplies the routing weights (DeepSeek-V3)",
    "moe_router_num_groups": "group-limited routing: experts in this many groups (DeepSeek-V3's "
    "n_group; sigmoid router)",
    "moe_router_group_topk": "group-limited routing: a token's experts come from its best "
    "this-many groups (topk_group)",
    "moe_ffn_hidden_size": "width of each routed expert (default: ffn-hidden-size)",
    "moe_shared_expert_intermediate_size": "width of the shared experts (unset: none)",
    "moe_shared_expert_gate": "sigmoid gate on the shared experts' output (Qwen2-MoE)",
    "moe_layer_freq": "N: layers 0, N, 2N, ... are MoE, or one 0/1 per layer (1 = MoE)",
    "moe_aux_loss_coeff": "weight of the Switch/GShard load-balancing loss (per microbatch)",
    "moe_z_loss_coeff": "weight of the ST-MoE router z-loss",
    "moe_router_enable_expert_bias": "DeepSeek-V3 aux-loss-free balancing: a per-expert "
    "bias on the sigmoid scores for the choice, moved after each applied step",
    "moe_router_bias_update_rate": "the expert bias's step per optimizer step",
    "moe_expert_capacity_factor": "per microbatch an expert keeps at most factor x k T / E "
    "routed tokens, dropping those of lowest probability (unset: dropless)",
    "moe_pad_expert_input_to_capacity": "pad every expert's input to exactly its capacity",
    "moe_token_dispatcher_type": "alltoall (the only one built)",
    # multi-token prediction (models/mtp.py)
    "mtp_num_layers": "DeepSeek-V3 multi-token prediction: depths D, each one more layer "
    "predicting one token further (unset or 0: none)",
    "mtp_loss_scaling_factor": "weight of the mean MTP loss added to the loss (the report's "
    "lambda)",
    # layout
    "tensor_model_parallel_size": "TP ranks per layer (adjacent ranks)",
    "pipeline_model_parallel_size": "pipeline stages",
    "virtual_pipeline_model_parallel_size": "model chunks per stage (interleaved 1F1B)",
    "pipeline_schedule": "1f1b, interleaved (needs vpp > 1), zb-h1 or zbv (zero bubble, Qi "
                         "et al. 2024: split backward, 1F1B's memory; zbv: 2 chunks per stage "
                         "in a V); default: interleaved with vpp > 1, else 1f1b",
    "num_layers_per_virtual_pipeline_stage": "layers per chunk (alternative to --vpp)",
    "decoder_first_pipeline_num_layers": "layers on the first stage (uneven split)",
    "decoder_last_pipeline_num_layers": "layers on the last stage (uneven split)",
    "pipeline_model_parallel_split_rank": "T5: stages before it hold the encoder, the rest "
    "the decoder",
    "sequence_parallel": "norms/dropout on sequence shards (needs tp > 1)",
    "context_parallel_size": "CP: ranks each sequence is split over (2 x cp load-balanced "
    "chunks, ring attention; alias --cp); world = tp x cp x dp x pp",
    "cp_comm_type": "CP attention's K/V exchange: p2p (ring, overlapped) | all_gather",
    "expert_model_parallel_size": "EP: ranks each MoE layer's experts are split over, carved "
    "out of the data-parallel ranks (alias --ep; needs --num-experts)",
    "expert_tensor_parallel_size": "TP of the routed experts (default, and the only value "
    "built: --tensor-model-parallel-size)",
    "use_distributed_optimizer": "ZeRO-1: shard main weights and Adam states over DP",
    "data_parallel_sharding_strategy": "no_shard | optim (ZeRO-1) | optim_grads (ZeRO-2) | "
    "optim_grads_params (ZeRO-3/FSDP)",
    "optimizer_cpu_offload": "keep main weights and Adam moments in host memory, step there",
    "optimizer_offload_fraction": "share of optimizer state offloaded (default 1.0 with "
    "--optimizer-cpu-offload or --optimizer-offload-device)",
    "optimizer_offload_device": "cpu | nvme: where offloaded main weights and Adam moments live "
    "(nvme: raw files under --offload-path, streamed per bucket; ZeRO-Infinity); "
    "--optimizer-cpu-offload is the cpu alias",
    "param_offload_device": "cpu | nvme: ZeRO-3 (optim_grads_params) parameter shards live off "
    "the device between uses, brought in one unit ahead of its all-gather",
    "offload_path": "nvme offload: folder on the NVMe drive; each rank of each run writes into "
    "its own scratch folder there, removed at exit (a killed run's: at the next start)",
    "offload_buffer_count": "nvme offload: host buffers the shards stream through (>= 2: one "
    "updated while the next is read)",
    "offload_buffer_size": "nvme offload: optimizer elements per host buffer (16 B each: "
    "main copy, two moments, gradient); longer shards stream in pieces of this size",
    "offload_io_threads": "nvme offload: threads reading and writing the scratch files",
    "offload_pin_memory": "page-locked host buffers for offload on CUDA (ignored on CPU)",
    "recompute_granularity": "full | selective activation recompute",
    "recompute_method": "full only: uniform | block",
    "recompute_num_layers": "full only: layers per checkpointed group / checkpointed layers",
    "compile": "torch.compile each transformer layer (fuses norms, RoPE, SwiGLU, residuals; "
    "the first steps pay the compilation)",
    # batch and optimizer
    "micro_batch_size": "sequences per microbatch per DP rank",
    "global_batch_size": "sequences per optimizer step (all DP ranks)",
    "train_iters": "optimizer steps", "lr": "peak learning rate", "min_lr": "final learning rate",
    "lr_warmup_iters": "linear warmup steps", "lr_decay_iters": "decay length (default: train-iters)",
    "lr_decay_style": "cosine | linear | constant",
    "rampup_batch_size": "START INCREMENT SAMPLES: grow the global batch from START by "
    "INCREMENT over the first SAMPLES samples",
    "train_samples": "run length in samples (replaces --train-iters; LR schedule in samples)",
    "lr_warmup_samples": "linear warmup samples (with --train-samples)",
    "lr_decay_samples": "decay length in samples (default: --train-samples)",
    "weight_decay": "AdamW decay (not on 1-D)",
    "clip_grad": "max global grad norm; 0 disables", "seed": "seeds init, data order and dropout",
    "dropout_masks": "sample: masks keyed by (seed, sample, layer, position), the same at any "
    "layout | rank-streams: Megatron's per-rank RNG streams",
    "check_for_nan_in_loss_and_grad": "do not apply a step whose loss or grad norm is NaN/inf "
    "(it is logged as skipped)",
    "max_skipped_iters": "stop (without saving) after this many consecutive skipped steps; 0: "
    "never",
    "check_weight_hash_across_dp_replicas_interval": "every N steps compare the weights' "
    "hashes across DP replicas and across TP ranks for TP-replicated ones; stop on a mismatch",
    "bf16": "bf16 weights/activations with fp32 main weights and grads",
    "fp8_format": "FP8 GEMMs in the transformer layers' linears (forward, input and weight "
    "gradients): e4m3, or hybrid (e4m3 forward, e5m2 gradients); unset: off",
    "fp8_recipe": "FP8 scaling: tensorwise (current amax per tensor), delayed (amax "
    "history), rowwise (per row along the contraction dim), blockwise (DeepSeek-V3: 1x128 "
    "tiles, 128x128 weight blocks), mxfp8 (1x32 tiles, power-of-two scales)",
    "fp8_margin": "FP8 scale = fmax / amax / 2^margin",
    "fp8_amax_history_len": "delayed: steps of amax history per tensor",
    "fp8_amax_compute_algo": "delayed: the history's max or most_recent amax",
    "first_last_layers_bf16": "keep the first and last transformer layers out of FP8 "
    "(the embedding and output layer always are)",
    "num_layers_at_start_in_bf16": "with --first-last-layers-bf16: first layers kept",
    "num_layers_at_end_in_bf16": "with --first-last-layers-bf16: last layers kept",
    # data, logging, checkpoints
    "data_path": "PREFIX or W1 PREFIX1 W2 PREFIX2 ... (default: embedded stdlib corpus)",
    "split": "train,valid,test shares of documents",
    "reset_position_ids": "restart positions after each EOD inside a sample",
    "reset_attention_mask": "do not attend across an EOD inside a sample",
    "eod_mask_loss": "no loss where the input token is EOD", "tokenizer_model":
    "SentencePiece .model or HF tokenizer folder used to make --data-path",
    "vocab_extra_ids": "T5 sentinel ids added above the tokenizer's (default 100 for t5)",
    "noise_density": "T5 span corruption: share of tokens masked",
    "mean_noise_span_length": "T5 span corruption: mean masked span length",
    "model_type": "gpt (decoder-only) | t5 (encoder-decoder)",
    "encoder_num_layers": "T5 encoder layers (default num-layers)",
    "decoder_num_layers": "T5 decoder layers (default num-layers)",
    "decoder_seq_length": "T5 decoder (target) tokens per sample",
    "relative_attention_num_buckets": "T5 relative position buckets",
    "relative_attention_max_distance": "T5 distance where the last bucket starts",
    "eval_interval": "validate every N steps; 0 disables", "eval_iters": "batches per validation",
    "log_interval": "log every N steps", "log_dir": "metrics.jsonl + TensorBoard events",
    "tensorboard": "write TensorBoard events to --log-dir (unset: when tensorboard is installed)",
    "add_qkv_bias": "biases on the query, key and value projections only (Qwen2)",
    "softmax_scale": "attention scores' scale (unset: 1 / sqrt(head dim))",
    "rope_local_base_freq": "RoPE base of the sliding-window layers (Gemma 3)",
    "attn_logit_softcapping": "cap * tanh(score / cap) on attention scores (Gemma 2)",
    "final_logit_softcapping": "cap * tanh(logit / cap) on the output logits (Gemma 2)",
    "save": "checkpoint folder", "load": "checkpoint folder (or iter_XXXXXXX) to resume from",
    "save_interval": "save every N steps (and at the end)", "keep_last": "keep the newest N",
    "save_replica": "second folder receiving a copy of each checkpoint",
    "async_save": "write checkpoints in the background", "load_rng": "restore RNG on resume",
    "load_optim": "restore optimizer state on resume",
    "finetune": "start a new run from --load's weights (iteration 0, fresh optimizer)",
    "lora_rank": "LoRA: train rank-R adapters on the frozen base (0: train every weight)",
    "lora_alpha": "LoRA scale alpha / rank", "lora_dropout": "dropout on the adapters' input",
    "lora_target_modules": "comma-separated: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
    "down_proj, or linear_qkv,linear_proj,linear_fc1,linear_fc2, or all-linear",
    "use_rslora": "LoRA scale alpha / sqrt(rank) (rsLoRA)",
    "lora_base_quantization": "QLoRA: hold the frozen base's layer linears in this low-bit "
    "format (int8, int4 in groups of 32, GGUF q8_0 / q4_0 / q4_1), quantized after loading",
    "override_opt_param_scheduler": "on resume use this command line's LR schedule (the "
    "default; a change is logged)",
    "use_checkpoint_opt_param_scheduler": "on resume keep the LR schedule stored in the "
    "checkpoint, ignoring --lr/--min-lr/--lr-warmup-iters/--lr-decay-iters/--lr-decay-style",
    "override_data_config": "resume although --data-path/--split/--seed/--seq-length differ "
    "from the checkpoint's: the new data is read from its beginning",
    "exit_signal_handler": "on SIGTERM or SIGUSR1 finish the current step, save, exit 0",
    "exit_duration_in_mins": "save and exit 0 once the run has lasted this long",
    "exit_interval": "save and exit 0 after an iteration divisible by N",
    "ddp_bucket_size": "elements per bucket",
    "overlap_grad_reduce": "overlap DP gradient sync with backward",
    "diloco_sync_every": "DiLoCo (Douillard et al. 2023): each data-parallel replica trains "
    "with its own AdamW and no per-step gradient all-reduce; every H steps an outer Nesterov "
    "step on the dp-averaged pseudo-gradient (global copy - local weights); unset: off",
    "diloco_outer_lr": "DiLoCo's outer learning rate (1 with momentum 0: plain averaging)",
    "diloco_outer_momentum": "DiLoCo's outer Nesterov momentum, in [0, 1)",
    "straggler_threshold": "warn (naming host and rank) when a rank's mean compute time over "
    "a log interval is this many times the median rank's, two intervals in a row",
    "peak_tflops": "per-device peak for MFU (default: measured)", "device": "auto | cpu | cuda",
    "profile_pipeline": "record the schedule timeline and report the bubble",
    "profile": "torch.profiler over steps --profile-step-start+1..--profile-step-end: a "
    "Chrome trace per rank in <log-dir>/profile and a table of time by category",
    "profile_step_start": "finished iterations when profiling starts",
    "profile_step_end": "finished iterations when profiling stops",
    "profile_ranks": "global ranks to profile (default: 0)",
    "report_comm": "count the calls and bytes of every collective of the second step (the "
    "first in a 1-step run) per group and op, beside the planner's prediction (tools/plan.py; "
    "also in metrics.jsonl)",
    "distributed_timeout_minutes": "timeout of every collective (fractions allowed; "
    "a stuck one becomes a report in <log-dir>/hang)",
    "collective_trace_size": "collectives each rank keeps in its trace for the hang "
    "report; 0 turns the trace off",
    "debug_collectives": "check before each collective that all ranks of the group make "
    "the same call (an extra all-gather each: debugging only)",
}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; every option defaults to 'not given' (argparse.SUPPRESS)."""
    p = _Parser(description="shardzoo training run", allow_abbrev=False,
                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE.yaml", help="run file; flags override its keys")
    p.add_argument("--model", metavar="NAME", help=f"model file NAME.yaml in {MODEL_DIR} "
                   f"(or a path to a .yaml), base of the model fields: {available_models()}")
    groups = {ModelConfig: p.add_argument_group("model (defaults: the --model file, else these)"),
              TrainConfig: p.add_argument_group("training")}
    for cls, group in groups.items():
        for f in dataclasses.fields(cls):
            if f.name not in _field_types():
                continue
            base, flags = _field_types()[f.name][0], [flag(f.name)] + \
                [flag(a) for a, n in ALIASES.items() if n == f.name]
            kw = dict(action=argparse.BooleanOptionalAction) if base is bool else \
                dict(type=str, nargs="+", metavar="STR") if base is list else \
                dict(type=_argtype(f.name), metavar="INT[,INT...]" if base is tuple else
                     base.__name__.upper())
            group.add_argument(*flags, dest=f.name,
                               help=flag_help(FLAG_HELP.get(f.name, ""), f.default), **kw)
    return p


def flag_help(text: str, default: Any) -> str | None:
    """A flag's help: `text` with `(default: X)` added, unless the text already says its
    default or X is None (unset: the model file's value or one derived, which the text says
    where it matters; "(default: None)" said nothing)."""
    if default is None or "default" in text:
        return text or None
    return f"{text} (default: {default})" if text else f"default: {default}"


def _argtype(name: str):
    def convert(text: str) -> Any:
        try:
            return _convert(name, text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = name
    return convert


def available_models() -> list[str]:
    """Names of the model files in configs/models/."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


def load_model_config(name: str) -> ModelConfig:
    """`ModelConfig` from configs/models/NAME.yaml (or a .yaml path); ``name`` is recorded."""
    return ModelConfig.from_dict(_model_file(name))


def _load_yaml(path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None


def _model_file(name: str) -> dict[str, Any]:
    """The fields of a model file, type-checked, with ``name`` set to the file's stem."""
    if not isinstance(name, str):
        raise ConfigError(f"model must be a name from configs/models or a .yaml path, got {name!r}")
    is_path = name.endswith((".yaml", ".yml"))
    path = Path(name) if is_path else MODEL_DIR / f"{name}.yaml"
    if not path.exists():
        close = difflib.get_close_matches(name, available_models(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"--model {name}: no file {path}{hint} Available: {available_models()}")
    data = _load_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold one mapping of model field: value")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in data:
        if key.replace("-", "_") not in names:
            raise ConfigError(f"{path}: unknown model key {key!r}{_suggest(key, names)}")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    data = {k: v if k in ("name", "extra") else _convert(k, v) for k, v in data.items()}
    return data | {"name": path.stem if is_path else name}


def _suggest(key: str, names: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), list(names), n=1)
    return f"; did you mean {flag(close[0])}?" if close else ""


def _read_run_file(path: str) -> dict[str, Any]:
    """Flat run file -> {field: value}, with keys normalised and aliases resolved."""
    data = _load_yaml(path) if os.path.exists(path) else None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must be a YAML file holding one flat mapping of "
                          f"flag: value (missing, empty or not a mapping)")
    known = set(_field_types()) | set(ALIASES) | {"model"}
    out = {}
    for raw, value in data.items():
        key = str(raw).lstrip("-").replace("-", "_")
        if key not in known:
            raise ConfigError(f"{path}: unknown key {raw!r}{_suggest(key, known)}")
        key = ALIASES.get(key, key)
        out[key] = value if key == "model" else _convert(key, value)
    return out


def _checkpoint_defaults(load: str | None) -> tuple[dict, str | None] | None:
    """`(model fields, tokenizer path or None)` of the checkpoint `--load` names, or None when
    there is none (yet). With no --model, a run that loads a checkpoint takes its model (and,
    with no --tokenizer-model, the tokenizer stored in it), so `--load CKPT` alone is enough."""
    from checkpoint.format import read_metadata, resolve_checkpoint
    from checkpoint.model_io import find_tokenizer

    if not load or not os.path.exists(load):
        return None
    if str(load).endswith(".gguf") and os.path.isfile(load):  # a LoRA base kept as stored
        from models.hf import open_checked

        _, config = open_checked(load, quantization="keep")  # the header: nothing allocated
        return config.to_dict(), load  # its tokenizer is the file's (models/tokenizer.py)
    path = resolve_checkpoint(load, newest_if_no_marker=True)  # defaults only; the loader checks
    if path is None:
        return None
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: v for k, v in read_metadata(path)["model"].items() if k in fields}
    return model, find_tokenizer(path)


def parse_config(argv: list[str] | None = None) -> Config:
    """Read --config, --model and flags (argv, default sys.argv[1:]) into one `Config`.

    Precedence: model file < run file < flags. Not yet validated: call `validate(world_size)`.
    Raises `ConfigError` for unknown keys/flags or unreadable values.
    """
    given, unknown = build_parser().parse_known_args(argv)
    if unknown:
        options = [s for a in build_parser()._actions for s in a.option_strings]
        close = difflib.get_close_matches(unknown[0].split("=")[0], options, n=1)
        raise ConfigError(f"unknown flag(s) {unknown}"
                          + f"; did you mean {close[0]}?" * bool(close))
    flags = vars(given)
    run = _read_run_file(flags.pop("config")) if "config" in flags else {}
    run.update(flags)  # flags win over the run file
    model_name = run.pop("model", None)
    model_fields = set(model_flag_names())
    checkpoint = _checkpoint_defaults(run.get("load"))
    if checkpoint and "tokenizer_model" not in run and checkpoint[1]:
        run["tokenizer_model"] = checkpoint[1]
    model = _model_file(model_name) if model_name else (checkpoint[0] if checkpoint else {})
    model.update({k: v for k, v in run.items() if k in model_fields})
    defaults = finetune_defaults(run, run.get("train_iters", TrainConfig.train_iters)) \
        if run.get("finetune") else {}
    run.update(defaults)
    train = TrainConfig(**{k: v for k, v in run.items() if k not in model_fields})
    return Config(model=ModelConfig.from_dict(model), train=train, finetune_defaults=defaults)
