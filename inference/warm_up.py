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
then two then three (decode and fresh prefill, several key lengths and first blocks: the
rows of a decode start at a later block once the request before them has left), one-token
prompts, prompts past the short-prefill attention's 128 keys (fresh and in chunks), a
prompt cut into chunks (prefill over cached keys), with prefix caching a prompt that
hits the cache, and requests that arrive and leave at different steps (gathered cache
reads; with prefix caching, prefills of several rows over shared cached blocks). The
requests leave through the engine's normal release (their blocks are free; with prefix
caching their full blocks stay cached like any finished request's) and the engine's
counters are reset. Every rank of a replica runs the same requests (their
steps are collective).
"""
from __future__ import annotations

from layers.attention import SHORT_PREFILL_KEYS

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
    # (prompt lengths, new tokens): in the last round the first row leaves after its prefill
    # and the second two steps before the third, so decodes of several rows and of one row
    # also start at a later block than the first
    rounds = [([bs + 1], None), ([5, 2 * bs + 3], None),
              ([9, bs + 4, 3 * bs - 2], [1, NEW_TOKENS, NEW_TOKENS + 2])]
    budget = engine.max_num_batched_tokens
    salt, ran = 0, 0

    def run(lengths: list[int], same_prompt: bool = False, new_tokens=None) -> None:
        nonlocal salt, ran
        requests = []
        for i, n in enumerate(lengths):
            salt += 0 if same_prompt else 1
            params = SamplingParams(max_new_tokens=new_tokens[i] if new_tokens else NEW_TOKENS,
                                    ignore_eos=True)
            requests.append(Request(f"warm-up-{ran}", _prompt(min(n, longest), salt, vocab),
                                    params))
            ran += 1
        engine.generate(requests)

    for lengths, new_tokens in rounds:
        run(lengths, new_tokens=new_tokens)
    run([1])  # one-token prompts: a fresh prefill of one position
    run([1, 1])
    # past the short-prefill attention (layers/attention.py): SDPA over more keys
    long = min(SHORT_PREFILL_KEYS + bs + 3, longest, budget // 2)
    if long > SHORT_PREFILL_KEYS:
        run([long])
        run([long - 1, long])
    engine.max_num_batched_tokens = bs  # a prompt in chunks: prefill over cached keys
    try:
        run([2 * bs + 5])
        run([2 * bs + 7, 2 * bs + 9])
        if long > SHORT_PREFILL_KEYS:
            run([long + 1])
    finally:
        engine.max_num_batched_tokens = budget
    if engine.blocks.enable_prefix_caching:  # the same prompt again: its blocks are cached
        run([2 * bs + 3])
        run([2 * bs + 3], same_prompt=True)
    ran += _staggered(engine, bs, vocab, longest)
    engine.prefix_queries = engine.prefix_hits = engine.num_preemptions = 0
    if engine.spec is not None:
        engine.spec.stats = type(engine.spec.stats)()
    return ran


def _staggered(engine, bs: int, vocab: int, longest: int) -> int:
    """Requests that arrive and leave at different steps, some sharing a two-block prefix:
    a row leaving from the middle of a batch (the others' blocks no longer evenly spaced:
    decodes read the cache gathered), and with prefix caching prompts whose first blocks
    are another request's (prefills of one and of several rows read gathered cached keys,
    and decodes of rows that share blocks). Returns how many requests ran."""
    shared = _prompt(2 * bs, 1000, vocab)

    def prompt(n: int, salt: int, prefix: bool) -> list[int]:
        return ((shared if prefix else []) + _prompt(n, 1000 + salt, vocab))[:longest]

    plan = [  # (prompt, new tokens, arrival step)
        (prompt(3, 1, True), 4, 0), (prompt(5, 2, False), 1, 0),
        (prompt(bs + 2, 3, False), 5, 0), (prompt(bs + 1, 4, True), 5, 0),
        (prompt(7, 5, True), 3, 3), (prompt(2, 6, True), 4, 3), (prompt(9, 7, False), 2, 4)]
    requests = [Request(f"warm-up-staggered-{i}", p, SamplingParams(max_new_tokens=n,
                                                                    ignore_eos=True))
                for i, (p, n, _) in enumerate(plan)]
    step = 0
    while step <= max(at for _, _, at in plan) or engine.has_work():
        for r, (_, _, at) in zip(requests, plan):
            if at == step:
                engine.add(r)
        engine.step()
        step += 1
    return len(requests)
