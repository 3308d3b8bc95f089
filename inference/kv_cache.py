"""Preallocated KV cache of one pipeline stage: per layer, `[slots, max_len, g, d]` keys and
values of this rank's local KV heads (g = num_query_groups / tp, or 1 when KV heads are
replicated). A request owns one slot for its lifetime; its token at position p lives at
`[slot, p]`, so rows of a batch sit at different lengths and no row is ever moved.
"""
from __future__ import annotations

import torch


class KVCache:
    """The cache `SelfAttention` talks to through `update(layer_number, k, v)`.

    Before each forward, `bind(slots [b] (CPU), positions [b, s], length)` says which slots the batch rows
    use and at which positions their new tokens go; `update` then writes the new `[b, g, s, d]`
    keys/values there and returns `[b, g, L, d]` for positions `0..L-1`, L = max position + 1
    (entries past a row's own length are stale and must be masked by the caller).
    """

    def __init__(self, layer_numbers, slots: int, max_len: int, groups: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (slots, max_len, groups, head_dim)
        self.max_len, self.slots = max_len, slots
        # zeros, not empty: masked entries still enter attention as 0 * value, and stale memory
        # may hold NaN (0 * NaN = NaN). Large zero tensors are lazily mapped pages on CPU.
        self.k = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        self.v = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        self._slots = self._pos = None
        self._length = 0

    def bind(self, slots: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        """`length` = max position + 1 (the caller knows it without a device sync)."""
        if length > self.max_len:
            raise ValueError(f"position {length - 1} is past the KV cache length "
                             f"{self.max_len} (--max-seq-length)")
        self._pos, self._length = positions, length
        first = int(slots[0])
        # consecutive slots (the usual case) are read as a view, not gathered into a copy
        self._run = slice(first, first + len(slots)) if torch.equal(
            slots, torch.arange(first, first + len(slots))) else None
        self._slots = slots.to(positions.device)

    def update(self, layer_number: int, k: torch.Tensor, v: torch.Tensor):
        kc, vc = self.k[layer_number], self.v[layer_number]
        rows = self._slots[:, None]
        kc[rows, self._pos] = k.transpose(1, 2).to(kc.dtype)  # [b, s, g, d]
        vc[rows, self._pos] = v.transpose(1, 2).to(vc.dtype)
        rows = self._run if self._run is not None else self._slots
        ks, vs = kc[rows, :self._length], vc[rows, :self._length]
        return ks.transpose(1, 2), vs.transpose(1, 2)
