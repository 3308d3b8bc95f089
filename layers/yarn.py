"""YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models"): the "NTK-by-parts" frequencies (sec. 3.2) and the attention temperature
(sec. 3.3, eq. 21), as DeepSeek-V2/V3 and transformers' `_compute_yarn_parameters` use them.

- Frequencies: a dimension pair i that turns fewer than `beta_slow` times over the original
  context is interpolated (its frequency divided by `factor`), one that turns more than
  `beta_fast` times is kept, and those between blend linearly (a ramp over the pair index
  between the two correction dimensions, rounded outwards).
- Temperature: `mscale(factor, m) = 0.1 m ln(factor) + 1` (1 when factor <= 1). The cos and
  sin of RoPE are multiplied by the `attention_factor` (`yarn_attention_factor`); multi-head
  latent attention also multiplies its softmax scale by `mscale(factor, mscale_all_dim)^2`
  (layers/mla.py), which reaches the non-RoPE dimensions too.
"""
from __future__ import annotations

import math

import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """`0.1 * mscale * ln(factor) + 1` for factor > 1, else 1 (YaRN eq. 21's sqrt(1/t))."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_attention_factor(factor: float, mscale: float | None,
                          mscale_all_dim: float | None) -> float:
    """The factor on RoPE's cos and sin: `mscale(f, mscale) / mscale(f, mscale_all_dim)` when
    both are given and non-zero (DeepSeek's form, 1 when they are equal), else `mscale(f)`."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _correction_dim(rotations: float, dim: int, base: float, max_position: int) -> float:
    """The (fractional) dimension index whose wavelength turns `rotations` times over
    `max_position` positions (YaRN sec. 3.2)."""
    return dim * math.log(max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, factor: float,
                  original_max_position: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """YaRN's frequencies `[dim/2]` (float64) from the unscaled `inv_freq [dim/2]`: pair i
    keeps `ramp_i` of the interpolated `inv_freq / factor` and `1 - ramp_i` of `inv_freq`,
    `ramp_i = clamp((i - low) / (high - low), 0, 1)` with `low = floor(correction dim of
    beta_fast rotations)`, `high = ceil(correction dim of beta_slow rotations)`, both clamped
    to [0, dim - 1]; `truncate` false (gpt-oss) keeps `low` and `high` unrounded
    (transformers' `truncate`)."""
    low = _correction_dim(beta_fast, dim, base, original_max_position)
    high = _correction_dim(beta_slow, dim, base, original_max_position)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a step instead of a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)
