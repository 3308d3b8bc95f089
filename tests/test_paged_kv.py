"""The paged KV cache, prefix caching, chunked prefill and preemption (inference/block_manager.py,
PagedKVCache, the engine's scheduler), in one process (tp 2 / pp 2: tests/test_inference.py).

One spawned world of 1 runs the engine on tiny random transformers models (a Llama with
grouped KV heads and a Mistral with a sliding window of 6); the parent compares:
- greedy ids of every configuration (blocks of 4; prefix caching on / off; 8-token prefill
  chunks; a cache too small for the load, so requests are preempted and recomputed; the
  layers compiled, --compile, without a graph break) equal transformers' `generate`, each
  prompt alone, and the second pass over the same prompts hits the prefix cache;
- seeded sampling gives the same ids with chunks and preemption as without (an id is keyed
  by the request's seed and its output position);
- chunked prefill: no forward holds more prompt tokens than the budget, and a running
  request waits at most one prefill between two of its tokens; prefills and decodes
  alternate but for a burst of arrivals (a second prefill that admits more requests than
  the decode would advance goes first; never a third);
- block accounting after 200 requests of mixed lengths with shared prefixes, cancels at
  random steps and preemptions: at every step each block's reference count is the number of
  tables holding it, shared blocks are named full blocks, and in the end every block is free;
- preemption under a load four times the cache, with and without prefix caching: the victim
  is the running request that arrived last, preempted requests keep their arrival order,
  all finish, and the i-th arrival is preempted at most i times (one that arrived before it
  leaves between two of its preemptions);
- refusals: a request the whole cache cannot hold (at `check`, naming --kv-cache-memory),
  a cache too small for one block, bad --kv-cache-memory / --kv-block-size flags.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from distributed import run_distributed

SYSTEM = [(7 * i + 3) % 200 + 10 for i in range(21)]  # a 21-token shared prefix
PROMPTS = [SYSTEM + [5, 6], SYSTEM + [9], [3, 4, 5, 6, 7, 8, 9, 10], SYSTEM[:8],
           SYSTEM + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [99]]
MAX_NEW = 9
CONFIGS = {  # Engine keyword arguments (max_batch_size 3, max_seq_length 48)
    "blocks of 16": dict(),
    "blocks of 4": dict(block_size=4, enable_prefix_caching=False),
    "prefix caching": dict(block_size=4),
    "chunked prefill": dict(block_size=4, max_num_batched_tokens=8),
    # 12 blocks of 4 = 48 tokens: three requests of up to 48 need preemption
    "preemption": dict(block_size=4, max_num_batched_tokens=8, blocks=12),
    "preemption, no prefix caching": dict(block_size=4, blocks=12,
                                          enable_prefix_caching=False),
    # --compile (the llama only: compiling costs ~1 min a model on 2 cores): every path
    # through the compiled layers (fresh, cached and chunked prefill; decode of one row and of
    # several; strided and gathered cache reads)
    "compiled": dict(block_size=4, max_num_batched_tokens=8, blocks=12, compile=True),
}
COMPILED = "llama"


def _hf_configs() -> dict:
    from transformers import LlamaConfig, MistralConfig

    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    return {"llama": LlamaConfig(num_hidden_layers=2, **common),
            "mistral": MistralConfig(num_hidden_layers=2, sliding_window=6, **common)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from test_inference import random_hf_models

    return random_hf_models(tmp_path_factory.mktemp("paged"), _hf_configs(), 30)


def _engine(model, blocks=None, **kw):
    from inference.engine import Engine

    if blocks is not None:  # the cache's size in blocks, through --kv-cache-memory's bytes
        per_token = Engine(model, max_batch_size=1, max_seq_length=8).runner.bytes_per_token
        kw["kv_cache_memory"] = (blocks + 1) * kw.get("block_size", 16) * per_token
    return Engine(model, max_batch_size=3, max_seq_length=48, **kw)


def check_blocks(engine) -> None:
    """The block manager's invariants against the engine's requests."""
    bm = engine.blocks
    holders = {id(r): r for r in engine.running}
    for flight in engine.in_flight.values():  # cancelled in flight: blocks freed on return
        holders.update((id(r), r) for r in flight.batch)
    held = Counter(b for r in holders.values() for b in r.blocks)
    for b in range(bm.first_block, bm.num_blocks):
        assert bm.ref[b] == held[b], (b, bm.ref[b], held[b])
        if held[b] > 1:  # only named (full, computed) blocks are shared
            assert bm.hash_of[b] is not None, b
    assert set(bm.free_queue) == {b for b in range(bm.first_block, bm.num_blocks)
                                  if bm.ref[b] == 0}
    assert all(bm.hash_of[b] == h for h, b in bm.cached.items())
    assert not any(r.blocks for r in engine.waiting)


def _run(engine, reqs, cancel=None, arrive=None) -> dict:
    """Step `reqs` to the end, checking the blocks each step; `cancel(step)` -> ids to
    cancel, `arrive(step)` -> requests to add. Returns {"widest": most token positions in one
    forward, "gap": most steps between two tokens of a request, "kinds": each forward's kind
    and rows, e.g. "P5" (a prefill of five rows) or "D8" (a decode of eight)}."""
    for r in reqs:
        engine.add(r)
    last, gap, widest, step, kinds = {}, 0, 0, 0, []
    launch = engine._launch

    def recorded(tick):
        nonlocal widest
        flight = launch(tick)
        widest = max(widest, flight.ids.numel() if flight is not None else 0)
        if flight is not None:
            kinds.append(("P" if flight.ids.shape[1] > 1 else "D") + str(len(flight.batch)))
        return flight
    engine._launch = recorded
    while engine.has_work() or (arrive and step < 10):
        for r in (arrive(step) if arrive else ()):
            engine.add(r)
        for rid in (cancel(step) if cancel else ()):
            engine.cancel(rid)
        for e in engine.step():
            if e.token_ids and e.id in last:
                gap = max(gap, step - last[e.id])
            last[e.id] = step
        check_blocks(engine)
        step += 1
    engine._launch = launch
    assert engine.blocks.num_free == engine.blocks.capacity
    return {"gap": gap, "widest": widest, "kinds": kinds}


def _worker(folders: dict) -> dict:
    from inference.engine import Request
    from inference.loading import load
    from inference.sampling import SamplingParams

    out = {}
    for name, (hf_dir, _) in folders.items():
        model, _, _ = load(hf=hf_dir)
        for label, kw in CONFIGS.items():
            if kw.get("compile") and name != COMPILED:
                continue
            engine = _engine(model, **kw)
            passes = []
            for _ in range(2):
                reqs = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW))
                        for i, p in enumerate(PROMPTS)]
                _run(engine, reqs)
                passes.append([r.output for r in reqs])
            out[(name, label)] = {"passes": passes, "stats": engine.stats()}
            if kw.get("compile"):
                from torch._dynamo.utils import counters

                out[(name, label)]["dynamo"] = {
                    "graphs": counters["stats"]["unique_graphs"],
                    "graph_breaks": sum(counters["graph_break"].values()),
                    "frames": dict(counters["frames"])}
            params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=i)
                      for i in range(len(PROMPTS))]
            reqs = [Request(str(i), p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
            _run(engine, reqs)
            out[(name, label)]["sampled"] = [r.output for r in reqs]
    model, _, _ = load(hf=folders["llama"][0])
    out["warm_up"] = _warm_up_leaves_no_trace(model)
    out["chunks"] = _chunk_bound(model)
    out["burst"] = _burst(model)
    out["leaks"] = _many_requests(model)
    out["refusals"] = _refusals(model)
    return out


def _warm_up_leaves_no_trace(model) -> dict:
    """inference/warm_up.py on an engine with prefix caching and a small cache, then the
    prompts: their outputs and the engine's counters are those of an engine without it."""
    from inference.engine import Request
    from inference.sampling import SamplingParams
    from inference.warm_up import warm_up

    got = {}
    for warm in (False, True):
        engine = _engine(model, block_size=4, blocks=12)
        ran = warm_up(engine) if warm else 0
        check_blocks(engine)
        free = engine.blocks.num_free == engine.blocks.capacity
        reqs = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW))
                for i, p in enumerate(PROMPTS)]
        _run(engine, reqs)
        got[warm] = {"ran": ran, "free": free, "outputs": [r.output for r in reqs],
                     "stats": engine.stats()}
    return got


