"""Many LoRA adapters over one frozen linear layer, one adapter per batch row (serving:
inference/lora.py).

Each targeted linear holds `slots` stacked adapters, `A^T [slots, in, parts x R]` and every
HF part's `B_i^T` side by side, `[slots, R, out]` (a fused linear's parts: QKV's q/k/v,
SwiGLU's fc1 gate/up; part i's columns are its own rows of the output, its rank block i); a
forward's rows name their adapter in `LoRABatch` (or none: the base). As S-LoRA's MBGMM and
Punica's SGMV (Sheng et al. 2023, sec. 5; Chen et al. 2023) the tokens are grouped by
adapter, once per step: each adapter in use is read once per hook (the used slots are the
contiguous range from the lowest to the highest one named -- slots are handed out lowest
first), each token multiplies only its own adapter, and no zero block of B is read.

Float32 rows on a CPU (serving's case) go through the C++ kernels of layers/lora_kernels.py:
one call a hook, shrink `x A^T` then expand into the output rows in place, in register tiles
on one thread; a row's delta is the same bits alone as in any batch. Anything else (bfloat16,
autograd, no compiler) takes the `torch.bmm` form: the tokens gathered into `[k, m, in]`
(`LoRABatch.plan`: k used slots, groups padded to the largest, m, pads zeroed), one `bmm`
with the slots' `A^T` -> `[k, m, parts x R]`, one per part with its `B_i^T`, the parts put
in output order (QKV's rows interleave per KV group) and one `index_add_`, on one thread
(`torch.set_num_threads(1)` for the hook: its GEMMs take tens of microseconds, less than an
OpenMP fork / join costs on a shared host, where both threads took 1,100-3,300 us a hook at
load average 8-9 against 88 on one). SmolLM2-135M's shapes (30 layers x 4 hooks, 8 decode
rows over 3 adapters of rank 16 + base; bench/lora_hook.py, docs/PERFORMANCE.md): the
kernels against the `bmm` form, whose GEMMs of 8 rows are bound by dispatch and one FMA
chain's latency, not by bytes. Forms measured and dropped: `x @ A_used^T` over every used
adapter's ranks for every row with a mask (k times the FLOPs), each row's A and B gathered
and two `bmm` (Punica's BGMV: every row's weights copied each step, 0.54x end to end), a
block-diagonal B (reads the zero blocks).

Tensor parallelism (as peft's tp_layer and Megatron-Bridge shard LoRA): over a
column-parallel base the rank holds A whole and its rows of B (the base's output shard);
over a row-parallel base it holds its columns of A (the base's input shard) and B whole: the
partial `A x_i` `[k, m, R]` are summed over TP before B (one all-reduce of R values per
token and slot). The delta is added to the layer's output by a forward hook, so the layers
stay as they are.
"""
from __future__ import annotations

import torch

from parallel_state import (get_tensor_model_parallel_world_size,
                            reduce_from_tensor_model_parallel_region)

from . import lora_kernels
from .linear import ColumnParallelLinear, RowParallelLinear


