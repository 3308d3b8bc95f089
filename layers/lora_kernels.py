"""The C++ kernels of the LoRA serving hook (layers/multi_lora.py): Punica's SGMV shrink and
expand (Chen et al. 2023) for float32 rows grouped by adapter slot, on one CPU thread
(lora_kernels.cpp). Built at first use by layers/cpu_extension.py; where they cannot be built
(no g++ or ninja) `extension()` is None after one warning and the hook runs its `torch.bmm`
form instead.
"""
from __future__ import annotations

import os

from . import cpu_extension

SOURCES = ("lora_kernels.cpp",)


def extension_name() -> str:
    """`shardzoo_lora_<avx2|generic>_<8 hex of sha256(lora_kernels.cpp)>`."""
    return cpu_extension.extension_name("shardzoo_lora", os.path.dirname(__file__), SOURCES)


def _build():
    return cpu_extension.build(extension_name(),
                               [os.path.join(os.path.dirname(__file__), SOURCES[0])])


_LAZY = cpu_extension.LazyExtension(
    lambda: _build(), "LoRA serving kernels",
    "mixed-adapter batches run batched matmuls instead (slower)")


def extension():
    """The compiled module (`shrink`, `expand`, `add`), or None when it cannot be built
    here."""
    return _LAZY.get()
