"""Shared-memory collectives for the CPU ranks of one host (the tensor-parallel group).

gloo moves every collective over TCP sockets: on one host an all-reduce costs about 0.8 ms for
a single element and 3 ms for 512 KB (measured on the 2-core development machine, one thread
per rank), and a tensor-parallel layer needs two in forward and two in backward. Ranks that
share a host can instead exchange through one shared memory segment, as CPU serving engines do
(vLLM's CPU worker, DeepSpeed's shm comm): each rank copies its tensor into its own slot, marks
it arrived, waits until every rank has arrived, and reads the others' slots.

`Channel` holds, per group, a segment with two buffers (collectives alternate between them, so
a rank may write the next collective while a slower rank still reads this one) of one
`slot_bytes` slot per rank, and per rank two counters, `arrived` and `done`, each on its own
cache line. Collective k uses buffer k % 2: a rank waits until every rank is done with
collective k - 2 (the last user of that buffer), writes its slot, sets `arrived = k`, waits
for every `arrived >= k`, reads, and sets `done = k`. Tensors larger than a slot go through
in pieces. A reduction sums the slots in rank order on every rank, so every rank gets the
same bits (gloo's ring order differs by chunk; with two ranks both are the same sum).

Ordering: the counters are plain stores and loads, which x86-64 keeps in program order
(stores are not reordered with other stores, loads not with other loads), so a rank that
sees `arrived = k` also sees the data written before it. Channels are therefore only made on
x86-64 Linux (with /dev/shm); elsewhere, or across hosts, or with SHARDZOO_SHM_COLLECTIVES=0
set, the group stays on gloo.

Set-up (`shm_setup.attach`, a collective over the group's gloo link, so it lives above the
collectives layer while this module, which that layer calls, lives below it): rank 0 creates
the segment with all its pages reserved (a segment that does not fit /dev/shm is refused
there, with a warning, instead of killing a rank with SIGBUS later) and a random token in it;
a rank that does not find that file and token (its own /dev/shm, as in containers sharing a
host name) makes the whole group stay on gloo; the channel is then `register`ed for the group,
and parallel_state.collectives runs the group's CPU collectives over it. Each
rank publishes, with every piece, the collective's op, dtype and element count: ranks that
disagree all raise a `RuntimeError` naming what each called, instead of reading each other's
bytes as something else. The collectives run under `torch.no_grad()`, as torch's do.

A waiting rank spins, yielding its core (`sched_yield`) so that more ranks than cores still
progress. It fails instead of hanging, with a `RuntimeError` (as gloo does), when a peer
process exits (naming the rank) or when the operation timeout of the process groups passes.
"""
from __future__ import annotations

import os
import platform
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

ENV_SWITCH = "SHARDZOO_SHM_COLLECTIVES"  # "0": keep every group on gloo
SLOT_BYTES = 4 << 20  # per rank and buffer; larger tensors go through in pieces
SPINS = 64  # yields (about 1 us each) before a waiting rank starts to nap
NAP_S = 2e-5  # a nap (the kernel's timer slack makes it 50-80 us)
_LINE = 8  # int64 words per counter (64 bytes: one cache line each)
_ARRIVED, _DONE = 0, 1
_REDUCE = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum,
           dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.PRODUCT: torch.mul}

# What a rank publishes with each piece (word 2 + k % 2 of its `arrived` line) so that ranks calling
# different collectives, sizes or dtypes get an error instead of reading each other's bytes
# as something else: op * 2**56 + dtype index * 2**48 + the collective's element count.
_OPS = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3}
_DTYPES = {dt: i + 1 for i, dt in enumerate((
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128))}
_KEY_OP, _KEY_DTYPE = 1 << 56, 1 << 48

SHM_DIR = "/dev/shm"  # where segments are made (each is unlinked once every rank mapped it)
_channels: dict[str, "Channel"] = {}  # torch group name -> channel


class _Done:
    """The Work of a collective that already finished (shared-memory ops run synchronously)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


def available() -> bool:
    """Whether this process may use shared-memory channels at all (see the module docstring)."""
    return (os.environ.get(ENV_SWITCH, "1") != "0" and platform.system() == "Linux"
            and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm"))


def segment_bytes(size: int, slot_bytes: int) -> int:
    """Bytes of the segment of a `size`-rank channel: the counters, then two buffers."""
    return 2 * size * _LINE * 8 + 2 * size * slot_bytes


def create_segment(path: str, nbytes: int) -> bool:
    """Create the segment file at `path` with all its `nbytes` reserved; False (and a
    warning, no file) when the file system lacks the space. A tmpfs file is sparse: without
    the reservation a segment larger than the free space of /dev/shm (Docker's default is
    64 MB; a tp8 channel takes 64 MB) fails with SIGBUS, killing the rank, when a
    collective first touches a page past it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.unlink(path)
        warnings.warn(f"no shared-memory channel ({nbytes >> 20} MB in {os.path.dirname(path)}: "
                      f"{e.strerror}); the group stays on gloo. Give /dev/shm more space "
                      f"(docker run --shm-size) or set {ENV_SWITCH}=0 to silence this")
        return False
    finally:
        os.close(fd)
    return True


