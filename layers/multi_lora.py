"""Many LoRA adapters over one frozen linear layer, one adapter per batch row (serving:
inference/lora.py).

Each targeted linear holds `slots` stacked adapters, `A [slots, parts x R, in]` and, per HF
part of a fused linear (QKV: q/k/v; SwiGLU's fc1: gate/up), `B_i [its rows, slots, R]`; a
forward's rows name their adapter in `LoRABatch` (or none: the base), and the deltas
`B_k (A_k x)` of every row are computed at once over the stacked ranks of the adapters the
batch uses: `X [n, in] @ A_used^T -> [n, k parts R]`, each row's columns outside its own
adapter's block zeroed by a mask, then per part `@ B_i,used^T -> [n, its rows]`, added into
its rows of the output (a slice for SwiGLU's halves, `index_add_` for QKV's per-group rows).
Each adapter in use is read once per step whatever the rows (the weights, not the FLOPs,
bound decode), and no zero block: one B over all parts' ranks would read `parts` times the
B bytes (QKV 3x, fc1 2x); no pass per adapter and no per-row copy of the weights (Punica's
BGMV gathers per row, Chen et al. 2023; S-LoRA's MBGMM, Sheng et al. 2023, reads each adapter
once per segment). The adapters used are the contiguous range of slots from the lowest to
the highest one named (slots are handed out lowest first, so this is usually exactly them):
a view, never a copy. Against gathering each row's A and B and two `torch.bmm` (Punica's
BGMV form), SmolLM2's linears at 8 decode rows over 3 adapters of rank 16 took 2-10x less
time per hook (2-core CPU, 24 GiB, a loaded machine, 2026-12-05), since the gathered form
copies every row's weights each step.

Tensor parallelism (as peft's tp_layer and Megatron-Bridge shard LoRA): over a
column-parallel base the rank holds A whole and its rows of B (the base's output shard);
over a row-parallel base it holds its columns of A (the base's input shard) and B whole: the
partial `A_i x_i` `[s, b, R]` are summed over TP before B (one all-reduce of R values per
token). The delta is added to the layer's output by a forward hook, so the layers stay as
they are.
"""
from __future__ import annotations

import torch

from parallel_state import reduce_from_tensor_model_parallel_region

from .linear import ColumnParallelLinear, RowParallelLinear


class LoRABatch:
    """The adapters of the rows of the forward in progress (`bind`); `used` None when no row
    names one (the hooks then do nothing)."""

    def __init__(self):
        self.used: tuple[int, int] | None = None  # slot range [lo, hi) the rows use
        self.rows: torch.Tensor | None = None  # [b] each row's slot - lo (-1: base)
        self._masks: dict = {}

    def bind(self, slots: list[int], device) -> None:
        """Row i uses adapter slot `slots[i]` (0-based), or none (-1)."""
        used = [x for x in slots if x >= 0]
        self._masks = {}
        if not used:
            self.used = self.rows = None
            return
        lo, hi = min(used), max(used) + 1
        self.used = (lo, hi)
        self.rows = torch.tensor([x - lo if x >= 0 else -1 for x in slots], device=device)

    def mask(self, seq: int, rank: int, dtype) -> torch.Tensor:
        """`[seq x b, (hi - lo) x rank]`: 1 where a token's row uses the column's slot (row
        `t b + i` is position t of batch row i, as `[s, b, ...]` flattens)."""
        key = (seq, rank, dtype)
        if key not in self._masks:
            lo, hi = self.used
            cols = torch.arange(hi - lo, device=self.rows.device).repeat_interleave(rank)
            self._masks[key] = (self.rows.repeat(seq)[:, None] == cols[None, :]).to(dtype)
        return self._masks[key]


class MultiLoRA:
    """The stacked adapters of one linear `layer` (a `ColumnParallelLinear` without
    gather_output, or a `RowParallelLinear`): `a [slots, parts x R, in/tp or in]` and, per
    part, `b[i] [its rows, slots, R]`, zeros until `set` fills a slot. `part_rows`: for a
    fused column-parallel layer (QKV, SwiGLU's [gate; up]), the local output rows of each
    part (a LongTensor each; None: one part, every row), so that each part's B multiplies
    only its own rank block (no zero blocks are read). Attaches a forward hook adding the
    deltas for the rows `batch` binds. Raises `ValueError` for another kind of layer."""

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
        self.b = [torch.zeros(len(r), slots, rank, dtype=dtype, device=w.device) for r in rows]
        # where each part's rows go: a slice when contiguous (SwiGLU's halves), else indices
        self.rows = [slice(int(r[0]), int(r[-1]) + 1) if len(r) and
                     torch.equal(r, torch.arange(int(r[0]), int(r[0]) + len(r))) else
                     r.to(w.device) for r in rows]
        self.handle = layer.register_forward_hook(self._hook)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(b.nbytes for b in self.b)

    def set(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` holds `a [parts x R, in local]`, `b [out local, parts x R]` (this rank's
        shards, part i's rank block in columns `i R .. (i + 1) R`, zero outside its rows;
        None: zeros, the adapter does not target this layer)."""
        self.a[slot].zero_()
        for i, part in enumerate(self.b):
            part[:, slot].zero_()
            if a is not None:
                part[:, slot].copy_(b[self.rows[i], i * self.rank:(i + 1) * self.rank])
        if a is not None:
            self.a[slot].copy_(a)

    def _hook(self, layer, args, out):
        used = self.batch.used
        if used is None:
            return out
        x, (lo, hi) = args[0], used
        a = self.a[lo:hi].flatten(0, 1)  # a view: the slots are contiguous blocks
        parts = len(self.b)
        mask = self.batch.mask(x.numel() // x.shape[-1] // self.batch.rows.numel(),
                               parts * self.rank, self.a.dtype)
        xa = x.to(self.a.dtype).reshape(-1, x.shape[-1]) @ a.t()  # [n, k parts R]
        if self.row:
            xa = reduce_from_tensor_model_parallel_region(xa)
        xa = xa * mask
        serving = out.dtype == self.a.dtype and not torch.is_grad_enabled()
        y = out.view(-1, out.shape[-1]) if serving else \
            torch.zeros(xa.shape[0], out.shape[-1], dtype=xa.dtype, device=xa.device)
        if parts > 1:  # [n, k, parts, R]: part i's columns of every used slot
            xa = xa.view(xa.shape[0], hi - lo, parts, self.rank)
        for i, (b, rows) in enumerate(zip(self.b, self.rows)):
            xi = xa if parts == 1 else xa[:, :, i].reshape(xa.shape[0], -1)
            bi = b[:, lo:hi].flatten(1)  # [its rows, k R], a view
            if isinstance(rows, slice):
                y[:, rows].addmm_(xi, bi.t())
            else:
                y.index_add_(1, rows, xi @ bi.t())
        return out if serving else out + y.view(out.shape).to(out.dtype)
