"""The hang doctor's recorder: a per-rank ring of the last collectives and p2p calls, dumped
with every Python thread's stack when something goes wrong.

`start_trace(log_dir)` registers a `CollectiveTrace` consumer with parallel_state.collectives.
Each observed call becomes one fixed-size text line in a memory-mapped ring file
`<log_dir>/hang/rank-K.ring` (the kernel keeps it even if the process is SIGKILLed or aborts;
the calling thread only stores a tuple, the watchdog thread writes the lines every FLUSH_S,
so a call blocked longer than that is always in the file):

    <status><end time>  <index>  <start time>  <thread>  <group>  <seq>  <signature>  <sites>

(tab-separated; status `R` in flight, `D` done, `E` raised; times are Unix seconds; `seq` is
the call's number on its group; sites innermost first, joined by " < "). A JSON header at the
start of the file says who wrote it (rank, world size, pid, host, operation timeout, state)
and names the groups seen (label and global ranks).

Dumps: on a timeout or any error raised by a collective, on SIGUSR1, on SIGTERM (torchrun
stops the other workers so when one fails; signals marked with `handle_gracefully`, as
training's --exit-signal-handler does, neither dump nor exit), and when an exception escapes
`dump_on_error`, the rank writes `<log_dir>/hang/rank-K.txt`: why, the error, the ring oldest
first, and all Python thread stacks (faulthandler). A watchdog thread does the signal dumps
(the C-level signal handler wakes it through `signal.set_wakeup_fd`), so they work while the
main thread is blocked inside a C++ collective, where Python signal handlers cannot run; it
also dumps if a call stays in flight past the timeout without the backend raising. Fatal signals
(SIGSEGV, SIGABRT: gloo aborts when message sizes disagree) write the stacks to
`rank-K.crash` through faulthandler. After a timeout or error dump, rank 0 waits briefly for
the other ranks' dumps and prints the analysis of `hang_doctor.trace_report` (also written
to `hang/report.txt`); `python tools/hang_report.py <log_dir>/hang` prints it at any time.

`stop_trace(remove=True)` (after a final barrier, when every rank is known to be done)
removes the ring and crash files; without it (a process that ends otherwise) the header
state becomes "exited" at interpreter exit and the files stay as evidence.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import faulthandler
import json
import mmap
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

from .. import collectives, grid

HANG_DIR = "hang"
FLUSH_S = 0.2  # the watchdog writes new calls to the ring file this often
HEADER_BYTES = 64 * 1024
SLOT_BYTES = 512
_END_FIELD = 19  # status char + 18-char end time, rewritten in place when a call ends
_RUNNING = "R" + "-".rjust(_END_FIELD - 1)
_PAD = b" " * (SLOT_BYTES - 1) + b"\n"  # a slot's tail after its line

_active: "CollectiveTrace | None" = None


def hang_dir(log_dir: str) -> str:
    return os.path.join(log_dir, HANG_DIR)


_MAIN = threading.main_thread()


def _thread_name() -> str:
    return "MainThread" if threading.get_ident() == _MAIN.ident else \
        _clean(threading.current_thread().name)


def _clean(text: str) -> str:
    return text.replace("\t", " ").replace("\n", " ")


def run_id() -> str:
    """Equal on the ranks of one launch, different between launches and torchrun restarts."""
    env = os.environ
    return ":".join(env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                             "MASTER_ADDR", "MASTER_PORT"))


def is_timeout(error: BaseException) -> bool:
    """True for the timeout errors of gloo ("Timed out waiting 3000ms ...") and NCCL."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


