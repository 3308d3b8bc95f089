"""The API server process apart from the engine process (inference/core_client.py), on
loopback: a stream whose client disconnects frees its slot in the engine process; kill -9 of
the engine process gives every open client an error body and the API process exits; kill -9
of the API process stops the engine process (exit 1), leaving no process behind. And the
API process's own stop strings (the engine sends ids only): ids after a stop string are
dropped and the engine is told to cancel. And an idle engine's wait for the rest of a
burst: the requests the API process counts as arriving, and those right behind."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from distributed import free_port
from launch import OWN_PROCESS_GROUP, read_until
from test_server_faults import _ask
from test_server_limits import _chain_model, _metric, _until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _children(parent: int) -> list[int]:
    """The pids of `parent`'s child processes (the API process, multiprocessing's resource
    tracker)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                    out.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _start(folder: str):
    """`infer.py --serve` (one engine process) -> (proc, port, API process pid, lines)."""
    port = free_port()
    cmd = [sys.executable, os.path.join(REPO, "infer.py"), "--hf", folder, "--serve",
           "--port", str(port), "--served-model-name", "chain", "--max-model-len", "4096",
           "--max-batch-size", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            **OWN_PROCESS_GROUP)
    lines: list[str] = []
    read_until(proc, lines, "serving chain on")
    api = int(re.search(r"API server process (\d+)", "".join(lines)).group(1))
    assert api in _children(proc.pid)
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    return proc, port, api, lines


def _stop(proc, api: int) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not _gone(api):
        os.kill(api, signal.SIGKILL)


