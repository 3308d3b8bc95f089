"""The `llamacpp` part of bench/generate_throughput.py: shardzoo's engine against llama.cpp on
the same GGUF file, on the same machine, in the same run.

llama.cpp runs through llama-cpp-python in its own virtual environment (bench/README.md has
the recipe), found by `--llamacpp-python PATH` or `SHARDZOO_LLAMACPP_PYTHON`; it is never
imported here: its side is bench/llamacpp_worker.py under that Python. Ours is this file run
as a worker by this Python (`ours_main`: `inference.loading.load(hf=FILE.gguf)`, the path of
`infer.py --hf FILE.gguf`, then `inference.engine.Engine`), so each side is one process of
its own whose resident memory is its own. Both answer the same JSON jobs on stdin
(bench/vllm_peer.py's `Worker` drives them). Without llama.cpp the part prints why it is
skipped and returns.

Both get the same file, the same chat-templated prompt ids, `--threads` threads
(`n_threads = n_threads_batch` for llama.cpp, torch threads and OMP_NUM_THREADS for ours),
`--new-tokens` greedy tokens with end of sequence ignored, and:

- decode tokens/s (tokens after the first over their time) and TTFT (until every row has its
  first token) at each `--batches` size, `--repeats` rounds in alternating order after an
  uncounted warm-up of each; the best round of each side counts. llama.cpp's batch of b
  rows is b sequences of one `llama_batch` (its batched decoding: one `llama_decode` per
  step for all rows). Greedy ids: rows identical, and the first position where row 0 parts.
- TTFT at batch 1 alone, `--ttft-samples` alternated pairs (bench/vllm_peer.py
  `alternated_pairs`): min and median of each, the median pair ratio.
- perplexity of each on a held-out text: the first `--ppl-window` tokens (the model's
  tokenizer) of this Python's copy of the standard library's textwrap.py, scored as one
  sequence (every token after the first, given all before it).
- resident memory (VmRSS after loading, after the runs, and the peak VmHWM) of each process;
  our weight bytes (every parameter and buffer storage of the model, tied ones once) against
  the GGUF file's tensor bytes.
- the acceptance ratios: decode at batch 1 ours / llama.cpp >= 1; ours at batch 8 over
  llama.cpp at batch 1 >= 2; weight bytes / the file's tensor bytes <= 1.2; TTFT at batch 1
  no worse than llama.cpp's (median pair ratio theirs / ours >= 1); perplexity within 2% of
  llama.cpp's.

`--requantize q8_0` also makes a Q8_0 copy of the file (llama.cpp's `llama_model_quantize`
with requantizing allowed, in a temporary folder) and measures it the same way.
`--quantization` is passed to our loader as `load(..., quantization=...)` (left out when
not given: the engine's default).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = "SHARDZOO_LLAMACPP_PYTHON"
HELD_OUT = "textwrap"  # the standard-library module whose source is the held-out text
ACCEPTANCE = {"decode1": 1.0, "decode8_over_1": 2.0, "weight_bytes": 1.2, "ttft": 1.0,
              "ppl": 0.02}


def find_llamacpp(flag: str | None) -> tuple[str | None, str]:
    """(python of llama-cpp-python's venv, its version) or (None, why the part is skipped)."""
    from vllm_peer import find_peer_python

    return find_peer_python(flag, "--llamacpp-python", ENV, "llama_cpp")


def held_out_ids(tokenizer, window: int) -> tuple[list[int], str]:
    """(the first `window` ids of `HELD_OUT`'s source under `tokenizer`, where it came
    from). Raises `ValueError` when the text is shorter than `window` tokens."""
    import importlib

    path = importlib.import_module(HELD_OUT).__file__
    with open(path, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    if window < 2 or len(ids) < window:
        raise ValueError(f"--ppl-window {window}: pass 2..{len(ids)} (the tokens of {path})")
    return ids[:window], path


def file_tensor_bytes(path: str) -> tuple[int, str]:
    """(bytes of the GGUF file's tensor data, its tensor types as 'Q4_1 x210, F32 x61')."""
    from collections import Counter

    import gguf

    tensors = gguf.GGUFReader(path).tensors
    kinds = Counter(t.tensor_type.name for t in tensors)
    return sum(int(t.n_bytes) for t in tensors), ", ".join(f"{k} x{v}" for k, v in
                                                            kinds.most_common())


def model_bytes(model) -> tuple[int, str]:
    """(bytes of every low-bit weight (layers/quantized.py), parameter and buffer storage of
    `model`, each once (tied weights share one), the bytes per kind as 'float32 0.5 MB,
    q4_1 92.1 MB')."""
    from layers.quantized import quantized_weights

    seen, per = set(), {}
    for _, w in quantized_weights(model):
        if id(w) not in seen:
            seen.add(id(w))
            per[w.format] = per.get(w.format, 0) + w.nbytes
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        per[str(t.dtype).removeprefix("torch.")] = per.get(
            str(t.dtype).removeprefix("torch."), 0) + s.nbytes()
    return sum(per.values()), ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(per.items()))


def check(reply: dict, who: str) -> dict:
    if "error" in reply:
        raise RuntimeError(f"{who}: {reply['error']}")
    return reply


def mb(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


# --- ours: this file run as a worker by shardzoo's Python ------------------------------------

def ours_main(config: dict) -> None:
    """Our side of the jobs (bench/llamacpp_worker.py's protocol) on `config["model"]`."""
    import inspect

    import torch

    from llamacpp_worker import rss_bytes, serve_jobs

    try:
        import parallel_state as ps
        from inference.engine import Engine
        from inference.loading import load
        from parallel_state.host_memory import tune_host_allocator
        from vllm_peer import run_ours

        tune_host_allocator()  # as infer.py does
        torch.set_num_threads(config["threads"])
        ps.initialize_distributed("cpu")
        ps.initialize_model_parallel(1, 1, device="cpu")
        kw = {}
        if config.get("quantization") is not None:
            if "quantization" not in inspect.signature(load).parameters:
                raise ValueError("inference.loading.load takes no `quantization` in this "
                                 "checkout; drop --quantization (the engine's default is used)")
            from layers.quantized import Quantization
            kw["quantization"] = Quantization(method=config["quantization"])
        t0 = time.perf_counter()
        model, _, _ = load(hf=config["model"], **kw)
        model.eval()
        load_s = time.perf_counter() - t0
    except Exception as e:  # one line for the bench, which stops this part
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    engines = {}

    def run(job):
        reqs = job["requests"]
        key = (len(reqs), max(len(r["prompt"]) + r["max_tokens"] for r in reqs))
        if key not in engines:  # built once per shape, reused as a server's engine is
            engines[key] = Engine(model, max_batch_size=key[0], max_seq_length=key[1],
                                  enable_prefix_caching=False,
                                  compile=bool(config.get("compile")))
        return run_ours(engines[key], reqs)

    @torch.inference_mode()
    def ppl(job):
        ids = torch.tensor([job["ids"]])
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])  # [1, s-1] nats
        return {"nll": float(loss.float().mean()), "tokens": ids.shape[1] - 1}

    weight, dtypes = model_bytes(model)
    serve_jobs({"ready": lambda job: {"ready": True, "load_s": load_s, "weight_bytes": weight,
                                      "weight_dtypes": dtypes, **rss_bytes()},
                "run": run, "ppl": ppl, "rss": lambda job: rss_bytes()})
    ps.destroy_model_parallel(destroy_world=True)