class CollectiveTrace(collectives.Consumer):
    """Records every observed call in the ring file and dumps on errors and signals.

    Args:
        directory: where rank-K.ring / .txt / .crash go (created; this rank's old files are
            removed, and rank 0 removes files of ranks beyond the world size).
        size: calls kept in the ring (oldest overwritten).
        rank, world_size: of this process (default: torch.distributed's).
        timeout: the operation timeout (default: collectives.get_timeout()), for the
            watchdog and the report.
    """

    needs_site = True

    def __init__(self, directory: str, size: int = 2000, rank: int | None = None,
                 world_size: int | None = None, timeout: timedelta | None = None):
        import torch.distributed as dist

        if size < 1:
            raise ValueError(f"the collective trace needs at least 1 slot, got {size}")
        self.directory, self.size = directory, size
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        timeout = timeout or collectives.get_timeout()
        self.timeout_s = timeout.total_seconds() if timeout else None
        os.makedirs(directory, exist_ok=True)
        self.ring_path = os.path.join(directory, f"rank-{self.rank}.ring")
        self.text_path = os.path.join(directory, f"rank-{self.rank}.txt")
        self.crash_path = os.path.join(directory, f"rank-{self.rank}.crash")
        self._remove_stale()
        self.header = {"format": 1, "rank": self.rank, "world_size": self.world_size,
                       "pid": os.getpid(), "host": socket.gethostname(), "run": run_id(),
                       "started": time.time(), "timeout_s": self.timeout_s, "slots": size,
                       "slot_bytes": SLOT_BYTES, "state": "running", "groups": {}}
        with open(self.ring_path, "wb") as f:
            f.truncate(HEADER_BYTES + size * SLOT_BYTES)
        self._file = open(self.ring_path, "r+b")
        self._mm = mmap.mmap(self._file.fileno(), 0)
        self._lock = threading.RLock()  # reentrant: a signal handler may run inside start()
        self._dump_lock = threading.RLock()
        self._closed = False
        self._write_header()
        self._records: list = [None] * size  # slot -> the call's tuple (see start)
        self._latest = self._flushed = 0  # newest call index stored / written to the file
        self._ended: collections.deque = collections.deque()  # (index, status, end time)
        self._flush_lock = threading.RLock()
        self.in_flight: dict[int, collectives.Call] = {}
        self.reasons: list[str] = []
        self.errors: list[BaseException] = []  # errors dumped so far
        self.reported = False
        self.finding: str | None = None  # the report's first finding, once rank 0 made it
        self._report_done = threading.Event()
        self._hurry = False  # SIGTERM: stop waiting for the other ranks' dumps
        self._stalled: set[int] = set()
        self._crash_file = None
        self._watchdog: threading.Thread | None = None
        self._wakeup = None
        self._old_handlers: dict = {}
        self._wakeup_is_ours = False

    def _remove_stale(self) -> None:
        for path in (self.ring_path, self.text_path, self.crash_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        if self.rank == 0:
            for name in os.listdir(self.directory):
                stem, _, ext = name.partition(".")
                if stem.startswith("rank-") and stem[5:].isdigit() and \
                        int(stem[5:]) >= self.world_size or name == "report.txt":
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.directory, name))

    # ------------------------------------------------------------------ ring
    def _write_header(self) -> None:
        self.header["updated"] = time.time()
        data = json.dumps(self.header).encode()
        if len(data) > HEADER_BYTES - 1:  # huge worlds: keep the labels, drop member lists
            slim = dict(self.header, groups={k: dict(v, ranks=None)
                                             for k, v in self.header["groups"].items()})
            data = json.dumps(slim).encode()[:HEADER_BYTES - 1]
        with self._lock:
            if not self._closed:
                self._mm[:HEADER_BYTES] = data.ljust(HEADER_BYTES - 1) + b"\n"

    def start(self, call: collectives.Call) -> None:
        # The hot path only stores a tuple; the watchdog thread formats and writes it to the
        # file within FLUSH_S (and every dump flushes first).
        if call.group_name not in self.header["groups"]:
            self.header["groups"][call.group_name] = {"label": call.label,
                                                      "ranks": list(call.ranks)}
            self._write_header()
        i = call.index
        self._records[(i - 1) % self.size] = (i, call.t_start, _thread_name(), call.group_name,
                                              call.seq, call.key(), call.site)
        self._latest = i
        self.in_flight[i] = call

    def end(self, call: collectives.Call, error: BaseException | None) -> None:
        if self.in_flight.pop(call.index, None) is None:
            return  # started before this trace
        self._ended.append((call.index, "D" if error is None else "E", call.t_end))
        if error is not None and not isinstance(error, KeyboardInterrupt):
            from .debug_collectives import CollectiveMismatchError

            kind = "timeout" if is_timeout(error) else "collective error"
            self.dump(f"{kind} in {call.op} #{call.seq} of group {call.label}: "
                      f"{type(error).__name__}: {_clean(str(error))[:500]}", error)
            if not isinstance(error, CollectiveMismatchError):  # that message is the diagnosis
                self.report_if_rank0()

    def flush(self) -> None:
        """Write the calls started and ended since the last flush into the ring file."""
        with self._flush_lock, self._lock:
            if self._closed:
                return
            latest, mm = self._latest, self._mm
            for i in range(max(self._flushed + 1, latest - self.size + 1), latest + 1):
                rec = self._records[(i - 1) % self.size]
                if rec is None or rec[0] != i:
                    continue
                index, t_start, thread, group, seq, key, site = rec
                data = (f"{_RUNNING}\t{index}\t{t_start:.6f}\t{thread}\t{group}\t{seq}\t"
                        f"{collectives.format_signature(key)}\t{' < '.join(site)}"
                        ).encode()[:SLOT_BYTES - 1]
                off = HEADER_BYTES + (i - 1) % self.size * SLOT_BYTES
                mm[off: off + SLOT_BYTES] = data + _PAD[len(data):]
            self._flushed = latest
            later = []
            while self._ended:
                index, status, t_end = self._ended.popleft()
                if index > latest:  # started after this flush began: next time
                    later.append((index, status, t_end))
                    continue
                rec = self._records[(index - 1) % self.size]
                if rec is not None and rec[0] == index:
                    off = HEADER_BYTES + (index - 1) % self.size * SLOT_BYTES
                    mm[off: off + _END_FIELD] = f"{status}{t_end:18.6f}".encode()
            self._ended.extendleft(reversed(later))

    def lines(self) -> list[str]:
        """The ring's lines, oldest first (after a flush)."""
        self.flush()
        with self._lock:
            if self._closed:
                return []
            raw = bytes(self._mm[HEADER_BYTES:])
        rows = []
        for i in range(self.size):
            line = raw[i * SLOT_BYTES:(i + 1) * SLOT_BYTES].decode(errors="replace").rstrip()
            parts = line.split("\t", 2)
            if len(parts) > 2 and parts[1].isdigit():
                rows.append((int(parts[1]), line))
        return [line for _, line in sorted(rows)]

    # ------------------------------------------------------------------ dumps
    def dump(self, reason: str, error: BaseException | None = None) -> str:
        """Write rank-K.txt (atomically): reasons so far, the error, the ring, all stacks."""
        with self._dump_lock:
            self.reasons.append(f"{time.time():.6f} {reason}")
            if error is not None:
                self.errors.append(error)
            self.header["state"] = "dumped"
            self._write_header()
            tmp = f"{self.text_path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(f"# shardzoo collective trace: rank {self.rank} of {self.world_size}, "
                        f"pid {os.getpid()} on {socket.gethostname()}\n")
                f.write("header " + json.dumps(self.header) + "\n")
                f.write("== reasons\n" + "\n".join(self.reasons) + "\n")
                if error is not None:
                    f.write("== error\n" + "".join(traceback.format_exception(error)))
                f.write("== calls (oldest first; R in flight, D done, E raised)\n")
                f.write("\n".join(self.lines()) + "\n")
                f.write("== python stacks (faulthandler, most recent call first)\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            os.replace(tmp, self.text_path)
            return self.text_path

    def report_if_rank0(self, wait: float | None = None) -> None:
        """On rank 0 (once, with other ranks): wait up to `wait` s (default: the timeout,
        at most 10 s) for every rank's dump, then print the analysis to stderr and write it
        to hang/report.txt."""
        if self.rank != 0 or self.world_size == 1:
            return
        if self.reported:  # running in another thread: let it finish first
            self._hurry = True
            self._report_done.wait(timeout=5.0)
            return
        self.reported = True
        from . import trace_report

        try:
            wait = min(10.0, self.timeout_s or 10.0) if wait is None else wait
            self._wait_for_dumps(time.time() + wait)
            try:
                text = trace_report.report(self.directory)
            except Exception as e:  # noqa: BLE001 - a broken analysis must not hide the hang
                text = (f"hang report failed ({type(e).__name__}: {e}); run "
                        f"python tools/hang_report.py {self.directory}")
            path = os.path.join(self.directory, "report.txt")
            with contextlib.suppress(OSError):
                with open(path, "w") as f:
                    f.write(text + "\n")
            self.finding = first_finding(text)
            # framed: the ranks' tracebacks and torchrun's summary surround it
            print(f"{'=' * 100}\n{text}\n{'=' * 100}\n(end of the hang report; also in {path})",
                  file=sys.stderr, flush=True)
        finally:
            self._report_done.set()

    def pointer(self, error: BaseException) -> str:
        """One line for the end of this rank's traceback and for torchrun's failure summary
        (the last lines on screen): the report's first finding and where the report is.
        Another rank than 0 waits up to 5 s for rank 0's report.txt (its dump, written
        before, is what rank 0 waits for); without it, the line says where to look."""
        path = os.path.join(self.directory, "report.txt")
        again = f"python tools/hang_report.py {self.directory} prints it again"
        deadline = time.time() + min(5.0, self.timeout_s or 5.0)
        while self.finding is None and self.rank != 0 and time.time() < deadline:
            with contextlib.suppress(OSError):
                if os.path.getmtime(path) >= self.header["started"]:
                    with open(path) as f:
                        self.finding = first_finding(f.read()) or ""
            time.sleep(0.1)
        if self.finding:
            return (f"shardzoo hang doctor: {self.finding}. The report (rank 0 prints it) is in "
                    f"{path} ({again})")
        return (f"shardzoo hang doctor: rank {self.rank} ended with {type(error).__name__}; the "
                f"hang report is in {path} (rank 0 prints it; {again})")

    def _wait_for_dumps(self, deadline: float) -> None:
        """Until `deadline`, wait for each other rank's dump, unless its process is gone."""
        from .trace_report import alive, read_header

        pending, headers = set(range(1, self.world_size)), {}
        while pending and time.time() < deadline and not self._hurry:
            for r in list(pending):
                if os.path.exists(os.path.join(self.directory, f"rank-{r}.txt")):
                    pending.discard(r)
                    continue
                if headers.get(r) is None:
                    headers[r] = read_header(os.path.join(self.directory, f"rank-{r}.ring"))
                if headers[r] is not None and alive(headers[r]) is False:
                    pending.discard(r)
            time.sleep(0.1)

    # ------------------------------------------------------------------ signals, watchdog
    def start_watchdog(self) -> None:
        """The thread that writes the ring file, dumps on signals and on stuck calls."""
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        self._wakeup = (r, w)
        self._watchdog = threading.Thread(target=self._watch, name="shardzoo-hang-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def install_handlers(self) -> None:
        """faulthandler for fatal signals; SIGUSR1/SIGTERM dumps (from the main thread only)
        through the watchdog, which the C-level signal handler wakes."""
        self._crash_file = open(self.crash_path, "w")
        self._faulthandler_was_enabled = faulthandler.is_enabled()
        faulthandler.enable(file=self._crash_file, all_threads=True)
        if threading.current_thread() is threading.main_thread():
            old = signal.set_wakeup_fd(self._wakeup[1].fileno(), warn_on_full_buffer=False)
            if old != -1:  # someone else's (an event loop): keep theirs, use plain handlers
                signal.set_wakeup_fd(old)
            self._wakeup_is_ours = old == -1
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                current = signal.getsignal(sig)
                if sig == signal.SIGUSR1 or current in (signal.SIG_DFL, None):
                    self._old_handlers[sig] = current
                    signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # Runs in the main thread between bytecodes; when the wakeup fd is ours the watchdog
        # thread has already been woken by the C-level handler and does the work.
        if not self._wakeup_is_ours:
            self._handle_signal(signum)

    def _handle_signal(self, signum: int) -> None:
        if signum in _graceful:  # the training loop stops cleanly on it (no dump, no exit)
            return
        if signum == signal.SIGUSR1:
            self.dump("SIGUSR1: dump on request (the run continues)")
        elif signum == signal.SIGTERM:
            self.dump("SIGTERM: terminated (torchrun stops every worker when one fails)")
            self.report_if_rank0(wait=2.0)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)

    def _watch(self) -> None:
        r = self._wakeup[0]
        while not self._closed:
            ready, _, _ = select.select([r], [], [], FLUSH_S)
            if self._closed:
                return
            if ready:
                with contextlib.suppress(BlockingIOError, OSError):
                    for signum in r.recv(64):
                        if signum in (signal.SIGUSR1, signal.SIGTERM):
                            self._handle_signal(signum)
            self.flush()
            self.check_stalls()

    def check_stalls(self, now: float | None = None) -> list[int]:
        """Dump (once per call) for calls in flight longer than the timeout plus a grace of
        max(5 s, 10%): the backend should have raised by then (gloo does; a backend or
        state that does not, still leaves a dump). Returns the indices dumped for."""
        if not self.timeout_s:
            return []
        now = time.time() if now is None else now
        limit = self.timeout_s + max(5.0, 0.1 * self.timeout_s)
        stalled = [c for i, c in list(self.in_flight.items())
                   if now - c.t_start > limit and i not in self._stalled]
        for call in stalled:
            self._stalled.add(call.index)
            self.dump(f"watchdog: {call.op} #{call.seq} of group {call.label} in flight for "
                      f"{now - call.t_start:.1f} s (timeout {self.timeout_s:g} s)")
            self.report_if_rank0()
        return [c.index for c in stalled]

    # ------------------------------------------------------------------ teardown
    def close(self, remove: bool, state: str = "finished") -> None:
        if self._closed:
            return
        self.flush()
        with self._lock:
            self.header["state"] = state
            self._write_header()
            self._closed = True
            self._mm.flush()
            self._mm.close()
            self._file.close()
        if self._wakeup is not None:
            with contextlib.suppress(OSError):
                self._wakeup[1].send(b"\0")  # wake the watchdog so it sees _closed
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            if self._wakeup_is_ours:
                signal.set_wakeup_fd(-1)
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2)
        if self._wakeup is not None:
            for s in self._wakeup:
                s.close()
        if self._crash_file is not None:
            faulthandler.disable()
            if self._faulthandler_was_enabled:
                faulthandler.enable(file=sys.stderr, all_threads=True)
            self._crash_file.close()
        if remove:
            for path in (self.ring_path, self.crash_path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)  # only if empty (no dumps were asked for)