def _chunk_bound(model) -> dict:
    """Two running requests, then a 40-token prompt arrives: with 8-token chunks no forward
    holds more than 8 prompt tokens and the running ones wait at most one prefill."""
    from inference.engine import Request
    from inference.sampling import SamplingParams

    engine = _engine(model, block_size=4, max_num_batched_tokens=8)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=20)) for i, p in
            enumerate(([1, 2, 3], [4, 5]))]
    long = Request("long", list(range(10, 50)), SamplingParams(max_new_tokens=4))
    seen = _run(engine, reqs, arrive=lambda step: [long] if step == 3 else [])
    return {**seen, "outputs": [r.output for r in reqs + [long]]}


def _burst(model) -> dict:
    """The kinds of forwards (P: prefill, D: decode) as requests arrive: one, then a burst
    of five, then two more after those two prefills, then one more right after a prefill,
    while eight decode."""
    from inference.engine import Engine, Request
    from inference.sampling import SamplingParams

    engine = Engine(model, max_batch_size=10, max_seq_length=48)
    prompts = [[3 + i, 40 + i, 7, 9] for i in range(9)]
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=8)) for i, p in enumerate(prompts)]
    arrive = {0: reqs[:1], 1: reqs[1:6], 2: reqs[6:8], 4: reqs[8:]}
    kinds = _run(engine, [], arrive=lambda step: arrive.get(step, []))["kinds"]
    return {"kinds": kinds[:7], "outputs": [r.output for r in reqs], "prompts": prompts}


