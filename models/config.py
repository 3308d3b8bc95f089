"""ModelConfig: the one description of a transformer's shape, with Megatron-LM's field names.

A config is validated once (`validate`) and then read everywhere; layers never re-check it.
Named sizes live in `configs/*.yaml` and load through `ModelConfig.from_dict`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A bad configuration value; the message names the flag and how to fix it."""


from .config_mla import (mla_parameters, validate_group_routing, validate_mla,  # noqa: E402
                         validate_mla_off, validate_yarn)  # (they raise ConfigError)
from .config_oss import sink_parameters, validate_oss  # noqa: E402
from .config_mtp import mtp_extra_parameters, validate_mtp  # noqa: E402


_POSITION_TYPES = ("learned_absolute", "rope", "relative", "none")
_NORMS = ("LayerNorm", "RMSNorm")
_ACTIVATIONS = ("gelu", "swiglu", "relu", "geglu", "quick_geglu")
_MODEL_TYPES = ("gpt", "t5")
_ROPE_SCALING = (None, "linear", "llama3", "yarn")
# bounds of the counts a config may hold (files are untrusted): every size below 2**31, and
# at most 2**24 positions (16.8M, past any released model's context)
MAX_COUNT = 2**31 - 1
MAX_POSITIONS = 2**24


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only model (GPT-2 / Llama families) or, with
    `model_type: t5`, an encoder-decoder (T5: `encoder_num_layers` + `decoder_num_layers`,
    relative position bias, `seq_length` the encoder length, `decoder_seq_length` the
    decoder's).

    Sizes are counts (not bytes). `ffn_hidden_size` defaults to 4*h for GeLU and to
    Llama's 2/3 * 4h rounded up to a multiple of 256 for SwiGLU.
    """

    model_type: str = "gpt"  # "gpt" (decoder-only) or "t5" (encoder-decoder)
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (= num_attention_heads)
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None  # per-head dim; None: hidden_size / num_attention_heads
    seq_length: int = 128
    max_position_embeddings: int | None = None  # None: seq_length
    vocab_size: int = 512  # true tokenizer vocabulary (before padding)
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    # RoPE frequency scaling for long context: None, "linear" (positions / factor, Chen et al.
    # 2023) or "llama3" (Llama 3.1's banded rescaling, low/high freq factors, original length)
    rope_scaling_type: str | None = None
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    # YaRN ("yarn", Peng et al. 2023; layers/yarn.py): the ramp's rotation bounds, and the
    # temperature's mscale / mscale_all_dim (HF's names without the prefix; None: unset)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    # Multi-head latent attention (DeepSeek-V2/V3, layers/mla.py; HF's field names): set
    # kv_lora_rank to use it instead of SelfAttention. q_lora_rank None: one query projection.
    # kv_channels then defaults to qk_nope_head_dim + qk_rope_head_dim (the q/k head dim).
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # Sliding-window attention (Megatron-Core's fields): `window_size` (left, right) lets the
    # query at position i attend keys i - left .. i + right (right is 0: causal decoders), so
    # HF's `sliding_window` W is (W - 1, 0); `window_attn_skip_freq` says which layers keep
    # full attention: None (none), N (every Nth, 1-based: layers N, 2N, ...) or one 0/1 per
    # layer (1 = sliding, 0 = full). See `layer_window_size`.
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | list[int] | None = None
    # RoPE base of the sliding-window layers when it differs from `rotary_base` (Gemma 3's
    # rope_local_base_freq: local layers 10^4, global ones 10^6); None: rotary_base everywhere
    rope_local_base_freq: float | None = None
    # gpt-oss (OpenAI 2025; Megatron-Core's names; models/config_oss.py checks them):
    # `softmax_type` "learnable" gives each attention head a learned sink logit in its softmax
    # (layers/attention.py); the gated unit of `activation` "quick_geglu" is clamped at
    # `activation_func_clamp_value` and its linear half offset by `glu_linear_offset`
    # (layers/mlp.py `quick_geglu`); `rope_yarn_truncate` false keeps YaRN's correction range
    # unrounded (layers/yarn.py). An MoE model with `add_bias_linear` has router and expert
    # biases.
    softmax_type: str = "vanilla"
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    rope_yarn_truncate: bool = True
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    # Gemma: norms scale by (1 + weight), the weight stored zero-centred (Megatron's name)
    layernorm_zero_centered_gamma: bool = False
    # Gemma's sandwich norms: a norm on the attention / MLP output before the residual add
    post_self_attn_layernorm: bool = False
    post_mlp_layernorm: bool = False
    # Gemma: word embeddings multiplied by sqrt(hidden_size) (in the embedding's dtype)
    apply_embedding_scaling: bool = False
    # attention scores scale (Megatron's softmax_scale; Gemma: query_pre_attn_scalar^-0.5);
    # None: 1/sqrt(kv_channels)
    softmax_scale: float | None = None
    # Gemma 2: scores and final logits soft-capped, cap * tanh(x / cap); None: no cap
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    activation: str = "gelu"  # "gelu" (tanh approximation, as GPT-2) or "swiglu"
    add_bias_linear: bool = True
    add_qkv_bias: bool | None = None  # None: same as add_bias_linear
    # Norms on the queries and keys before RoPE (Megatron's qk_layernorm): per head over
    # kv_channels (Qwen3), or with `qk_norm_over_heads` an RMSNorm over the whole q and the
    # whole k projection (OLMo 2; its squares summed over TP ranks)
    qk_layernorm: bool = False
    qk_norm_over_heads: bool = False
    # False: no norm before attention and MLP (OLMo 2 normalizes their outputs instead)
    pre_layernorm: bool = True
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    # T5 (model_type t5): layers of each stack (None: num_layers), decoder length (None:
    # seq_length) and the relative position buckets (Raffel et al. 2020, sec. 2.1)
    encoder_num_layers: int | None = None
    decoder_num_layers: int | None = None
    decoder_seq_length: int | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    # Mixture of experts (Megatron-Core's fields; layers/moe/). `num_moe_experts` None: dense.
    # `moe_layer_freq`: which layers are MoE, N (0-based layers 0, N, 2N, ...) or one 0/1 per
    # layer (1 = MoE), see `is_moe_layer`. `moe_ffn_hidden_size` None: ffn_hidden_size.
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # "softmax" or "sigmoid"
    moe_router_pre_softmax: bool = False  # softmax over all experts before top-k
    moe_router_topk_scaling_factor: float | None = None  # routing weights x this
    # group-limited routing (DeepSeek-V3's n_group / topk_group): experts in `num_groups`
    # equal groups, a token picks its top-k among the `group_topk` best groups only
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None  # None: no shared experts
    moe_shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared output
    moe_layer_freq: int | list[int] = 1
    moe_aux_loss_coeff: float = 0.0  # Switch/GShard load-balancing loss, per microbatch
    moe_z_loss_coeff: float | None = None  # ST-MoE router z-loss
    moe_router_enable_expert_bias: bool = False  # DeepSeek-V3 aux-loss-free balancing
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    # DeepSeek-V3 multi-token prediction (models/mtp.py; Megatron-Core's names): depths
    # D (None or 0: none) and the weight of their mean loss (the report's lambda)
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.kv_lora_rank is not None and \
                type(self.qk_nope_head_dim) is int and type(self.qk_rope_head_dim) is int:
            self.kv_channels = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.kv_channels is None and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.activation == "swiglu":
                self.ffn_hidden_size = 256 * math.ceil(int(8 * self.hidden_size / 3) / 256)
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.add_qkv_bias is None:
            self.add_qkv_bias = self.add_bias_linear
        if isinstance(self.window_size, list):  # YAML and JSON have no tuples
            self.window_size = tuple(self.window_size)
        if self.model_type == "t5":
            self.encoder_num_layers = self.encoder_num_layers or self.num_layers
            self.decoder_num_layers = self.decoder_num_layers or self.num_layers
            self.decoder_seq_length = self.decoder_seq_length or self.seq_length

    @property
    def is_encoder_decoder(self) -> bool:
        return self.model_type == "t5"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a mapping (YAML); unknown keys raise `ConfigError` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k.replace("-", "_") not in names)
        if unknown:
            raise ConfigError(
                f"unknown model config key(s) {unknown}; valid keys are {sorted(names)}"
            )
        return cls(**{k.replace("-", "_"): v for k, v in d.items()})

    def to_dict(self) -> dict[str, Any]:
        """The fields as YAML/JSON values (`window_size` as a list); `from_dict` reads it back."""
        d = dataclasses.asdict(self)
        if self.window_size is not None:
            d["window_size"] = list(self.window_size)
        return d

    def describe(self) -> str:
        """One line of the model's size: `30 layers, hidden 576, heads 9/3, vocab 49152,
        134.5M parameters` (heads: query/KV; T5: `6+6 encoder+decoder layers`)."""
        layers = (f"{self.encoder_num_layers}+{self.decoder_num_layers} encoder+decoder"
                  if self.is_encoder_decoder else f"{self.num_layers}")
        return (f"{layers} layers, hidden {self.hidden_size}, heads "
                f"{self.num_attention_heads}/{self.num_query_groups}, vocab {self.vocab_size}, "
                f"{self.num_parameters() / 1e6:.1f}M parameters")

    # ------------------------------------------------------------------ derived sizes
    @property
    def multi_latent_attention(self) -> bool:
        """Whether the layers use multi-head latent attention (`kv_lora_rank` set)."""
        return self.kv_lora_rank is not None

    @property
    def rotary_dim(self) -> int:
        """RoPE's dimension: qk_rope_head_dim under MLA, else the head dim kv_channels."""
        return self.qk_rope_head_dim if self.multi_latent_attention else self.kv_channels

    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_query_groups

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron)."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Exact parameter count of the unpadded, untied-if-configured dense model."""
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        qkv_out = self.query_projection_size + 2 * self.kv_projection_size
        norm = 2 * h if self.normalization == "LayerNorm" else h
        attn = h * qkv_out + self.query_projection_size * h
        if self.multi_latent_attention:
            attn = mla_parameters(self)
        mlp = self._mlp_parameters(f)
        if self.add_qkv_bias:
            attn += qkv_out
        if self.add_bias_linear:
            attn += h
        attn += sink_parameters(self)
        if self.is_encoder_decoder:  # cross-attention: same projections; 3 norms a layer
            total = self.encoder_num_layers * (attn + mlp + 2 * norm) + \
                self.decoder_num_layers * (2 * attn + mlp + 3 * norm) + 2 * norm
            total += 2 * self.relative_attention_num_buckets * self.num_attention_heads
        else:
            norms = 2 + self.post_self_attn_layernorm + self.post_mlp_layernorm
            total = L * (attn + mlp + norms * norm) + norm
            moe_layers = self.num_moe_layers()
            if moe_layers:
                total += moe_layers * (self._moe_parameters() - mlp)
            if self.mtp_num_layers:  # each depth: a layer like the last one, norms, eh_proj
                one = attn + mlp + norms * norm + self._qk_norm_parameters() - \
                    (0 if self.pre_layernorm else 2 * norm)
                if self.is_moe_layer(self.num_layers - 1):
                    one += self._moe_parameters() - mlp
                total += self.mtp_num_layers * (one + mtp_extra_parameters(self, norm))
        if not self.is_encoder_decoder:
            total += L * self._qk_norm_parameters() - (0 if self.pre_layernorm else 2 * L * norm)
        if include_embedding:
            total += self.vocab_size * h
            if self.untie_embeddings_and_output_weights:
                total += self.vocab_size * h
            if self.position_embedding_type == "learned_absolute":
                total += self.max_position_embeddings * h
        return total

    def _qk_norm_parameters(self) -> int:
        """Parameters of one layer's q and k norms (`qk_layernorm`)."""
        if not self.qk_layernorm:
            return 0
        if self.qk_norm_over_heads:
            return self.query_projection_size + self.kv_projection_size
        return (2 if self.normalization == "RMSNorm" else 4) * self.kv_channels

    def _mlp_parameters(self, ffn: int) -> int:
        """Parameters of one dense MLP of width `ffn` (fused [gate; up] for gated units)."""
        fc1_out = 2 * ffn if self.activation in ("swiglu", "geglu", "quick_geglu") else ffn
        n = self.hidden_size * fc1_out + ffn * self.hidden_size
        return n + fc1_out + self.hidden_size if self.add_bias_linear else n

    def _moe_parameters(self) -> int:
        """Parameters of one MoE MLP, all experts counted: router `[E, h]` (+ bias `[E]` with
        add_bias_linear), E experts of width moe_ffn_hidden_size (with add_bias_linear their
        biases), the shared experts and their gate `[1, h]`."""
        h, e = self.hidden_size, self.num_moe_experts
        n = e * h + e * self._mlp_parameters(self.moe_ffn_hidden_size)
        n += e if self.add_bias_linear else 0
        if self.moe_shared_expert_intermediate_size:
            n += self._mlp_parameters(self.moe_shared_expert_intermediate_size)
            n += h if self.moe_shared_expert_gate else 0
        return n

    def num_moe_layers(self) -> int:
        """How many of the `num_layers` layers have an MoE MLP (`is_moe_layer`), counted
        without a loop over the layers: a checkpoint's metadata may claim any number of them,
        and is refused by the size this count gives (`checkpoint.format.model_config`)."""
        if self.num_moe_experts is None:
            return 0
        freq = self.moe_layer_freq
        if isinstance(freq, list):  # one 0/1 per layer (validate), as long as its file allows
            return sum(1 for v in freq[:self.num_layers] if v)
        return -(-self.num_layers // freq)  # layers 0, N, 2N, ... below num_layers

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether the 0-based global layer `layer_number` has an MoE MLP (Megatron-Core's
        `moe_layer_freq`: N makes layers 0, N, 2N, ... MoE; a list gives one 0/1 per layer)."""
        if self.num_moe_experts is None:
            return False
        if layer_number >= self.num_layers:  # a multi-token-prediction layer: as the last
            layer_number = self.num_layers - 1
        freq = self.moe_layer_freq
        return bool(freq[layer_number]) if isinstance(freq, list) else layer_number % freq == 0

    def layer_window_size(self, layer_number: int) -> tuple[int, int] | None:
        """`window_size` for the 0-based global layer `layer_number` when that layer slides,
        None when it attends to every earlier key: Megatron-Core's
        `is_layer_window_attention` (which counts layers from 1)."""
        freq = self.window_attn_skip_freq
        if self.window_size is None or freq is None:
            return self.window_size
        slides = bool(freq[layer_number]) if isinstance(freq, list) else \
            (layer_number + 1) % freq != 0
        return self.window_size if slides else None

    # ------------------------------------------------------------------ validation
    def validate(self, tensor_model_parallel_size: int = 1,
                 kv_replication: bool = False) -> None:
        """Raise `ConfigError` naming the field and the fix for any inconsistent value.

        `kv_replication` (inference) also accepts a tp that is a multiple of
        num_query_groups: each KV head is then replicated on tp / num_query_groups ranks.
        """
        tp = tensor_model_parallel_size
        if self.model_type not in _MODEL_TYPES:
            raise ConfigError(f"--model-type must be one of {_MODEL_TYPES}, got "
                              f"{self.model_type!r}")
        if self.is_encoder_decoder:
            self._validate_t5()
        elif self.position_embedding_type == "relative":
            raise ConfigError("--position-embedding-type relative (T5's bias) is for "
                              "--model-type t5; a GPT model uses learned_absolute, rope or none")
        self._check_counts("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                           "vocab_size", "ffn_hidden_size", "kv_channels", "num_query_groups",
                           "make_vocab_size_divisible_by", "max_position_embeddings")
        for name in ("seq_length", "max_position_embeddings"):
            if getattr(self, name) > MAX_POSITIONS:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name):,} is more "
                                  f"than {MAX_POSITIONS:,} positions (2**24), past any real "
                                  f"model's context; correct the config")
        for name in ("layernorm_epsilon", "init_method_std", "rotary_base"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive finite number, "
                                  f"got {v}")
        if self.position_embedding_type not in _POSITION_TYPES:
            raise ConfigError(f"--position-embedding-type must be one of {_POSITION_TYPES}, "
                              f"got {self.position_embedding_type!r}")
        if self.normalization not in _NORMS:
            raise ConfigError(f"--normalization must be one of {_NORMS}, "
                              f"got {self.normalization!r}")
        if self.activation not in _ACTIVATIONS:
            raise ConfigError(f"--activation must be one of {_ACTIVATIONS}, "
                              f"got {self.activation!r}")
        if self.multi_latent_attention:
            validate_mla(self, tp)
        else:
            validate_mla_off(self)
            self._validate_heads(tp, kv_replication)
        if self.ffn_hidden_size % tp:
            raise ConfigError(
                f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                f"--tensor-model-parallel-size {tp}")
        self._validate_rope_scaling()
        self._validate_window()
        self._validate_layer_norms(tp, kv_replication)
        self._validate_gemma()
        validate_oss(self)
        self._validate_moe(tp)
        validate_mtp(self)
        if self.position_embedding_type == "rope" and self.rotary_dim % 2:
            raise ConfigError(f"RoPE needs an even head dim, got --kv-channels {self.kv_channels}")
        if self.max_position_embeddings < self.seq_length and \
                self.position_embedding_type == "learned_absolute":
            raise ConfigError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings}; raise max-position-embeddings or shorten "
                f"the sequence")
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1), got {p}")

    def _validate_heads(self, tp: int, kv_replication: bool) -> None:
        """Heads, KV groups and head dim against each other and against tp (`validate`)."""
        if self.kv_channels * self.num_attention_heads != self.hidden_size and \
                self.kv_channels == self.hidden_size // self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; pick sizes where it is, or set --kv-channels")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--num-query-groups {self.num_query_groups}; each query group must hold the "
                f"same number of heads")
        if self.num_attention_heads % tp:
            raise ConfigError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; use a tp that divides the head count")
        replicate = kv_replication and tp % self.num_query_groups == 0
        if self.num_query_groups % tp and not replicate:
            if kv_replication:
                raise ConfigError(
                    f"--num-query-groups {self.num_query_groups} (KV heads) and "
                    f"--tensor-model-parallel-size {tp}: tp must divide the KV heads or be a "
                    f"multiple of them (each KV head then replicated on tp / "
                    f"{self.num_query_groups} ranks); pick such a tp")
            raise ConfigError(
                f"--num-query-groups {self.num_query_groups} is not divisible by "
                f"--tensor-model-parallel-size {tp}; use a tp that divides the number of "
                f"KV heads (or fewer, larger groups); replicating KV heads over TP is for inference "
                f"only (infer.py)")

    def _validate_rope_scaling(self) -> None:
        """`rope_scaling_type` and its factors (linear, llama3)."""
        if self.rope_scaling_type not in _ROPE_SCALING:
            raise ConfigError(f"--rope-scaling-type must be one of linear, llama3, yarn (or "
                              f"none), "
                              f"got {self.rope_scaling_type!r}")
        if self.rope_scaling_type is not None and not self.rope_scaling_factor >= 1.0:
            raise ConfigError(f"--rope-scaling-factor must be >= 1, got "
                              f"{self.rope_scaling_factor}")
        if self.rope_scaling_type == "yarn":
            validate_yarn(self)
        if self.rope_scaling_type == "llama3" and \
                not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError(f"llama3 RoPE scaling needs 0 < --rope-low-freq-factor "
                              f"{self.rope_low_freq_factor} < --rope-high-freq-factor "
                              f"{self.rope_high_freq_factor}")

    def _validate_window(self) -> None:
        """`window_size` and `window_attn_skip_freq` (they may come from untrusted metadata:
        exact types, bounds, one entry per layer)."""
        w, freq = self.window_size, self.window_attn_skip_freq
        if w is None:
            if freq is not None:
                raise ConfigError(f"--window-attn-skip-freq {freq} says which layers keep full "
                                  f"attention among sliding-window ones, but --window-size is "
                                  f"not set; set it (e.g. --window-size 4095,0) or drop the flag")
            return
        if type(w) is int:
            raise ConfigError(
                f"--window-size {w}: give Megatron's (left, right) pair, e.g. --window-size "
                f"{max(w - 1, 0)},0 for HF's sliding_window {w} (the query and the "
                f"{max(w - 1, 0)} keys before it)")
        if type(w) is not tuple or len(w) != 2 or any(type(v) is not int for v in w):
            raise ConfigError(f"--window-size must be two integers (left, right), e.g. "
                              f"4095,0; got {w!r}")
        if not 0 <= w[0] < 2**31 or w[1] != 0:
            raise ConfigError(
                f"--window-size {w[0]},{w[1]}: left must be in [0, 2^31) (-1, Megatron's "
                f"unbounded window, is full attention: leave --window-size unset) and right 0 "
                f"(a causal decoder attends to no later key)")
        if self.is_encoder_decoder:
            raise ConfigError("--window-size is for decoder-only models (T5 has no sliding "
                              "window); drop it or use --model-type gpt")
        if freq is None:
            return
        if type(freq) is int:
            if freq < 2:
                raise ConfigError(
                    f"--window-attn-skip-freq {freq}: every {freq}th layer keeps full attention, "
                    f"so give N >= 2 (N = 1 is no sliding layer at all: drop --window-size)")
            return
        self._check_layer_list("--window-attn-skip-freq", freq, 2, "sliding window",
                               "full attention")

    def _validate_gemma(self) -> None:
        """The Gemma fields (they may come from untrusted metadata: exact types, bounds)."""
        for name in ("rope_local_base_freq", "softmax_scale", "attn_logit_softcapping",
                     "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and math.isfinite(v) and v > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive finite number "
                                  f"(or unset), got {v!r}")
        for name in ("layernorm_zero_centered_gamma", "post_self_attn_layernorm",
                     "post_mlp_layernorm", "apply_embedding_scaling"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"--{name.replace('_', '-')} must be true or false, got "
                                  f"{getattr(self, name)!r}")
        if self.rope_local_base_freq is not None and self.window_size is None:
            raise ConfigError("--rope-local-base-freq is the RoPE base of the sliding-window "
                              "layers, but --window-size is not set; set it or drop the flag")

    def _validate_layer_norms(self, tp: int, kv_replication: bool) -> None:
        """qk_layernorm / qk_norm_over_heads / pre_layernorm (exact types: they may come from
        untrusted metadata) and what they combine with."""
        for name in ("qk_layernorm", "qk_norm_over_heads", "pre_layernorm"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"--{name.replace('_', '-')} must be true or false, got "
                                  f"{getattr(self, name)!r}")
        if self.qk_norm_over_heads and not self.qk_layernorm:
            raise ConfigError("--qk-norm-over-heads says how the q/k norms span the heads, but "
                              "--qk-layernorm is not set; set it or drop the flag")
        if self.qk_norm_over_heads and self.normalization != "RMSNorm":
            raise ConfigError("--qk-norm-over-heads is an RMSNorm over the whole q and k "
                              "projections (OLMo 2); add --normalization RMSNorm")
        if self.qk_norm_over_heads and self.num_query_groups % tp:
            raise ConfigError(
                f"--qk-norm-over-heads with --num-query-groups {self.num_query_groups} at "
                f"--tensor-model-parallel-size {tp}: the k norm's weight is split over TP with "
                f"the KV heads, which cannot be replicated here; use a tp that divides the KV "
                f"heads")
        if self.is_encoder_decoder and (self.qk_layernorm or not self.pre_layernorm):
            raise ConfigError("--qk-layernorm and --no-pre-layernorm are for decoder-only models "
                              "(T5's layers have neither); drop them or use --model-type gpt")

    def _check_layer_list(self, flag: str, freq, smallest: int, one: str, zero: str) -> None:
        """`freq`, given as a list, must hold one 0/1 per layer; the ConfigError names `flag`,
        its integer form N >= `smallest`, and what 1 (`one`) and 0 (`zero`) mean."""
        if type(freq) is not list or len(freq) != self.num_layers or \
                any(type(v) is not int or v not in (0, 1) for v in freq):
            shown = repr(freq) if len(repr(freq)) < 200 else repr(freq)[:200] + "..."
            raise ConfigError(
                f"{flag} must be an integer N >= {smallest} or a list of --num-layers "
                f"{self.num_layers} entries, each 1 ({one}) or 0 ({zero}); got {shown}")

    def _validate_moe(self, tp: int) -> None:
        """The MoE fields (they may come from untrusted metadata: exact types and bounds)."""
        e = self.num_moe_experts
        if e is None:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            stray = [n for n in defaults if n.startswith("moe_") and getattr(self, n) != defaults[n]]
            if stray:
                raise ConfigError(f"{', '.join('--' + n.replace('_', '-') for n in stray)} "
                                  f"configure mixture-of-experts layers, but --num-experts is "
                                  f"not set; set it (e.g. --num-experts 8) or drop them")
            return
        if type(e) is not int or e < 1:
            raise ConfigError(f"--num-experts must be a positive integer, got {e!r}")
        k = self.moe_router_topk
        if type(k) is not int or not 1 <= k <= e:
            raise ConfigError(f"--moe-router-topk must be an integer in [1, --num-experts {e}] "
                              f"(experts per token), got {k!r}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ConfigError(f"--moe-router-score-function must be softmax or sigmoid, got "
                              f"{self.moe_router_score_function!r}")
        sigmoid = self.moe_router_score_function == "sigmoid"
        if self.moe_router_pre_softmax and sigmoid:
            raise ConfigError("--moe-router-pre-softmax is for --moe-router-score-function "
                              "softmax (sigmoid scores each expert on its own); drop one")
        if k == 1 and not sigmoid and not self.moe_router_pre_softmax:
            raise ConfigError(
                "--moe-router-topk 1 with softmax after the top-k gives every token the weight "
                "1.0, so the router never learns; add --moe-router-pre-softmax (Switch "
                "Transformer's routing) or use --moe-router-score-function sigmoid")
        for name in ("moe_router_topk_scaling_factor", "moe_expert_capacity_factor"):
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and math.isfinite(v) and v > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive finite number "
                                  f"(or unset), got {v!r}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0, "
                                  f"got {v!r}")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            v = getattr(self, name)
            if v is None and name == "moe_shared_expert_intermediate_size":
                continue
            if type(v) is not int or v < 1 or v % tp:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer "
                                  f"divisible by --tensor-model-parallel-size {tp}, got {v!r}")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError("--moe-shared-expert-gate gates the shared experts, but there are "
                              "none; set --moe-shared-expert-intermediate-size or drop it")
        if self.moe_router_enable_expert_bias:
            if not sigmoid:
                raise ConfigError("--moe-router-enable-expert-bias (DeepSeek-V3's aux-loss-free "
                                  "balancing) biases sigmoid scores; add "
                                  "--moe-router-score-function sigmoid")
            r = self.moe_router_bias_update_rate
            if not (_is_number(r) and math.isfinite(r) and r > 0):
                raise ConfigError(f"--moe-router-bias-update-rate must be a positive finite "
                                  f"number, got {r!r}")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ConfigError("--moe-pad-expert-input-to-capacity pads to the capacity of "
                              "--moe-expert-capacity-factor, which is not set; set it or drop "
                              "the padding")
        if self.moe_token_dispatcher_type != "alltoall":
            raise ConfigError(f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type!r} "
                              f"is not built; use alltoall")
        if self.is_encoder_decoder:
            raise ConfigError("--num-experts is for decoder-only models (--model-type gpt)")
        self._validate_moe_layer_freq()
        validate_group_routing(self)

    def _validate_moe_layer_freq(self) -> None:
        freq = self.moe_layer_freq
        if type(freq) is int:
            if freq < 1:
                raise ConfigError(f"--moe-layer-freq {freq}: give N >= 1 (layers 0, N, 2N, ... "
                                  f"are MoE) or one 0/1 per layer")
            return
        self._check_layer_list("--moe-layer-freq", freq, 1, "MoE", "dense MLP")

    def _check_counts(self, *names: str) -> None:
        """Raise `ConfigError` unless each field of `names` is an integer in [1, MAX_COUNT]."""
        for name in names:
            if getattr(self, name) is None or not 0 < getattr(self, name) <= MAX_COUNT:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer "
                                  f"below 2**31, got {getattr(self, name)}")

    def _validate_t5(self) -> None:
        self._check_counts("encoder_num_layers", "decoder_num_layers", "decoder_seq_length",
                           "relative_attention_num_buckets", "relative_attention_max_distance")
        if self.position_embedding_type != "relative":
            raise ConfigError(f"--model-type t5 uses --position-embedding-type relative, got "
                              f"{self.position_embedding_type!r}")
        if self.relative_attention_num_buckets < 4:
            raise ConfigError("--relative-attention-num-buckets must be >= 4 (half exact, "
                              "half logarithmic, per direction)")
