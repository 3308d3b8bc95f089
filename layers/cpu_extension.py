"""Building shardzoo's C++ CPU kernels (layers/quant/kernels.cpp, layers/lora_kernels.cpp,
layers/attention_kernels.cpp, inference/sampling_kernels.cpp) at first use, with
`torch.utils.cpp_extension.load` (g++ and ninja) into torch's extensions cache, once per
machine and source version.

A build's name carries the instruction set it targets (`avx2`: `-mavx2 -mfma -mf16c` when
torch reports AVX2 or AVX-512; `generic`: plain `-O3`) and 8 hex digits of the sources'
sha256, so checkouts of other versions keep their own builds. Builders take an exclusive
`flock` on the build folder first: torch's own lock (a `lock` file that only its builder
removes) outlives a builder that is killed mid-build, and every later `load` would wait on it
forever; a `lock` found while the flock is held is such a leftover and is removed.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
import warnings

import torch


def simd() -> bool:
    """Whether builds here target AVX2 + FMA + F16C (torch reports AVX2 or AVX-512)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def extension_name(prefix: str, folder: str, sources: tuple[str, ...]) -> str:
    """`<prefix>_<avx2|generic>_<8 hex of sha256 of the sources in folder, in order>`."""
    digest = hashlib.sha256()
    for source in sources:
        with open(os.path.join(folder, source), "rb") as f:
            digest.update(f.read())
    return f"{prefix}_{'avx2' if simd() else 'generic'}_{digest.hexdigest()[:8]}"


def build_directory(name: str) -> str:
    """torch's extensions cache folder for `name` ($TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions/py<major><minor>_cpu)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions",
        f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    return os.path.join(root, name)


def build_lock(directory: str):
    """An open file holding an exclusive flock on `directory` (blocks until it is free; the
    kernel releases it when the holder exits, however it exits). Close it to release."""
    os.makedirs(directory, exist_ok=True)
    held = open(os.path.join(directory, "shardzoo.flock"), "a+")
    fcntl.flock(held, fcntl.LOCK_EX)
    return held


def build(name: str, sources: list[str]):
    """Compile (or load the cached build of) the C++ files `sources` as the module `name`.
    Raises what `cpp_extension.load` raises (no compiler, no ninja, a compile error)."""
    from torch.utils import cpp_extension
    flags = ["-O3", "-fopenmp"] + (["-mavx2", "-mfma", "-mf16c"] if simd() else [])
    directory = build_directory(name)
    with build_lock(directory):
        leftover = os.path.join(directory, "lock")  # torch's FileBaton of a killed builder
        if os.path.exists(leftover):
            os.remove(leftover)
        return cpp_extension.load(name=name, sources=list(sources),
                                  build_directory=directory, extra_cflags=flags,
                                  extra_ldflags=["-fopenmp"], verbose=False)


def build_or_warn(builder, what: str, fallback: str):
    """`builder()`, or None after one warning: `what` could not be built (the error's first
    line), `fallback` is what runs instead, and how to get the kernels (g++ and ninja)."""
    try:
        return builder()
    except Exception as e:  # no compiler, no ninja, a failed build
        first = str(e).splitlines()[0] if str(e) else ""
        warnings.warn(f"shardzoo's {what} could not be built ({type(e).__name__}: {first}); "
                      f"{fallback}. Install g++ and ninja to build them.", stacklevel=4)
        return None


class LazyExtension:
    """A C++ extension built at first use, once per process: `get()` returns the module, or
    None where it cannot be built (after one warning, `build_or_warn`); thread-safe.
    `module` and `tried` may be read directly on a hot path once `tried` is set."""

    def __init__(self, builder, what: str, fallback: str):
        self.builder, self.what, self.fallback = builder, what, fallback
        self.module = None
        self.tried = False
        self._lock = threading.Lock()

    def get(self):
        if not self.tried:
            with self._lock:
                if not self.tried:
                    self.module = build_or_warn(self.builder, self.what, self.fallback)
                    self.tried = True
        return self.module


def lazy_source(prefix: str, folder: str, sources: tuple[str, ...], what: str,
                fallback: str) -> LazyExtension:
    """A `LazyExtension` compiling `folder/sources[0]` (the rest of `sources`: headers it
    includes, hashed into the name) as `extension_name(prefix, folder, sources)`; `what`
    and `fallback` for the warning where it cannot be built."""
    return LazyExtension(
        lambda: build(extension_name(prefix, folder, sources),
                      [os.path.join(folder, sources[0])]), what, fallback)
