"""`infer.py --serve`: an OpenAI-compatible HTTP server on global rank 0, every rank in
lockstep.

- The HTTP layer (FastAPI + uvicorn, the `serve` extra) runs in a thread of rank 0: it
  validates requests (inference/protocol.py), routes each choice to the data-parallel
  replica with the least work still to do, and streams events back.
- The control loop (`serve`, every rank) runs one iteration at a time: rank 0 broadcasts the
  new requests / cancels / stop flag to the world, each replica runs one `Engine.step`, and
  the replicas' events are gathered to rank 0. While nothing runs, rank 0 sends a heartbeat
  every `IDLE_S` so the others never sit in a collective past its timeout.
- SIGTERM / Ctrl-C: new requests get 503, in-flight ones finish, then every rank leaves the
  loop and exits 0; a second signal cancels what is left at once.
"""

import asyncio
import json
import queue
import secrets
import signal
import threading
import time
import uuid

import torch.distributed as dist

import parallel_state as ps

from . import protocol
from .comm import broadcast_control, gather_to_rank0, replica_ranks
from .engine import Request

IDLE_S = 0.5


class Frontend:
    """Rank 0's side: the HTTP app's bridge to the control loop (thread-safe)."""

    def __init__(self, engine, tokenizer, model_name: str, api_key: str | None, dp: int):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.dp = api_key, dp
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, tuple] = {}  # request id -> (loop, asyncio.Queue)
        self.work = [0] * dp  # tokens still to generate at most, per replica
        self.served = [0] * dp  # choices finished, per replica (GET /health)
        self.owner: dict[str, list[int]] = {}  # id -> [replica, tokens still to generate]
        self.lock = threading.Lock()
        self.stopping = 0  # 1: drain then stop; 2: cancel and stop

    # ---------------------------------------------------------------- HTTP thread side
    def submit(self, loop, q, items: list[tuple[str, list[int], object]]) -> None:
        """Route each choice to the replica with the least work: tokens it still has to
        generate at most (its requests' max_tokens minus what they produced so far)."""
        with self.lock:
            adds = []
            for rid, prompt, params in items:
                rep = min(range(self.dp), key=lambda r: self.work[r])
                self.work[rep] += params.max_new_tokens
                self.owner[rid] = [rep, params.max_new_tokens]
                self.streams[rid] = (loop, q)
                adds.append((rep, rid, prompt, params))
        self.inbox.put(("add", adds))

    def cancel(self, ids: list[str]) -> None:
        self.inbox.put(("cancel", ids))

    # ---------------------------------------------------------------- control loop side
    def collect(self) -> dict:
        msg = {"add": [], "cancel": [], "stop": False}
        idle = not self.owner
        try:
            items = [self.inbox.get(timeout=IDLE_S) if idle else self.inbox.get_nowait()]
        except queue.Empty:
            items = []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for kind, payload in items:
            msg[kind].extend(payload)
        if self.stopping == 2 or (self.stopping and not self.owner and not msg["add"]):
            msg["stop"] = True
            msg["cancel"].extend(self.owner)
        return msg

    def deliver(self, events) -> None:
        for e in events:
            with self.lock:
                target = self.streams.get(e.id)
                own = self.owner.get(e.id)
                if own is not None:
                    done = own[1] if e.finish_reason is not None else len(e.token_ids)
                    own[1] -= done
                    self.work[own[0]] -= done
                if e.finish_reason is not None:
                    self.streams.pop(e.id, None)
                    if self.owner.pop(e.id, None) is not None:
                        self.served[own[0]] += 1
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, e)


