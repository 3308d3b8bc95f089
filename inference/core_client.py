"""The API server in its own process, apart from the engine ranks (the split of vLLM V1's
AsyncLLM / EngineCoreProc; docs/DECISIONS.md says why multiprocessing pipes carry it).

Global rank 0 starts the API server process (`APIProcess.start`, multiprocessing's "spawn":
a fresh interpreter, no copy of the model, the process group or torch's threads). There,
`api_main` runs the HTTP layer (inference/api.py: FastAPI + uvicorn) and the `Frontend`
(inference/frontend.py): parsing, chat templates, tokenisation, detokenisation, stop strings,
tool / reasoning parsing, streaming and the metrics. The two processes exchange pickled
messages over one `multiprocessing.Pipe`:

- API -> engine: `("control", {"add": [(replica, id, prompt ids, SamplingParams, adapter)],
  "cancel": [ids], "lora": [(ticket, op, name, path)], "stop": bool, "arriving": count})`,
  sent as soon as there is something (a pump thread blocks on the Frontend's inbox). The
  engine's control loop reads whatever has arrived at the top of each iteration (waiting up
  to `IDLE_S` only while it has nothing to run, then briefly for the rest of a burst:
  `APIProcess.collect`) and broadcasts it to every rank as before.
- engine -> API: `("events", [Event], [stats per replica])` after every step with news
  (new token ids, log-probabilities, finish reasons; no text), `("lora", ticket, op, name,
  path, error)`, `("signal", count)` (rank 0 got SIGTERM / SIGINT: the API process ignores
  both itself, torchrun signals the whole process group), `("failed", message)` (a rank
  died: every open request gets that error body) and `("exit",)`.

Back-pressure: a pipe holds a bounded number of bytes; a writer blocks until the reader has
read. Parents are watched through the pipe: when rank 0 dies the API process reads end of
file, answers every open request with a 503 error body and exits; when the API process dies
rank 0 reads end of file and stops every rank (they exit, torchrun restarts the group when
it has --max-restarts left).
"""
from __future__ import annotations

import gc
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass, field

from .frontend import IDLE_S, Failure, Frontend

FLUSH_S = 5.0  # how long the API process waits for the HTTP handlers to send their answers
START_S = 300.0  # the longest the API process may take to import and bind its port
# an idle engine's wait for a burst's next request (see `APIProcess.collect`), seconds: the
# API process hands over one request per 1.3 ms of its CPU; 8 clients' arrivals came 1-3 ms
# apart on a 2-core host
ARRIVAL_GAP_S = 0.003
ARRIVAL_WINDOW_S = 0.020


@dataclass
class APIConfig:
    """Everything the API server process needs (picklable: it crosses to a fresh process).
    The fields are `inference.server.serve`'s arguments; `limits`: the engines'
    `RequestLimits`; `adapters`: LoRA adapters served at start, name -> folder."""

    limits: object
    tokenizer: object
    model_name: str
    dp: int
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    shutdown_timeout: float = 20.0
    max_request_bytes: int = 4 << 20
    max_request_choices: int = 256
    sampling_defaults: dict | None = None
    sse_keep_alive_interval: float = 15.0
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    allow_lora_updates: bool = False
    adapters: dict = field(default_factory=dict)


