"""The one place every collective and point-to-point call of shardzoo passes through.

The functions mirror `torch.distributed` (same names, arguments and results), so code moves
here by a rename: `dist.all_reduce(t, group=g)` -> `collectives.all_reduce(t, group=g)`.
Object collectives (`all_gather_object`, `broadcast_object_list`, `gather_object`) and
`batch_isend_irecv` included; DCP's internal collectives are torch's own and do not pass here.

Consumers observe the calls: an object with `start(call)` and `end(call, error)` methods
(see `Consumer`), registered with `add_consumer`. The collective trace of the hang doctor
(hang_doctor/trace.py) and `--debug-collectives` (hang_doctor/debug_collectives.py) are
consumers; call and byte counting (comm_counter.py) is another. A CPU group with a
shared-memory channel (transport/shm.py) runs its reductions and gathers there. With no consumer registered (the default) a function here is the
torch call plus one truth test of a module-level list: nothing is recorded or allocated.

For each observed call a `Call` says what runs: the op, the group (its torch name, a label
such as "tp" given with `name_group`, its global ranks), `seq` (1-based count of this rank's
collectives on that group, equal on every member when the program is consistent; p2p
batches are numbered apart, and each message by its channel, see `P2PMessage`), the tensors,
and, when a consumer asks for it (`needs_site`), the Python call site: the innermost frames
outside parallel_state/, torch and the standard library. `start` runs before the torch call
(a consumer may raise there to stop it), `end` after it returns, after the wait of an async
op (`async_op=True` returns a wrapper of torch's Work whose `wait()` reports the end), or
with the exception the call raised.

Timeouts: `set_timeout(td)` is the operation timeout of every group (init_process_group's,
the grid's and those made by `new_group` here); groups are created with at least
`STARTUP_TIMEOUT` so that slow-starting ranks do not fail the rendezvous, then set to the
operation timeout (`apply_timeout`).
"""
from __future__ import annotations

import gc
import itertools
import os
import sys
import sysconfig
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .transport import shm

ReduceOp = dist.ReduceOp
STARTUP_TIMEOUT = timedelta(minutes=10)  # group creation (rendezvous) waits at least this long

_consumers: list = []  # registered consumers, in order; empty -> fast path
_needs_site = False
_lock = threading.Lock()
_timeout: timedelta | None = None
_labels: dict[str, str] = {}  # torch group name -> label ("tp", "dp", ...)
_ranks: dict[str, tuple[int, ...]] = {}  # torch group name -> global ranks (cached)
_seq: dict = {}  # torch group name -> collectives observed on it ((name, "p2p"): p2p batches)
_p2p_seq: dict[tuple, int] = {}  # (group name, "send"/"recv", peer, tag) -> messages observed
_index = itertools.count(1)  # every observed call on this rank, in start order


# ---------------------------------------------------------------------------- consumers
class Consumer:
    """Interface of a consumer (subclassing is optional; duck typing is enough)."""

    needs_site = False  # True: fill `Call.site` (a frame walk, ~1-2 us per call)

    def start(self, call: "Call") -> None:
        """Before the torch call; raising here stops it (the error reaches the caller)."""

    def end(self, call: "Call", error: BaseException | None) -> None:
        """After the call (or its wait) returned, or with the exception it raised."""

    def wait(self, call: "Call") -> None:
        """Optional: an async call's `wait()` begins (its end follows on the same thread)."""


def add_consumer(consumer) -> None:
    """Start observing every call with `consumer` (after the already registered ones). The
    first consumer restarts the numbering of calls (every rank adds it at the same point)."""
    global _needs_site
    if not _consumers:
        _seq.clear()
        _p2p_seq.clear()
    _consumers.append(consumer)
    _needs_site = any(getattr(c, "needs_site", False) for c in _consumers)


def remove_consumer(consumer) -> None:
    global _needs_site
    if consumer in _consumers:
        _consumers.remove(consumer)
    _needs_site = any(getattr(c, "needs_site", False) for c in _consumers)


def forget_world_label() -> None:
    """Drop the world group's label: the grid that named a dimension after it ("world/dp") is
    gone, and the next grid may split the world otherwise."""
    if dist.is_initialized():
        _labels.pop(_world_name(), None)


def forget_groups() -> None:
    """Drop labels, cached ranks and call counts (the world was destroyed: torch reuses
    group names in the next one)."""
    for table in (_labels, _ranks, _seq, _p2p_seq):
        table.clear()


