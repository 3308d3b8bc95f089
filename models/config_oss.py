"""ModelConfig's checks and counts for gpt-oss-style models (OpenAI 2025, "gpt-oss-120b &
gpt-oss-20b Model Card"): attention sinks (`softmax_type`), the clamped, offset gated unit
of the experts (`activation` "quick_geglu" with `activation_func_clamp_value` and
`glu_linear_offset`) and YaRN without rounding (`rope_yarn_truncate`). Fields come from
untrusted files too: exact types and bounds."""
from __future__ import annotations

import math

from .config import ConfigError

SOFTMAX_TYPES = ("vanilla", "learnable")


def sink_parameters(c) -> int:
    """Parameters of one layer's attention sinks: one logit per head when learnable."""
    return c.num_attention_heads if c.softmax_type == "learnable" else 0


def validate_oss(c) -> None:
    """Raise `ConfigError` naming the flag for a gpt-oss field of the wrong type or range."""
    if c.softmax_type not in SOFTMAX_TYPES:
        raise ConfigError(f"--softmax-type must be one of {SOFTMAX_TYPES} (learnable: a "
                          f"learned sink logit per head), got {c.softmax_type!r}")
    if c.softmax_type == "learnable" and c.multi_latent_attention:
        raise ConfigError("--softmax-type learnable (attention sinks) is not built into "
                          "multi-latent attention; drop one")
    off = c.glu_linear_offset
    if type(off) not in (int, float) or not math.isfinite(off):
        raise ConfigError(f"--glu-linear-offset must be a finite number, got {off!r}")
    clamp = c.activation_func_clamp_value
    if clamp is not None and not (type(clamp) in (int, float) and math.isfinite(clamp)
                                  and clamp > 0):
        raise ConfigError(f"--activation-func-clamp-value must be a positive finite number "
                          f"(or unset), got {clamp!r}")
    if (clamp is not None or off) and c.activation != "quick_geglu":
        raise ConfigError("--activation-func-clamp-value and --glu-linear-offset shape the "
                          "gated unit of --activation quick_geglu (gpt-oss); set it or drop "
                          "them")
    if type(c.rope_yarn_truncate) is not bool:
        raise ConfigError(f"--rope-yarn-truncate must be true or false, got "
                          f"{c.rope_yarn_truncate!r}")
