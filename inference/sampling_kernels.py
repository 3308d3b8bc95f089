"""The C++ form of `sampling.uniforms` (sampling_kernels.cpp): one pass over the ids where the
torch form makes ~30, the same float64 values bit for bit. Built at first use by
layers/cpu_extension.py; where it cannot be built (no g++ or ninja) `extension()` is None
after one warning and sampling keeps the torch form.
"""
from __future__ import annotations

import os

from layers import cpu_extension

SOURCES = ("sampling_kernels.cpp",)
_LAZY = cpu_extension.lazy_source(
    "shardzoo_sampling", os.path.dirname(__file__), SOURCES, "sampling kernel",
    "sampled rows draw their uniforms with torch ops instead (slower)")


def extension():
    """The compiled module (`keyed_uniforms`), or None when it cannot be built here."""
    return _LAZY.get()