class P2PMessage:
    """One send or receive of a `batch_isend_irecv` call. `peer` is a global rank; `seq`
    counts this rank's messages of the same kind, peer, tag and group (1-based), so the
    k-th send from a to b matches the k-th receive on b from a."""

    __slots__ = ("kind", "peer", "tag", "tensor", "seq")

    def __init__(self, kind: str, peer: int, tag: int, tensor: torch.Tensor, seq: int):
        self.kind, self.peer, self.tag, self.tensor, self.seq = kind, peer, tag, tensor, seq


class Call:
    """One observed call. `tensors`: the payload (inputs; for all_gather/all_gather_single
    the local input, for reduce_scatter_single the full input); `messages`: the p2p messages
    of a batch_isend_irecv; `site`: innermost-first `"path:line (function)"` strings, or ()."""

    __slots__ = ("op", "group", "group_name", "seq", "tensors", "reduce_op", "src",
                 "messages", "async_op", "site", "t_start", "t_wait", "t_end", "index",
                 "extra")

    def __init__(self, op: str, group, tensors=(), reduce_op=None, src=None, messages=None,
                 async_op=False):
        self.op, self.group, self.tensors = op, group, tensors
        self.reduce_op, self.src, self.messages, self.async_op = reduce_op, src, messages, async_op
        self.group_name = group.group_name
        self.seq = self.index = 0
        self.site: tuple[str, ...] = ()
        self.t_start = self.t_wait = self.t_end = 0.0  # time.time(); t_wait: async wait()
        self.extra: dict | None = None  # a consumer may keep its per-call state here

    @property
    def ranks(self) -> tuple[int, ...]:
        return group_ranks(self.group)

    @property
    def label(self) -> str:
        return group_label(self.group)

    @property
    def nbytes(self) -> int:
        """Payload bytes of this rank: the tensors' (or the p2p messages') bytes."""
        ts = self.tensors if self.messages is None else [m.tensor for m in self.messages]
        return sum(t.numel() * t.element_size() for t in ts)

    def key(self) -> tuple:
        """What `signature()` formats, cheap to take and holding no tensor: (op, reduce op,
        src, is p2p, ((dtype, shape), ...) or ((kind, peer, tag, seq, dtype, shape), ...)).
        For an op in `UNEVEN_OPS` dim 0 of the shape is "*": it differs between ranks."""
        if self.messages is None:
            ts = self.tensors
            payload = ((ts[0].dtype, ts[0].shape),) if len(ts) == 1 else \
                tuple((t.dtype, t.shape) for t in ts)
            if self.op in UNEVEN_OPS:
                payload = tuple((dtype, ("*", *shape[1:])) for dtype, shape in payload)
            return (self.op, self.reduce_op, self.src, False, payload)
        return (self.op, self.reduce_op, self.src, True,
                tuple((m.kind, m.peer, m.tag, m.seq, m.tensor.dtype, m.tensor.shape)
                      for m in self.messages))

    def signature(self) -> str:
        """What every rank of the group must agree on: op, reduce op / root, dtype, shapes
        (for a p2p batch: each message), e.g. `all_reduce SUM float32[4, 8]`."""
        return format_signature(self.key())


# Collectives whose input's dim 0 is per-rank (all_to_all_single's split sizes): signatures
# (what --debug-collectives and the trace report compare across ranks) leave it out.
UNEVEN_OPS = frozenset({"all_to_all_single"})


def format_signature(key: tuple) -> str:
    """The text of a `Call.key()`: `all_reduce SUM float32[4, 8]`, `broadcast src 0
    float32[3]`, `batch_isend_irecv send>1 tag 0 #2 float32[8, 2, 16]; recv<1 tag 1 #1 ...`."""
    op, reduce_op, src, p2p, payload = key
    parts = [op]
    if reduce_op is not None:
        parts.append(_reduce_name(reduce_op))
    if src is not None:
        parts.append(f"src {src}")
    if p2p:
        parts.append("; ".join(f"{kind}{'>' if kind == 'send' else '<'}{peer} tag {tag} #{seq} "
                               f"{_desc(dtype, shape)}"
                               for kind, peer, tag, seq, dtype, shape in payload))
    else:
        parts.extend(_desc(dtype, shape) for dtype, shape in payload)
    return " ".join(parts)


_dtype_names: dict = {}


def _desc(dtype, shape) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return f"{name}[{', '.join(map(str, shape))}]"


def tensor_desc(t: torch.Tensor) -> str:
    """`float32[16, 2, 64]`"""
    return _desc(t.dtype, t.shape)


_reduce_names: dict = {}


def _reduce_name(op) -> str:
    try:
        return _reduce_names[op]
    except (KeyError, TypeError):
        name = getattr(op, "name", None)
        name = name if isinstance(name, str) else str(op).rsplit(".", 1)[-1]
        try:
            _reduce_names[op] = name
        except TypeError:  # an unhashable op (a premul-sum with its factor)
            pass
        return name


