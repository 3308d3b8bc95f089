"""`infer.py --serve`: an OpenAI-compatible HTTP server on global rank 0, every rank in
lockstep.

- The HTTP layer (inference/api.py: FastAPI + uvicorn, the `serve` extra) runs in a thread of
  rank 0: it checks and parses requests, routes each choice to the data-parallel replica with
  the least work still to do, and answers from the events the control loop delivers.
- `Frontend` (inference/frontend.py) owns a request's lifetime: `open` registers its choices,
  `Lifetime.close` cancels whatever has not finished, whatever the transport did (stream
  dropped, non-streaming client gone, handler error), and `fail_all` ends every open request
  with an error body (drain deadline passed, a replica failed).
- The control loop (`serve`, every rank) runs one iteration at a time: rank 0 broadcasts the
  new requests / cancels / stop flag to the world, each replica runs one `Engine.step`, and
  the replicas' events and load are gathered to rank 0. While nothing runs, rank 0 sends a
  heartbeat every `IDLE_S` so the others never sit in a collective past its timeout.
- SIGTERM / Ctrl-C: new requests get 503, in-flight ones run on for at most
  `shutdown_timeout` seconds (then end with a 503 error body), then every rank leaves the loop
  and exits 0; a second signal ends what is left at once. torchrun kills its workers
  `--shutdown-timeout` seconds (default 30) after it forwards the signal: keep ours below it.
- A failed collective (a rank of some replica died): rank 0 answers every open request with
  a 503 error body, lets the HTTP layer send them, and raises; torchrun, given
  `--max-restarts`, then starts the whole service again.
"""
from __future__ import annotations

import signal
import threading
import time

import torch.distributed as dist

import parallel_state as ps

from .comm import broadcast_control, gather_to_rank0, replica_ranks
from .engine import Event, Request
from .frontend import Failure, Frontend

FLUSH_S = 5.0  # how long rank 0 waits for the HTTP layer to send error bodies before exiting


def serve(engine, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log=print, *, shutdown_timeout: float = 20.0,
          max_request_bytes: int = 4 << 20, max_request_choices: int = 256,
          sampling_defaults: dict | None = None, sse_keep_alive_interval: float = 15.0,
          reasoning_parser: str | None = None, tool_call_parser: str | None = None,
          enable_auto_tool_choice: bool = False, allow_lora_updates: bool = False) -> None:
    """Run the server until SIGTERM / Ctrl-C (collective: every rank of the world calls it).

    `shutdown_timeout`: seconds in-flight requests may still run after the first signal.
    `max_request_bytes`: larger request bodies get 413 before they are read.
    `max_request_choices`: prompts x n of one request, at most.
    `sampling_defaults`: a request's defaults (protocol.sampling_defaults) instead of OpenAI's.
    `sse_keep_alive_interval`: seconds without bytes before a stream gets an SSE comment
    line (0: none).
    `reasoning_parser`: chat answers' thinking as `reasoning_content` (inference/reasoning.py).
    `tool_call_parser`, `enable_auto_tool_choice`: tool calls (inference/tool_calls.py).
    `allow_lora_updates`: POST /v1/load_lora_adapter and /v1/unload_lora_adapter work
    (--allow-runtime-lora-updating); every rank then loads / unloads in the same iteration.
    Raises `RuntimeError` when a collective fails (a rank died), after rank 0 has answered
    every open request with an error body."""
    rank = dist.get_rank()
    grid = ps.get_grid()
    dp, my_replica = grid.data_parallel_size, grid.dp_rank
    leader = replica_ranks()[0] == rank
    fe = server = thread = None
    signals = {"n": 0}

    def on_signal(signum, frame):
        signals["n"] += 1
        if fe is not None:
            fe.stop(min(2, signals["n"]))

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # other ranks: follow rank 0's stop
    if rank == 0:
        import uvicorn

        from .api import Limits, build_app
        from .metrics import ServerMetrics

        fe = Frontend(engine, tokenizer, model_name, api_key, dp,
                      ServerMetrics(model_name, dp), shutdown_timeout, sampling_defaults,
                      reasoning_parser, tool_call_parser, enable_auto_tool_choice,
                      allow_lora_updates)
        app = build_app(fe, Limits(max_request_bytes, max_request_choices),
                        sse_keep_alive_interval)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="http", daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the HTTP server could not start on {host}:{port} (is the "
                                   f"port in use? pass another --port)")
            time.sleep(0.05)
        ep = grid.expert_model_parallel_size  # --enable-expert-parallel: experts over tp
        log(f"serving {model_name} on http://{host}:{port}/v1 (dp={dp}, "
            f"tp={grid.tensor_model_parallel_size}, pp={grid.pipeline_model_parallel_size}"
            f"{f', ep={ep}' if ep > 1 else ''})", flush=True)
    try:
        _loop(engine, fe, my_replica, leader)
    except Exception as e:  # a collective failed: a rank of some replica is gone
        if fe is not None:
            fe.failed = (f"a model replica failed ({type(e).__name__}: {str(e)[:200]}); the "
                         f"service restarts if torchrun has --max-restarts left; retry shortly")
            fe.fail_all(Failure(503, fe.failed))
            fe.wait_for_handlers(FLUSH_S)
            log(f"server failed: {e}", flush=True)
        raise RuntimeError(f"serving stopped: {e}") from e
    finally:
        if server is not None:
            fe.wait_for_handlers(FLUSH_S)
            server.should_exit = True
            thread.join(timeout=10)
    if rank == 0:
        log("server stopped", flush=True)


def _loop(engine, fe: Frontend | None, my_replica: int, leader: bool) -> None:
    """The control loop of every rank (see the module docstring)."""
    while True:
        msg = broadcast_control(fe.collect() if fe is not None else None)
        events = []
        for rep, rid, prompt, params, lora in msg["add"]:
            if rep == my_replica:
                engine.add(Request(rid, prompt, params, lora_name=lora))
        for rid in msg["cancel"]:
            r = engine.cancel(rid)
            if r is not None:  # not yet admitted: its wait so far is its queue time
                waited = None if r.output else r.queue_s if r.queue_s is not None else \
                    time.monotonic() - r.arrival
                events.append(Event(r.id, [], "", "cancelled", len(r.prompt), len(r.output),
                                    queue_s=waited, preemptions=r.preemptions))
        for ticket, op, name, path in msg["lora"]:  # after the cancels: their users are gone
            error = None
            try:
                engine.load_lora(name, path) if op == "load" else engine.unload_lora(name)
            except ValueError as e:  # inference.lora.LoRAError: the same on every rank
                error = (getattr(e, "status", 400), str(e))
            if fe is not None:
                fe.lora_done(ticket, op, name, path, error)
        if not msg["stop"] and engine.has_work():
            events += engine.step()
        gathered = gather_to_rank0((events, engine.stats()) if leader else None)
        if fe is not None:
            parts = [g for g in gathered if g is not None]
            fe.deliver([e for evs, _ in parts for e in evs], [s for _, s in parts])
        if msg["stop"]:
            break
