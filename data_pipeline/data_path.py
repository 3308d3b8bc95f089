"""--data-path: one prefix, or weight/prefix pairs of a blend (Megatron's format)."""
from __future__ import annotations

import math

from models.config import ConfigError


def parse_data_path(data_path: list[str]) -> list[tuple[float, str]]:
    """``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` -> ``[(weight, prefix), ...]``.

    Weights are returned as given (not normalised). Raises `ConfigError` (a ValueError) naming
    --data-path.
    """
    data_path = [str(x) for x in data_path]
    if not data_path:
        raise ConfigError("--data-path is empty; pass a prefix or pairs 'w1 prefix1 w2 prefix2'")
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if len(data_path) % 2:
        raise ConfigError(f"--data-path with several entries must be weight/prefix pairs "
                          f"(w1 prefix1 w2 prefix2 ...), got {len(data_path)} items: {data_path}")
    blend = []
    for w, prefix in zip(data_path[::2], data_path[1::2]):
        try:
            blend.append((float(w), prefix))
        except ValueError:
            raise ConfigError(f"--data-path weight {w!r} (before {prefix!r}) is not a number; "
                              f"write pairs like: --data-path 0.7 data/a_text 0.3 data/b_text")
    if not all(math.isfinite(w) for w, _ in blend):
        raise ConfigError(f"--data-path weights {[w for w, _ in blend]} must be finite numbers")
    if min(w for w, _ in blend) < 0:
        raise ConfigError(f"--data-path weights {[w for w, _ in blend]} must be >= 0")
    if not sum(w for w, _ in blend) > 0:
        raise ConfigError(f"--data-path weights {[w for w, _ in blend]} must not all be zero")
    return blend
