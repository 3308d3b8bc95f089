"""Faults under real torchrun: kill -9 of one data-parallel rank while long requests are in
flight gives every client an error body (503 JSON, or an error event in a stream), not a
connection reset; with `--max-restarts 1` torchrun starts the service again by itself and it
answers. Then SIGTERM to torchrun with requests in flight: each one either finishes or ends
with an error body once `--shutdown-timeout` has passed, and every rank exits cleanly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from distributed import free_port
from launch import OWN_PROCESS_GROUP, read_until
from test_server_limits import _chain_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workers(parent: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes torchrun `parent` started."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            out[int(env[b"RANK"])] = int(pid)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


def _ask(port: int, stream: bool, prompt: list[int]) -> tuple[str, object]:
    """('ok', tokens) / ('error', error object) / ('reset', exception) of one long request."""
    import http.client

    body = {"model": "chain", "prompt": prompt, "max_tokens": 3000, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode()
        conn.close()
    except (OSError, http.client.HTTPException) as e:
        return "reset", e
    if not stream:
        obj = json.loads(data)
        return ("ok", obj["usage"]["completion_tokens"]) if r.status == 200 else \
            ("error", (r.status, obj["error"]))
    events = [json.loads(line[6:]) for line in data.splitlines()
              if line.startswith("data: {")]
    assert data.rstrip().endswith("data: [DONE]"), data[-300:]
    errors = [e["error"] for e in events if "error" in e]
    return ("error", (r.status, errors[0])) if errors else ("ok", len(events))


def _generating(port: int) -> bool:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/health")
    obj = json.loads(conn.getresponse().read())
    conn.close()
    return all(r["queued_tokens"] > 0 for r in obj["replicas"])


def test_replica_death_then_restart_then_drain(tmp_path):
    folder = str(tmp_path / "chain")
    ids = _chain_model(folder)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", os.path.join(REPO, "infer.py"), "--hf", folder, "--dp", "2",
           "--serve", "--port", str(port), "--served-model-name", "chain",
           "--max-model-len", "4096", "--max-batch-size", "4", "--shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            **OWN_PROCESS_GROUP)
    lines: list[str] = []
    try:
        read_until(proc, lines, "serving chain on")
        drain = threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout],
                                 daemon=True)
        # kill -9 of rank 1 (replica 1) while both replicas generate
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_ask, port, i % 2 == 0, ids[:1]) for i in range(8)]
            deadline = time.monotonic() + 120
            while not _generating(port):
                assert time.monotonic() < deadline, "the requests never started"
            os.kill(_workers(proc.pid)[1], signal.SIGKILL)
            results = [f.result() for f in futures]
        kinds = [k for k, _ in results]
        assert "reset" not in kinds and set(kinds) == {"error"}, results
        for _, (status, error) in results:
            assert status in (200, 503) and "replica failed" in error["message"], error
        # torchrun restarts both ranks; the service answers again
        read_until(proc, lines, "serving chain on", count=2)
        assert _ask(port, False, ids[:1])[0] == "ok"
        # SIGTERM to torchrun with requests in flight: each finishes or gets an error body
        drain.start()
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_ask, port, i % 2 == 0, ids[:1]) for i in range(8)]
            deadline = time.monotonic() + 120
            while not _generating(port):
                assert time.monotonic() < deadline, "the requests never started"
            proc.send_signal(signal.SIGTERM)
            results = [f.result() for f in futures]
        assert all(k in ("ok", "error") for k, _ in results), results
        assert all(v[0] in (200, 503) and "shutdown timeout" in v[1]["message"]
                   for k, v in results if k == "error"), results
        proc.wait(timeout=120)
        drain.join(timeout=30)
        out = "".join(lines)
        assert out.count("server stopped") >= 1, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