def _many_requests(model) -> dict:
    """200 requests (shared prefixes, lengths 1-30, max_tokens 1-12), cancels at random
    steps, a cache of 20 blocks of 4 (preemptions): the invariants hold every step and every
    block is free in the end."""
    from inference.engine import Request
    from inference.sampling import SamplingParams

    rng = random.Random(5)
    engine = _engine(model, block_size=4, max_num_batched_tokens=16, blocks=20)
    reqs = []
    for i in range(200):
        head = SYSTEM[:rng.choice((0, 4, 8, 13))]
        tail = [rng.randrange(211) for _ in range(rng.randint(1, 17))]
        reqs.append(Request(str(i), head + tail, SamplingParams(
            max_new_tokens=rng.randint(1, 12), temperature=rng.choice((0.0, 1.0)), seed=i)))
    doomed = {str(i): rng.randrange(200) for i in rng.sample(range(200), 40)}

    def cancel(step):
        return [rid for rid, at in doomed.items() if at == step]
    _run(engine, reqs, cancel)
    return {"stats": engine.stats(), "cancelled": sum(r.finish_reason == "cancelled"
                                                      for r in reqs),
            "finished": sum(r.finish_reason is not None for r in reqs)}


def _refusals(model) -> list[str]:
    from inference.engine import Request
    from inference.sampling import SamplingParams

    messages = []
    engine = _engine(model, block_size=4, blocks=5)  # 20 tokens
    for prompt, n in (([1] * 12, 10), ([1] * 21, 1)):
        with pytest.raises(ValueError) as e:
            engine.add(Request("x", prompt, SamplingParams(max_new_tokens=n)))
        messages.append(str(e.value))
    engine.add(Request("fits", [1] * 12, SamplingParams(max_new_tokens=9)))  # 20 positions
    with pytest.raises(ValueError) as e:
        _engine(model, block_size=4, kv_cache_memory=100)
    messages.append(str(e.value))
    return messages


