"""The C++ kernels of the LoRA serving hook (layers/multi_lora.py): Punica's SGMV shrink and
expand (Chen et al. 2023) for float32 rows grouped by adapter slot, on one CPU thread
(lora_kernels.cpp). Built at first use by layers/cpu_extension.py; where they cannot be built
(no g++ or ninja) `extension()` is None after one warning and the hook runs its `torch.bmm`
form instead.
"""
from __future__ import annotations

import os

from . import cpu_extension

SOURCES = ("lora_kernels.cpp", "cpu_simd.h")
_LAZY = cpu_extension.lazy_source(
    "shardzoo_lora", os.path.dirname(__file__), SOURCES, "LoRA serving kernels",
    "mixed-adapter batches run batched matmuls instead (slower)")


def extension():
    """The compiled module (`shrink`, `expand`, `add`), or None when it cannot be built
    here."""
    return _LAZY.get()
