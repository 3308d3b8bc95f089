"""Shared test setup: the repo root and tests/ on sys.path (so `import layers` and
`from distributed import run_distributed` work under plain `pytest` too, and in spawned
workers, which inherit sys.path), a guard that single-process tests see no grid, and the
dropout key restored after each test."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture
def no_grid():
    """Fail fast if an earlier test leaked a process grid into this (parent) process: without
    a grid the layers act as one process (tp = 1), which is what dense references rely on."""
    import parallel_state

    assert not parallel_state.model_parallel_is_initialized(), "a test leaked a process grid"
    yield
    assert not parallel_state.model_parallel_is_initialized(), "this test leaked a process grid"


@pytest.fixture(autouse=True)
def dropout_key_restored():
    """Every test starts from the dropout key it found and leaves it so: a test that sets
    `--dropout-masks rank-streams` (ps.model_parallel_seed) in the pytest process would
    otherwise turn keyed dropout off for the tests run after it in the same worker."""
    from parallel_state.random import _DropoutKey

    saved = (_DropoutKey.seed, _DropoutKey.scheme, _DropoutKey.sample_ids)
    yield
    _DropoutKey.seed, _DropoutKey.scheme, _DropoutKey.sample_ids = saved


@pytest.fixture(scope="package")
def corpus_env(tmp_path_factory):
    """Environment for train.py subprocesses: the embedded stdlib corpus built once per test
    run in a temporary cache (about 6 s), not in the user's ~/.cache."""
    cache = tmp_path_factory.mktemp("shardzoo-cache")
    from data_pipeline import ensure_default_corpus

    ensure_default_corpus(str(cache), quiet=True)
    return {"SHARDZOO_CACHE": str(cache)}


@pytest.fixture
def no_cpp_compiler():
    """inductor finds no C++ compiler while the test runs (its cached search is reset)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import cpp_builder

    cpp_builder.cpp_compiler_search.cache_clear()
    with inductor_config.patch({"cpp.cxx": ("shardzoo-no-such-cxx",)}):
        yield
    cpp_builder.cpp_compiler_search.cache_clear()