def test_paged_cache_prefix_caching_chunks_and_preemption(models):
    from test_inference import _hf_generate

    ranks = run_distributed(_worker, 1, models, timeout=600)
    got = ranks[0]
    for name, (hf_dir, _) in models.items():
        ref = [_hf_generate(hf_dir, p, MAX_NEW, None) for p in PROMPTS]
        sampled = got[(name, "blocks of 16")]["sampled"]
        for label in CONFIGS:
            if CONFIGS[label].get("compile") and name != COMPILED:
                continue
            run = got[(name, label)]
            where = f"{name}, {label}"
            assert run["passes"] == [ref, ref], where
            assert run["sampled"] == sampled, f"{where}: seeded sampling differs"
            stats = run["stats"]
            if CONFIGS[label].get("enable_prefix_caching", True):
                assert stats["prefix_cache_hits"] > 0, (where, stats)
            else:
                assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0, where
            assert (stats["num_preemptions"] > 0) == ("blocks" in CONFIGS[label]), where
            if "dynamo" in run:  # compiled whole: no graph break, every frame compiled
                dyn = run["dynamo"]
                assert dyn["graphs"] > 0 and dyn["graph_breaks"] == 0, (where, dyn)
                assert dyn["frames"]["ok"] == dyn["frames"]["total"], (where, dyn)
    cold, warm = got["warm_up"][False], got["warm_up"][True]
    assert warm["ran"] >= 9 and warm["free"], warm
    llama = [_hf_generate(models["llama"][0], p, MAX_NEW, None) for p in PROMPTS]
    assert warm["outputs"] == cold["outputs"] == llama, (warm, cold)
    assert warm["stats"] == cold["stats"], (warm, cold)
    chunks = got["chunks"]
    assert chunks["widest"] == 8 and chunks["gap"] <= 2, chunks
    want = [_hf_generate(models["llama"][0], p, n, None)
            for p, n in (([1, 2, 3], 20), ([4, 5], 20), (list(range(10, 50)), 4))]
    assert chunks["outputs"] == want
    # a burst: the second prefill goes before the one admitted request's decode (five
    # admitted > one decoding), never a third; one arrival right after a prefill, with
    # eight decoding, waits for the decode (alternation)
    burst = got["burst"]
    assert burst["kinds"] == ["P1", "P5", "D6", "P2", "D8", "P1", "D9"], burst["kinds"]
    assert burst["outputs"] == [_hf_generate(models["llama"][0], p, 8, None)
                                for p in burst["prompts"]]
    leaks = got["leaks"]
    assert leaks["finished"] == 200 and leaks["cancelled"] > 0, leaks
    assert leaks["stats"]["num_preemptions"] > 0 and leaks["stats"]["prefix_cache_hits"] > 0
    too_long, too_long_prompt, no_block = got["refusals"]
    for m in (too_long, too_long_prompt):
        assert "KV cache blocks of 4 tokens, more than the whole cache holds (5 blocks, 20 " \
               "tokens)" in m and "--kv-cache-memory" in m and "--max-model-len" in m, m
    assert "holds no block of 4 tokens; raise --kv-cache-memory" in no_block, no_block


def _overload(prefix_caching: bool) -> dict:
    """In a worker: 24 requests (prompts of 4-11 tokens, 60-109 new tokens) arriving one
    every 3 steps at 8 slots over a cache of 40 blocks of 4 (about 2 requests' worth), each
    preemption recorded. Returns per request (in arrival order) its preemptions, the
    engine's `num_left` at each, its finish reason and steps from arrival to end; the
    victims that were not the running request that arrived last; steps where the waiting
    queue was out of arrival order."""
    from inference.engine import Engine, Request
    from inference.sampling import SamplingParams
    from models import GPTModel, ModelConfig

    torch.manual_seed(0)
    model = GPTModel(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                 vocab_size=64, seq_length=128, max_position_embeddings=128))
    per_token = Engine(model, max_batch_size=1, max_seq_length=8).runner.bytes_per_token
    engine = Engine(model, max_batch_size=8, max_seq_length=128, block_size=4,
                    max_num_batched_tokens=32, kv_cache_memory=41 * 4 * per_token,
                    enable_prefix_caching=prefix_caching)
    rng = random.Random(0)
    reqs = [Request(str(i), [rng.randrange(64) for _ in range(rng.randrange(4, 12))],
                    SamplingParams(max_new_tokens=rng.randrange(60, 110), ignore_eos=True))
            for i in range(24)]
    at, by_id = {r.id: [] for r in reqs}, {r.id: r for r in reqs}
    wrong_victims, disorder = [], []
    preempt = engine._preempt

    def recorded(r):
        latest = max(q.seq for q in engine.running if q.id not in engine.busy)
        if r.seq != latest:
            wrong_victims.append((r.seq, latest))
        at[r.id].append(engine.num_left)
        preempt(r)
    engine._preempt = recorded
    pending, arrived, ended, step = list(reqs), {}, {}, 0
    while pending or engine.has_work():
        if pending and step % 3 == 0:
            arrived[pending[0].id] = step
            engine.add(pending.pop(0))
        for e in engine.step():
            if e.finish_reason is not None:
                ended[e.id] = step
                assert e.preemptions == by_id[e.id].preemptions
        if [q.seq for q in engine.waiting] != sorted(q.seq for q in engine.waiting):
            disorder.append(step)
        step += 1
        assert step < 20_000, "the load did not finish"
    return {"requests": [(at[r.id], r.finish_reason, ended[r.id] - arrived[r.id])
                         for r in reqs],
            "wrong_victims": wrong_victims, "disorder": disorder, "steps": step}