def _world_name() -> str:
    return dist.distributed_c10d._get_default_group().group_name


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of `group` (None: the world), cached by group name."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    name = group.group_name
    if name not in _ranks:
        _ranks[name] = tuple(dist.get_process_group_ranks(group))
    return _ranks[name]


def name_group(group, label: str) -> None:
    """Give `group` a label for traces and reports ("tp", "dp", "pp", "embedding", ...); a
    grid dimension spanning the whole world is the world group itself ("world/dp")."""
    if group is None:
        return
    name = group.group_name
    if name == _world_name():
        label = f"{_labels.get(name, 'world')}/{label}"
    _labels[name] = label


def group_label(group) -> str:
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    return _labels.get(group.group_name, "world" if group.group_name == _world_name()
                       else f"group {group.group_name}")


# ---------------------------------------------------------------------------- call sites
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = tuple(os.path.join(p, "") for p in {
    os.path.dirname(os.path.abspath(__file__)),  # parallel_state/ (this layer and its shims)
    os.path.dirname(os.path.abspath(torch.__file__)),
    sysconfig.get_paths()["stdlib"], os.path.dirname(os.__file__)})
# Keyed by id(code): hashing a code object hashes its constants every time (microseconds for
# a large function). Each entry keeps its code object alive, so an id is never reused.
_user_code: dict = {}  # id(code) -> (code, its "path" if it is a user frame, else None)
_sites: dict = {}  # (id(code), instruction offset) -> (code, "path:line (function)")
SITE_DEPTH = 3


def _frame_path(code) -> str | None:
    path = code.co_filename
    if path.startswith("<") or os.path.abspath(path).startswith(_SKIP):
        return None
    path = os.path.abspath(path)
    return os.path.relpath(path, _ROOT) if path.startswith(os.path.join(_ROOT, "")) else path


def call_site(depth: int = SITE_DEPTH) -> tuple[str, ...]:
    """The `depth` innermost frames of the calling thread outside parallel_state/, torch and
    the standard library, innermost first, as `"path:line (function)"` (paths relative to
    the repository when inside it)."""
    out = []
    f = sys._getframe(1)
    while f is not None and len(out) < depth:
        code = f.f_code
        entry = _user_code.get(id(code))
        if entry is None:
            entry = _user_code[id(code)] = (code, _frame_path(code))
        if entry[1] is not None:  # f_lineno decodes the line table: once per offset
            key = (id(code), f.f_lasti)
            site = _sites.get(key)
            if site is None:
                site = _sites[key] = (code, f"{entry[1]}:{f.f_lineno} ({code.co_name})")
            out.append(site[1])
        f = f.f_back
    return tuple(out)


# ---------------------------------------------------------------------------- running a call
def _begin(call: Call) -> None:
    with _lock:
        call.index = next(_index)
        # p2p batches are numbered apart: the ranks of a group make different numbers of them
        key = call.group_name if call.messages is None else (call.group_name, "p2p")
        call.seq = _seq[key] = _seq.get(key, 0) + 1
        for m in call.messages or ():
            key = (call.group_name, m.kind, m.peer, m.tag)
            m.seq = _p2p_seq[key] = _p2p_seq.get(key, 0) + 1
    if _needs_site:
        call.site = call_site()
    call.t_start = time.time()
    started = 0
    try:
        for c in _consumers:
            c.start(call)
            started += 1
    except BaseException as e:
        _end(call, e, _consumers[:started])
        raise


def _end(call: Call, error: BaseException | None, observers=None) -> None:
    call.t_end = time.time()
    for c in _consumers if observers is None else observers:
        c.end(call, error)


def _run(call: Call, fn):
    _begin(call)
    try:
        result = fn()
    except BaseException as e:
        _end(call, e)
        raise
    if call.async_op and result is not None:
        return Work(result, call)
    _end(call, None)
    return result


class Work:
    """torch's Work of an observed async call; `wait()` reports the call's end."""

    __slots__ = ("_work", "_call", "_pending")

    def __init__(self, work, call: Call, pending: list | None = None):
        self._work, self._call, self._pending = work, call, pending

    def wait(self, *args, **kwargs):
        call = self._call
        if call is not None and not call.t_wait:  # the first wait of the call (or batch)
            call.t_wait = time.time()
            for c in _consumers:
                if hasattr(c, "wait"):
                    c.wait(call)
        try:
            out = self._work.wait(*args, **kwargs)
        except BaseException as e:
            if self._call is not None:
                call, self._call = self._call, None
                _end(call, e)
            raise
        call, self._call = self._call, None
        if call is not None:
            if self._pending is None:
                _end(call, None)
            else:  # one request of a batch: the batch ends with its last request
                self._pending[0] -= 1
                if self._pending[0] == 0:
                    _end(call, None)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _group(group):
    return group if group is not None else dist.distributed_c10d._get_default_group()


