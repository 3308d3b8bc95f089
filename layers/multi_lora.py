"""Many LoRA adapters over one frozen linear layer, one adapter per batch row (serving:
inference/lora.py).

Each targeted linear holds `slots` stacked adapters: `A [slots, R, in]` and `B [slots, out,
R]` (slot 0 all zeros: the base model); a forward's rows name their slot in `LoRABatch.slots
[b]`, and the delta `B_slot (A_slot x)` of every row is computed at once: the rows' A and B
are gathered and multiplied with two batched GEMMs (`torch.bmm`), as Punica's BGMV kernel
does for decode (Chen et al. 2023; S-LoRA, Sheng et al. 2023) -- whatever mix of adapters the
batch holds, the cost is two GEMM calls per linear, never one pass per adapter.

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
    """The slot of each row of the forward in progress: `slots [b]` int64 (on the model's
    device), or None when no row uses an adapter (the hooks then do nothing)."""

    def __init__(self):
        self.slots: torch.Tensor | None = None


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               reduce: bool = False) -> torch.Tensor:
    """`delta[t, i] = B[slots[i]] A[slots[i]] x[t, i]` for `x [s, b, in]`, `a [slots, R, in]`,
    `b [slots, out, R]`, `slots [b]` -> `[s, b, out]`; `reduce`: the shrunk `A x` summed over
    TP first (a row-parallel base)."""
    xa = torch.bmm(x.transpose(0, 1), a[slots].transpose(1, 2))  # [b, s, R]
    if reduce:
        xa = reduce_from_tensor_model_parallel_region(xa)
    return torch.bmm(xa, b[slots].transpose(1, 2)).transpose(0, 1)  # [b, s, out] -> [s, b, out]


class MultiLoRA:
    """The stacked adapters of one linear `layer` (a `ColumnParallelLinear` without
    gather_output, or a `RowParallelLinear`): `a [slots, R, in/tp or in]`, `b [slots, out/tp
    or out, R]`, zeros until `set` fills a slot. Attaches a forward hook adding `lora_delta`
    for `batch.slots`. Raises `ValueError` for another kind of layer."""

    def __init__(self, layer, rank: int, slots: int, batch: LoRABatch):
        if isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
            in_f, out_f, self.row = layer.input_size, layer.output_size_per_partition, False
        elif isinstance(layer, RowParallelLinear):
            in_f, out_f, self.row = layer.input_size_per_partition, layer.output_size, True
        else:
            raise ValueError(f"LoRA slots go on a column- or row-parallel linear, not "
                             f"{type(layer).__name__}")
        w = layer.weight
        dtype = w.dtype if w.is_floating_point() else torch.float32
        self.layer, self.batch = layer, batch
        self.a = torch.zeros(slots, rank, in_f, dtype=dtype, device=w.device)
        self.b = torch.zeros(slots, out_f, rank, dtype=dtype, device=w.device)
        self.handle = layer.register_forward_hook(self._hook)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def set(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` holds `a [R, in local]`, `b [out local, R]` (this rank's shards; None:
        zeros, the adapter does not target this layer)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if a is not None:
            self.a[slot].copy_(a)
            self.b[slot].copy_(b)

    def _hook(self, layer, args, out):
        slots = self.batch.slots
        if slots is None:
            return out
        x = args[0]
        return out + lora_delta(x.to(self.a.dtype), self.a, self.b, slots, self.row).to(out.dtype)