class LoRABatch:
    """The adapters of the rows of the forward in progress (`bind`, once per engine step);
    `used` None when no row names one (the hooks then do nothing)."""

    def __init__(self):
        self.used: tuple[int, int] | None = None  # slot range [lo, hi) the rows use
        self.slots: list[int] = []  # each row's slot (-1: base)
        self.device = None
        self._plans: dict = {}

    def bind(self, slots: list[int], device) -> None:
        """Row i uses adapter slot `slots[i]` (0-based), or none (-1)."""
        used = [x for x in slots if x >= 0]
        self.slots, self.device, self._plans = list(slots), device, {}
        self.used = (min(used), max(used) + 1) if used else None

    def plan(self, n: int, dtype):
        """`(k, m, take, valid)` for the `n = seq x b` tokens of a forward (token `t b + i` is
        position t of batch row i, as `[s, b, ...]` flattens): the tokens of slot `lo + j`
        are `take[j m:(j + 1) m]` (a LongTensor `[k m]`, k = hi - lo slots, m = the most
        tokens any slot has), a slot with fewer padded with token 0 and `valid [k, m, 1]`
        (0 on pads; None without pads) zeroing them. Built once per step and n, shared by
        every layer."""
        key = (n, dtype)
        if key not in self._plans:
            lo, hi = self.used
            per = self._groups(n)
            m = max(len(p) for p in per)
            take = torch.zeros(hi - lo, m, dtype=torch.long)
            valid = torch.zeros(hi - lo, m, 1, dtype=dtype)
            for j, p in enumerate(per):
                take[j, :len(p)] = p
                valid[j, :len(p)] = 1
            pads = any(len(p) < m for p in per)
            self._plans[key] = (hi - lo, m, take.flatten().to(self.device),
                                valid.to(self.device) if pads else None)
        return self._plans[key]

    def segments(self, n: int):
        """`(tokens, seg)` for the SGMV kernels (layers/lora_kernels.py): the ids of the `n`
        tokens that use slots lo..hi-1, grouped by slot (LongTensor `[tokens]`), the group of
        slot `lo + j` in `tokens[seg[j]:seg[j + 1]]` (`seg` LongTensor `[k + 1]`). Built once
        per step and n, on the CPU."""
        key = ("segments", n)
        if key not in self._plans:
            per = self._groups(n)
            seg = torch.tensor([0] + [len(p) for p in per]).cumsum(0)
            self._plans[key] = (torch.cat(per), seg)
        return self._plans[key]

    def _groups(self, n: int) -> list[torch.Tensor]:
        """For each slot lo..hi-1, the ids of the `n` tokens that use it (LongTensors, CPU)."""
        key = ("groups", n)
        if key not in self._plans:
            lo, hi = self.used
            token_slot = torch.tensor(self.slots).repeat(n // len(self.slots))
            self._plans[key] = [torch.nonzero(token_slot == j).flatten() for j in range(lo, hi)]
        return self._plans[key]


def _runs(rows: list[torch.Tensor]) -> torch.Tensor:
    """`[n, 4]` LongTensor of (part, first column of `b_all`, first output row, length): the
    parts' columns cut into runs of consecutive output rows (one run a part, except for QKV,
    whose parts' rows interleave per KV group)."""
    runs, col = [], 0
    for part, r in enumerate(rows):
        r = r.tolist()
        for w, row in enumerate(r):
            if w and row == r[w - 1] + 1:
                runs[-1][3] += 1
            else:
                runs.append([part, col + w, row, 1])
        col += len(r)
    return torch.tensor(runs, dtype=torch.long).reshape(-1, 4)


class MultiLoRA:
    """The stacked adapters of one linear `layer` (a `ColumnParallelLinear` without
    gather_output, or a `RowParallelLinear`): `a [slots, in/tp or in, parts x R]` (A
    transposed) and `b_all [slots, R, out local]` (each part's B_i transposed, side by side;
    `b[i]` the view of part i), zeros until `set` fills a slot.
    `part_rows`: for a fused column-parallel layer (QKV, SwiGLU's [gate; up]), the local
    output rows of each part (a LongTensor each; None: one part, every row), so that each
    part's B multiplies only its own rank block (no zero blocks are read). Attaches a forward
    hook adding the deltas for the rows `batch` binds. Raises `ValueError` for another kind
    of layer."""

    def __init__(self, layer, rank: int, slots: int, batch: LoRABatch, part_rows=None):
        if isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
            in_f, out_f, self.row = layer.input_size, layer.output_size_per_partition, False
        elif isinstance(layer, RowParallelLinear):
            in_f, out_f, self.row = layer.input_size_per_partition, layer.output_size, True
        else:
            raise ValueError(f"LoRA slots go on a column- or row-parallel linear, not "
                             f"{type(layer).__name__}")
        w = layer.weight  # a float tensor, or a low-bit `QuantizedWeight` (then float32)
        dtype = w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() \
            else torch.float32
        rows = [torch.arange(out_f)] if part_rows is None else list(part_rows)
        cols = torch.cat(rows)
        if not torch.equal(cols.sort().values, torch.arange(out_f)):
            raise ValueError(f"part_rows must split the {out_f} output rows among the parts")
        self.layer, self.batch, self.rank = layer, batch, rank
        # A transposed, [slots, in, parts x R]: what the shrink kernel and `bmm` read
        self.a = torch.zeros(slots, in_f, len(rows) * rank, dtype=dtype, device=w.device)
        # every part's B^T side by side, [slots, R, out local]; `b` its parts (views)
        self.b_all = torch.zeros(slots, rank, out_f, dtype=dtype, device=w.device)
        widths = [len(r) for r in rows]
        self.b = list(self.b_all.split(widths, dim=2))
        self.rows = [r.to(w.device) for r in rows]
        self.runs = _runs(rows)
        # the SGMV kernels' case (serving float32 on a CPU; layers/lora_kernels.py)
        self._sgmv = dtype == torch.float32 and w.device.type == "cpu"
        # the parts' deltas side by side, as columns in output order (None: they are)
        self.order = None if torch.equal(cols, torch.arange(out_f)) else \
            cols.argsort().to(w.device)
        self.filled = [False] * slots  # slots holding an adapter that targets this layer
        self._views: dict = {}  # (lo, hi) -> the used slots' A^T and B_i^T (views), or None
        self.handle = layer.register_forward_hook(self._hook)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b_all.nbytes

    def set(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` holds `a [parts x R, in local]`, `b [out local, parts x R]` (this rank's
        shards, part i's rank block in rows / columns `i R .. (i + 1) R`, zero outside its
        rows; None: zeros, the adapter does not target this layer)."""
        self.a[slot].zero_()
        for i, part in enumerate(self.b):
            part[slot].zero_()
            if a is not None:
                part[slot].copy_(b[self.rows[i], i * self.rank:(i + 1) * self.rank].t())
        if a is not None:
            self.a[slot].copy_(a.t())
        self.filled[slot] = a is not None
        self._views = {}

    def _used(self, lo: int, hi: int):
        """`(A^T [k, in, parts x R], [B_i^T [k, R, its rows]])` of slots lo..hi-1 (k of
        them), views (the slots are contiguous blocks); None when no adapter in those slots
        targets this layer."""
        key = (lo, hi)
        if key not in self._views:
            self._views[key] = (self.a[lo:hi], [b[lo:hi] for b in self.b]) \
                if any(self.filled[lo:hi]) else None
        return self._views[key]

    def _hook(self, layer, args, out):
        used = self.batch.used
        if used is None:
            return out
        views = self._used(*used)
        if views is None:
            return out
        x = args[0]
        if (self._sgmv and x.dtype == out.dtype == torch.float32 and
                not torch.is_grad_enabled() and out.is_contiguous()):
            ext = lora_kernels.extension()
            if ext is not None:
                return self._add_sgmv(ext, x, out, used[0])
        threads = torch.get_num_threads()
        if threads > 1:  # see the module docstring: small GEMMs, one thread
            torch.set_num_threads(1)
        try:
            return self._add(args[0], out, *views)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

    def _add_sgmv(self, ext, x, out, lo: int):
        """`out [s, b, out local]` (float32, contiguous) plus, in place, the deltas of the
        bound rows of `x [s, b, in local]` by the SGMV kernels (serving, no grad)."""
        tokens, seg = self.batch.segments(x.numel() // x.shape[-1])
        if self.row and get_tensor_model_parallel_world_size() > 1:
            x = x.reshape(-1, x.shape[-1]).contiguous()
            xa = ext.shrink(x, self.a, lo, tokens, seg)  # [tokens, parts x R], partial sums
            ext.expand(reduce_from_tensor_model_parallel_region(xa), self.b_all, self.runs, lo,
                       tokens, seg, out.view(-1, out.shape[-1]))
        else:
            ext.add(x, self.a, self.b_all, self.runs, lo, tokens, seg, out)
        return out

    def _add(self, x, out, a_t, b_t):
        """`out [s, b, out local]` plus the deltas of the bound rows of `x [s, b, in local]`
        (in place while serving: no grad, `out` of the slots' dtype)."""
        r = self.rank
        x = x.reshape(-1, x.shape[-1])
        k, m, take, valid = self.batch.plan(x.shape[0], self.a.dtype)
        xs = x.index_select(0, take).view(k, m, -1)  # each used slot's tokens
        if xs.dtype != self.a.dtype:
            xs = xs.to(self.a.dtype)
        xa = torch.bmm(xs, a_t)  # [k, m, parts x R]
        if self.row:
            xa = reduce_from_tensor_model_parallel_region(xa)
        if valid is not None:
            xa = xa * valid
        d = [torch.bmm(xa if len(b_t) == 1 else xa[..., i * r:(i + 1) * r], b)
             for i, b in enumerate(b_t)]  # [k, m, its rows] each
        d = (d[0] if len(d) == 1 else torch.cat(d, -1)).view(k * m, -1)
        if self.order is not None:  # QKV: the parts' rows interleave per KV group
            d = d.index_select(1, self.order)
        serving = out.dtype == self.a.dtype and not torch.is_grad_enabled()
        y = out.view(-1, out.shape[-1]) if serving else \
            torch.zeros(x.shape[0], out.shape[-1], dtype=d.dtype, device=d.device)
        y.index_add_(0, take, d)
        return out if serving else out + y.view(out.shape).to(out.dtype)