# ---------------------------------------------------------------------------- module API
_graceful: set[int] = set()


def handle_gracefully(signums=()) -> None:
    """Signals `signums` belong to a clean stop (training's --exit-signal-handler: finish
    the step, save, exit 0): the tracer neither dumps nor exits on them, whoever handles
    them in Python chains to the tracer's handler. `handle_gracefully()` gives them back."""
    _graceful.clear()
    _graceful.update(int(s) for s in signums)


def start_trace(log_dir: str, size: int = 2000, handlers: bool = True) -> CollectiveTrace:
    """Trace every collective of this process into `<log_dir>/hang/`; returns the tracer.

    Call on every rank after torch.distributed is initialized. `handlers`: also install
    faulthandler and the SIGUSR1/SIGTERM dumps (signals only from the main thread). Raises
    RuntimeError if a trace is already running.
    """
    global _active
    if _active is not None:
        raise RuntimeError("a collective trace is already running; call stop_trace() first")
    tracer = CollectiveTrace(hang_dir(log_dir), size)
    tracer.start_watchdog()
    if handlers:
        tracer.install_handlers()
    collectives.add_consumer(tracer)
    _active = tracer
    atexit.register(_at_exit, tracer)
    return tracer


def stop_trace(remove: bool = True) -> None:
    """Stop tracing; `remove`: delete this rank's ring and crash files (the run is known to
    have ended well on every rank), else keep them with the state "stopped". Dumps
    (rank-K.txt) are kept."""
    global _active
    tracer, _active = _active, None
    if tracer is None:
        return
    collectives.remove_consumer(tracer)
    tracer.close(remove=remove, state="finished" if remove else "stopped")
    atexit.unregister(_at_exit)


