"""Run a function on a world of CPU (gloo) processes with the shardzoo grid built: the harness
every multi-process test uses.

    from distributed import run_distributed

    def _check(x):                     # module level, so it pickles by name
        from parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank() * x

    def test_something():
        assert run_distributed(_check, 4, 10, tp=2) == [0, 10, 0, 10]

`run_distributed(fn, world_size, *args, tp=1, pp=1, vpp=None, timeout=120)` spawns
`world_size` processes (forked from a fork server that imported torch and the project once;
each takes the parent's environment and working folder, as a spawned process would; one CPU
thread each, MASTER_ADDR=127.0.0.1 on a free port, RANK / WORLD_SIZE / LOCAL_RANK set), and
in each one:

1. `parallel_state.initialize_distributed("cpu")` (gloo) and
   `parallel_state.initialize_model_parallel(tp, pp, vpp, device="cpu")`;
2. `result = fn(*args)`;
3. `parallel_state.destroy_model_parallel(destroy_world=True)`;

and returns the results as a list indexed by global rank. Results travel through
`torch.save`, so anything `torch.save` accepts (tensors, dicts, lists, numbers, strings) comes
back, as CPU tensors; keep them small (they go through a pipe).

`fn` may tear down and rebuild the grid itself (`destroy_model_parallel()` then
`initialize_model_parallel(...)`); the harness only destroys what is left at the end.

Failures: the first worker exception is raised in the parent as `WorkerError` (a
RuntimeError) whose message holds the failing rank and its full traceback text; `.rank`,
`.traceback` and `.exception` (the original exception when it unpickles, else None) are kept
for assertions. A worker that dies without reporting raises `WorkerError` with its exit code.
Nothing hangs: after `timeout` seconds (for the whole world) every worker is killed and
`TimeoutError` names the ranks that had not answered. Remaining workers are always killed
before the parent raises.

Cost: the fork server's imports (torch, the project: about 5 s) are paid once per test
run; a worker then costs its fork, the import of `fn`'s test module and the grid's set-up
(a spawned worker imported torch again: 2-3 s each on 2 cores). Still batch many checks into
one world rather than starting a world per assertion.
"""
from __future__ import annotations

import io
import os
import pickle
import queue as queue_lib
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

__all__ = ["run_distributed", "WorkerError", "free_port", "batched_by_world"]


class WorkerError(RuntimeError):
    """A worker of `run_distributed` raised or died; the message carries its traceback."""

    def __init__(self, rank: int, traceback_text: str, exception: BaseException | None = None):
        self.rank = rank
        self.traceback = traceback_text
        self.exception = exception
        super().__init__(f"rank {rank} failed:\n{traceback_text}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, drawn at random below the
    kernel's ephemeral range: a port taken by `bind(0)` comes from that range, where every
    torchrun rendezvous, TCPStore client and gloo connection of a busy machine takes its
    ports too, so the moment between this check and the server's bind could lose it to
    them (seen: "address already in use" for a test server while other jobs ran)."""
    import random
    lo, _ = _ephemeral_range()
    pick = random.Random()  # not the tests' seeded global generator
    for _ in range(200):
        port = pick.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _pickled_exception(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - an exception that does not round-trip is sent as text
        return None


def _worker(rank, world_size, port, tp, pp, vpp, fn, args, results, environ, cwd):
    # A forked worker has the fork server's environment and folder, from when it started:
    # take the parent's, as a spawned process would.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        import parallel_state

        parallel_state.initialize_distributed("cpu")
        parallel_state.initialize_model_parallel(tp, pp, vpp, device="cpu")
        try:
            result = fn(*args)
        finally:
            parallel_state.destroy_model_parallel(destroy_world=True)
        results.put((rank, "ok", _dumps(result)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", (traceback.format_exc(), _pickled_exception(exc))))
    # Flush the result, then skip interpreter teardown (torch's exit handlers cost seconds
    # per process on a loaded 2-core machine); the process group is already destroyed.
    results.close()
    results.join_thread()
    os._exit(0)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


# Imported once by the fork server; every worker then starts from a copy of it (a fork) and
# not from a fresh interpreter that imports torch again.
_PRELOAD = ["torch", "torch.distributed", "pytest", "parallel_state", "layers", "models",
            "training.trainer", "inference"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(fn, world_size: int, *args, tp: int = 1, pp: int = 1,
                    vpp: int | None = None, timeout: float = 120) -> list:
    """Run `fn(*args)` on `world_size` gloo CPU processes with a (pp, dp, tp) grid built.

    Args:
        fn: a module-level function (it is pickled by name into the workers).
        world_size: number of processes; must be a multiple of tp * pp.
        *args: passed to `fn` (pickled; tensors are fine).
        tp, pp, vpp: tensor-, pipeline- and virtual-pipeline-parallel sizes of the grid.
        timeout: seconds for the whole world before every worker is killed.
    Returns:
        `[fn's return value on rank 0, ..., on rank world_size - 1]`.
    Raises:
        WorkerError: a worker raised (message: rank + traceback) or died without reporting.
        TimeoutError: not every worker answered within `timeout` seconds.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # children read it when they import torch
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker, daemon=True,
                            args=(rank, world_size, port, tp, pp, vpp, fn, args, results,
                                  dict(os.environ), os.getcwd()))
            p.start()
            procs.append(p)
    finally:
        if saved_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_omp

    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_lib.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None:
                        # Give a message sent just before exit a last chance to arrive.
                        try:
                            rank, status, payload = results.get(timeout=1.0)
                            break
                        except queue_lib.Empty:
                            raise WorkerError(r, f"worker exited with code {p.exitcode} "
                                                 f"without reporting a result") from None
                else:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(out))
                        raise TimeoutError(f"run_distributed({getattr(fn, '__name__', fn)}): "
                                           f"ranks {missing} did not finish within {timeout} s")
                    continue
            if status == "error":
                text, exc_bytes = payload
                exc = pickle.loads(exc_bytes) if exc_bytes is not None else None
                raise WorkerError(rank, text, exc)
            out[rank] = _loads(payload)
    finally:
        if len(out) < world_size:
            _kill(procs)
        else:
            for p in procs:
                p.join(timeout=10)
            _kill(procs)
        results.close()
    return [out[r] for r in range(world_size)]


def batched_by_world(cases: list, world_of, run_cases):
    """`get(case)` -> that case's result, where every case of the same world size runs in one
    world, on the first request for any of them (a module-scoped fixture returns `get`):
    starting a world (torch imported in every process) costs more than a tiny 5-step run.

    `world_of(case)` is a case's world size; `run_cases(world, same_world_cases)` runs them
    (typically one `run_distributed` call) and returns one result per case, in order.
    """
    done: dict[int, object] = {}  # index in `cases` -> result

    def get(case):
        if cases.index(case) not in done:
            same = [i for i, c in enumerate(cases) if world_of(c) == world_of(case)]
            results = run_cases(world_of(case), [cases[i] for i in same])
            done.update(zip(same, results, strict=True))
        return done[cases.index(case)]
    return get