# ---------------------------------------------------------------------------- collectives
def _channel(group, tensor, op=None):
    """The shared-memory channel (transport/shm.py) that runs a collective of CPU `tensor` on
    `group`, or None (torch's backend runs it; also inside a torch.compile region, which
    traces torch's collectives into its graph)."""
    if not shm._channels or tensor.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    ch = shm.channel(_group(group))
    return ch if ch is not None and (op is None or ch.supports(op)) else None


def _collective(name, group, payload, async_op, torch_fn, shm_fn, reduce_op=None):
    """Run collective `name` on `payload`: `shm_fn(channel)` when the group has a
    shared-memory channel for it (synchronous; an async call returns a finished Work), else
    `torch_fn()` (always when `shm_fn` is None: an op the channel does not run); observed by
    the consumers, if any (a shared-memory call as the blocking call it is, so that profiles
    count its time as communication)."""
    ch = None if shm_fn is None else _channel(group, payload, reduce_op)
    if ch is not None:
        if _consumers:
            _run(Call(name, _group(group), (payload,), reduce_op=reduce_op, async_op=False),
                 lambda: shm_fn(ch))
        else:
            shm_fn(ch)
        return shm.DONE if async_op else None
    if not _consumers:
        return torch_fn()
    return _run(Call(name, _group(group), (payload,), reduce_op=reduce_op, async_op=async_op),
                torch_fn)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """`torch.distributed.all_reduce`, observed."""
    return _collective("all_reduce", group, tensor, async_op,
                       lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
                       lambda ch: ch.all_reduce(tensor, op), reduce_op=op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """`torch.distributed.all_gather`, observed."""
    return _collective("all_gather", group, tensor, async_op,
                       lambda: dist.all_gather(tensor_list, tensor, group=group,
                                               async_op=async_op),
                       lambda ch: ch.all_gather(tensor_list, tensor))


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """`torch.distributed.all_gather_single` (formerly all_gather_into_tensor), observed."""
    return _collective("all_gather_single", group, input_tensor, async_op,
                       lambda: _all_gather_single(output_tensor, input_tensor, group=group,
                                                  async_op=async_op),
                       lambda ch: ch.all_gather_single(output_tensor, input_tensor))


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """`torch.distributed.reduce_scatter_single` (formerly reduce_scatter_tensor), observed."""
    return _collective("reduce_scatter_single", group, input, async_op,
                       lambda: _reduce_scatter_single(output, input, op=op, group=group,
                                                      async_op=async_op),
                       lambda ch: ch.reduce_scatter_single(output, input, op), reduce_op=op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """`torch.distributed.all_to_all_single`, observed: rows `input_split_sizes[j]` of `input`
    (dim 0, in order) go to rank j of `group`, and `output` receives `output_split_sizes[j]`
    rows from rank j (None: equal splits). Splits may differ per rank and be zero (gloo and
    NCCL both take uneven splits). Observed with `input` as payload (the bytes this rank
    sends, its own split included) and dim 0 out of the signature (`UNEVEN_OPS`). Always on
    torch's backend: the shared-memory channel does not run all-to-all."""
    return _collective("all_to_all_single", group, input, async_op,
                       lambda: dist.all_to_all_single(output, input, output_split_sizes,
                                                      input_split_sizes, group=group,
                                                      async_op=async_op), None)


# Newer torch names the flat collectives *_single and deprecates the *_tensor spellings;
# older releases only have the latter.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into_tensor = all_gather_single  # torch's older names, so a rename is enough
reduce_scatter_tensor = reduce_scatter_single


def broadcast(tensor, src, group=None, async_op=False):
    """`torch.distributed.broadcast` (`src` a global rank), observed."""
    if not _consumers:
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return _run(Call("broadcast", _group(group), (tensor,), src=src, async_op=async_op),
                lambda: dist.broadcast(tensor, src, group=group, async_op=async_op))


def barrier(group=None):
    """`torch.distributed.barrier`, observed."""
    if not _consumers:
        return dist.barrier(group=group)
    return _run(Call("barrier", _group(group)), lambda: dist.barrier(group=group))


def all_gather_object(object_list, obj, group=None):
    """`torch.distributed.all_gather_object`, observed (no tensors: shapes are not checked)."""
    if not _consumers:
        return dist.all_gather_object(object_list, obj, group=group)
    return _run(Call("all_gather_object", _group(group)),
                lambda: dist.all_gather_object(object_list, obj, group=group))


def broadcast_object_list(object_list, src=0, group=None):
    """`torch.distributed.broadcast_object_list` (`src` a global rank), observed."""
    if not _consumers:
        return dist.broadcast_object_list(object_list, src=src, group=group)
    return _run(Call("broadcast_object_list", _group(group), src=src),
                lambda: dist.broadcast_object_list(object_list, src=src, group=group))


def gather_object(obj, object_gather_list=None, dst=0, group=None):
    """`torch.distributed.gather_object` (`dst` a global rank), observed."""
    if not _consumers:
        return dist.gather_object(obj, object_gather_list, dst=dst, group=group)
    return _run(Call("gather_object", _group(group), src=dst),
                lambda: dist.gather_object(obj, object_gather_list, dst=dst, group=group))


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]):
    """`torch.distributed.batch_isend_irecv`, observed as one call whose `messages` are the
    sends and receives (peers as global ranks); the call ends when every request was waited."""
    if not _consumers:
        return dist.batch_isend_irecv(p2p_op_list)
    group = _group(p2p_op_list[0].group)
    messages = [P2PMessage("send" if op.op in (dist.isend, dist.send) else "recv", op.peer,
                           op.tag, op.tensor, 0) for op in p2p_op_list]
    call = Call("batch_isend_irecv", group, messages=messages, async_op=True)
    _begin(call)
    try:
        reqs = dist.batch_isend_irecv(p2p_op_list)
    except BaseException as e:
        _end(call, e)
        raise
    if not reqs:
        _end(call, None)
        return reqs
    pending = [len(reqs)]
    return [Work(r, call, pending) for r in reqs]


