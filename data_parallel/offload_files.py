"""Scratch files of ZeRO-Infinity's NVMe offload (Rajbhandari et al. 2021, "ZeRO-Infinity",
sec. 5.1 and 6.2): a rank's offloaded float32 tensors kept as raw bytes in one file, read and
written region by region with `os.preadv` / `os.pwrite` on a small thread pool (both release
the GIL, so the transfers overlap the optimizer's arithmetic; docs/DECISIONS.md says why not
libaio or io_uring).

Scratch folders: each rank of each run writes into its own folder under `--offload-path`,
named `shardzoo-offload.rank<R>.<pid>.<start>.<token>.<host>` (`start`: the owning process's
start time from /proc, so a reused pid is told apart). The name is the owner record and
`os.mkdir` creates it atomically, so there is no moment at which a live run's folder looks
ownerless. At start-up every rank removes the folders of dead processes of its own host
(`remove_stale_scratch`); a folder of a live process, or of another host (a shared
filesystem: its liveness cannot be told from here), is never touched. A run removes its own
folder when it closes. The files hold no state a checkpoint needs from them: checkpoints read
the offloaded tensors through the optimizer like any other (training/checkpointing.py).

Errors name the path and what to do: `OffloadPathError` for a folder that cannot take the
files (missing and not creatable, not a folder, read-only, too little free space), raised by
`check_offload_path` before any model is built.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

PREFIX = "shardzoo-offload."
_NAME = re.compile(r"^shardzoo-offload\.rank(\d+)\.(\d+)\.(\d+|x)\.([0-9a-f]+)\.(.+)$")


class OffloadPathError(ValueError):
    """--offload-path cannot hold this run's offload files (the message names the path, the
    bytes needed and free, and the fix)."""


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def process_start(pid: int) -> str | None:
    """Start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or
    None if there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the name may hold spaces and ')'
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, start: str) -> bool:
    if start == "x":  # no /proc when it was made: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return process_start(pid) == start


def remove_stale_scratch(path: str) -> list[str]:
    """Remove the scratch folders under `path` whose owning process (this host) is gone;
    returns their names. Other hosts' folders and live processes' folders stay."""
    host, removed = socket.gethostname(), []
    try:
        entries = list(os.scandir(path))
    except OSError:  # missing, not a folder, unreadable: check_offload_path says which
        return []
    for e in entries:
        m = _NAME.match(e.name)
        if not m or m.group(5) != host or not e.is_dir(follow_symlinks=False):
            continue
        if _alive(int(m.group(2)), m.group(3)):
            continue
        shutil.rmtree(e.path, ignore_errors=True)  # another rank of this host may race us
        removed.append(e.name)
    return removed


def check_offload_path(path: str, need_bytes: int, *, what: str,
                       disk_usage=shutil.disk_usage) -> int:
    """Refuse `path` unless it is (or can be made) a writable folder with at least
    `need_bytes` free; returns the free bytes. `what` says what the bytes are for (in the
    message). `disk_usage` is `shutil.disk_usage` (tests inject a full disk).

    Raises:
        OffloadPathError: naming the path, the free space and the fix.
    """
    try:  # every rank of the host may race to create it
        os.makedirs(path, exist_ok=True)
    except FileExistsError:  # a file (or a dangling link) by that name: said below
        pass
    except OSError as e:
        raise OffloadPathError(f"--offload-path {path}: cannot create it ({e.strerror}); "
                               f"give a writable folder on a local NVMe drive") from None
    if not os.path.isdir(path):
        raise OffloadPathError(f"--offload-path {path} is not a folder; give a folder on a "
                               f"local NVMe drive")
    free = disk_usage(path).free
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadPathError(f"--offload-path {path} is not writable by this user "
                               f"({_gib(free)} free there); give a writable folder or fix "
                               f"its permissions")
    try:
        fd, probe = tempfile.mkstemp(prefix=".shardzoo-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OffloadPathError(f"--offload-path {path}: cannot write a file there "
                               f"({e.strerror}; {_gib(free)} free); give a writable "
                               f"folder") from None
    if free < need_bytes:
        raise OffloadPathError(
            f"--offload-path {path} has {_gib(free)} free but {what} need {_gib(need_bytes)} "
            f"({need_bytes:,} B); free space there, point --offload-path at a larger drive, "
            f"or offload less (--optimizer-offload-fraction, or --optimizer-offload-device "
            f"cpu)")
    return free


def make_scratch(path: str, rank: int) -> str:
    """Create this process's scratch folder under `path` (see the module docstring)."""
    start = process_start(os.getpid()) or "x"
    name = (f"{PREFIX}rank{rank}.{os.getpid()}.{start}.{secrets.token_hex(4)}."
            f"{socket.gethostname()}")
    folder = os.path.join(path, name)
    os.mkdir(folder, 0o700)
    return folder


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor `t`, shared (no copy). Through ctypes rather than
    `Tensor.numpy()`, which would mark the storage not resizable (ZeRO-3's gathered buffers
    are resized to 0 between uses); the caller keeps `t` alive while the view is used."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("swap buffers must be contiguous host tensors")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class SwapFile:
    """One raw file of `nbytes` in `folder`, reserved up front (`posix_fallocate`, so a disk
    too small fails here, not mid-step), read and written at byte offsets by a pool of
    `threads` threads. Plain bytes, native byte order: only this process reads them back.

    Raises:
        OffloadPathError: the file cannot be created or reserved (full disk, file-size
            limit), naming the path and the free space.
    """

    def __init__(self, folder: str, name: str, nbytes: int, threads: int = 2):
        self.path = os.path.join(folder, name)
        self.nbytes = nbytes
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _reserve(self.fd, nbytes)
        except OSError as e:
            os.close(self.fd)
            os.unlink(self.path)
            free = shutil.disk_usage(folder).free
            raise OffloadPathError(
                f"--offload-path: cannot reserve {_gib(nbytes)} for {self.path} "
                f"({e.strerror}; {_gib(free)} free); free space there or point "
                f"--offload-path at a larger drive") from None
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                       thread_name_prefix="offload-io")
        self._finalizer = weakref.finalize(self, _close, self.fd, self.path, self.pool)

    def read(self, offset: int, out: torch.Tensor, after: Future | None = None) -> Future:
        """Fill host tensor `out` from byte `offset` in the background (after `after`, a
        write into the same buffer, has finished)."""
        return self.pool.submit(self._read, offset, out, after)

    def write(self, offset: int, src: torch.Tensor) -> Future:
        """Write host tensor `src` at byte `offset` in the background."""
        return self.pool.submit(self._write, offset, src)

    def _read(self, offset: int, out: torch.Tensor, after: Future | None) -> None:
        if after is not None:
            after.result()
        view, done = _bytes_of(out), 0
        self._check(offset, len(view))
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read of {self.path} at byte {offset + done}")
            done += n

    def _write(self, offset: int, src: torch.Tensor) -> None:
        view, done = _bytes_of(src), 0
        self._check(offset, len(view))
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def _check(self, offset: int, n: int) -> None:
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + n}) outside {self.path} "
                             f"({self.nbytes} B)")

    def close(self) -> None:
        """Wait for pending transfers, close and delete the file."""
        self._finalizer()


def _reserve(fd: int, nbytes: int) -> None:
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", -1)):
            raise
        os.ftruncate(fd, nbytes)  # a filesystem without fallocate: a sparse file


def _close(fd: int, path: str, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_scratch(folder: str) -> None:
    """Remove this process's scratch folder (its files closed first)."""
    shutil.rmtree(folder, ignore_errors=True)
