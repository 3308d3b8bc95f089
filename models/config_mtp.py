"""ModelConfig's checks and counts for multi-token prediction (models/mtp.py; DeepSeek-V3
technical report, arXiv:2412.19437, sec. 2.2). Fields come from untrusted files too: exact
types and bounds."""
from __future__ import annotations

import math

from .config import ConfigError

MAX_MTP_LAYERS = 16  # DeepSeek-V3 trains D = 1; a few more for experiments


def mtp_depths(c) -> int:
    """D, the number of multi-token-prediction depths (0 when off)."""
    return c.mtp_num_layers or 0


def validate_mtp(c) -> None:
    """Raise `ConfigError` for --mtp-num-layers / --mtp-loss-scaling-factor values that do not
    fit each other or the model (decoder-only, RoPE, no sliding windows)."""
    d, factor = c.mtp_num_layers, c.mtp_loss_scaling_factor
    if d is not None and (type(d) is not int or not 0 <= d <= MAX_MTP_LAYERS):
        raise ConfigError(f"--mtp-num-layers must be an integer in [0, {MAX_MTP_LAYERS}] "
                          f"(DeepSeek-V3: 1), got {d!r}")
    if not (type(factor) in (int, float) and math.isfinite(factor) and factor >= 0):
        raise ConfigError(f"--mtp-loss-scaling-factor must be a finite number >= 0 "
                          f"(DeepSeek-V3: 0.3, then 0.1), got {factor!r}")
    if not d:
        return
    if c.model_type != "gpt":
        raise ConfigError("--mtp-num-layers (multi-token prediction) is for decoder-only "
                          "models; drop it for --model-type t5")
    if c.position_embedding_type != "rope":
        raise ConfigError(f"--mtp-num-layers needs --position-embedding-type rope (its layers "
                          f"get positions from RoPE only), got "
                          f"{c.position_embedding_type!r}; drop --mtp-num-layers")
    if c.window_size is not None:
        raise ConfigError("--mtp-num-layers is not built with --window-size (sliding-window "
                          "layers); drop one of them")


def mtp_extra_parameters(c, norm: int) -> int:
    """Parameters of one depth besides its transformer layer: enorm, hnorm and the final
    norm (`norm` each), and eh_proj `[h, 2h]` (no bias). The embedding and output head are
    the main model's."""
    return 3 * norm + 2 * c.hidden_size * c.hidden_size
