"""The API server process's bridge between the HTTP layer (inference/api.py) and the engine
processes (inference/core_client.py carries its messages to rank 0's control loop,
inference/server.py): `Frontend` is the one place that owns a request's lifetime. `open`
registers and routes a request's choices, `Lifetime.close` cancels whatever has not finished
whatever the transport did (stream dropped, non-streaming client gone, handler error), and
`fail_all` ends every open request with an error body (drain deadline passed, a replica
failed). Thread-safe: the HTTP thread and the threads that talk to the engines all call
it.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass

from .detokenize import OutputText

IDLE_S = 0.5  # the longest the control loop and `collect` wait for something to do


@dataclass
class Failure:
    """Put on a request's queue instead of an event: end it with this error body."""

    status: int
    message: str
    kind: str = "server_error"


@dataclass
class _Choice:
    """The book-keeping of one choice in flight."""

    replica: int
    budget: int  # tokens it may still generate
    arrival: float  # time.monotonic() at `open`
    queue: object  # (loop, asyncio.Queue)
    last: float | None = None  # time of its previous event with tokens
    lora: str | None = None  # the LoRA adapter it runs with (None: the base)
    out: object = None  # its text (detokenize.OutputText; None without a tokenizer)
    generated: int = 0  # tokens handed to its request so far


class Lifetime:
    """The choices of one HTTP request: `queue` receives their events (or a `Failure`);
    `close()` (idempotent) cancels the ones that have not finished."""

    def __init__(self, fe: "Frontend", ids: list[str], q: asyncio.Queue):
        self.fe, self.ids, self.queue = fe, ids, q

    def close(self) -> None:
        self.fe.forget(self.ids)