# ---------------------------------------------------------------------------- groups, timeout
def set_timeout(timeout: timedelta | None) -> None:
    """The operation timeout of every process group made from now on (None: torch's)."""
    global _timeout
    _timeout = timeout


def get_timeout() -> timedelta | None:
    return _timeout


def startup_timeout() -> timedelta | None:
    """Timeout for creating groups: the operation timeout, but at least STARTUP_TIMEOUT."""
    return None if _timeout is None else max(_timeout, STARTUP_TIMEOUT)


def apply_timeout(group=None) -> None:
    """Set the operation timeout on an existing group (None: the world); no-op if unset."""
    if _timeout is None or not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(_timeout, group)
    ch = shm.channel(group) if group is not None else None
    if ch is not None:
        ch.timeout = _timeout.total_seconds()


def in_transient_group(label: str, fn):
    """`fn(group)` with a gloo group of the whole world made for it (labelled `label`) and
    destroyed after it, for one-off collectives of large objects (a checkpoint's
    verification and DCP's planning); `fn(None)` with no process group or a world of one
    (`fn` then runs alone: DCP's `no_dist`). `fn` must not keep the group: the group's
    threads end only with its last reference.

    Why not the world group: gloo copies a gathered object out of its buffer in one of the
    group's own worker threads, and an ATen copy of more than 32K elements there starts an
    OpenMP team of that thread. libgomp counts the threads of every team the process has,
    and once they outnumber the CPUs every barrier spins ~1,000 iterations instead of
    ~300,000 before it sleeps (libgomp's env.c: `gomp_throttled_spin_count_var`): each
    parallel region of the model then pays a futex wake-up. Ending the group joins its
    threads, and with them their teams go. Measured on a 2-core Xeon (2026-12-07): a world
    group used for one `all_gather_object` of a 300K-element list left `x.add_(1)` on 128K
    floats at 70-74 us a call instead of 11-16; a SmolLM2-135M bf16 server loaded from a
    native checkpoint ran its engine on 1.42 of the 2 cores at 64 clients. Collective:
    every rank of the world enters it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn(None)
    group = new_group(backend="gloo", label=label)
    name = group.group_name
    try:
        return fn(group)
    finally:
        dist.destroy_process_group(group)
        del group
        for table in (_labels, _ranks):
            table.pop(name, None)
        gc.collect()  # the group's last references go: its worker threads are joined


def new_group(ranks=None, backend=None, label: str | None = None):
    """`torch.distributed.new_group` with the operation timeout (created with the start-up
    timeout, then set), optionally labelled for traces."""
    group = dist.new_group(ranks, timeout=startup_timeout(), backend=backend)
    if ranks is None or dist.get_rank() in ranks:
        apply_timeout(group)
        if label:
            name_group(group, label)
    return group