# --- the bench side ----------------------------------------------------------------------------

def part_llamacpp(args, path: str, tokenizer, text: str) -> None:
    """Print the part's rows for GGUF `path` (and its `--requantize` copy); `text` is the
    prompt, as one chat-templated user turn where the tokenizer has a template."""
    exe, version = find_llamacpp(args.llamacpp_python)
    if exe is None:
        print(f"llamacpp part skipped: {version}", flush=True)
        return
    if not path.endswith(".gguf"):
        print(f"llamacpp part skipped: {path} is not a .gguf file (pass --hf FILE.gguf)",
              flush=True)
        return
    import shutil
    import tempfile

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}]) \
        if tokenizer.has_chat_template else tokenizer.encode(text)
    window, source = held_out_ids(tokenizer, args.ppl_window)
    print(f"llamacpp: llama-cpp-python {version} vs shardzoo, prompt {len(prompt)} tokens "
          f"(chat template: {tokenizer.has_chat_template}), {args.new_tokens} new, "
          f"{args.threads} threads, greedy, {args.repeats} alternated rounds; perplexity over "
          f"the first {len(window)} tokens of {source}; our --quantization "
          f"{args.quantization or '(engine default)'}, compiled {args.compile}, low-bit "
          f"activations {args.quant_activations or 'float'}", flush=True)
    scratch = tempfile.mkdtemp(prefix="llamacpp-bench-")
    try:
        files = [path]
        if args.requantize:
            out = os.path.join(scratch, f"{os.path.basename(path)[:-5]}.{args.requantize}.gguf")
            made = quantize(exe, path, out, args.requantize, args.threads)
            print(f"  made {os.path.basename(out)} from {os.path.basename(path)} with "
                  f"llama_model_quantize in {made['seconds']:.0f} s", flush=True)
            files.append(out)
        for f in files:
            compare_file(args, exe, f, prompt, window, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def quantize(exe: str, src: str, dst: str, ftype: str, threads: int) -> dict:
    import subprocess

    config = {"quantize": [src, dst], "ftype": ftype, "threads": threads}
    out = subprocess.run([exe, os.path.join(HERE, "llamacpp_worker.py"), json.dumps(config)],
                         capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('{"')]
    if out.returncode or not lines:
        raise RuntimeError(f"quantizing {src} to {ftype} failed (exit {out.returncode}): "
                           f"{out.stderr.strip()[-500:]}")
    return check(json.loads(lines[-1]), "llama_model_quantize")


def start_workers(args, exe: str, path: str, n_ctx: int, scratch: str):
    """(ours, llama.cpp) `vllm_peer.Worker`s on GGUF `path`, loaded one after the other."""
    from vllm_peer import Worker

    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    if args.quant_activations:  # layers/quant/kernels.py's switch, for our process only
        env["SHARDZOO_QUANT_ACTIVATIONS"] = args.quant_activations
    logs = {}
    workers = []
    try:
        for who, python, script, config in (
                ("shardzoo", sys.executable, "llamacpp_peer.py",
                 {"model": path, "threads": args.threads, "quantization": args.quantization,
                  "compile": args.compile}),
                ("llama.cpp", exe, "llamacpp_worker.py",
                 {"model": path, "threads": args.threads, "n_ctx": n_ctx,
                  "n_seq_max": max(args.batches)})):
            logs[who] = os.path.join(scratch, f"{who}.log")
            with open(logs[who], "w") as log:
                try:
                    workers.append(Worker(python, config, env, script=script, name=who,
                                          stderr=log))
                except RuntimeError as e:
                    with open(logs[who]) as f:
                        tail = f.read()[-1500:]
                    raise RuntimeError(f"{e}\n{tail}") from None
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def compare_file(args, exe: str, path: str, prompt: list[int], window: list[int],
                 scratch: str) -> None:
    from vllm_peer import alternated_pairs, decode_rate, describe_pairs, first_difference

    n, batches = args.new_tokens, args.batches
    tensor_bytes, kinds = file_tensor_bytes(path)
    need = max(max(batches) * (len(prompt) + n), len(window))
    ours, peer = start_workers(args, exe, path, -(-need // 256) * 256, scratch)
    name = os.path.basename(path)
    try:
        print(f"  {name}: {os.path.getsize(path) / 2**20:.1f} MiB file, tensor data "
              f"{tensor_bytes / 2**20:.1f} MiB ({kinds}) | loaded: ours in {ours.load_s:.1f} "
              f"s, RSS {mb(ours.ready['rss'])}; llama.cpp in {peer.load_s:.1f} s, RSS "
              f"{mb(peer.ready['rss'])} (load {os.getloadavg()[0]:.1f})", flush=True)
        best, ttft = {}, {}
        for b in batches:
            jobs = {"job": "run", "requests": [{"prompt": prompt, "max_tokens": n}] * b}
            runs = {"ours": [], "llama.cpp": []}
            for r in range(args.repeats + 1):  # round 0 warms both up and is not counted
                order = (("ours", ours), ("llama.cpp", peer))
                for who, w in (order if r % 2 == 0 else order[::-1]):
                    res = check(w.ask(jobs), who)
                    if r:
                        runs[who].append((res, os.getloadavg()[0]))
            for who, got in runs.items():
                print(f"  {name} batch {b} {who:9s}: " + " | ".join(
                    f"decode {decode_rate(x, b, n):.1f} tok/s ttft {x['first_all'] * 1e3:.0f} "
                    f"ms (load {ld:.1f})" for x, ld in got), flush=True)
                best[(who, b)] = max(decode_rate(x, b, n) for x, _ in got)
                ttft[(who, b)] = min(x["first_all"] for x, _ in got)
            ids, ids_p = runs["ours"][0][0]["ids"], runs["llama.cpp"][0][0]["ids"]
            agree = sum(a == c for a, c in zip(ids, ids_p))
            diff = first_difference(ids[0], ids_p[0])
            print(f"  {name} batch {b}: best decode ours {best[('ours', b)]:.1f} / llama.cpp "
                  f"{best[('llama.cpp', b)]:.1f} tok/s = "
                  f"{best[('ours', b)] / best[('llama.cpp', b)]:.2f}x | best ttft ours "
                  f"{ttft[('ours', b)] * 1e3:.0f} / llama.cpp {ttft[('llama.cpp', b)] * 1e3:.0f}"
                  f" ms | greedy ids: {agree}/{b} rows identical" +
                  ("" if diff is None else f", row 0 first differs at token {diff} of {n}"),
                  flush=True)
        first = {"job": "run", "requests": [{"prompt": prompt, "max_tokens": 1}]}
        check(ours.ask(first), "ours"), check(peer.ask(first), "llama.cpp")  # warm-up
        pairs = alternated_pairs(lambda: check(ours.ask(first), "ours")["first_all"],
                                 lambda: check(peer.ask(first), "llama.cpp")["first_all"],
                                 args.ttft_samples)
        line, ttft_ratio = describe_pairs(pairs, "llama.cpp")
        print(f"  {name} batch 1 ttft ({len(pairs)} alternated pairs, load "
              f"{os.getloadavg()[0]:.1f}): {line}", flush=True)
        job = {"job": "ppl", "ids": window}
        nll, nll_p = check(ours.ask(job), "ours")["nll"], check(peer.ask(job), "llama.cpp")["nll"]
        ppl_ratio = math.exp(nll - nll_p)
        print(f"  {name} perplexity over {len(window)} held-out tokens: ours "
              f"{math.exp(nll):.3f} | llama.cpp {math.exp(nll_p):.3f} | ours / llama.cpp "
              f"{ppl_ratio:.4f}", flush=True)
        mem, mem_p = check(ours.ask({"job": "rss"}), "ours"), check(peer.ask({"job": "rss"}),
                                                                      "llama.cpp")
        weight = ours.ready["weight_bytes"]
        print(f"  {name} memory: ours RSS {mb(mem['rss'])} (peak {mb(mem['peak'])}), weights "
              f"{weight / 2**20:.1f} MiB ({ours.ready['weight_dtypes']}) = "
              f"{weight / tensor_bytes:.2f}x the file's tensor data | llama.cpp RSS "
              f"{mb(mem_p['rss'])} (peak {mb(mem_p['peak'])})", flush=True)
        print_acceptance(name, best, ttft_ratio, weight / tensor_bytes, ppl_ratio)
    finally:
        ours.close()
        peer.close()


def print_acceptance(name: str, best: dict, ttft_ratio: float, weight_ratio: float,
                     ppl_ratio: float) -> None:
    """The acceptance lines of one file (`best`: {(who, batch): decode tokens/s})."""
    a = ACCEPTANCE
    rows = []
    if ("ours", 1) in best:
        r = best[("ours", 1)] / best[("llama.cpp", 1)]
        rows.append(f"decode batch 1 ours/llama.cpp {r:.2f}x (>= {a['decode1']:.1f}: "
                    f"{verdict(r >= a['decode1'])})")
    if ("ours", 8) in best and ("llama.cpp", 1) in best:
        r = best[("ours", 8)] / best[("llama.cpp", 1)]
        rows.append(f"ours batch 8 / llama.cpp batch 1 {r:.2f}x (>= {a['decode8_over_1']:.1f}"
                    f": {verdict(r >= a['decode8_over_1'])})")
    rows.append(f"weight bytes / file tensor bytes {weight_ratio:.2f}x (<= "
                f"{a['weight_bytes']:.1f}: {verdict(weight_ratio <= a['weight_bytes'])})")
    rows.append(f"ttft batch 1 llama.cpp/ours (median pair) {ttft_ratio:.2f}x (>= "
                f"{a['ttft']:.1f}: {verdict(ttft_ratio >= a['ttft'])})")
    rows.append(f"perplexity ours/llama.cpp {ppl_ratio:.4f} (within {a['ppl']:.0%}: "
                f"{verdict(abs(ppl_ratio - 1) <= a['ppl'])})")
    print(f"  {name} acceptance: " + "; ".join(rows), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))  # the repository: inference, models, ...
    ours_main(json.loads(sys.argv[1]))
