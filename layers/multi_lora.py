"""Many LoRA adapters over one frozen linear layer, one adapter per batch row (serving:
inference/lora.py).

Each targeted linear holds `slots` stacked adapters, `A [slots, R, in]` and `B [out, slots,
R]`; a forward's rows name their adapter in `LoRABatch` (or none: the base), and the deltas
`B_k (A_k x)` of every row are computed at once with two GEMMs over the stacked ranks of the
adapters the batch uses: `X [n, in] @ A_used^T -> [n, k R]`, each row's columns outside its
own adapter's block zeroed by a mask, then `@ B_used^T -> [n, out]`. Each adapter in use is
read once per step whatever the rows (the weights, not the FLOPs, bound decode); no pass per
adapter and no per-row copy of the weights (Punica's BGMV gathers per row, Chen et al. 2023;
S-LoRA's MBGMM, Sheng et al. 2023, reads each adapter once per segment). The adapters used
are the contiguous range of slots from the lowest to the highest one named (slots are
handed out lowest first, so this is usually exactly them): a view, never a copy. Against
gathering each row's A and B and two `torch.bmm` (Punica's BGMV form), SmolLM2's linears
at 8 decode rows over 3 adapters of rank 16 took 2-10x less time per hook (e.g. QKV ~0.1 ms
against 0.6-1.2 ms; 2-core CPU, 24 GiB, a loaded machine, 2026-12-05), since the gathered
form copies every row's weights each step; bench/lora_throughput.py's mixed batch decoded at
0.66-0.67x of the base alone against 0.54x gathered (2026-12-06, a quiet moment).

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


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
               reduce: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """`delta[t] = (mask[t] * (A x[t])) B^T` for `x [..., in]` (n tokens), the used adapters'
    `a [k R, in]` and `b [out, k R]`, `mask [n, k R]` -> `[n, out]`; `reduce`: the shrunk
    `A x` summed over TP first (a row-parallel base). `out` `[n, out]`: added into it in place
    (one fused GEMM + add, no new tensor) and returned."""
    xa = x.reshape(-1, x.shape[-1]) @ a.t()  # [n, k R]
    if reduce:
        xa = reduce_from_tensor_model_parallel_region(xa)
    xa = xa * mask
    return xa @ b.t() if out is None else out.addmm_(xa, b.t())


class MultiLoRA:
    """The stacked adapters of one linear `layer` (a `ColumnParallelLinear` without
    gather_output, or a `RowParallelLinear`): `a [slots, R, in/tp or in]`, `b [out/tp or out,
    slots, R]`, zeros until `set` fills a slot. Attaches a forward hook adding `lora_delta`
    for the rows `batch` binds. Raises `ValueError` for another kind of layer."""

    def __init__(self, layer, rank: int, slots: int, batch: LoRABatch):
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
        self.layer, self.batch = layer, batch
        self.a = torch.zeros(slots, rank, in_f, dtype=dtype, device=w.device)
        self.b = torch.zeros(out_f, slots, rank, dtype=dtype, device=w.device)
        self.rank = rank
        self.handle = layer.register_forward_hook(self._hook)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def set(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` holds `a [R, in local]`, `b [out local, R]` (this rank's shards; None:
        zeros, the adapter does not target this layer)."""
        self.a[slot].zero_()
        self.b[:, slot].zero_()
        if a is not None:
            self.a[slot].copy_(a)
            self.b[:, slot].copy_(b)

    def _hook(self, layer, args, out):
        used = self.batch.used
        if used is None:
            return out
        x, (lo, hi) = args[0], used
        a = self.a[lo:hi].flatten(0, 1)  # views: the slots are contiguous blocks
        b = self.b[:, lo:hi].flatten(1)
        mask = self.batch.mask(x.numel() // x.shape[-1] // self.batch.rows.numel(), self.rank,
                               self.a.dtype)
        x = x.to(self.a.dtype)
        if out.dtype == self.a.dtype and not torch.is_grad_enabled():  # serving: in place
            lora_delta(x, a, b, mask, self.row, out.view(-1, out.shape[-1]))
            return out
        return out + lora_delta(x, a, b, mask, self.row).view(out.shape).to(out.dtype)