def _compiled_after_warm_up(hf_dir: str) -> dict:
    """A compiled engine (a process of its own: no graph compiled before), warmed up, then
    requests that leave and arrive at different steps: a decode of several rows and of one
    row starting at a later block than the first, a late arrival's prefill beside them.
    Returns the graphs dynamo compiled after the warm-up and the outputs."""
    from torch._dynamo.utils import counters

    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams
    from inference.warm_up import warm_up

    model, _, _ = load(hf=hf_dir)
    engine = Engine(model, max_batch_size=4, max_seq_length=48, block_size=4, compile=True)
    warm_up(engine)
    before = counters["stats"]["unique_graphs"]
    plan = [(PROMPTS[0], 2, 0), (PROMPTS[2], 7, 0), (PROMPTS[3], 6, 0), (PROMPTS[4], 4, 3),
            (PROMPTS[5], 3, 5)]  # (prompt, new tokens, arrival step)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=n)) for i, (p, n, _) in
            enumerate(plan)]
    _run(engine, [], arrive=lambda step: [r for r, (_, _, at) in zip(reqs, plan) if at == step])
    return {"graphs": counters["stats"]["unique_graphs"] - before,
            "outputs": [r.output for r in reqs], "plan": [(p, n) for p, n, _ in plan]}


def test_warm_up_leaves_nothing_to_compile(models):
    """After inference/warm_up.py a serving-like sequence compiles no new graph (a variant met
    in serving stalled a request 5-8 s on SmolLM2), and its outputs equal transformers'."""
    from test_inference import _hf_generate

    hf_dir = models["llama"][0]
    got = run_distributed(_compiled_after_warm_up, 1, hf_dir, timeout=600)[0]
    assert got["graphs"] == 0, got["graphs"]
    assert got["outputs"] == [_hf_generate(hf_dir, p, n, None) for p, n in got["plan"]]


def test_preemption_is_first_come_first_served_and_bounded():
    """Under a load the cache holds a quarter of, with and without prefix caching: the
    victim is always the running request that arrived last, a preempted request keeps its
    place in arrival order, every request finishes, and a request is preempted at most once
    while the same requests run before it: between two of its preemptions a running request
    (one that arrived before it) has left, so the i-th arrival is preempted at most i times.
    (Re-admitted at once, the request that arrived last was pushed out again at each block
    the ones before it took: without prefix caching up to 27 times, each a full
    recompute.)"""
    for prefix_caching, out in zip((False, True), run_distributed(
            _overload_both, 1, timeout=600)[0]):
        reqs = out["requests"]
        where = f"prefix caching {prefix_caching}"
        assert all(reason == "length" for _, reason, _ in reqs), where
        assert not out["wrong_victims"] and not out["disorder"], (where, out)
        counts = [len(at) for at, _, _ in reqs]
        assert sum(counts) > 0, where  # the load does preempt
        for i, (at, _, _) in enumerate(reqs):
            assert all(a < b for a, b in zip(at, at[1:])), (where, i, at)
            assert len(at) <= i, (where, i, at)
        print(f"{where}: {out['steps']} steps, preemptions per request {counts}, steps "
              f"from arrival to end at most {max(w for _, _, w in reqs)}")


def _overload_both() -> list:
    return [_overload(False), _overload(True)]


def test_block_manager_sharing_and_lru_eviction():
    """Reference counts, names of full blocks only, LRU eviction of cached blocks (a prefix
    outlives its tail), placement never evicting, and allocation that changes nothing when
    it fails."""
    from inference.block_manager import BlockManager, block_hash, token_block_hashes

    bm = BlockManager(9, 2, region_blocks=4)  # blocks 1..8, regions 1-4 and 5-8
    tokens = [1, 2, 3, 4, 5]
    a, b = [], []
    assert bm.allocate(a, 5) and a == [1, 2, 3]  # placed at region 0
    hashes = token_block_hashes(tokens, 2, [])
    assert hashes == [block_hash(None, [1, 2]), block_hash(hashes[0], [3, 4])]
    bm.register(a, hashes, 0, 2)
    assert bm.match(hashes, 2) == [1, 2]
    # the same second block after another first block has another name: no hit
    assert bm.match(token_block_hashes([9, 9, 3, 4], 2, []), 2) == []
    assert bm.allocate(b, 6, cached=bm.match(hashes, 2)) and b == [1, 2, 4]
    assert bm.ref[1:5] == [2, 2, 1, 1] and bm.num_free == 4
    assert not bm.allocate(b, 20) and b == [1, 2, 4]  # too few: unchanged
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8 and all(r == 0 for r in bm.ref)
    # named blocks 1, 2 are cached at the back of the free list, tail (2) before head (1)
    assert list(bm.free_queue)[-2:] == [2, 1]
    c = []  # placed in region 1 (region 0 starts with a cached block), then the LRU order
    assert bm.allocate(c, 16) and c == [5, 6, 7, 8, 4, 3, 2, 1]
    assert bm.cached == {} and all(h is None for h in bm.hash_of)  # evicted to be reused
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free([3, 3])
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):
        BlockManager(1, 16)


