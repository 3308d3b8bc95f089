"""The `server` part of bench/vllm_peer.py: shardzoo's OpenAI server (`infer.py --serve`)
against vLLM's own (`vllm.entrypoints.openai.api_server`, in its own virtual environment) on
the same HF folder, at several numbers of concurrent streaming clients.

Both servers are started once and kept up; for each client count an untimed warm-up round
runs on each (a compiled engine meets that batch size's shapes there), then the load runs
on one, then the other, then again in the other order (rounds alternated: AB, BA, ...),
after the idle server's processes have settled (vLLM polls a core for ~1 s after
answering; `settle`). Each
client sends `requests_per_client` streaming /v1/completions requests one after the other
(`max_tokens` = `--new-tokens`, greedy, `ignore_eos`, prompts that differ in their first
token, so prefix caching cannot help either side; it is off on both). Per client count and
server:

- completion tokens/s: completion tokens of all requests over the round's wall time (the
  mean over rounds), the figure a busy server is judged by;
- TTFT p50 / p99 (ms): request sent to the first streamed chunk that carries a choice;
- ITL p99 (ms): the gaps between consecutive choice chunks of a request (inter-token
  latency as vLLM's `benchmark_serving` measures it: per streamed chunk).

Below each line: the cores our API server process and our engine used during our rounds
(whether one API process is the bottleneck, the case for vLLM's `--api-server-count`).
Percentiles pool the samples of all rounds (nearest-rank). The ratio printed is ours / vLLM
for tokens/s (above 1: ours faster) and vLLM / ours for the latencies (above 1: ours lower).
"""
from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import shutil

from vllm_peer import OWN_PROCESS_GROUP

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_table(value) -> tuple[dict[int, list[int]], dict[int, int]]:
    """({pid: child pids}, {pid: value(fields)}) of every process, `fields` the split
    /proc/PID/stat after the command name (Linux)."""
    children: dict[int, list[int]] = {}
    values = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(pid))
            values[int(pid)] = value(fields)
        except (OSError, ValueError, IndexError):
            continue
    return children, values


def cpu_ticks() -> tuple[dict[int, list[int]], dict[int, int]]:
    """({pid: child pids}, {pid: user + system CPU ticks}) of every process."""
    return proc_table(lambda fields: int(fields[11]) + int(fields[12]))


def subtree(root: int, children: dict, values: dict) -> int:
    """The sum of `values` over process `root` and all its descendants."""
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += values.get(p, 0)
        todo += children.get(p, [])
    return total


def tree_cpu_ticks(root: int) -> int:
    """User + system CPU ticks of process `root` and all its descendants."""
    return subtree(root, *cpu_ticks())


def api_and_engine_ticks(root: int) -> tuple[int, int]:
    """(ticks of `root`'s child processes' trees, ticks of `root` itself): for `infer.py
    --serve` at one rank, the API server process (rank 0 spawns it) and the engine."""
    children, ticks = cpu_ticks()
    return (sum(subtree(c, children, ticks) for c in children.get(root, [])),
            ticks.get(root, 0))


def settle(roots: list[int], window_s: float = 0.5, timeout_s: float = 30.0) -> None:
    """Wait until the process trees of `roots` used under 2% of a core over `window_s`
    (or `timeout_s` passed: then the round is timed anyway and the load shows it)."""
    hz = os.sysconf("SC_CLK_TCK")
    t_end = time.time() + timeout_s
    while time.time() < t_end:
        before = sum(tree_cpu_ticks(r) for r in roots)
        time.sleep(window_s)
        if (sum(tree_cpu_ticks(r) for r in roots) - before) / hz < 0.02 * window_s:
            return


def stream_one(port: int, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT s, inter-chunk gaps s, completion tokens) of one streaming completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}),
        headers={"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    arrivals, tokens = [], 0
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        obj = json.loads(line[6:])
        if obj.get("choices"):
            arrivals.append(time.perf_counter())
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
    conn.close()
    if not arrivals:
        raise RuntimeError("a stream ended without a choice chunk")
    return arrivals[0] - t0, [b - a for a, b in zip(arrivals, arrivals[1:])], tokens


def run_round(port: int, clients: int, per_client: int, max_tokens: int, text: str) -> dict:
    """One round: `clients` threads, each sending `per_client` requests back to back."""
    ttft, itl, tokens, errors = [], [], [0], []
    lock = threading.Lock()

    def client(c):
        for j in range(per_client):
            try:
                t, gaps, n = stream_one(port, f"{c * per_client + j} {text}", max_tokens)
            except Exception as e:  # a failed request is reported, not hidden
                with lock:
                    errors.append(repr(e))
                return
            with lock:
                ttft.append(t)
                itl.extend(gaps)
                tokens[0] += n

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return {"tps": tokens[0] / wall, "ttft": ttft, "itl": itl, "tokens": tokens[0]}


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile `q` (0-100) of `xs`."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def start(cmd: list[str], env: dict, port: int, log: str, wait_s: float = 1800):
    """Popen of a server (own process group, output to `log`) once GET /v1/models answers."""
    out = open(log, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            **OWN_PROCESS_GROUP)
    t_end = time.time() + wait_s
    while time.time() < t_end:
        if proc.poll() is not None:
            with open(log) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"{cmd[:3]} exited {proc.returncode} before serving:\n{tail}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"{cmd[:3]} did not serve within {wait_s} s")


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def server_commands(args, exe: str, folder: str, ckpt: str, dtype: str, ports: dict,
                    scratch: str, vllm_env) -> dict:
    """{name: (command, environment)} of both servers, the same limits on each."""
    most = max(args.server_clients)
    ours = [sys.executable, os.path.join(os.path.dirname(HERE), "infer.py"), "--load", ckpt,
            "--serve", "--port", str(ports["shardzoo"]), "--served-model-name", "m",
            "--dtype", dtype, "--max-batch-size", str(most), "--max-seq-length", "512",
            "--no-enable-prefix-caching"] + (["--compile"] if args.compile else [])
    theirs = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
              "--served-model-name", "m", "--dtype", dtype, "--port", str(ports["vLLM"]),
              "--max-model-len", "512", "--max-num-seqs", str(most),
              "--no-enable-prefix-caching"] + (
        ["--enforce-eager"] if args.vllm_enforce_eager else [])
    return {"shardzoo": (ours, {**os.environ, "OMP_NUM_THREADS": str(args.threads)}),
            "vLLM": (theirs, vllm_env(args.threads, scratch))}


