"""llama.cpp's side of bench/generate_throughput.py's `llamacpp` part, run by the Python of
llama-cpp-python's own virtual environment (never imported by shardzoo's code; it imports
llama_cpp, numpy and the standard library only, and llama_cpp only inside `main`).

    L/bin/python bench/llamacpp_worker.py '{"model": FILE.gguf, "threads": 2, "n_ctx": 1024}'
    L/bin/python bench/llamacpp_worker.py '{"quantize": [IN.gguf, OUT.gguf], "ftype": "q8_0"}'

The second form writes a requantized copy (llama.cpp's `llama_model_quantize`, requantizing
allowed) and prints one JSON line. The first loads the model (`llama_model_load_from_file`,
then a context of `n_ctx` tokens with `n_threads = n_threads_batch = threads`, `n_seq_max`
sequences in one unified KV cache, `n_batch = n_ctx`, llama.cpp's default `n_ubatch`) and
answers each stdin line, one JSON job, with one JSON line on stdout until stdin closes
(`serve_jobs`; bench/vllm_peer.py's `Worker` drives it):

- `{"job": "ready"}` -> `{"ready": true, "load_s": s, "rss": bytes, "system": info}`
- `{"job": "run", "requests": [{"prompt": [ids], "max_tokens": n}, ...]}`: every request
  at once, request i as sequence i of one `llama_batch` (the prompts' tokens in one batch,
  then one token per sequence per `llama_decode`), greedy (argmax of the logits), end of
  sequence ignored -> bench/vllm_worker.py's reply: `{"ttft": [s per request], "first_all":
  s, "end": s, "token_times": [[s per token]], "ids": [[ids]]}`, times from the first
  `llama_decode`.
- `{"job": "ppl", "ids": [ids]}`: the ids as one sequence in one batch, logits at every
  position -> `{"nll": mean negative log-likelihood in nats of ids[1:] (`mean_nll`),
  "tokens": len(ids) - 1}`.
- `{"job": "rss"}` -> `{"rss": bytes, "peak": bytes}` (`rss_bytes`).
"""
from __future__ import annotations

import json
import sys
import time

FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "f16": 1}  # llama_ftype