def test_kv_cache_memory_and_flags():
    import infer
    from inference.kv_cache import parse_memory

    assert parse_memory("2GiB") == 2 * 2**30 and parse_memory("512 MiB") == 512 * 2**20
    assert parse_memory("1.5GB") == 1_500_000_000 and parse_memory("4000") == 4000
    assert parse_memory("0.5") == 0.5 and parse_memory("1.0") == 1.0
    for bad in ("", "lots", "-1GiB", "0", "0.0", "2XB", "nan", "inf"):
        with pytest.raises(ValueError, match="--kv-cache-memory"):
            parse_memory(bad)
    args = infer.parse_args(["--hf", "x", "--prompt", "a", "--kv-cache-memory", "1GiB",
                             "--no-enable-prefix-caching", "--kv-block-size", "32",
                             "--max-num-batched-tokens", "512", "--compile"])
    assert (args.kv_cache_memory, args.enable_prefix_caching, args.kv_block_size,
            args.max_num_batched_tokens, args.compile) == (2**30, False, 32, 512, True)
    default = infer.parse_args(["--hf", "x", "--prompt", "a"])
    assert default.enable_prefix_caching and not default.compile
    for flags in (["--kv-cache-memory", "lots"], ["--kv-block-size", "0"],
                  ["--max-num-batched-tokens", "0"]):
        with pytest.raises(SystemExit) as e:
            infer.parse_args(["--hf", "x", "--prompt", "a", *flags])
        assert e.value.code == 2


def test_prefix_cache_metrics():
    """The engine's running totals become vLLM's counters (by their difference) and the
    hit-rate gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    from inference.metrics import ServerMetrics

    m = ServerMetrics("tiny", 1)
    base = {"running": 1, "waiting": 0, "kv_cache_usage": 0.5}
    m.replica_stats(0, {**base, "prefix_cache_queries": 100, "prefix_cache_hits": 40,
                        "num_preemptions": 1})
    m.replica_stats(0, {**base, "prefix_cache_queries": 200, "prefix_cache_hits": 120,
                        "num_preemptions": 1})
    values = {s.name: s.value for f in text_string_to_metric_families(m.render().decode())
              for s in f.samples}
    assert values["shardzoo:prefix_cache_queries_total"] == 200
    assert values["shardzoo:prefix_cache_hits_total"] == 120
    assert values["shardzoo:prefix_cache_hit_rate"] == 0.6
    assert values["shardzoo:num_preemptions_total"] == 1
    assert values["shardzoo:kv_cache_usage_perc"] == 0.5
    # per request, at its end: the times it was preempted
    from inference.engine import Event

    for times in (3, 0):
        m.event(0, Event("a", [5], "x", "length", 4, 9, preemptions=times), 0.0, 0.0)
    samples = {(s.name, s.labels.get("le")): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert samples["shardzoo:request_preemptions_count", None] == 2
    assert samples["shardzoo:request_preemptions_sum", None] == 3
    assert samples["shardzoo:request_preemptions_bucket", "2.0"] == 1


def test_compile_without_cpp_compiler_is_a_usage_error(no_grid, no_cpp_compiler):
    """infer.py --compile on a CPU with no C++ compiler: a ValueError naming the fix (infer.py
    prints it and exits 2) before anything is compiled, not inductor's error at the first
    request."""
    from inference.runner import compile_for_inference
    from models import GPTModel, ModelConfig

    model = GPTModel(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                 vocab_size=16, seq_length=8))
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler.*drop --compile"):
        compile_for_inference(model)
    assert not any(getattr(m, "_compiled_call_impl", None) for m in model.modules())
