"""The HTTP API of `infer.py --serve` (FastAPI, in the API server process): POST /v1/completions,
POST /v1/chat/completions, POST /tokenize, POST /detokenize, GET /v1/models, GET /health,
GET /metrics, and with --enable-lora POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter.

Every answer that is not a success is an OpenAI error object `{"error": {"message", "type",
"param", "code"}}` with a 4xx/5xx status, the router's own errors and unexpected exceptions
included. Limits are checked before work: the body size from Content-Length (and while it is
read), prompts x n before tokenizing, a prompt's characters against what the context could
hold before tokenizing; parsing and tokenizing run off the event loop, so /health answers
while a large request is read. With an API key every route but /health needs
`Authorization: Bearer KEY` (the scheme in any case, RFC 7235; the key compared in constant
time; a 401 carries `WWW-Authenticate: Bearer`).
"""

import asyncio
import json
import secrets
import uuid
from dataclasses import dataclass

from . import protocol
from .frontend import Failure, Frontend

OPEN_PATHS = ("/health",)  # answered without the API key (load balancers' probes)
# after an answer given before the request body was read, the rest of the body is read and
# discarded before the connection closes: at most LINGER_BYTES bytes, LINGER_S seconds in all
# and LINGER_IDLE_S seconds between two pieces (nginx's lingering_time / lingering_timeout)
LINGER_BYTES = 64 << 20
LINGER_S = 30.0
LINGER_IDLE_S = 5.0
KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment line: bytes on an idle stream


@dataclass
class Limits:
    """`max_request_bytes`: largest request body; `max_request_choices`: prompts x n."""

    max_request_bytes: int = 4 << 20
    max_request_choices: int = 256


def build_app(fe: Frontend, limits: Limits = Limits(), sse_keep_alive_interval: float = 15.0):
    """The FastAPI app serving `fe`; a stream with no bytes for `sse_keep_alive_interval`
    seconds gets an SSE comment line (0: never)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="shardzoo", redoc_url=None)

    def err(e: protocol.APIError, headers=None) -> JSONResponse:
        if fe.metrics is not None:
            fe.metrics.error(e.code or e.kind)
        return JSONResponse(protocol.error_body(e), status_code=e.status, headers=headers)

    _install_errors_and_auth(app, fe, err)
    app.add_middleware(LingeringClose)  # outside the API key's middleware: its 401 too
    _status_routes(app, fe)
    _generation_routes(app, fe, limits, err, sse_keep_alive_interval)
    _tokenizer_routes(app, fe, limits, err)
    _lora_routes(app, fe, limits, err)
    return app


class LingeringClose:
    """ASGI middleware: when the app answers a request before it has read the whole body (a
    413 from Content-Length, a 401, a 503), the answer goes out with `Connection: close`, then
    the rest of the body is read and discarded -- at most `max_bytes` bytes, `max_s` seconds
    in all, `idle_s` seconds waiting for any one piece, and not past the client's own close --
    and only then does the response end and the server close the connection (nginx's
    lingering close). Closing a socket whose received data is unread makes the kernel reset
    the connection, and a client that writes its whole body before reading (urllib, httpx
    with a body it sends in one go) then gets ECONNRESET instead of the answer. A client
    that sends more than the bounds allow may still see the reset."""

    def __init__(self, app, max_bytes: int = LINGER_BYTES, max_s: float = LINGER_S,
                 idle_s: float = LINGER_IDLE_S):
        self.app, self.max_bytes, self.max_s, self.idle_s = app, max_bytes, max_s, idle_s

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", ())) if scope["type"] == "http" else {}
        if headers.get(b"content-length", b"0") in (b"0", b"") and \
                b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)  # no body, or not HTTP
        read = {"done": False}  # the body's last piece (or the client's close) was received

        async def tracked_receive():
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                read["done"] = True
            return message

        async def lingering_send(message):
            if read["done"]:
                return await send(message)
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() !=
                        b"connection"]
                return await send({**message, "headers": kept + [(b"connection", b"close")]})
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await send({**message, "more_body": True})  # the answer, whole
                await self._discard(tracked_receive, read)
                return await send({"type": "http.response.body", "body": b"",
                                   "more_body": False})
            return await send(message)

        await self.app(scope, tracked_receive, lingering_send)

    async def _discard(self, receive, read: dict) -> None:
        """Read and drop the body's rest within the bounds."""
        loop = asyncio.get_running_loop()
        end, left = loop.time() + self.max_s, self.max_bytes
        while not read["done"] and left > 0:
            wait = min(self.idle_s, end - loop.time())
            if wait <= 0:
                return
            try:
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                return
            left -= len(message.get("body", b""))