def register(group, channel: "Channel") -> None:
    """Make `channel` the one that runs `group`'s CPU collectives (`shm_setup.attach`)."""
    _channels[group.group_name] = channel


def channel(group) -> "Channel | None":
    """The channel of `group` (None: it has none, or `group` is torch's NON_GROUP_MEMBER,
    which torch's collectives take as a no-op on a rank outside the group)."""
    return _channels.get(getattr(group, "group_name", None)) if _channels else None


def detach_all() -> None:
    """Forget every channel (the process groups are being destroyed)."""
    _channels.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class Channel:
    """A shared-memory segment for the `size` ranks of one group (see the module docstring);
    `rank` is this process's rank in the group, `global_ranks` name peers in errors."""

    def __init__(self, path: str, size: int, rank: int, slot_bytes: int,
                 timeout: timedelta | None, global_ranks: list[int]):
        self.size, self.rank, self.global_ranks = size, rank, global_ranks
        self.slot_bytes = slot_bytes
        self.timeout = (timeout or timedelta(minutes=30)).total_seconds()
        counters = 2 * size * _LINE * 8
        mem = torch.from_file(path, shared=True, size=segment_bytes(size, slot_bytes),
                              dtype=torch.uint8)
        self._counters = mem[:counters].view(torch.int64).numpy().reshape(2, size, _LINE)
        self._slots = mem[counters:].view(2, size, slot_bytes)
        self._counters[_ARRIVED, rank, 1] = os.getpid()  # for the dead-peer check
        self._pids: list[int | None] = []  # peers' pids, once every rank wrote its own
        self._others = [j for j in range(size) if j != rank]
        self._views: dict = {}
        self.seq = 0  # collectives done on this channel

    @property
    def token(self) -> int:
        """Rank 0's set-up token (word 1 of its `done` line, unused by the protocol): a rank
        that reads back the token rank 0 wrote maps rank 0's segment (`shm_setup.attach`)."""
        return int(self._counters[_DONE, 0, 1])

    @token.setter
    def token(self, value: int) -> None:
        self._counters[_DONE, 0, 1] = value

    def find_peers(self) -> None:
        """Read the peers' pids (after every rank wrote its own); a pid this process cannot
        see (another pid namespace) is not checked for liveness."""
        pids = [int(p) for p in self._counters[_ARRIVED, :, 1]]
        self._pids = [p if p > 0 and _alive(p) else None for p in pids]  # kill(0) is our group

    # ------------------------------------------------------------------ the protocol
    def _round(self, data: torch.Tensor, read, key: int) -> None:
        """One collective step: publish `data` (at most a slot), then `read(slots)` with
        every rank's published tensor (same dtype and length, rank order). `key` (see
        `_key`) must be the same on every rank, else every rank raises `RuntimeError`."""
        k = self.seq = self.seq + 1
        if k > 2:
            self._wait(_DONE, k - 2)
        slots = self._typed(data.dtype)[k % 2]
        count = data.numel()
        mine = slots[self.rank][:count]
        mine.copy_(data.view(-1) if data.is_contiguous() else data.reshape(-1))
        arrived, word = self._counters[_ARRIVED], 2 + k % 2  # a key word per buffer, as
        arrived[self.rank, word] = key  # the slots (a rank at k + 1 must not overwrite it)
        arrived[self.rank, 0] = k  # after the key: whoever sees `arrived` sees the key
        self._wait(_ARRIVED, k)
        try:
            if (arrived[:, word] != key).any():
                self._mismatch([int(x) for x in arrived[:, word]])
            read([mine if j == self.rank else s[:count] for j, s in enumerate(slots)])
        finally:  # also after an error: the peers' next collectives need not wait for us
            self._counters[_DONE, self.rank, 0] = k

    @staticmethod
    def _key(op: str, count: int, dtype) -> int:
        return _OPS[op] * _KEY_OP + _DTYPES.get(dtype, 0) * _KEY_DTYPE + count

    def _mismatch(self, keys: list[int]) -> None:
        ops, dtypes = {v: k for k, v in _OPS.items()}, {v: k for k, v in _DTYPES.items()}

        def desc(key):
            op, rest = divmod(key, _KEY_OP)
            dt, count = divmod(rest, _KEY_DTYPE)
            return (f"{ops.get(op, '?')} of {count} "
                    f"{str(dtypes.get(dt, 'other dtype')).removeprefix('torch.')} elements")
        raise RuntimeError(
            f"shared-memory collective {self.seq} does not match across its ranks: "
            + "; ".join(f"rank {g} calls {desc(key)}" for g, key in zip(self.global_ranks, keys))
            + ". Every rank of the group must call the same collectives with the same shapes "
              "and dtypes, in the same order (--debug-collectives names the call sites)")

    def _typed(self, dtype) -> list[list[torch.Tensor]]:
        """[buffer][rank] slots viewed as `dtype` (cached: views cost microseconds each)."""
        views = self._views.get(dtype)
        if views is None:
            views = self._views[dtype] = [[self._slots[b, j].view(dtype)
                                           for j in range(self.size)] for b in range(2)]
        return views

    def _wait(self, field: int, k: int) -> None:
        counters = self._counters[field]
        for j in self._others:
            if counters[j, 0] >= k:
                continue
            start, spins = time.monotonic(), 0
            while counters[j, 0] < k:
                spins += 1
                if spins <= SPINS:
                    os.sched_yield()
                else:  # the peer is late (or shares our core): sleep, freeing the core
                    time.sleep(NAP_S)
                    if spins % 256 == 0:
                        self._check(j, start, "arrive at" if field == _ARRIVED else "finish")

    def _check(self, j: int, start: float, what: str) -> None:
        who = f"rank {self.global_ranks[j]}"
        pid = self._pids[j]
        if pid is not None and not _alive(pid):
            raise RuntimeError(f"{who} (pid {pid}) exited while this rank waited "
                               f"for it to {what} shared-memory collective {self.seq}; see "
                               f"that rank's error")
        waited = time.monotonic() - start
        if waited > self.timeout:
            raise RuntimeError(f"Timed out after {waited:.1f} s (the process-group timeout) "
                               f"waiting for {who} to {what} shared-memory collective "
                               f"{self.seq}: the ranks are out of step or one is stuck (find "
                               f"which with --debug-collectives or the hang doctor)")

    def _pieces(self, count: int, element_size: int, parts: int = 1):
        step = max(1, self.slot_bytes // (element_size * parts))
        return [(a, min(a + step, count)) for a in range(0, count, step)]

    # ------------------------------------------------------------------ collectives
    def supports(self, op) -> bool:
        try:
            return op in _REDUCE
        except TypeError:  # an unhashable custom op: gloo's
            return False

    @torch.no_grad()  # like torch's collectives: no autograd through the copies
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """In place, like `dist.all_reduce` (SUM, MAX, MIN, PRODUCT)."""
        fn = _REDUCE[op]
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()

        def reduce_into(out):
            def read(slots):
                fn(slots[0], slots[1], out=out)
                for s in slots[2:]:
                    fn(out, s, out=out)
            return read

        key = self._key("all_reduce", flat.numel(), flat.dtype)
        for a, b in self._pieces(flat.numel(), flat.element_size()):
            self._round(flat[a:b], reduce_into(flat[a:b]), key)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))

    @torch.no_grad()  # like torch's collectives: no autograd through the copies
    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Like `dist.all_gather`: `outputs[j]` = rank j's `tensor`."""
        if len(outputs) != self.size or any(o.numel() != tensor.numel() for o in outputs):
            raise ValueError(f"all_gather needs {self.size} output tensors (the group's size) "
                             f"of {tensor.numel()} elements each (the input's), got "
                             f"{[o.numel() for o in outputs]}")
        flat = tensor.reshape(-1)
        key = self._key("all_gather", flat.numel(), flat.dtype)
        outs = [o.view(-1) if o.is_contiguous() else None for o in outputs]
        temps = [torch.empty_like(flat) if o is None else o for o in outs]
        for a, b in self._pieces(flat.numel(), flat.element_size()):
            def read(slots, a=a, b=b):
                for out, s in zip(temps, slots):
                    out[a:b].copy_(s)
            self._round(flat[a:b], read, key)
        for o, out, t in zip(outs, outputs, temps):
            if o is None:
                out.copy_(t.view(out.shape))

    @torch.no_grad()  # like torch's collectives: no autograd through the copies
    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """Like `dist.all_gather_into_tensor`: `output` (size x tensor's elements, contiguous)
        holds the ranks' tensors concatenated in rank order."""
        self.all_gather(list(output.view(self.size, -1).unbind(0)), tensor)

    @torch.no_grad()  # like torch's collectives: no autograd through the copies
    def reduce_scatter_single(self, output: torch.Tensor, tensor: torch.Tensor,
                              op=dist.ReduceOp.SUM) -> None:
        """Like `dist.reduce_scatter_tensor`: `output` = the reduction over ranks of chunk
        `rank` of `tensor` (split into `size` equal chunks in order)."""
        fn = _REDUCE[op]
        n, r = self.size, self.rank
        chunks = tensor.reshape(n, -1)
        key = self._key("reduce_scatter", tensor.numel(), tensor.dtype)
        out = output.view(-1) if output.is_contiguous() else torch.empty(
            chunks.shape[1], dtype=output.dtype)
        for a, b in self._pieces(chunks.shape[1], chunks.element_size(), parts=n):
            def read(slots, a=a, b=b):
                mine = [s.view(n, b - a)[r] for s in slots]
                fn(mine[0], mine[1], out=out[a:b])
                for s in mine[2:]:
                    fn(out[a:b], s, out=out[a:b])
            self._round(chunks[:, a:b], read, key)
        if not output.is_contiguous():
            output.copy_(out.view(output.shape))