class Frontend:
    """The HTTP app's bridge to the engines' control loop (thread-safe). `limits`: the
    engines' `RequestLimits` (inference/limits.py); `adapters`: the LoRA adapters served at
    start, name -> folder."""

    def __init__(self, limits, tokenizer, model_name: str, api_key: str | None, dp: int,
                 metrics=None, shutdown_timeout: float = 20.0,
                 sampling_defaults: dict | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 allow_lora_updates: bool = False, adapters: dict | None = None):
        self.limits, self.tokenizer, self.model_name = limits, tokenizer, model_name
        # LoRA adapters served (inference/lora.py): name -> folder, as the engines last
        # reported; run-time loads and unloads (--allow-runtime-lora-updating) wait for
        # their ticket
        self.adapters = dict(adapters or {})
        self.allow_lora_updates = allow_lora_updates
        self.lora_waiting: dict[int, tuple] = {}  # ticket -> (loop, future)
        self.tickets = 0
        self.reasoning_parser = reasoning_parser  # --reasoning-parser (inference/reasoning.py)
        # --tool-call-parser, --enable-auto-tool-choice (inference/tool_calls.py)
        self.tool_call_parser, self.enable_auto_tool_choice = \
            tool_call_parser, enable_auto_tool_choice
        self.sampling_defaults = sampling_defaults or {}
        self.api_key, self.dp, self.metrics = api_key, dp, metrics
        self.shutdown_timeout = shutdown_timeout
        self.inbox: queue.Queue = queue.Queue()
        self.choices: dict[str, _Choice] = {}
        # cancelled choices until the engine's last event for them (it carries their
        # preemptions, and their time in the queue when no token came): id -> (replica,
        # whether that queue time is still to be counted)
        self.leaving: dict[str, tuple[int, bool]] = {}
        self.work = [0] * dp  # tokens still to generate at most, per replica
        self.served = [0] * dp  # choices finished, per replica (GET /health)
        self.lock = threading.Lock()
        self.stopping = 0  # 1: drain then stop; 2: end what is left and stop
        self.failed: str | None = None  # why the service failed (a replica died)
        self.deadline: float | None = None  # drain deadline (time.monotonic())
        self.handlers = 0  # HTTP handlers still answering (the exit waits for them)
        # generation requests the HTTP handlers are parsing (`arrive` .. `open` or `settle`):
        # an idle engine that gets one request waits for these (core_client.APIProcess.collect)
        self.arriving = 0

    # ---------------------------------------------------------------- HTTP thread side
    def open(self, items: list[tuple[str, list[int], object]], lora: str | None = None,
             ticket: list | None = None) -> Lifetime:
        """Register and route each choice `(id, prompt ids, SamplingParams)` to the replica
        with the least work: tokens it still has to generate at most. `lora`: the adapter
        the choices run with (None: the base); `ticket`: the request's from `arrive` (it no
        longer counts as arriving); `LookupError` when the adapter is no longer served."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        now = time.monotonic()
        with self.lock:
            if lora is not None and lora not in self.adapters:
                raise LookupError(f"the LoRA adapter '{lora}' was unloaded")
            adds = []
            for rid, prompt, params in items:
                rep = min(range(self.dp), key=lambda r: self.work[r])
                self.work[rep] += params.max_new_tokens
                out = None if self.tokenizer is None else OutputText(
                    self.tokenizer.decode, () if self.limits.encoder_decoder else prompt,
                    params.stop)
                self.choices[rid] = _Choice(rep, params.max_new_tokens, now, (loop, q),
                                            lora=lora, out=out)
                adds.append((rep, rid, prompt, params, lora))
            self._settle(ticket)
            self.inbox.put(("add", adds))  # with the count: `collect` reads both at once
        return Lifetime(self, [rid for rid, _, _ in items], q)

    def arrive(self) -> list:
        """Count a request an HTTP handler starts parsing in `arriving` until `open` or
        `settle` gets the ticket returned."""
        with self.lock:
            self.arriving += 1
        return [True]

    def settle(self, ticket: list) -> None:
        """The request of `ticket` was handled: it no longer counts in `arriving` (a no-op
        once `open` took it)."""
        with self.lock:
            self._settle(ticket)

    def _settle(self, ticket: list | None) -> None:
        if ticket is not None and ticket[0]:
            ticket[0] = False
            self.arriving -= 1

    def lora_command(self, op: str, name: str, path: str | None = None):
        """Queue a run-time adapter command ("load" name from path, "unload" name) for every
        rank; returns an asyncio future of its error, (HTTP status, message), or None: done.
        An unload of an adapter some open request uses is refused here (`ValueError`), and
        once accepted no new request may name it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            if op == "unload":
                users = sum(c.lora == name for c in self.choices.values())
                if users:
                    raise ValueError(f"the LoRA adapter '{name}' is in use by {users} "
                                     f"request(s); unload it once they have finished")
                self.adapters.pop(name, None)
            self.tickets += 1
            ticket = self.tickets
            self.lora_waiting[ticket] = (loop, future)
        self.inbox.put(("lora", [(ticket, op, name, path)]))
        return future

    def lora_done(self, ticket: int, op: str, name: str, path: str | None,
                  error: tuple[int, str] | None) -> None:
        """The control loop ran command `ticket` on rank 0 (`error`: (HTTP status, why it
        failed))."""
        with self.lock:
            if op == "load" and error is None:
                self.adapters[name] = path
            loop, future = self.lora_waiting.pop(ticket, (None, None))
        if loop is not None:
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(error))
            except RuntimeError:
                pass

    def forget(self, ids: list[str]) -> None:
        """Cancel those of `ids` still open in their engines; their remaining events go
        nowhere (finished ones, or ones already forgotten, are skipped)."""
        with self.lock:
            gone = [(rid, c) for rid, c in ((rid, self.choices.pop(rid, None)) for rid in ids)
                    if c is not None]
            for rid, c in gone:
                self.work[c.replica] -= c.budget
                self.leaving[rid] = (c.replica, c.last is None)
        if not gone:
            return
        if self.metrics is not None:
            for _, c in gone:
                self.metrics.aborted(c.replica, c.arrival)
        self.inbox.put(("cancel", [rid for rid, _ in gone]))

    def stop(self, level: int) -> None:
        """1: drain (new requests 503; open ones get `shutdown_timeout` seconds); 2: now."""
        if level == 1 and not self.stopping:
            self.deadline = time.monotonic() + self.shutdown_timeout
        self.stopping = max(self.stopping, level)
        self.inbox.put(("wake", []))

    def unavailable(self) -> str | None:
        """Why a new request is refused now (None: it is accepted)."""
        if self.failed:
            return self.failed
        if self.stopping:
            return "the server is shutting down; retry on another server"
        return None

    # ---------------------------------------------------------------- engine side
    def collect(self) -> dict:
        """The next control message for the engines: requests to add, ids to cancel, adapter
        commands, whether to stop (blocks up to `IDLE_S` until there is one), and how many
        requests are `arriving` behind these."""
        if self.stopping == 1 and self.deadline is not None and \
                time.monotonic() > self.deadline:
            self.stopping = 2
            self.fail_all(Failure(503, f"the server is shutting down and its shutdown "
                                       f"timeout ({self.shutdown_timeout:g} s) has passed; "
                                       f"retry on another server"))
        if self.stopping == 2:
            self.fail_all(Failure(503, "the server was stopped before this request "
                                       "finished; retry on another server"))
        msg = {"add": [], "cancel": [], "lora": [], "stop": False, "arriving": 0}
        try:
            items = [self.inbox.get(timeout=IDLE_S)]
        except queue.Empty:
            items = []
        with self.lock:  # `open` puts under the lock: the count matches what was taken
            while True:
                try:
                    items.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            msg["arriving"] = self.arriving
        for kind, payload in items:
            if kind != "wake":  # (stop, a choice finished while stopping): look again
                msg[kind].extend(payload)
        msg["stop"] = self.stopping == 2 or bool(self.stopping and not self.choices)
        return msg

    def fail_all(self, failure: Failure) -> None:
        """End every open request with `failure`'s error body (and cancel it)."""
        with self.lock:
            ids = list(self.choices)
            targets = {id(c.queue[1]): c.queue for c in self.choices.values()}
        for loop, q in targets.values():
            try:
                loop.call_soon_threadsafe(q.put_nowait, failure)
            except RuntimeError:  # the HTTP loop has closed
                pass
        self.forget(ids)
        if self.metrics is not None:
            for _ in ids:
                self.metrics.error("shutdown" if self.failed is None else "replica_failed")

    def deliver(self, events, stats=None) -> None:
        """Hand the engines' events to their requests; `stats[r]`: replica r's load."""
        now = time.monotonic()
        for e in events:
            with self.lock:
                c = self.choices.get(e.id)
                if c is None:  # cancelled by its client, or failed above
                    self._left(e)
                    continue
                if self._text(c, e):  # a stop string ended it: the engine still runs it
                    self.leaving[e.id] = (c.replica, False)
                    self.inbox.put(("cancel", [e.id]))
                done = c.budget if e.finish_reason is not None else len(e.token_ids)
                c.budget -= done
                self.work[c.replica] -= done
                if e.finish_reason is not None:
                    del self.choices[e.id]
                    self.served[c.replica] += 1
                    if self.stopping and not self.choices:
                        self.inbox.put(("wake", []))
                last, c.last = c.last, (now if e.token_ids else c.last)
            if self.metrics is not None:
                self.metrics.event(c.replica, e, c.arrival, last)
            loop, q = c.queue
            try:
                loop.call_soon_threadsafe(q.put_nowait, e)
            except RuntimeError:
                pass
        if stats and self.metrics is not None:
            for r, s in enumerate(stats):
                if s is not None:
                    self.metrics.replica_stats(r, s)

    @staticmethod
    def _text(c: _Choice, e) -> bool:
        """Give engine event `e` of choice `c` its text (stop strings are applied here: the
        engines send ids only): the ids after a stop string are dropped and the finish reason
        becomes "stop". Returns whether a stop string ended a choice its engine still runs."""
        running = e.finish_reason is None
        if c.out is not None:
            n = len(e.token_ids)
            for i, token in enumerate(e.token_ids):
                reason = c.out.add(token, e.finish_reason if i == n - 1 else None)
                if reason is not None:
                    e.token_ids, e.finish_reason = e.token_ids[:i + 1], reason
                    if e.logprobs is not None:
                        e.logprobs = e.logprobs[:i + 1]
                    break
            e.text = c.out.new_text(e.finish_reason is not None)
        c.generated += len(e.token_ids)
        e.completion_tokens = c.generated
        return running and e.finish_reason is not None

    def _left(self, e) -> None:
        """Account an event of a cancelled choice (under `lock`)."""
        rep, unqueued = self.leaving.get(e.id, (None, False))
        if rep is None:
            return
        if self.metrics is not None and unqueued and e.queue_s is not None:
            self.metrics.queued(rep, e.queue_s)
        if e.finish_reason is None:
            self.leaving[e.id] = (rep, unqueued and e.queue_s is None)
            return
        del self.leaving[e.id]
        if self.metrics is not None and e.preemptions is not None:
            self.metrics.preempted(rep, e.preemptions)

    def wait_for_handlers(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self.handlers and time.monotonic() < end:
            time.sleep(0.01)
