"""OpenMP's wait policy for this process, set by the entry points (train.py, infer.py) before
torch is imported: GNU OpenMP (libgomp, which torch's Linux wheels use) reads its environment
once, when torch loads it.

A libgomp thread that finds no work spins for a while, then sleeps in the kernel; waking a
sleeping thread costs tens of microseconds, and a model step runs hundreds of parallel
regions. libgomp spins ~300,000 iterations by default, but only 100 once the process holds
more libgomp threads than it has CPUs, and it counts the idle team of every thread that ever
ran a parallel region. A gloo collective of a large tensor or object (DCP's planning when a
checkpoint loads, a pickled control message) copies it inside one of gloo's own threads,
which then keeps a team of its own: from then on the process waits the short way. On the
2-core development machine (Zen 4, 2026-12-07) a parallel region then took 48-64 us instead
of 11 (`torch.add` on 128K floats with Python between calls), a 32-row SmolLM2-135M float32
decode step loaded from a native checkpoint 48 ms instead of 37 (the same model loaded from
its GGUF ran no collective), and the OpenAI server at 32 streaming clients decoded 413-476
tokens/s instead of 568-594 (docs/DECISIONS.md "OpenMP wait policy").

`set_openmp_wait_defaults()` sets `OMP_WAIT_POLICY=ACTIVE` with `GOMP_SPINCOUNT=300000`:
libgomp then spins the default 300,000 iterations (~3 ms) before sleeping, so an idle server
still sleeps, and a throttled process 1,000 instead of 100 (libgomp's env.c keeps the
throttled count apart: GOMP_SPINCOUNT can only lower it). That softens the throttle without
removing it, so checkpoint loads also keep their gathers out of the world group's threads
(parallel_state/collectives.py `in_transient_group`). Nothing is set when the user set
either variable, or off Linux (other OpenMP runtimes, e.g. LLVM's on macOS, read ACTIVE as
"never sleep").
"""
from __future__ import annotations

import os
import sys

WAIT_POLICY, SPIN_COUNT = "ACTIVE", "300000"


def set_openmp_wait_defaults(environ=os.environ, platform: str = sys.platform) -> bool:
    """Set libgomp's wait policy in `environ` unless the user chose one (see the module
    docstring); call it before `import torch`. Returns whether anything was set."""
    if not platform.startswith("linux") or "OMP_WAIT_POLICY" in environ or \
            "GOMP_SPINCOUNT" in environ:
        return False
    environ["OMP_WAIT_POLICY"], environ["GOMP_SPINCOUNT"] = WAIT_POLICY, SPIN_COUNT
    return True