def _open_stream(port: int, prompt: list[int]) -> socket.socket:
    """A raw streaming request; returns once its first token has come."""
    body = json.dumps({"model": "chain", "prompt": prompt, "max_tokens": 4000,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while b"data: {" not in got:
        got += s.recv(4096)
    return s


def _complete(port: int, prompt: list[int], n: int) -> int:
    """Completion tokens of a greedy non-streaming request of `n` tokens."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "chain", "prompt": prompt, "max_tokens": n, "ignore_eos": True,
         "temperature": 0}), headers={"content-type": "application/json"})
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    assert r.status == 200, body
    return body["usage"]["completion_tokens"]


def test_disconnect_then_kill_engine_process(tmp_path):
    ids = _chain_model(str(tmp_path / "chain"))
    proc, port, api, lines = _start(str(tmp_path / "chain"))
    try:
        # the only slot (--max-batch-size 1) runs a stream; its client goes away
        s = _open_stream(port, ids[:1])
        running = "shardzoo:num_requests_running"
        _until(lambda: _metric(port, running) == 1, "the stream is not running")
        s.close()
        # the engine process reports the slot free, and the next request gets it
        _until(lambda: _metric(port, running) == 0, "the cancelled stream still runs")
        assert _complete(port, ids[:1], 5) == 5
        # kill -9 of the engine process while clients wait (streamed and not)
        children = _children(proc.pid)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_ask, port, i % 2 == 0, ids[:1]) for i in range(4)]
            _until(lambda: _metric(port, "shardzoo:num_requests_waiting") +
                   _metric(port, running) == 4, "not all queued")
            os.kill(proc.pid, signal.SIGKILL)
            results = [f.result(timeout=120) for f in futures]
        assert [k for k, _ in results] == ["error"] * 4, results
        for _, (status, error) in results:
            assert status in (200, 503) and "engine process exited" in error["message"], error
        _until(lambda: all(map(_gone, children)), "a child outlived its engine process", 60)
    finally:
        _stop(proc, api)


def test_kill_api_process_stops_the_engine(tmp_path):
    ids = _chain_model(str(tmp_path / "chain"))
    proc, port, api, lines = _start(str(tmp_path / "chain"))
    try:
        s = _open_stream(port, ids[:1])  # the engine is busy when its API process dies
        children = _children(proc.pid)
        os.kill(api, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1, "".join(lines[-30:])
        s.close()
        time.sleep(0.2)  # the reader thread takes the last lines
        assert "API server process exited" in "".join(lines), "".join(lines[-30:])
        assert all(map(_gone, children)), children
    finally:
        _stop(proc, api)


class _Tokenizer:
    """ids are letters: 0 -> "a", 1 -> "b", ..."""

    vocab_size = 26

    @staticmethod
    def decode(ids):
        return "".join(chr(97 + i) for i in ids)


def test_api_process_applies_stop_strings():
    """An engine event of several ids (speculative decoding) whose middle id completes a
    stop string: the request ends there, its later ids are dropped and counted nowhere, and
    the engine is asked to cancel it; its last event then only settles the metrics."""
    from inference.engine import Event
    from inference.frontend import Frontend
    from inference.limits import RequestLimits
    from inference.sampling import SamplingParams

    async def run():
        fe = Frontend(RequestLimits(26, 64, 64), _Tokenizer(), "m", None, 1)
        life = fe.open([("r", [0], SamplingParams(max_new_tokens=20, stop=("cd",)))])
        fe.collect()  # the add
        fe.deliver([Event("r", [1, 2], "", None, 1, 2, logprobs=[(1,), (2,)])])
        fe.deliver([Event("r", [3, 4, 5], "", None, 1, 5, logprobs=[(3,), (4,), (5,)])])
        fe.deliver([Event("r", [6], "", "cancelled", 1, 6, preemptions=0)])  # settles
        await asyncio.sleep(0)
        got = [life.queue.get_nowait() for _ in range(life.queue.qsize())]
        assert [(e.token_ids, e.text, e.finish_reason, e.completion_tokens)
                for e in got] == [([1, 2], "b", None, 2), ([3], "", "stop", 3)], got
        assert got[1].logprobs == [(3,)]
        assert fe.collect()["cancel"] == ["r"] and not fe.choices and not fe.leaving
        assert fe.work == [0]

    asyncio.run(run())


def test_tokenizers_cross_to_the_api_process():
    """What `APIConfig` carries survives pickling (the spawned API process unpickles it): a
    T5 prompt tokenizer, whose attribute look-ups go to the tokenizer it wraps."""
    import pickle

    from inference.seq2seq import SourceTokenizer

    t5 = pickle.loads(pickle.dumps(SourceTokenizer(_Tokenizer(), 30)))
    assert t5.model_vocab_size == 30 and t5.decode([0, 1]) == "ab"


def test_api_app_has_no_buffering_middleware():
    """The app's middleware are plain ASGI callables (the API key check, the lingering
    close): none is Starlette's `BaseHTTPMiddleware`, which passes every streamed chunk
    through a memory stream and a task of its own (the API process's time per streamed
    request: 2.0 -> 1.3 ms on 2 CPU cores)."""
    from starlette.middleware.base import BaseHTTPMiddleware

    from inference.api import APIKeyCheck, LingeringClose, build_app
    from inference.frontend import Frontend
    from inference.limits import RequestLimits

    app = build_app(Frontend(RequestLimits(26, 64, 64), None, "m", "sk-key", 1))
    kinds = [m.cls for m in app.user_middleware]
    assert kinds == [LingeringClose, APIKeyCheck], kinds  # outermost first
    assert BaseHTTPMiddleware not in kinds


class _ScriptedPipe:
    """A `multiprocessing.Connection` stand-in on a clock of its own: `poll(t)` says whether
    a scripted message has arrived by now + t (moving the clock there), `recv` takes it."""

    def __init__(self, arrivals: list[tuple]):
        self.now, self.todo = 0.0, sorted(arrivals)

    def poll(self, timeout: float = 0.0) -> bool:
        if self.todo and self.todo[0][0] <= self.now + timeout:
            self.now = max(self.now, self.todo[0][0])
            return True
        self.now += timeout
        return False

    def recv(self):
        _, rid, *arriving = self.todo.pop(0)
        return ("control", {"add": [(0, rid, [1], None, None)], "cancel": [], "lora": [],
                            "stop": False, "arriving": arriving[0] if arriving else 0})


def test_an_idle_engine_gathers_a_burst(monkeypatch):
    """An idle engine takes the requests that come less than ARRIVAL_GAP_S apart, and those
    the API process said are arriving, for at most ARRIVAL_WINDOW_S (one prefill for the
    burst); a busy one takes only what has arrived."""
    from inference import core_client

    gap, window = core_client.ARRIVAL_GAP_S, core_client.ARRIVAL_WINDOW_S

    def collect(arrivals, busy):
        pipe = _ScriptedPipe(arrivals)
        monkeypatch.setattr(core_client.time, "monotonic", lambda: pipe.now)
        api = core_client.APIProcess(pipe, None)
        return [rid for _, rid, *_ in api.collect(busy)["add"]], pipe

    burst = [(0.1 + i * gap * 0.9, f"r{i}") for i in range(3)] + [(0.1 + 2 * gap * 0.9 + gap * 1.5,
                                                                      "late")]
    got, pipe = collect(burst, busy=False)
    assert got == ["r0", "r1", "r2"]  # "late" came more than a gap after r2
    assert pipe.now == pytest.approx(0.1 + 2 * gap * 0.9 + gap)  # waited one gap past r2
    assert collect(burst, busy=True)[0] == []  # busy: nothing had arrived at time 0
    ready = [(0.0, "r0"), (0.0, "r1")] + burst[1:]
    assert collect(ready, busy=True)[0] == ["r0", "r1"]  # busy: no wait for the next one
    steady = [(i * gap * 0.5, f"s{i}") for i in range(int(3 * window / gap))]
    got, pipe = collect(steady, busy=False)
    assert 0 < len(got) < len(steady) and pipe.now <= window + 1e-9  # the window bounds it
    # the API process still parses one: waited for past the gap, but not past the window
    slow = [(0.1, "r0", 1), (0.1 + 3 * gap, "r1", 0), (0.1 + 5 * gap, "r2")]
    assert collect(slow, busy=False)[0] == ["r0", "r1"]
    assert collect([(0.1, "r0", 1), (0.1 + window * 1.5, "r1")], busy=False)[0] == ["r0"]


def test_arriving_counts_requests_until_handed_over():
    """`Frontend.arriving`: requests between `arrive` and `open` (or `settle`: answered
    without opening), reported with the control message that carries what was opened
    before."""
    from inference.frontend import Frontend
    from inference.sampling import SamplingParams

    fe = Frontend(limits=type("L", (), {"encoder_decoder": False})(), tokenizer=None,
                  model_name="m", api_key=None, dp=1)

    async def handler(opens: bool):
        ticket = fe.arrive()
        try:
            if opens:
                fe.open([(f"r{len(fe.choices)}", [1, 2], SamplingParams(max_new_tokens=2))],
                        ticket=ticket)
            else:
                fe.inbox.put(("wake", []))  # so that `collect` does not wait for a message
            return fe.collect()["arriving"], fe.arriving
        finally:
            fe.settle(ticket)

    async def main():
        other = fe.arrive()  # a request another handler still parses
        first = await asyncio.create_task(handler(True))
        error = await asyncio.create_task(handler(False))  # answered without opening
        fe.settle(other)
        return first, error

    assert asyncio.run(main()) == ((1, 1), (2, 2))
    assert fe.arriving == 0


@pytest.mark.parametrize("stream", [True, False])
def test_arriving_ends_when_the_http_app_opens_a_request(tmp_path, stream):
    """Through the app's routes: a completion counts in `arriving` only until its handler
    opens it, not for as long as it generates (a non-streamed one's handler waits for the
    whole answer; the engine would then wait its whole window for every request that
    follows)."""
    from starlette.testclient import TestClient

    from inference.api import build_app
    from inference.frontend import Failure, Frontend
    from inference.limits import RequestLimits

    from models.tokenizer import build_tokenizer
    from test_detokenize import llama2_style_tokenizer

    llama2_style_tokenizer().save_pretrained(str(tmp_path))
    tok = build_tokenizer(str(tmp_path))
    fe = Frontend(RequestLimits(tok.vocab_size, 64, 64), tok, "m", None, 1)
    seen = {}

    def client():
        with TestClient(build_app(fe)) as c:
            with c.stream("POST", "/v1/completions", json={
                    "model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}) as r:
                seen["status"] = r.status_code
                seen["body"] = "".join(r.iter_text())

    t = threading.Thread(target=client, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not fe.choices:  # opened: the add is in the inbox, the answer not yet given
        assert time.monotonic() < deadline and t.is_alive(), seen
        time.sleep(0.01)
    assert fe.collect()["arriving"] == 0 and fe.arriving == 0
    fe.fail_all(Failure(503, "test over"))  # ends the stream, or answers with the error
    t.join(60)
    assert seen["status"] == (200 if stream else 503) and "test over" in seen["body"], seen
    assert fe.arriving == 0