class APIProcess:
    """Rank 0's handle on the API server process: `collect` its control messages, `deliver`
    the engines' events, `fail` / `close` it. `lost`: it died (end of file on the pipe)."""

    def __init__(self, conn, proc):
        self.conn, self.proc = conn, proc
        self.lost = False
        self.signals = 0  # SIGTERM / SIGINT rank 0 got (forwarded by `collect`)
        self._sent_signals = 0
        self._stats = None  # the replicas' stats last sent

    @classmethod
    def start(cls, config: APIConfig) -> "APIProcess":
        """Start the API server process and wait until it listens; `RuntimeError` with its
        reason when it cannot (the port is in use, ...)."""
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=api_main, args=(child, config), name="api-server",
                           daemon=True)
        proc.start()
        child.close()  # ours is the only other end: end of file when the child dies
        why = None
        end = time.monotonic() + START_S
        try:
            while not conn.poll(0.1):
                if not proc.is_alive() or time.monotonic() > end:
                    why = f"the API server process exited (exit code {proc.exitcode})" \
                        if not proc.is_alive() else "the API server process did not start"
                    break
            else:
                kind, *rest = conn.recv()
                why = rest[0] if kind == "error" else None
        except (EOFError, OSError):
            proc.join(5)
            why = f"the API server process exited (exit code {proc.exitcode})"
        if why is not None:
            proc.kill()
            proc.join()
            raise RuntimeError(why)
        return cls(conn, proc)

    def collect(self, busy: bool) -> dict:
        """The control messages that have arrived, merged (waiting up to `IDLE_S` for one
        unless `busy`); a stop message once the API process is gone.

        An idle engine that gets a request waits for the requests right behind it: those
        the API process said are `arriving` (in its HTTP layer, not yet sent), and those
        that come less than `ARRIVAL_GAP_S` after the previous message, for at most
        `ARRIVAL_WINDOW_S` after the first, so that a burst starts with one prefill of all
        its rows instead of one of the first and one of the rest (docs/DECISIONS.md). A
        busy engine never waits."""
        msg = {"add": [], "cancel": [], "lora": [], "stop": False}
        try:
            if self.signals != self._sent_signals:
                self._sent_signals = self.signals
                self.conn.send(("signal", self.signals))
            ready = self.conn.poll(0 if busy else IDLE_S)
            window_end = None
            while ready:
                _, m = self.conn.recv()
                for k in ("add", "cancel", "lora"):
                    msg[k] += m[k]
                msg["stop"] |= m["stop"]
                ready = self.conn.poll(0)
                if not ready and not busy and msg["add"] and not msg["stop"]:
                    window_end = window_end or time.monotonic() + ARRIVAL_WINDOW_S
                    left = window_end - time.monotonic()
                    wait = left if m["arriving"] else min(ARRIVAL_GAP_S, left)
                    ready = left > 0 and self.conn.poll(wait)
        except (EOFError, OSError):
            self.lost = msg["stop"] = True
        return msg

    def _send(self, obj) -> None:
        if self.lost:
            return
        try:
            self.conn.send(obj)
        except (EOFError, OSError):
            self.lost = True

    def deliver(self, events: list, stats: list) -> None:
        """Send the engines' events of one iteration and `stats` (per replica) when either
        is news."""
        if events or stats != self._stats:
            self._stats = stats
            self._send(("events", events, stats))

    def lora_done(self, ticket: int, op: str, name: str, path: str | None, error) -> None:
        self._send(("lora", ticket, op, name, path, error))

    def fail(self, message: str) -> None:
        """Every open request ends with a 503 error body saying `message`."""
        self._send(("failed", message))

    def close(self, timeout: float = FLUSH_S + 10) -> None:
        """Let the API process send its last answers and exit (killed after `timeout` s)."""
        self._send(("exit",))
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def freeze_heap() -> int:
    """Collect, then move every object the process holds into the garbage collector's
    permanent generation (`gc.freeze`, as vLLM does after start-up); returns how many.

    A compiled engine holds ~930,000 objects tracked by the collector (SmolLM2-135M after
    the warm-up: dynamo's and inductor's graphs, guards and caches, the model), and a full
    collection walked all of them: ~600 ms on a 2-core Xeon (2026-12-07). Python runs one
    whenever the objects that survived younger collections reach a quarter of the old ones,
    so now and then a step stalled for that long. Frozen objects are never
    walked again; one of them that later becomes cyclic garbage is not freed (plain
    reference counting still frees the rest)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def api_main(conn, config: APIConfig) -> None:
    """The API server process: serve HTTP until the engine side says exit or is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 forwards the signals it gets
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch
    import uvicorn

    from .api import Limits, build_app
    from .metrics import ServerMetrics

    torch.set_num_threads(1)  # the cores are the engines'
    c = config
    fe = Frontend(c.limits, c.tokenizer, c.model_name, c.api_key, c.dp,
                  ServerMetrics(c.model_name, c.dp), c.shutdown_timeout, c.sampling_defaults,
                  c.reasoning_parser, c.tool_call_parser, c.enable_auto_tool_choice,
                  c.allow_lora_updates, c.adapters)
    app = build_app(fe, Limits(c.max_request_bytes, c.max_request_choices),
                    c.sse_keep_alive_interval)
    server = uvicorn.Server(uvicorn.Config(app, host=c.host, port=c.port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            conn.send(("error", f"the HTTP server could not start on {c.host}:{c.port} (is "
                                 f"the port in use? pass another --port)"))
            return
        time.sleep(0.05)
    freeze_heap()  # the imports' objects (FastAPI, the tokenizer) out of full collections
    conn.send(("started",))
    threading.Thread(target=_pump, args=(fe, conn), name="to-engine", daemon=True).start()
    _receive(fe, conn)
    fe.wait_for_handlers(FLUSH_S)
    server.should_exit = True
    thread.join(timeout=10)


def _pump(fe: Frontend, conn) -> None:
    """Send the Frontend's control messages to the engines as they come, until the stop."""
    while True:
        msg = fe.collect()
        if not (msg["add"] or msg["cancel"] or msg["lora"] or msg["stop"]):
            continue
        try:
            conn.send(("control", msg))
        except (EOFError, OSError):  # the engine side is gone: `_receive` sees it too
            return
        if msg["stop"]:
            return


def _receive(fe: Frontend, conn) -> None:
    """Hand the engine side's messages to the Frontend until it says exit or is gone."""
    while True:
        try:
            kind, *rest = conn.recv()
        except (EOFError, OSError):  # rank 0 died
            fe.failed = ("the engine process exited unexpectedly; the service restarts if "
                         "torchrun has --max-restarts left; retry shortly")
            fe.fail_all(Failure(503, fe.failed))
            return
        if kind == "events":
            fe.deliver(*rest)
        elif kind == "lora":
            fe.lora_done(*rest)
        elif kind == "signal":
            fe.stop(min(2, rest[0]))
        elif kind == "failed":
            fe.failed = rest[0]
            fe.fail_all(Failure(503, fe.failed))
        elif kind == "exit":
            return