def _install_errors_and_auth(app, fe: Frontend, err) -> None:
    """The router's own errors and unexpected exceptions as OpenAI error objects; the API key
    on every route but `OPEN_PATHS`, compared in constant time."""
    from fastapi import Request as HTTPRequest
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(req: HTTPRequest, exc: HTTPException):
        where = f"{req.method} {req.url.path}"
        allow = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow")
        message = {404: f"no route {where}; this server has POST /v1/completions, POST "
                        f"/v1/chat/completions, POST /tokenize, POST /detokenize, GET "
                        f"/v1/models, GET /health and GET /metrics",
                   405: f"{where} is not allowed; use {allow or 'another method'}"}.get(
            exc.status_code, str(exc.detail))
        return err(protocol.APIError(exc.status_code, message), headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(req: HTTPRequest, exc: Exception):
        return err(protocol.APIError(500, f"internal error ({type(exc).__name__}); the "
                                          f"server log has the details", kind="server_error"))

    app.add_middleware(APIKeyCheck, fe=fe, err=err)


class APIKeyCheck:
    """ASGI middleware: the API key on every HTTP route but `OPEN_PATHS` (`Authorization:
    Bearer KEY`, RFC 7235: scheme case-insensitive, 1*SP, the token compared in constant
    time as the bytes sent), else a 401 with `WWW-Authenticate: Bearer`. A plain ASGI
    callable, not Starlette's `BaseHTTPMiddleware`: that one passes every streamed chunk
    through a memory stream and a task of its own (a third of the API process's time in a
    burst of streaming requests)."""

    def __init__(self, app, fe: Frontend, err):
        self.app, self.fe, self.err = app, fe, err

    async def __call__(self, scope, receive, send):
        key = self.fe.api_key
        if scope["type"] == "http" and key is not None and scope["path"] not in OPEN_PATHS:
            got = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            scheme, _, token = got.strip(b" ").partition(b" ")
            if scheme.lower() != b"bearer" or \
                    not secrets.compare_digest(token.lstrip(b" "), key.encode()):
                response = self.err(protocol.APIError(
                    401, "invalid or missing API key; send 'Authorization: Bearer KEY'",
                    code="invalid_api_key", kind="authentication_error"),
                    headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _status_routes(app, fe: Frontend) -> None:
    """GET /health, /metrics, /v1/models."""
    from fastapi.responses import JSONResponse, Response

    @app.get("/health")
    async def health():
        """Liveness (503 while stopping or failed), and per data-parallel replica the work
        queued (tokens still to generate at most) and the choices it finished."""
        with fe.lock:
            replicas = [{"queued_tokens": w, "served": n} for w, n in zip(fe.work, fe.served)]
        status = "failed" if fe.failed else "stopping" if fe.stopping else "ok"
        return JSONResponse({"status": status, "replicas": replicas},
                            status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(fe.metrics.render(), media_type=fe.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        """The base model and its LoRA adapters (`parent`: the base, `root`: the adapter's
        folder, as vLLM lists them)."""
        base = {"id": fe.model_name, "object": "model", "created": 0, "owned_by": "shardzoo",
                "root": fe.model_name, "parent": None,
                "max_model_len": fe.limits.max_seq_length}
        with fe.lock:
            adapters = sorted(fe.adapters.items())
        return {"object": "list", "data": [base] + [
            {**base, "id": name, "root": path, "parent": fe.model_name}
            for name, path in adapters]}


async def _read_body(req, cap: int) -> bytes:
    """The request body, refused (413) past `cap` bytes: from Content-Length before reading,
    else while it is read."""
    too_big = protocol.APIError(413, f"the request body is larger than this server's "
                                     f"--max-request-bytes ({cap} bytes); send less",
                                code="request_too_large")
    length = req.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > cap):
        raise too_big
    body = bytearray()
    async for piece in req.stream():
        body += piece
        if len(body) > cap:
            raise too_big
    return bytes(body)


def _generation_routes(app, fe: Frontend, limits: Limits, err, keep_alive: float) -> None:
    """POST /v1/completions and /v1/chat/completions (streams: a comment line after
    `keep_alive` seconds without bytes, 0: never)."""
    from fastapi import Request as HTTPRequest
    from fastapi.responses import StreamingResponse

    max_chars = protocol.max_prompt_chars(fe.tokenizer, fe.limits.max_seq_length)

    class Stream(StreamingResponse):
        """A streamed answer whose `Lifetime` is closed however the response ends (also when
        the client is gone before the first chunk, so the generator never starts)."""

        def __init__(self, life, body):
            super().__init__(body, media_type="text/event-stream")
            self.life = life

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.life.close()
                fe.handlers -= 1

    async def handle(req: HTTPRequest, chat: bool):
        why = fe.unavailable()
        if why:
            return err(protocol.APIError(503, why, kind="server_error"))
        fe.handlers += 1
        ticket = fe.arrive()  # an idle engine waits for it (core_client.APIProcess.collect)
        try:
            try:
                raw = await _read_body(req, limits.max_request_bytes)
                parsed = await asyncio.to_thread(
                    protocol.parse, raw, chat=chat, tokenizer=fe.tokenizer,
                    model_names=[fe.model_name, *fe.adapters], check=fe.limits.check,
                    max_seq_length=fe.limits.max_seq_length,
                    seed_source=lambda: secrets.randbits(62),
                    max_choices=limits.max_request_choices, max_prompt_chars=max_chars,
                    defaults=fe.sampling_defaults, tool_parser=fe.tool_call_parser,
                    auto_tools=fe.enable_auto_tool_choice)
            except protocol.APIError as e:
                return err(e)
            if chat:
                parsed.reasoning_parser = fe.reasoning_parser
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            prompts = [p for p in parsed.prompts for _ in range(parsed.n)]
            ids = [f"{rid}-{i}" for i in range(len(prompts))]
            try:
                life = fe.open(list(zip(ids, prompts, parsed.params)),
                               None if parsed.model == fe.model_name else parsed.model, ticket)
            except LookupError as e:  # unloaded between parsing and here
                return err(protocol.APIError(404, f"{e}; list the models with GET /v1/models",
                                             "model", "model_not_found"))
            if parsed.stream:
                fe.handlers += 1  # the stream's own; this handler's ends below
                return Stream(life, _stream(life, rid, parsed, keep_alive))
            return await _answer(req, life, rid, parsed, err)
        finally:
            fe.settle(ticket)
            fe.handlers -= 1

    @app.post("/v1/completions")
    async def completions(req: HTTPRequest):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: HTTPRequest):
        return await handle(req, chat=True)


def _tokenizer_routes(app, fe: Frontend, limits: Limits, err) -> None:
    """POST /tokenize and /detokenize (vLLM's): the server's own ids for a text or chat."""
    from fastapi import Request as HTTPRequest

    max_chars = protocol.max_prompt_chars(fe.tokenizer, fe.limits.max_seq_length)
    vocab = fe.limits.vocab_size

    async def run(req, work):
        try:
            raw = await _read_body(req, limits.max_request_bytes)
            return await asyncio.to_thread(work, raw)
        except protocol.APIError as e:
            return err(e)

    @app.post("/tokenize")
    async def tokenize(req: HTTPRequest):
        return await run(req, lambda raw: protocol.tokenize(
            raw, tokenizer=fe.tokenizer, model_names=[fe.model_name],
            max_seq_length=fe.limits.max_seq_length, max_prompt_chars=max_chars))

    @app.post("/detokenize")
    async def detokenize(req: HTTPRequest):
        return await run(req, lambda raw: protocol.detokenize(
            raw, tokenizer=fe.tokenizer, model_names=[fe.model_name], vocab_size=vocab))


def _lora_routes(app, fe: Frontend, limits: Limits, err) -> None:
    """POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter
    {lora_name} (vLLM's): answered once every rank has done it; 403 without
    --allow-runtime-lora-updating."""
    from fastapi import Request as HTTPRequest
    from fastapi.responses import PlainTextResponse

    async def command(req, op: str):
        if not fe.allow_lora_updates:
            return err(protocol.APIError(403, "run-time LoRA updates are off; start the server "
                                              "with --enable-lora --allow-runtime-lora-updating",
                                         kind="permission_error"))
        try:
            raw = await _read_body(req, limits.max_request_bytes)
            body = protocol.lora_request(raw, op == "load")
        except protocol.APIError as e:
            return err(e)
        name = body["lora_name"]
        if name == fe.model_name:
            return err(protocol.APIError(400, f"'{name}' is the base model's name; pick "
                                              f"another lora_name", "lora_name"))
        try:
            future = fe.lora_command(op, name, body.get("lora_path"))
        except ValueError as e:  # in use
            return err(protocol.APIError(409, str(e), "lora_name"))
        error = await future
        if error is not None:
            return err(protocol.APIError(error[0], error[1], "lora_name"))
        done = "added" if op == "load" else "removed"
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {done} successfully.")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: HTTPRequest):
        return await command(req, "load")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: HTTPRequest):
        return await command(req, "unload")


async def _client_gone(req) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message
    is the disconnect)."""
    while (await req.receive())["type"] != "http.disconnect":
        pass


async def _answer(req, life, rid: str, parsed, err):
    """The non-streaming answer: every choice's events gathered, or an error body on a
    `Failure`; a client that goes away cancels its choices."""
    index = {cid: i for i, cid in enumerate(life.ids)}
    n = len(life.ids)
    texts, reasons, tokens = [""] * n, [None] * n, [0] * n
    logprobs = [[] for _ in range(n)]
    prompt_lps = [None] * n

    async def gather():
        left = n
        while left:
            e = await life.queue.get()
            if isinstance(e, Failure):
                return e
            i = index[e.id]
            texts[i] += e.text
            logprobs[i] += e.logprobs or []
            if e.prompt_logprobs is not None:
                prompt_lps[i] = e.prompt_logprobs
            reasons[i], tokens[i] = e.finish_reason, e.completion_tokens
            if e.finish_reason is not None:
                left -= 1
        return None

    work, gone = asyncio.create_task(gather()), asyncio.create_task(_client_gone(req))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        life.close()  # cancels whatever did not finish (client gone, error)
    if not work.done() or work.cancelled():  # nobody is listening (nginx's 499)
        return err(protocol.APIError(499, "the client closed the request",
                                     code="client_closed"))
    failure = work.result()
    if failure is not None:
        return err(protocol.APIError(failure.status, failure.message, kind=failure.kind))
    usage = protocol.usage(sum(len(p) for p in parsed.prompts), sum(tokens))
    return protocol.response(rid, parsed, texts, reasons, usage, logprobs, prompt_lps)


async def _stream(life, rid: str, parsed, keep_alive: float = 0.0):
    """Server-sent events: one chunk per text delta, a final chunk per choice with its finish
    reason, usage if asked, then `data: [DONE]`; a `Failure` ends the stream with an error
    event. After `keep_alive` seconds without a chunk (queued, prefilling, tokens that are
    not yet whole characters; 0: never) a comment line `: keep-alive`, which SSE clients
    skip and proxies or clients with read timeouts count as traffic. A client that goes away
    cancels its choices (Lifetime.close)."""
    index = {cid: i for i, cid in enumerate(life.ids)}
    splitters = None
    if parsed.reasoning_parser is not None:
        from .reasoning import ReasoningSplitter

        splitters = [ReasoningSplitter(parsed.reasoning_parser) for _ in life.ids]
    calls = None
    if parsed.tool_parser is not None:  # content up to a call streams; calls at the end
        from .tool_calls import ToolStream

        calls = [ToolStream(parsed.tool_parser) for _ in life.ids]
    tokens = 0
    clock = asyncio.get_running_loop().time
    sent = clock()  # when the last bytes went out
    try:
        if parsed.chat:
            for i in range(len(life.ids)):
                yield _sse(protocol.chunk(rid, parsed, i, None, None, first=True))
        elif parsed.echo and not parsed.echo_logprobs:  # the prompt's text comes first
            for i in range(len(life.ids)):
                yield _sse(protocol.chunk(rid, parsed, i, parsed.echo[i // parsed.n], None))
        left = len(life.ids)
        while left:
            wait = max(0.0, sent + keep_alive - clock()) if keep_alive else None
            try:  # an event that comes as the wait times out stays in the queue
                e = await asyncio.wait_for(life.queue.get(), wait)
            except asyncio.TimeoutError:
                sent = clock()
                yield KEEP_ALIVE
                continue
            if isinstance(e, Failure):
                yield _sse(protocol.error_body(protocol.APIError(e.status, e.message,
                                                                 kind=e.kind)))
                break
            i = index[e.id]
            text, thought = e.text, None
            if splitters:  # --reasoning-parser: the thinking as reasoning_content deltas
                thought, text = splitters[i].add(text)
                if e.finish_reason is not None:
                    more = splitters[i].finish()
                    thought, text = thought + more[0], text + more[1]
            found, reason = None, e.finish_reason
            if calls:
                text = calls[i].add(text)
                if e.finish_reason is not None:
                    rest, found = calls[i].finish()
                    text += rest
                    reason = "tool_calls" if found and reason == "stop" else reason
            logprobs = e.logprobs
            if parsed.echo_logprobs and e.prompt_logprobs is not None:  # the choice's first
                text = parsed.echo[i // parsed.n] + text  # event: the prompt leads it
                logprobs = protocol.echoed(parsed, i, e.prompt_logprobs) + (logprobs or [])
            if text or thought or logprobs or found:
                sent = clock()
                yield _sse(protocol.chunk(rid, parsed, i, text, None, logprobs=logprobs,
                                          reasoning=thought, tool_calls=found))
            if e.finish_reason is not None:
                left -= 1
                tokens += e.completion_tokens
                sent = clock()
                yield _sse(protocol.chunk(rid, parsed, i, None, reason))
        else:
            if parsed.include_usage:
                body = protocol.chunk(rid, parsed, 0, None, None)
                body["choices"] = []
                body["usage"] = protocol.usage(sum(len(p) for p in parsed.prompts), tokens)
                yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:
        life.close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
