"""Compile a `--compile` server's shapes before it takes requests.

torch.compile specialises a graph on what it first sees and compiles again when a guard
fails: a size of 1 against larger ones (one row, one query), an int the cache reads (the
number of key positions, the first block of a strided view) the first time it changes, a
fresh prefill against one that reads cached keys. Each such variant took 5-8 s to compile
on the 2-core development machine, and without a warm-up it was compiled in the middle of
serving: a request whose batch first met a variant waited for it (one client's TTFT p99
7.7 s in the server bench of 2026-12-07, against 36 ms without the compile). vLLM compiles
and captures its batch sizes at start-up for the same reason.

`warm_up(engine)` runs synthetic requests through the engine itself, so every path a real
batch takes (scheduler, cache placement, forward, sampling) meets its variants: one row
then two then three (decode and fresh prefill, several key lengths and first blocks), a
prompt cut into chunks (prefill over cached keys), and with prefix caching a prompt that
hits the cache. The requests leave through the engine's normal release (their blocks are
free; with prefix caching their full blocks stay cached like any finished request's) and
the engine's counters are reset. Every rank of a replica runs the same requests (their
steps are collective).
"""
from __future__ import annotations

from .engine import Request
from .sampling import SamplingParams

NEW_TOKENS = 3  # each request's output: decode steps at two cache lengths


def _prompt(length: int, salt: int, vocab_size: int) -> list[int]:
    """`length` token ids of no meaning, different for each `salt`."""
    return [(salt * 7919 + 31 * i + 1) % vocab_size for i in range(length)]


def warm_up(engine) -> int:
    """Run the warm-up requests (see the module docstring) on `engine`, which must be idle;
    returns how many ran. Decoder-only engines only (--compile is refused for T5)."""
    if engine.encoder_decoder or engine.has_work():
        raise ValueError("warm_up needs an idle decoder-only engine")
    vocab, bs = engine.runner.config.vocab_size, engine.blocks.block_size
    longest = engine.max_seq_length - NEW_TOKENS
    rounds = [[bs + 1], [5, 2 * bs + 3], [9, bs + 4, 3 * bs - 2]]
    budget = engine.max_num_batched_tokens
    salt, ran = 0, 0

    def run(lengths: list[int], same_prompt: bool = False) -> None:
        nonlocal salt, ran
        requests = []
        for n in lengths:
            salt += 0 if same_prompt else 1
            requests.append(Request(f"warm-up-{ran}", _prompt(min(n, longest), salt, vocab),
                                    SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)))
            ran += 1
        engine.generate(requests)

    for lengths in rounds:
        run(lengths)
    engine.max_num_batched_tokens = bs  # a prompt in chunks: prefill over cached keys
    try:
        run([2 * bs + 5])
        run([2 * bs + 7, 2 * bs + 9])
    finally:
        engine.max_num_batched_tokens = budget
    if engine.blocks.enable_prefix_caching:  # the same prompt again: its blocks are cached
        run([2 * bs + 3])
        run([2 * bs + 3], same_prompt=True)
    engine.prefix_queries = engine.prefix_hits = engine.num_preemptions = 0
    if engine.spec is not None:
        engine.spec.stats = type(engine.spec.stats)()
    return ran