def active() -> CollectiveTrace | None:
    return _active


def _at_exit(tracer: CollectiveTrace) -> None:
    if _active is tracer:
        tracer.close(remove=False, state="exited")


def first_finding(report: str) -> str | None:
    """The first sentence of a report's first finding ("1. Ranks of group world/dp [0, 1]
    disagree at its collective #4: different collectives. rank 0 calls ..."), or None."""
    findings = [p for p in report.split("\n\n")[1:] if p[:1].isdigit()]
    if not findings:
        return None
    body = re.sub(r"^\d+\.( \([^)]*\))? ", "", findings[0])  # "1. (the first point ...) "
    return body.split(". ", 1)[0].rstrip(".")


@contextlib.contextmanager
def dump_on_error(ignore: tuple[type[BaseException], ...] = ()):
    """Dump the running trace if an exception (other than `ignore`) escapes the block, and
    let rank 0 report; re-raises."""
    try:
        yield
    except BaseException as e:
        tracer = _active
        if tracer is not None and not isinstance(e, ignore):
            if any(e is seen for seen in tracer.errors):  # a collective's error, dumped already
                tracer.dump("exit: the error above ended the process (full traceback below)", e)
            else:
                tracer.dump(f"exception: {type(e).__name__}: {_clean(str(e))[:500]}", e)
            tracer.report_if_rank0()
            pointer = tracer.pointer(e)
            if hasattr(e, "add_note"):  # Python 3.11+: printed as the traceback's last line
                e.add_note(pointer)
            grid.report_error(pointer)  # torchrun's failure summary shows it (root cause)
        raise