def build_app(fe: Frontend):
    """The FastAPI app of `fe` (routes /v1/completions, /v1/chat/completions, /v1/models,
    /health)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    from starlette.exceptions import HTTPException

    app = FastAPI(title="shardzoo")

    def err(e: protocol.APIError, headers=None) -> JSONResponse:
        return JSONResponse(protocol.error_body(e), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(req: HTTPRequest, exc: HTTPException):
        """The router's own errors (unknown path, wrong method) as OpenAI error objects."""
        where = f"{req.method} {req.url.path}"
        allow = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow")
        message = {404: f"no route {where}; this server has POST /v1/completions, POST "
                        f"/v1/chat/completions, GET /v1/models and GET /health",
                   405: f"{where} is not allowed; use {allow or 'another method'}"}.get(
            exc.status_code, str(exc.detail))
        return err(protocol.APIError(exc.status_code, message), headers=exc.headers)

    def authorized(req: HTTPRequest) -> bool:
        return fe.api_key is None or req.headers.get("authorization") == f"Bearer {fe.api_key}"

    @app.get("/health")
    async def health():
        """Liveness, and per data-parallel replica the work queued (tokens still to generate
        at most) and the choices it finished."""
        with fe.lock:
            replicas = [{"queued_tokens": w, "served": n} for w, n in zip(fe.work, fe.served)]
        return {"status": "stopping" if fe.stopping else "ok", "replicas": replicas}

    @app.get("/v1/models")
    async def models(req: HTTPRequest):
        if not authorized(req):
            return err(protocol.APIError(401, "invalid or missing API key", code="invalid_api_key",
                                         kind="authentication_error"))
        return {"object": "list", "data": [{"id": fe.model_name, "object": "model",
                                            "created": 0, "owned_by": "shardzoo"}]}

    async def handle(req: HTTPRequest, chat: bool):
        if not authorized(req):
            return err(protocol.APIError(401, "invalid or missing API key", code="invalid_api_key",
                                         kind="authentication_error"))
        if fe.stopping:
            return err(protocol.APIError(503, "the server is shutting down", kind="server_error"))
        try:
            parsed = protocol.parse(
                await req.body(), chat=chat, tokenizer=fe.tokenizer,
                model_names=[fe.model_name], check=fe.engine.check,
                max_seq_length=fe.engine.max_seq_length,
                seed_source=lambda: secrets.randbits(62))
        except protocol.APIError as e:
            return err(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        prompts = [p for p in parsed.prompts for _ in range(parsed.n)]
        ids = [f"{rid}-{i}" for i in range(len(prompts))]
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        fe.submit(loop, q, list(zip(ids, prompts, parsed.params)))
        index = {cid: i for i, cid in enumerate(ids)}
        if parsed.stream:
            return StreamingResponse(_stream(fe, q, rid, parsed, ids, index),
                                     media_type="text/event-stream")
        texts, reasons = [""] * len(ids), [None] * len(ids)
        tokens, logprobs = [0] * len(ids), [[] for _ in ids]
        while any(r is None for r in reasons):
            e = await q.get()
            i = index[e.id]
            texts[i] += e.text
            logprobs[i] += e.logprobs or []
            reasons[i], tokens[i] = e.finish_reason, e.completion_tokens
        prompt_tokens = sum(len(p) for p in parsed.prompts)
        return protocol.response(rid, parsed, texts, reasons,
                                 protocol.usage(prompt_tokens, sum(tokens)), logprobs)

    @app.post("/v1/completions")
    async def completions(req: HTTPRequest):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: HTTPRequest):
        return await handle(req, chat=True)

    return app


async def _stream(fe: Frontend, q, rid, parsed, ids, index):
    """Server-sent events: one chunk per text delta, a final chunk per choice with its finish
    reason, usage if asked, then `data: [DONE]`. A client that goes away cancels its
    requests."""
    open_ids = set(ids)
    tokens = 0
    try:
        if parsed.chat:
            for i in range(len(ids)):
                yield _sse(protocol.chunk(rid, parsed, i, None, None, first=True))
        while open_ids:
            e = await q.get()
            i = index[e.id]
            if e.text or e.logprobs:
                yield _sse(protocol.chunk(rid, parsed, i, e.text, None, logprobs=e.logprobs))
            if e.finish_reason is not None:
                open_ids.discard(e.id)
                tokens += e.completion_tokens
                yield _sse(protocol.chunk(rid, parsed, i, None, e.finish_reason))
        if parsed.include_usage:
            body = protocol.chunk(rid, parsed, 0, None, None)
            body["choices"] = []
            body["usage"] = protocol.usage(sum(len(p) for p in parsed.prompts), tokens)
            yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:
        if open_ids:  # the client disconnected (or the server is stopping)
            fe.cancel(sorted(open_ids))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(engine, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log=print) -> None:
    """Run the server until SIGTERM / Ctrl-C (collective: every rank of the world calls it)."""
    rank = dist.get_rank()
    grid = ps.get_grid()
    dp, my_replica = grid.data_parallel_size, grid.dp_rank
    leader = replica_ranks()[0] == rank
    fe = server = thread = None
    signals = {"n": 0}

    def on_signal(signum, frame):
        signals["n"] += 1
        if fe is not None:
            fe.stopping = min(2, signals["n"])

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # other ranks: follow rank 0's stop
    if rank == 0:
        import uvicorn

        fe = Frontend(engine, tokenizer, model_name, api_key, dp)
        config = uvicorn.Config(build_app(fe), host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="http", daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the HTTP server could not start on {host}:{port} (is the "
                                   f"port in use? pass another --port)")
            time.sleep(0.05)
        log(f"serving {model_name} on http://{host}:{port}/v1 (dp={dp}, "
            f"tp={grid.tensor_model_parallel_size}, pp={grid.pipeline_model_parallel_size})",
            flush=True)
    while True:
        msg = broadcast_control(fe.collect() if fe is not None else None)
        events = []
        for rep, rid, prompt, params in msg["add"]:
            if rep == my_replica:
                engine.add(Request(rid, prompt, params))
        for rid in msg["cancel"]:
            r = engine.cancel(rid)
            if r is not None:
                events.append(_cancelled(r))
        if msg["stop"]:
            gathered = gather_to_rank0(events if leader else None)
            if fe is not None:
                fe.deliver([e for part in gathered if part for e in part])
            break
        if engine.has_work():
            events += engine.step()
        gathered = gather_to_rank0(events if leader else None)
        if fe is not None:
            fe.deliver([e for part in gathered if part for e in part])
    if server is not None:
        server.should_exit = True
        thread.join(timeout=10)
        log("server stopped", flush=True)


def _cancelled(r):
    from .engine import Event

    return Event(r.id, [], "", "cancelled", len(r.prompt), len(r.output))
