"""`Config`: the resolved run, a `ModelConfig` beside a `TrainConfig` and the sizes derived
from both (data-parallel size, microbatches) by `validate(world_size)`.

Below training/, tools/ and planner/: train.py builds one from flags (training/arguments.py);
the planner builds one per candidate layout and validates it exactly as train.py would.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from models.config import ModelConfig

from .checks import stage_layers, validate
from .finetune_defaults import describe as describe_finetune_defaults
from .finetune_defaults import resolve_global_batch
from .train_config import TrainConfig

MODEL_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"


def model_flag_names() -> list[str]:
    """The `ModelConfig` fields that are flags (all but `name` and `extra`)."""
    return [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("name", "extra")]


@dataclass
class Config:
    """The resolved run: model shape, training settings and the values derived from both.

    ``data_parallel_size`` and ``num_microbatches`` are None until `validate(world_size)`.
    """

    model: ModelConfig
    train: TrainConfig
    world_size: int | None = None
    data_parallel_size: int | None = None
    num_microbatches: int | None = None
    eod: int | None = None  # the tokenizer's end-of-document id (set when the data is built)
    # --finetune: the settings nobody gave and the values chosen (run_config/finetune_defaults.py)
    finetune_defaults: dict = dataclasses.field(default_factory=dict, compare=False)

    def validate(self, world_size: int) -> "Config":
        """Check all against ``world_size``, fill derived values, return self (idempotent).
        Raises `ConfigError` naming the flag and the fix (run_config/checks.py)."""
        if "global_batch_size" in self.finetune_defaults:
            resolve_global_batch(self.train, world_size)
        self.data_parallel_size, self.num_microbatches = validate(self.model, self.train,
                                                                  world_size)
        self.world_size = world_size
        return self

    def stage_num_layers(self) -> list[int]:
        """Decoder layers held by each pipeline stage (first/last may differ; rest even)."""
        return stage_layers(self.model.num_layers, self.train)

    def to_yaml(self) -> str:
        """A flat run file that `parse_config(["--config", path])` reads back to this config."""
        lines = ["# shardzoo run configuration (resolved; every key is also a --flag)"]
        if self.data_parallel_size is not None:
            lines.append(f"# derived for world size {self.world_size}: data_parallel_size "
                         f"{self.data_parallel_size}, num_microbatches {self.num_microbatches}")
        name = self.model.name
        if name and (MODEL_DIR / f"{name}.yaml").exists():
            lines.append(yaml.safe_dump({"model": name}, sort_keys=False).rstrip())
        lines.append("# --- model")
        model = {k: v for k, v in self.model.to_dict().items() if k in model_flag_names()}
        lines.append(yaml.safe_dump(model, sort_keys=False).rstrip())
        lines.append("# --- training")
        lines.append(yaml.safe_dump(dataclasses.asdict(self.train), sort_keys=False).rstrip())
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        """A short human-readable block for the start of the log."""
        m, t, dp = self.model, self.train, self.data_parallel_size
        pad = m.padded_vocab_size(t.tensor_model_parallel_size)
        tp = t.tensor_model_parallel_size
        padded = f" (padded to {pad} for tp {tp})" if pad != m.vocab_size else ""
        layers = (f"{m.encoder_num_layers}+{m.decoder_num_layers} encoder+decoder"
                  if m.is_encoder_decoder else f"{m.num_layers}")
        seq = (f"{m.seq_length}/{m.decoder_seq_length}" if m.is_encoder_decoder
               else f"{m.seq_length}")
        return (
            f"model   {m.name or 'custom'}: {m.num_parameters() / 1e6:.1f}M params, {layers}"
            f" layers, hidden {m.hidden_size}, heads {m.num_attention_heads} (kv "
            f"{m.num_query_groups}), ffn {m.ffn_hidden_size}, seq {seq}, vocab "
            f"{m.vocab_size}{padded}, {m.position_embedding_type}/{m.normalization}/"
            f"{m.activation}\n"
            f"layout  world {self.world_size} = pp {t.pipeline_model_parallel_size} x dp {dp} x "
            + (f"cp {t.context_parallel_size} ({t.cp_comm_type}) x "
               if t.context_parallel_size > 1 else "") +
            f"tp {t.tensor_model_parallel_size}, vpp {t.virtual_pipeline_model_parallel_size}, "
            f"sequence parallel {t.sequence_parallel}"
            + (f", experts over ep {t.expert_model_parallel_size} x expert-dp "
               f"{dp // t.expert_model_parallel_size} of the dp ranks"
               if t.expert_model_parallel_size > 1 else "") + "\n"
            f"batch   global {t.global_batch_size} = micro {t.micro_batch_size} x "
            f"{self.num_microbatches} microbatches x dp {dp}"
            + (f", ramp-up {' '.join(map(str, t.rampup_batch_size))} (start increment samples)"
               if t.rampup_batch_size else "") + "\n"
            f"optim   lr {t.lr:g} -> {t.min_lr:g} {t.lr_decay_style}, warmup {t.lr_warmup_iters}"
            f", decay {t.lr_decay_iters}, wd {t.weight_decay:g}, clip {t.clip_grad:g}, "
            f"bf16 {t.bf16}, dp sharding {t.data_parallel_sharding_strategy}"
            + (f", optimizer offload {t.optimizer_offload_fraction:g} to "
               f"{t.optimizer_offload_device}" if t.optimizer_cpu_offload else "")
            + (f", parameter offload to {t.param_offload_device}" if t.param_offload_device
               else "")
            + (f" (scratch under {t.offload_path})" if t.offload_path else "") + "\n"
            f"run     {t.train_iters} iters"
            + (f" (--train-samples {t.train_samples})" if t.train_samples else "")
            + f", eval every {t.eval_interval} ({t.eval_iters} iters),"
            f" log every {t.log_interval} -> {t.log_dir}"
            + ("\n" + describe_finetune_defaults(self.finetune_defaults, t)
               if self.finetune_defaults else ""))
