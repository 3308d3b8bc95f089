"""ZeRO-3 / FSDP parameter units for `--data-parallel-sharding-strategy optim_grads_params`.

Between uses each data-parallel rank keeps only its shard of the parameters
(`DistributedDataParallel.param_shards`, the same flat shard layout as the gradient shards and
the optimizer's main weights). A *unit* is a group of parameters gathered together: each
transformer layer, the embedding and the output layer (`GPTModel.sharding_units`), plus the
chunk's *root* unit of everything else (final norm; an embedding tied to this chunk's output
layer). Following FSDP (Zhao et al. 2023, "PyTorch FSDP", sec. 3.3-3.4) and Megatron-FSDP:

- a unit's parameters are views into one flat buffer whose storage is allocated and filled by
  an all-gather of its buckets just before the unit's forward, and resized to zero right after
  (`torch.UntypedStorage.resize_`: tensors saved for backward keep pointing at the same
  storage, so they see the values again once it is re-gathered);
- the next unit's all-gather is launched asynchronously when a unit starts (forward order in
  forward, reverse order in backward), so it overlaps the unit's compute;
- an identity autograd function on the unit's outputs re-gathers the unit when backward
  reaches it; the unit is freed when its last bucket's gradient has been reduce-scattered;
- the last unit and the root stay gathered from forward to backward (their backward follows;
  FSDP2's and torchtitan's choice for the last block), counted per pending microbatch;
- a forward replayed inside backward by activation recompute (detected as FSDP2 does, by a
  running autograd graph task) gathers but never frees, so the backward that follows finds
  the values.

Parameter offload (`--param-offload-device`, ZeRO-Infinity): with the shards in host memory
a unit's all-gather takes its input copied to the device; with the shards in an NVMe file the
unit's shard (one contiguous range of the file: its buckets are consecutive) is read into a
host buffer by the file's I/O threads, started when the unit before it is used -- in forward
order in forward, reverse order in backward -- so the read overlaps that unit's compute and
the all-gather of the unit between. Staged reads are dropped when the shards change
(`invalidate`).

`peak_gathered_bytes()` reports the most bytes of gathered (full) parameters that were alive at
once in this process, next to `predicted_peak_bytes` (root + the two largest adjacent units).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from parallel_state.collectives import all_gather_single


def _in_backward() -> bool:
    """True while autograd runs a backward (a recompute inside it), as FSDP2 tests it."""
    return torch._C._current_graph_task_id() != -1


class _Gathered:
    """Bytes of gathered parameters alive in this process (all model chunks) and their peak."""

    now = 0
    peak = 0

    @classmethod
    def add(cls, n: int) -> None:
        cls.now += n
        cls.peak = max(cls.peak, cls.now)


def peak_gathered_bytes(reset: bool = False) -> int:
    """Most bytes of gathered ZeRO-3 parameters alive at once in this process so far."""
    peak = _Gathered.peak
    if reset:
        _Gathered.peak = _Gathered.now
    return peak


@dataclass(eq=False)
class _Unit:
    name: str
    params: list[nn.Parameter]
    module: nn.Module | None  # None: the root (gathered by the wrapper's forward)
    index: int = 0  # position in forward order
    buckets: list = field(default_factory=list)
    start: int = 0
    end: int = 0
    full: torch.Tensor | None = None  # flat [end - start], storage size 0 while freed
    gathered: bool = False
    handles: list = field(default_factory=list)
    reshard_after_forward: bool = True
    pending: int = 0  # forwards with autograd whose backward has not finished (kept units)
    reduced: int = 0  # buckets reduce-scattered in the running backward
    in_backward: bool = False  # gathered by the running backward, not yet released
    stage: tuple | None = None  # NVMe parameter offload: (host buffer, read future)
    stage_in_use: torch.Tensor | None = None  # the buffer its running all-gather reads

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * self.full.element_size()


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward (before the unit's own) gathers the unit."""

    @staticmethod
    def forward(ctx, hook, *tensors):
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


