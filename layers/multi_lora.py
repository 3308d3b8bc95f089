"""Many LoRA adapters over one frozen linear layer, one adapter per batch row (serving:
inference/lora.py).

Each targeted linear holds `slots` stacked adapters, `A [slots, parts x R, in]` and, per HF
part of a fused linear (QKV: q/k/v; SwiGLU's fc1: gate/up), `B_i^T [slots, R, its rows]`; a
forward's rows name their adapter in `LoRABatch` (or none: the base). As S-LoRA's MBGMM and
Punica's SGMV (Sheng et al. 2023, sec. 5; Chen et al. 2023) the tokens are grouped by
adapter: `LoRABatch.plan`, built once per step, lists each used slot's tokens, padded to the
largest group (m tokens; pads zeroed). Per hook: `x [n, in]` gathered into `[k, m, in]` (k
used slots, base rows left out), one `bmm` with the slots' `A^T` -> `[k, m, parts x R]`,
one `bmm` per part with its `B_i^T` -> `[k, m, its rows]`, the parts side by side (QKV's
columns put in output order, since its parts' rows interleave per KV group), and one
`index_add_` into the rows of the output. Each adapter in use is read once per step (the
used slots are the contiguous range from the lowest to the highest one named -- slots are
handed out lowest first -- a view, never a copy), each token multiplies only its own
adapter, and no zero block of B is read. Measured on SmolLM2-135M's shapes (30 layers x 4
hooks, 8 decode rows over 3 adapters of rank 16 + base, 2-core CPU, 24 GiB, 2026-12-06,
load average 4-9, one thread): 60 us a hook, against 78-98 us for the earlier form (`x @
A_used^T` over every used adapter's ranks for every row, a mask zeroing the other adapters'
columns, then per part `@ B_i^T`): that form did k times the FLOPs of this one (4x at this
mix), and GEMMs of 8 rows on a CPU core are bound by FLOPs (about 40 GFLOP/s), not bytes.
Gathering each row's A and B and two `bmm` (Punica's BGMV) copies every row's weights each
step (8 x 331 KB for QKV against 331 KB read once): 0.54x end to end (docs/PERFORMANCE.md).

The hook runs its GEMMs on one thread (`torch.set_num_threads(1)` for the hook, put back
after: 0.1 us a call): each is a few tens of microseconds, less than an OpenMP fork / join
costs on a shared host (the same hooks on both threads at load average 8-9: 1,100-3,300 us
a hook against 88 on one; the base's large GEMMs keep every thread).

Tensor parallelism (as peft's tp_layer and Megatron-Bridge shard LoRA): over a
column-parallel base the rank holds A whole and its rows of B (the base's output shard);
over a row-parallel base it holds its columns of A (the base's input shard) and B whole: the
partial `A x_i` `[k, m, R]` are summed over TP before B (one all-reduce of R values per
token and slot). The delta is added to the layer's output by a forward hook, so the layers
stay as they are.
"""
from __future__ import annotations

import torch

from parallel_state import reduce_from_tensor_model_parallel_region

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
            token_slot = torch.tensor(self.slots).repeat(n // len(self.slots))
            per = [torch.nonzero(token_slot == j).flatten() for j in range(lo, hi)]
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


class MultiLoRA:
    """The stacked adapters of one linear `layer` (a `ColumnParallelLinear` without
    gather_output, or a `RowParallelLinear`): `a [slots, parts x R, in/tp or in]` and, per
    part, `b[i] [slots, R, its rows]` (B_i transposed), zeros until `set` fills a slot.
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
        self.layer, self.batch, self.rank = layer, batch, rank
        self.a = torch.zeros(slots, len(rows) * rank, in_f, dtype=dtype, device=w.device)
        self.b = [torch.zeros(slots, rank, len(r), dtype=dtype, device=w.device) for r in rows]
        self.rows = [r.to(w.device) for r in rows]
        # the parts' deltas side by side, as columns in output order (None: they are)
        cols = torch.cat(rows)
        if not torch.equal(cols.sort().values, torch.arange(out_f)):
            raise ValueError(f"part_rows must split the {out_f} output rows among the parts")
        self.order = None if torch.equal(cols, torch.arange(out_f)) else \
            cols.argsort().to(w.device)
        self.filled = [False] * slots  # slots holding an adapter that targets this layer
        self._views: dict = {}  # (lo, hi) -> the used slots' A^T and B_i^T (views), or None
        self.handle = layer.register_forward_hook(self._hook)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(b.nbytes for b in self.b)

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
            self.a[slot].copy_(a)
        self.filled[slot] = a is not None
        self._views = {}

    def _used(self, lo: int, hi: int):
        """`(A^T [k, in, parts x R], [B_i^T [k, R, its rows]])` of slots lo..hi-1 (k of
        them), views (the slots are contiguous blocks); None when no adapter in those slots
        targets this layer."""
        key = (lo, hi)
        if key not in self._views:
            self._views[key] = (self.a[lo:hi].transpose(1, 2), [b[lo:hi] for b in self.b]) \
                if any(self.filled[lo:hi]) else None
        return self._views[key]

    def _hook(self, layer, args, out):
        used = self.batch.used
        if used is None:
            return out
        views = self._used(*used)
        if views is None:
            return out
        threads = torch.get_num_threads()
        if threads > 1:  # see the module docstring: small GEMMs, one thread
            torch.set_num_threads(1)
        try:
            return self._add(args[0], out, *views)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

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
