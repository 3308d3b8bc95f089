"""The paged KV cache's workloads , in one process, on our engine:

    python bench/kv_cache_workloads.py [--hf PATH] [--parts memory prefix chunked]
        [--threads 2] [--repeats 2] [--dtype float32]

- memory: bytes per cached token on this rank (keys and values of every layer's local KV
  heads) and the tokens a given --kv-cache-memory holds (the start-up line's numbers);
- prefix: 16 requests with the same ~400-token system prompt and their own short question,
  16 new tokens each, all queued at once, with and without prefix caching: mean and max
  time to first token and the total time (the shared-prefix workload);
- chunked: 4 requests decoding when a 1,500-token prompt arrives, with prefill chunks of
  256 tokens (--max-num-batched-tokens 256) and without (one 2,048-token prefill): the p99
  and max inter-token latency of the 4 running requests, and the long prompt's TTFT.

Each workload alternates its two settings `--repeats` times and keeps the best of each (the
machine may be shared). `shared_prefix` and `long_prompt_mid_decode` take any engine
factory, so bench/generate_throughput.py can run them beside vLLM's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def shared_prefix(make_engine, vocab: int, requests: int = 16, system: int = 400,
                  question: int = 12, new_tokens: int = 16) -> dict:
    """`requests` prompts = the same `system` ids + their own `question` ids, queued at once
    on `make_engine()`; {"ttft_mean", "ttft_max", "total"} in seconds, "hit_tokens"."""
    from inference.engine import Request
    from inference.sampling import SamplingParams

    engine = make_engine()
    head = _ids(system, 1, vocab)
    reqs = [Request(str(i), head + _ids(question, 100 + i, vocab),
                    SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            for i in range(requests)]
    t0 = time.perf_counter()
    engine.generate(reqs)
    total = time.perf_counter() - t0
    ttft = [r.ttft_s for r in reqs]
    return {"ttft_mean": sum(ttft) / len(ttft), "ttft_max": max(ttft), "total": total,
            "hit_tokens": engine.stats()["prefix_cache_hits"]}


def long_prompt_mid_decode(make_engine, vocab: int, running: int = 4, long: int = 1500,
                           new_tokens: int = 48, arrive_after: int = 8) -> dict:
    """`running` requests decode; after `arrive_after` of their tokens a `long`-token prompt
    arrives. {"itl_p99", "itl_max"} (seconds between consecutive tokens of the running
    requests, from the long prompt's arrival to the end), "long_ttft"."""
    from inference.engine import Request
    from inference.sampling import SamplingParams

    engine = make_engine()
    reqs = [Request(str(i), _ids(16, 10 + i, vocab),
                    SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            for i in range(running)]
    big = Request("long", _ids(long, 7, vocab), SamplingParams(max_new_tokens=4,
                                                               ignore_eos=True))
    for r in reqs:
        engine.add(r)
    last, gaps, arrived = {}, [], False
    while engine.has_work():
        if not arrived and min(len(r.output) for r in reqs) >= arrive_after:
            engine.add(big)
            arrived = True
        for e in engine.step():
            now = time.perf_counter()
            if e.id != "long" and e.token_ids:
                if arrived and e.id in last:
                    gaps.append(now - last[e.id])
                last[e.id] = now
    gaps.sort()
    return {"itl_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], "itl_max": gaps[-1],
            "long_ttft": big.ttft_s}


def _best(runs: list[dict]) -> dict:
    return {k: min(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    from inference.engine import Engine
    from inference.kv_cache import PagedKVCache, parse_memory
    from inference.loading import load
    import parallel_state as ps

    from generate_throughput import default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", default=None)
    p.add_argument("--parts", nargs="+", default=["memory", "prefix", "chunked"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", default="2GiB")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    model, _, name = load(hf=args.hf or default_model(), dtype=args.dtype)
    vocab = model.config.vocab_size
    print(f"{name}, {args.dtype}, {args.threads} threads")
    if "memory" in args.parts:
        attn = next(iter(model.decoder.layers.values())).self_attention
        per = PagedKVCache.bytes_per_token(len(model.layer_numbers), attn.num_groups,
                                           attn.head_dim, next(model.parameters()).dtype)
        fits = (parse_memory(args.kv_cache_memory) // (per * 16) - 1) * 16  # less block 0
        print(f"memory: {per:,} bytes per cached token ({len(model.layer_numbers)} layers x "
              f"{attn.num_groups} KV heads x {attn.head_dim} x 2); --kv-cache-memory "
              f"{args.kv_cache_memory} holds {fits:,} tokens in blocks of 16")
    if "prefix" in args.parts:
        runs = {True: [], False: []}
        for _ in range(args.repeats):
            for on in (True, False):
                runs[on].append(shared_prefix(lambda: Engine(
                    model, max_batch_size=16, max_seq_length=512,
                    enable_prefix_caching=on), vocab))
        on, off = _best(runs[True]), _best(runs[False])
        print(f"prefix: 16 x (400 shared + 12) tokens, 16 new each: TTFT mean "
              f"{on['ttft_mean']:.2f} s with prefix caching vs {off['ttft_mean']:.2f} s "
              f"without ({off['ttft_mean'] / on['ttft_mean']:.2f}x), max {on['ttft_max']:.2f}"
              f" vs {off['ttft_max']:.2f} s; total {on['total']:.2f} vs {off['total']:.2f} s "
              f"({off['total'] / on['total']:.2f}x); {on['hit_tokens']} prompt tokens hit")
    if "chunked" in args.parts:
        runs = {256: [], 2048: []}
        for _ in range(args.repeats):
            for budget in runs:
                runs[budget].append(long_prompt_mid_decode(lambda: Engine(
                    model, max_batch_size=8, max_seq_length=2048,
                    max_num_batched_tokens=budget), vocab))
        on, off = _best(runs[256]), _best(runs[2048])
        print(f"chunked: 4 decoding + a 1,500-token prompt: inter-token latency p99 "
              f"{on['itl_p99'] * 1e3:.0f} ms with 256-token chunks vs "
              f"{off['itl_p99'] * 1e3:.0f} ms in one piece (max {on['itl_max'] * 1e3:.0f} vs "
              f"{off['itl_max'] * 1e3:.0f} ms); the long prompt's TTFT "
              f"{on['long_ttft']:.2f} vs {off['long_ttft']:.2f} s")
    ps.destroy_model_parallel(destroy_world=True)


if __name__ == "__main__":
    main()
