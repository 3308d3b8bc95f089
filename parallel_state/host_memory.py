"""The host allocator: keep large freed blocks in the process instead of returning them to
the kernel (glibc's `mallopt`), set once by the entry points.

torch allocates CPU tensors with the C library's `malloc`. glibc serves a request above its
mmap threshold with a fresh `mmap` and gives it back with `munmap` on free; the threshold
adapts upwards only to 32 MB. A training step on CPU frees and reallocates its largest
tensors every step: the logits and their gradient (`[s, b, v]` float32 is 64 MB for the
training bench's model), the loss's softmax. Each new mapping is zero-filled by the kernel
page by page on first touch, which costs more than the arithmetic done on it. On the 2-core
development machine, cloning a 64 MB tensor took 20 ms with glibc's default and 3 ms
with large blocks kept; a training step of the bench's Llama took 8% (float32) and 20%
(bf16 autocast) less time (2-core Zen 5, 2026-12-02). CPU PyTorch tuning
guides get the same by preloading jemalloc or tcmalloc; this needs no extra library.

`tune_host_allocator()` sets `M_MMAP_THRESHOLD` (requests served by mmap) and
`M_TRIM_THRESHOLD` (free memory at the heap top kept before shrinking it) to 1 GiB, so blocks
up to 1 GiB are reused from the heap. The process's resident memory then stays near its peak
instead of falling between steps. `SHARDZOO_HOST_MALLOC=default` keeps glibc's defaults;
elsewhere than glibc (musl, macOS, Windows) nothing is changed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ENV_SWITCH = "SHARDZOO_HOST_MALLOC"
CHOICES = ("tuned", "default")
MMAP_THRESHOLD = 1 << 30  # bytes: larger requests still get their own mapping
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept before it is returned (a C int)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def tune_host_allocator() -> bool:
    """Keep large freed blocks in this process (see the module docstring). Returns whether
    the allocator was changed: False with `SHARDZOO_HOST_MALLOC=default` or without glibc.
    Call it once, early, from a process's entry point: it changes the whole process.

    Raises:
        ValueError: `SHARDZOO_HOST_MALLOC` is neither `tuned` nor `default`.
    """
    choice = os.environ.get(ENV_SWITCH, "tuned").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{ENV_SWITCH}={choice!r}: expected one of {', '.join(CHOICES)} "
                         f"(tuned: keep large freed blocks, the default; default: glibc's "
                         f"own thresholds)")
    if choice == "default" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
