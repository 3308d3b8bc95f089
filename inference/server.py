"""`infer.py --serve`: an OpenAI-compatible HTTP server in its own process, the engine ranks
in lockstep in theirs.

- The API server process (inference/core_client.py, started by global rank 0) runs the HTTP
  layer (inference/api.py: FastAPI + uvicorn, the `serve` extra) and the `Frontend`
  (inference/frontend.py): it checks and parses requests, tokenises, routes each choice to
  the data-parallel replica with the least work still to do, detokenises, applies stop
  strings and streams the answers; `Lifetime.close` cancels whatever has not finished,
  whatever the transport did, and `fail_all` ends every open request with an error body.
- The control loop (`serve`, every rank) runs one iteration at a time: rank 0 reads the
  control messages the API process has sent (new requests / cancels / adapter commands /
  stop) and broadcasts them to the world, each replica runs one `Engine.step`, and the
  replicas' events (token ids, no text) and load are gathered to rank 0, which sends them to
  the API process. While nothing runs, rank 0 waits up to `IDLE_S` for a message, then
  broadcasts anyway: a heartbeat, so the others never sit in a collective past its timeout.
- SIGTERM / Ctrl-C (rank 0 forwards them; the API process ignores them itself): new requests
  get 503, in-flight ones run on for at most `shutdown_timeout` seconds (then end with a 503
  error body), then every rank leaves the loop and exits 0; a second signal ends what is
  left at once. torchrun kills its workers `--shutdown-timeout` seconds (default 30) after it
  forwards the signal: keep ours below it.
- A failed collective (a rank of some replica died): the API process answers every open
  request with a 503 error body and exits, and rank 0 raises; torchrun, given
  `--max-restarts`, then starts the whole service again. The API process dying stops every
  rank (rank 0 raises); rank 0 dying makes the API process answer every open request with a
  503 error body and exit.
"""
from __future__ import annotations

import signal
import time

import torch.distributed as dist

import parallel_state as ps

from .comm import broadcast_control, gather_to_rank0, replica_ranks
from .core_client import APIConfig, APIProcess, freeze_heap
from .engine import Event, Request


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
    Raises `RuntimeError` when a collective fails (a rank died), after the API process has
    answered every open request with an error body, when the API process dies, and on rank 0
    when the API process cannot start (its port is in use)."""
    rank = dist.get_rank()
    grid = ps.get_grid()
    dp, my_replica = grid.data_parallel_size, grid.dp_rank
    leader = replica_ranks()[0] == rank
    api = None
    signals = {"n": 0}
    engine.decode = None  # events carry ids; the API process detokenises them

    def on_signal(signum, frame):
        signals["n"] += 1
        if api is not None:  # rank 0 forwards the count at its next iteration
            api.signals = signals["n"]

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # other ranks: follow rank 0's stop
    if rank == 0:
        lora = getattr(engine, "lora", None)
        api = APIProcess.start(APIConfig(
            engine.limits, tokenizer, model_name, dp, host, port, api_key, shutdown_timeout,
            max_request_bytes, max_request_choices, sampling_defaults, sse_keep_alive_interval,
            reasoning_parser, tool_call_parser, enable_auto_tool_choice, allow_lora_updates,
            {n: a.path for n, a in lora.adapters.items()} if lora else {}))
        api.signals = signals["n"]
        log(f"API server process {api.proc.pid}: HTTP, tokenisation, streaming", flush=True)
        ep = grid.expert_model_parallel_size  # --enable-expert-parallel: experts over tp
        log(f"serving {model_name} on http://{host}:{port}/v1 (dp={dp}, "
            f"tp={grid.tensor_model_parallel_size}, pp={grid.pipeline_model_parallel_size}"
            f"{f', ep={ep}' if ep > 1 else ''})", flush=True)
    frozen = freeze_heap()
    if rank == 0:
        log(f"{frozen:,} objects of the start-up moved out of the garbage collector's "
            f"generations (gc.freeze)", flush=True)
    try:
        _loop(engine, api, my_replica, leader)
    except Exception as e:  # a collective failed: a rank of some replica is gone
        if api is not None:
            api.fail(f"a model replica failed ({type(e).__name__}: {str(e)[:200]}); the "
                     f"service restarts if torchrun has --max-restarts left; retry shortly")
            log(f"server failed: {e}", flush=True)
        raise RuntimeError(f"serving stopped: {e}") from e
    finally:
        if api is not None:
            api.close()
    if api is not None and api.lost:
        raise RuntimeError(f"the API server process exited (exit code {api.proc.exitcode}); "
                           f"every rank stopped")
    if rank == 0:
        log("server stopped", flush=True)


def _loop(engine, api: APIProcess | None, my_replica: int, leader: bool) -> None:
    """The control loop of every rank (see the module docstring)."""
    busy = False  # rank 0: some replica had work at the last iteration
    while True:
        msg = broadcast_control(api.collect(busy) if api is not None else None)
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
            if api is not None:
                api.lora_done(ticket, op, name, path, error)
        if not msg["stop"] and engine.has_work():
            events += engine.step()
        gathered = gather_to_rank0((events, engine.stats(), engine.has_work()) if leader
                                   else None)
        if api is not None:
            parts = [g for g in gathered if g is not None]
            busy = any(w for _, _, w in parts)
            api.deliver([e for evs, _, _ in parts for e in evs], [s for _, s, _ in parts])
        if msg["stop"]:
            break