def compare_servers(args, exe: str, folder: str, ckpt: str, dtype: str, text: str,
                    vllm_env) -> None:
    """Both servers up at once, client counts `args.server_clients`, `args.server_rounds`
    alternated rounds each; prints one line per client count (see the module docstring)."""
    scratch = tempfile.mkdtemp(prefix="server-peer-")
    procs = {}
    try:
        ports = {"shardzoo": free_port(), "vLLM": free_port()}
        cmds = server_commands(args, exe, folder, ckpt, dtype, ports, scratch, vllm_env)
        for name, (cmd, env) in cmds.items():
            t0 = time.time()
            procs[name] = start(cmd, env, ports[name], os.path.join(scratch, f"{name}.log"))
            print(f"  {name} server up in {time.time() - t0:.0f} s", flush=True)
        roots = [p.pid for p in procs.values()]
        for name in procs:  # warm-up: the first requests build caches (and vLLM's graphs)
            settle(roots)
            run_round(ports[name], 4, 1, args.new_tokens, text)
        for clients in args.server_clients:
            per_client = max(1, 16 // clients)
            for name in procs:  # untimed: shapes first seen here compile (--compile, vLLM)
                settle(roots)
                run_round(ports[name], clients, 1, args.new_tokens, text)
            got = {"shardzoo": [], "vLLM": []}
            loads, split = [], [0, 0, 0.0]  # our API process's ticks, engine's, seconds
            for r in range(args.server_rounds):
                order = ["shardzoo", "vLLM"] if r % 2 == 0 else ["vLLM", "shardzoo"]
                for name in order:
                    settle(roots)
                    before, t0 = api_and_engine_ticks(procs["shardzoo"].pid), time.time()
                    got[name].append(run_round(ports[name], clients, per_client,
                                               args.new_tokens, text))
                    if name == "shardzoo":
                        after = api_and_engine_ticks(procs["shardzoo"].pid)
                        split = [split[0] + after[0] - before[0],
                                 split[1] + after[1] - before[1], split[2] + time.time() - t0]
                    loads.append(os.getloadavg()[0])
            print_line(dtype, clients, per_client, args.new_tokens, got, loads)
            hz = os.sysconf("SC_CLK_TCK")
            print(f"    ours: the API process used {split[0] / hz / split[2]:.2f} cores, the "
                  f"engine {split[1] / hz / split[2]:.2f} cores", flush=True)
    finally:
        for p in procs.values():
            stop(p)
        shutil.rmtree(scratch, ignore_errors=True)


def print_line(dtype, clients, per_client, n, got, loads) -> None:
    def stats(rounds):
        ttft = [t for r in rounds for t in r["ttft"]]
        itl = [t for r in rounds for t in r["itl"]]
        return (sum(r["tps"] for r in rounds) / len(rounds), percentile(ttft, 50) * 1e3,
                percentile(ttft, 99) * 1e3, percentile(itl, 99) * 1e3 if itl else float("nan"))

    o, v = stats(got["shardzoo"]), stats(got["vLLM"])
    print(f"  {dtype} server, {clients} streaming clients x {per_client} requests x {n} tokens:"
          f" tok/s ours {o[0]:.1f} vLLM {v[0]:.1f} ({o[0] / v[0]:.2f}x) | TTFT p50 ms ours "
          f"{o[1]:.0f} vLLM {v[1]:.0f} ({v[1] / o[1]:.2f}x) | TTFT p99 ours {o[2]:.0f} vLLM "
          f"{v[2]:.0f} ({v[2] / o[2]:.2f}x) | ITL p99 ours {o[3]:.0f} vLLM {v[3]:.0f} "
          f"({v[3] / o[3]:.2f}x) | load {min(loads):.1f}-{max(loads):.1f}", flush=True)