class ParameterUnits:
    """The units of one `DistributedDataParallel(..., optim_grads_params)` wrapper.

    Args:
        ddp: the wrapper (its `params`, `shard_range`, `param_view`; each bucket's group).
        unit_modules: submodules, each gathered as one unit, in forward order.
    """

    def __init__(self, ddp, unit_modules: list[nn.Module]):
        self.ddp = ddp
        trainable = {id(p) for p in ddp.params}
        seen, units = set(), []
        for m in unit_modules:
            own = [p for p in m.parameters() if id(p) in trainable and id(p) not in seen]
            if own:
                seen |= {id(p) for p in own}
                units.append(_Unit(type(m).__name__, own, m))
        rest = [p for p in ddp.params if id(p) not in seen]
        self.root = _Unit("root", rest, None, reshard_after_forward=False) if rest else None
        self.order = ([self.root] if self.root else []) + units
        for i, u in enumerate(self.order):
            u.index = i
        if units:
            units[-1].reshard_after_forward = False

    def param_groups(self) -> list[list[nn.Parameter]]:
        """Parameters per unit, in backward order (the order of the flat index space)."""
        return [u.params for u in reversed(self.order)]

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def build(self, buckets) -> None:
        """Move the parameters into per-unit flat buffers, copy this rank's shards into the
        wrapper's `param_shards`, free the buffers and install the module hooks. Parameters on
        the meta device become views of their unit's buffer filled by `ddp.param_init`, one
        unit at a time (at most one unit's full values exist at once)."""
        ddp = self.ddp
        unit_of = {id(p): u for u in self.order for p in u.params}
        names = {id(p): n for n, p in ddp.module.named_parameters()}
        for b in buckets:
            b.unit = unit_of[id(b.params[0])]
            b.unit.buckets.append(b)
        for u in self.order:
            u.start, u.end = min(b.start for b in u.buckets), max(b.end for b in u.buckets)
            u.full = torch.zeros(u.end - u.start, dtype=ddp.param_dtype, device=ddp.device)
            for p in u.params:
                view = ddp._view(u.full, p, u.start)
                if p.is_meta:
                    view.copy_(ddp.param_init(names[id(p)], p))
                    # the same parameter object (ids key the layout and the hooks), made an
                    # empty tensor of the device, with its own version counter (the gathers
                    # write the buffer in place, as with `.data`); swap_tensors swaps
                    # __dict__ too
                    attributes = p.__dict__.copy()
                    torch.utils.swap_tensors(p, nn.Parameter(
                        torch.empty(0, dtype=p.dtype, device=ddp.device), p.requires_grad))
                    p.__dict__.update(attributes)
                else:
                    view.copy_(p)
                p.data = view
            for b in u.buckets:
                lo, hi = ddp.shard_range(b)
                ddp.write_params(b, lo, hi, u.full[lo - u.start: hi - u.start])
            u.full.untyped_storage().resize_(0)
            if u.module is not None:
                u.module.register_forward_pre_hook(self._pre_forward_hook(u))
                u.module.register_forward_hook(self._post_forward_hook(u))

    # ------------------------------------------------------------------ gather / free
    def _gather(self, u: _Unit, async_op: bool = False) -> None:
        """Allocate `u`'s flat buffer and all-gather its buckets into it (no-op if done)."""
        if u.gathered:
            return
        ddp = self.ddp
        staged = self._take_stage(u)
        u.full.untyped_storage().resize_(u.nbytes)
        u.gathered = True
        _Gathered.add(u.nbytes)
        for b in u.buckets:
            lo, hi = ddp.shard_range(b)
            out = u.full[b.start - u.start: b.end - u.start]
            if staged is not None:
                at = ddp.param_file_offset(b, lo) // staged.element_size() - self._pos(u)[0]
                src = staged[at: at + hi - lo].to(out.device, non_blocking=True)
            else:  # on the device, or (cpu offload) copied in from host memory
                src = ddp.param_view(b, lo, hi).to(out.device, non_blocking=True)
            if b.comm.size > 1:  # over the bucket's group: dp, or edp for experts
                u.handles.append(all_gather_single(out, src, group=b.comm.group,
                                                   async_op=async_op))
            else:
                out.copy_(src)

    # ------------------------------------------------------------------ NVMe staging
    def _pos(self, u: _Unit) -> tuple[int, int]:
        """[first, end) element of unit `u`'s shard in the parameter file."""
        ddp, es = self.ddp, self.ddp.param_dtype.itemsize
        ranges = [ddp.shard_range(b) for b in u.buckets]
        return (min(ddp.param_file_offset(b, lo) for b, (lo, _) in zip(u.buckets, ranges)) // es,
                max(ddp.param_file_offset(b, lo) + (hi - lo) * es
                    for b, (lo, hi) in zip(u.buckets, ranges)) // es)

    def _stage(self, u: _Unit | None) -> None:
        """Start reading `u`'s shard from the NVMe parameter file (no-op without one, or if
        it is gathered or already being read)."""
        ddp = self.ddp
        if u is None or ddp.param_file is None or u.gathered or u.stage is not None:
            return
        first, end = self._pos(u)
        buf = torch.empty(end - first, dtype=ddp.param_dtype,
                          pin_memory=ddp.device.type == "cuda" and ddp.pin_offload)
        u.stage = (buf, ddp.param_file.read(first * buf.element_size(), buf))

    def _take_stage(self, u: _Unit) -> torch.Tensor | None:
        """`u`'s shard read from the NVMe file (waiting for, or starting, its read)."""
        if self.ddp.param_file is None:
            return None
        self._stage(u)
        buf, done = u.stage
        done.result()
        u.stage, u.stage_in_use = None, buf  # kept alive until the all-gather finished
        return buf

    def _wait(self, u: _Unit) -> None:
        for h in u.handles:
            if h is not None:
                h.wait()
        u.handles, u.stage_in_use = [], None

    def _free(self, u: _Unit) -> None:
        if not u.gathered:
            return
        self._wait(u)
        u.full.untyped_storage().resize_(0)
        u.gathered = False
        _Gathered.add(-u.nbytes)

    def _use(self, u: _Unit, prefetch: _Unit | None, backward: bool = False) -> None:
        """Make `u` gathered now and start gathering `prefetch` in the background (and, with
        the shards on NVMe, reading the unit after `prefetch`)."""
        self._gather(u)
        self._wait(u)
        if prefetch is not None:
            self._gather(prefetch, async_op=True)
            self._stage(self._next(prefetch, backward))

    def _next(self, u: _Unit, backward: bool) -> _Unit | None:
        if backward:  # the root's backward comes first, then the last unit's, ...
            i = len(self.order) - 1 if u is self.root else u.index - 1
        else:
            i = u.index + 1
        if not 0 <= i < len(self.order) or i == u.index or self.order[i] is self.root:
            return None
        return self.order[i]

    # ------------------------------------------------------------------ forward and backward
    def _attach(self, u: _Unit, output):
        """Route the tensors of `output` needing grad through `_PreBackward` for unit `u`."""
        tensors = [output] if torch.is_tensor(output) else \
            [t for t in output if torch.is_tensor(t)] if isinstance(output, (tuple, list)) else []
        need = [t for t in tensors if t.requires_grad]
        if not need:
            return output
        routed = dict(zip(map(id, need), _PreBackward.apply(lambda: self._pre_backward(u), *need)))
        if torch.is_tensor(output):
            return routed[id(output)]
        return type(output)(routed.get(id(t), t) if torch.is_tensor(t) else t for t in output)

    def _after_forward(self, u: _Unit, output):
        if _in_backward():
            return output  # a recompute: backward of this unit follows, keep it
        if torch.is_grad_enabled():
            output = self._attach(u, output)
            if not u.reshard_after_forward:
                u.pending += 1
        if u.reshard_after_forward or u.pending == 0:
            self._free(u)
        return output

    def _pre_forward_hook(self, u: _Unit):
        def hook(module, args):
            self._use(u, None if _in_backward() else self._next(u, backward=False))
        return hook

    def _post_forward_hook(self, u: _Unit):
        def hook(module, args, output):
            return self._after_forward(u, output)
        return hook

    def run_root(self, module: nn.Module, args, kwargs):
        """The wrapper's forward: the root unit around the whole chunk."""
        if self.root is None:
            return module(*args, **kwargs)
        self._use(self.root, None if _in_backward() else self._next(self.root, backward=False))
        return self._after_forward(self.root, module(*args, **kwargs))

    def _pre_backward(self, u: _Unit) -> None:
        u.in_backward = True
        self._use(u, self._next(u, backward=True), backward=True)

    def bucket_reduced(self, bucket) -> None:
        """Called by the wrapper when a bucket's gradient was handed to its reduce-scatter:
        after a unit's last bucket its parameters are no longer needed by this backward."""
        u = bucket.unit
        u.reduced += 1
        if u.reduced == len(u.buckets):
            self._post_backward(u)

    def _post_backward(self, u: _Unit) -> None:
        u.reduced, u.in_backward = 0, False
        if not u.reshard_after_forward:
            u.pending = max(u.pending - 1, 0)
            if u.pending:
                return
        self._free(u)

    def end_of_backward(self, split: bool = False) -> None:
        """A unit with some buckets never reduced in this backward (no gradients) is done;
        with `split` (a zero-bubble B, whose weight gradients come later) so is every unit
        this backward gathered, reduced or not."""
        for u in self.order:
            if u.reduced or (split and u.in_backward):
                self._post_backward(u)

    # ------------------------------------------------------------------ step boundaries
    def new_step(self) -> None:
        """Start of a step (all backwards done): free units kept for forwards that had no
        backward (e.g. a measurement); other gathered values stay valid."""
        for u in self.order:
            if u.pending:
                self._free(u)
            u.pending, u.reduced, u.in_backward = 0, 0, False

    def invalidate(self, prefetch: bool) -> None:
        """The shards changed (optimizer step, checkpoint load): drop every gathered copy and
        optionally start gathering the first unit for the next forward."""
        for u in self.order:
            self._free(u)
            u.pending, u.reduced, u.in_backward = 0, 0, False
            if u.stage is not None:  # read before the shards changed
                u.stage[1].result()
                u.stage = None
        if prefetch and self.order:
            self._gather(self.order[0], async_op=True)
            self._stage(self.order[1] if len(self.order) > 1 else None)

    def gather_all(self) -> None:
        """Gather every unit (to read full weights outside a forward)."""
        for u in self.order:
            self._gather(u)
        for u in self.order:
            self._wait(u)

    # ------------------------------------------------------------------ accounting
    def unit_bytes(self) -> list[tuple[str, int]]:
        """`(name, bytes when gathered)` of each unit in forward order (root first)."""
        return [(u.name, u.nbytes) for u in self.order]

    def predicted_peak_bytes(self) -> int:
        """Gathered bytes at the busiest moment of a forward-backward without pipelining:
        the root plus a unit and its prefetched neighbour (the two largest adjacent units)."""
        units = [u for u in self.order if u is not self.root]
        root = self.root.nbytes if self.root else 0
        pairs = [a.nbytes + b.nbytes for a, b in zip(units, units[1:])]
        return root + max(pairs or [u.nbytes for u in units] or [0])