def rss_bytes() -> dict:
    """`{"rss": resident bytes now, "peak": the most resident so far}` of this process, from
    /proc/self/status (VmRSS, VmHWM); both None where it is missing (not Linux)."""
    out = {"rss": None, "peak": None}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):  # "  123456 kB"
                    out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def mean_nll(logits, targets) -> float:
    """Mean negative log-likelihood (nats) of `targets` `[n]` (int) under `logits` `[n, v]`
    (row i predicts targets[i]): mean of logsumexp(row) - row[target], computed in float64
    (the perplexity is its exp). Raises `ValueError` on empty or mismatched inputs."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    t = np.asarray(targets, dtype=np.int64)
    if x.ndim != 2 or t.shape != (x.shape[0],) or x.shape[0] == 0:
        raise ValueError(f"mean_nll needs logits [n, v] and targets [n], n > 0; got "
                         f"{x.shape} and {t.shape}")
    if t.min() < 0 or t.max() >= x.shape[1]:
        raise ValueError(f"a target id is outside the vocabulary of {x.shape[1]} logits")
    top = x.max(axis=1)
    lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    return float((lse - x[np.arange(len(t)), t]).mean())


def serve_jobs(handlers: dict, lines=None, out=None) -> None:
    """Answer each JSON job line of `lines` (default stdin) with `handlers[job["job"]](job)`
    as one JSON line on `out` (default stdout), flushed; an unknown job or a handler's
    exception is answered `{"error": "..."}` and the loop goes on."""
    lines = sys.stdin if lines is None else lines
    out = sys.stdout if out is None else out
    for line in lines:
        try:
            job = json.loads(line)
            handler = handlers.get(job.get("job"))
            reply = handler(job) if handler else {"error": f"unknown job {job.get('job')!r}; "
                                                           f"one of {sorted(handlers)}"}
        except Exception as e:  # the bench reports it; the worker stays up
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class LlamaCpp:
    """One model and context through llama_cpp's low-level API (the C functions)."""

    def __init__(self, config: dict):
        import llama_cpp as L
        import numpy as np

        self.L, self.np = L, np
        L.llama_backend_init()  # its log goes to stderr: the bench's log file of this worker
        t0 = time.perf_counter()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(config["model"].encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {config['model']}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = config.get("n_ctx", 2048)  # tokens a decode takes
        cparams.n_ubatch = min(cparams.n_ctx, 512)  # llama.cpp's default physical batch
        cparams.n_seq_max = config.get("n_seq_max", 8)
        cparams.kv_unified = True
        cparams.n_threads = cparams.n_threads_batch = config["threads"]
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {cparams.n_ctx} tokens")
        self.n_ctx, self.n_seq = cparams.n_ctx, cparams.n_seq_max
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.n_ctx, 0, 1)
        self.load_s = time.perf_counter() - t0
        self.system = L.llama_print_system_info().decode()

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One `llama_decode` of `(token, position, sequence, wants logits)` entries."""
        if len(tokens) > self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens in one batch; the context holds "
                             f"{self.n_ctx} (n_ctx)")
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {len(tokens)} tokens")

    def logits(self, i: int):
        """`[n_vocab]` float32 logits at token i of the last decoded batch (one that asked
        for them; a view)."""
        return self.np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i),
                                          shape=(self.n_vocab,))

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def run(self, job: dict) -> dict:
        reqs = job["requests"]
        if len(reqs) > self.n_seq:
            raise ValueError(f"{len(reqs)} requests; the context was made for {self.n_seq}")
        self.clear()
        ids, times = [[] for _ in reqs], [[] for _ in reqs]
        pos = [len(r["prompt"]) for r in reqs]
        t0 = time.perf_counter()
        batch = [(tok, p, s, p == len(r["prompt"]) - 1)
                 for s, r in enumerate(reqs) for p, tok in enumerate(r["prompt"])]
        live = list(range(len(reqs)))
        last = [sum(pos[:s + 1]) - 1 for s in live]  # batch index of each one's last token
        while live:
            self.decode(batch)
            now = time.perf_counter() - t0
            for s, i in zip(live, last):
                ids[s].append(int(self.logits(i).argmax()))
                times[s].append(now)
            live = [s for s in live if len(ids[s]) < reqs[s]["max_tokens"]]
            batch = [(ids[s][-1], pos[s] + len(ids[s]) - 1, s, True) for s in live]
            last = list(range(len(live)))
        first = [t[0] for t in times]
        return {"ttft": first, "first_all": max(first), "end": time.perf_counter() - t0,
                "token_times": times, "ids": ids}

    def ppl(self, job: dict) -> dict:
        ids = job["ids"]
        if len(ids) < 2:
            raise ValueError("perplexity needs 2 or more ids")
        self.clear()
        self.decode([(tok, p, 0, True) for p, tok in enumerate(ids)])
        logits = self.np.stack([self.logits(i) for i in range(len(ids) - 1)])
        return {"nll": mean_nll(logits, ids[1:]), "tokens": len(ids) - 1}


def quantize(config: dict) -> dict:
    """Write `config["quantize"][1]`, a copy of GGUF `[0]` in llama_ftype `config["ftype"]`
    (a `FTYPES` key), with llama.cpp's `llama_model_quantize` (requantizing allowed)."""
    import llama_cpp as L

    src, dst = config["quantize"]
    params = L.llama_model_quantize_default_params()
    params.ftype = FTYPES[config["ftype"]]
    params.allow_requantize = True
    params.nthread = config.get("threads", 0)
    t0 = time.perf_counter()
    rc = L.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        return {"error": f"llama_model_quantize {src} -> {dst} ({config['ftype']}) returned {rc}"}
    return {"out": dst, "seconds": time.perf_counter() - t0}


def main() -> None:
    config = json.loads(sys.argv[1])
    if "quantize" in config:
        print(json.dumps(quantize(config)), flush=True)
        return
    llm = LlamaCpp(config)
    serve_jobs({
        "ready": lambda job: {"ready": True, "load_s": llm.load_s, "system": llm.system,
                              **rss_bytes()},
        "run": llm.run, "ppl": llm.ppl, "rss": lambda job: rss_bytes()})


if __name__ == "__main__":
    main()
