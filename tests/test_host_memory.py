"""The host allocator setting (parallel_state/host_memory.py): with it, a 64 MB tensor comes
from the heap instead of its own mmap (glibc's mallinfo2 tells which), so freeing it and
allocating again reuses pages already mapped; without it (the switch), glibc maps it."""
import os
import platform
import subprocess
import sys

import pytest

from parallel_state import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import ctypes, torch
from parallel_state.host_memory import tune_host_allocator
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
tuned = tune_host_allocator()
before = libc.mallinfo2().hblkhd
x = torch.ones(16 << 20)  # 64 MB of float32
mapped = libc.mallinfo2().hblkhd - before
print(tuned, mapped >= 64 << 20)
"""


def _probe(switch: str) -> str:
    env = {**os.environ, host_memory.ENV_SWITCH: switch, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def _glibc_with_mallinfo2() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes
    return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")  # glibc >= 2.33


@pytest.mark.skipif(not _glibc_with_mallinfo2(),
                    reason="the setting is glibc's (mallopt; elsewhere nothing changes), and "
                           "the probe reads glibc >= 2.33's mallinfo2")
def test_large_blocks_come_from_the_heap_once_tuned():
    assert _probe("tuned") == ["True", "False"]  # no mapping of its own
    assert _probe("default") == ["False", "True"]  # glibc's default: mmap


def test_bad_switch_names_the_choices(monkeypatch):
    monkeypatch.setenv(host_memory.ENV_SWITCH, "jemalloc")
    with pytest.raises(ValueError, match="SHARDZOO_HOST_MALLOC='jemalloc': expected one of "
                                         "tuned, default"):
        host_memory.tune_host_allocator()
