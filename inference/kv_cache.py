"""The KV caches of one pipeline stage, holding this rank's local KV heads (g =
num_query_groups / tp, or 1 when KV heads are replicated):

- `PagedKVCache` (decoder-only models): per layer, pools of fixed-size blocks; a request's
  block table (inference/block_manager.py) says where each of its positions lives.
- `KVCache` (T5's decoder, inference/seq2seq.py): per layer `[slots, max_len, g, d]`; a
  request owns one slot for its lifetime and its token at position p lives at `[slot, p]`.

In both, rows of a batch sit at different lengths and no row is ever moved.
"""
from __future__ import annotations

import torch


class LayerCache:
    """One layer's handle on a cache (`cache.layer(n)`): what its SelfAttention calls
    `update(k, v)` on and its CrossAttention `cross(compute)` (layers/attention.py); both
    go to the cache's `update(n, k, v)` / `cross(n, compute)`."""

    def __init__(self, cache, layer_number: int):
        self.cache, self.layer_number = cache, layer_number

    def update(self, k: torch.Tensor, v: torch.Tensor):
        return self.cache.update(self.layer_number, k, v)

    def cross(self, compute):
        return self.cache.cross(self.layer_number, compute)


class KVCache:
    """The cache `SelfAttention` talks to through its layer's handle (`layer(n).update(k, v)`).

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
        self._layers = {n: LayerCache(self, n) for n in layer_numbers}

    def layer(self, layer_number: int) -> LayerCache:
        return self._layers[layer_number]

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


class PagedKVCache:
    """The paged cache `SelfAttention` talks to through its layer's handle
    (`layer(n).update(k, v)`, `PagedLayerCache`): per
    layer, a pool of keys `[num_blocks, block_size, g, d]` and one of values, of this rank's
    local KV heads (g as for `KVCache`). Position p of a request lives in block
    `table[p // block_size]` of its block table (inference/block_manager.py), row
    `p % block_size`; block 0 (`NULL_BLOCK`) pads tables and takes padded rows' writes.

    Before each forward, `bind(tables [b, n] int64 (CPU), positions [b, s], length, fresh)`
    gives each row's table (n >= ceil(length / block_size), padded with 0) and its new
    tokens' positions; a layer's `update` writes the new `[b, g, s, d]` keys/values there and returns
    `[b, g, L, d]` for positions 0..L-1, L = `length` (max position + 1): the new keys
    themselves when `fresh` (every row starts at position 0: nothing cached to read), else
    the rows' blocks read through the tables: as one strided view of the pool when each
    row's blocks are consecutive and the rows evenly spaced (`_strided`; the block manager's
    placement makes that the usual case), else gathered into a workspace shared by the
    layers (one `index_select` per layer and tensor). Entries past a row's own length are stale and
    must be masked by the caller; the pools start zeroed (stale memory may hold NaN).

    `values=False`: one pool per layer, no values (multi-head latent attention's latent
    cache, layers/mla.py: `groups` 1, `head_dim` kv_lora_rank + qk_rope_head_dim); a layer
    then calls `update_latent(c)` on its handle.
    """

    def __init__(self, layer_numbers, num_blocks: int, block_size: int, groups: int,
                 head_dim: int, dtype: torch.dtype, device, values: bool = True):
        shape = (num_blocks, block_size, groups, head_dim)
        self.num_blocks, self.block_size, self.values = num_blocks, block_size, values
        self.k = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        self.v = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers} \
            if values else {}
        self._work = (torch.empty(0, dtype=dtype, device=device),) * (2 if values else 1)
        self._fresh, self._length, self._view = False, 0, None
        self._layers = {n: PagedLayerCache(self, n) for n in layer_numbers}

    def layer(self, layer_number: int) -> "PagedLayerCache":
        return self._layers[layer_number]

    @staticmethod
    def bytes_per_token(num_layers: int, groups: int, head_dim: int,
                        dtype: torch.dtype, values: bool = True) -> int:
        """Keys and values (only the one pool with `values=False`) of one token position over
        `num_layers` layers, in bytes."""
        pools = 2 if values else 1
        return pools * num_layers * groups * head_dim * \
            torch.empty((), dtype=dtype).element_size()

    def bind(self, tables: torch.Tensor, positions: torch.Tensor, length: int,
             fresh: bool = False) -> None:
        bs, dev = self.block_size, positions.device
        b, n = tables.shape[0], -(-length // bs)
        if tables.shape[1] < n:
            raise ValueError(f"block tables of {tables.shape[1]} blocks do not reach position "
                             f"{length - 1} (blocks of {bs} tokens)")
        tables = tables[:, :n]
        rows = tables.to(dev).gather(1, positions // bs)  # [b, s] block of each new token
        self._slots = (rows * bs + positions % bs).flatten()
        self._fresh, self._length, self._b, self._n = fresh, length, b, n
        if fresh:
            return
        self._view = self._strided(tables)
        if self._view is None:
            flat = tables.flatten()
            self._blocks = flat.to(dev)
            need = len(flat) * self.k[next(iter(self.k))][0].numel()
            if self._work[0].numel() < need:
                self._work = tuple(torch.empty(need, dtype=w.dtype, device=w.device)
                                   for w in self._work)

    def _strided(self, tables: torch.Tensor) -> tuple[int, int] | None:
        """`(first block, stride in blocks)` when row i's blocks are `first + i * stride +
        0, 1, ...` (its own ones; past them its table is padding, and the view then reads
        other blocks there, which the mask hides), so the rows can be read as one strided
        view of the pools; None otherwise."""
        rows = tables.tolist()  # a few Python comparisons beat a dozen tiny tensor ops
        n, base = len(rows[0]), [row[0] for row in rows]
        stride = base[1] - base[0] if len(rows) > 1 else n
        if min(base) == 0 or base[-1] + n > self.num_blocks or stride < 1:
            return None
        for i, row in enumerate(rows):
            first = base[0] + i * stride
            if any(blk != first + j for j, blk in enumerate(row) if blk):  # padding: 0
                return None
        return base[0], stride

    def _update(self, pool: torch.Tensor, new: torch.Tensor, work: torch.Tensor):
        n, bs, g, d = pool.shape
        rows = new.transpose(1, 2).reshape(-1, g, d)  # [b * s, g, d]
        if rows.dtype != pool.dtype:
            rows = rows.to(pool.dtype)
        pool.view(n * bs, g, d).index_copy_(0, self._slots, rows)
        if self._fresh:
            return new
        if self._view is not None:  # [b, g, L, d] straight from the pool
            first, stride = self._view
            return pool.as_strided((self._b, g, self._length, d),
                                   (stride * bs * g * d, d, g * d, 1), first * bs * g * d)
        m = len(self._blocks)
        if torch.compiler.is_compiling():  # torch's own gather: see `_gather_blocks`
            read = _gather_blocks(pool, self._blocks)
        else:
            read = torch.index_select(pool, 0, self._blocks,
                                      out=work[:m * bs * g * d].view(m, bs, g, d))
        return read.view(self._b, -1, g, d)[:, :self._length].transpose(1, 2)


# The gathered read as one opaque op under torch.compile: inductor's own gather kernel
# (elementwise, an index computed per element) took twice the time of torch's index_select
# (a copy per block) on SmolLM2 at batch 8. Registered through `torch.library.Library` for
# a low per-call cost (see layers/gemm.py).
_LIB = torch.library.Library("shardzoo", "FRAGMENT")
_LIB.define("gather_blocks(Tensor pool, Tensor blocks) -> Tensor")
_LIB.impl("gather_blocks", lambda pool, blocks: torch.index_select(pool, 0, blocks),
          "CompositeExplicitAutograd")
torch.library.register_fake(
    "shardzoo::gather_blocks",
    lambda pool, blocks: pool.new_empty((blocks.shape[0], *pool.shape[1:])), lib=_LIB)
_gather_blocks = torch.ops.shardzoo.gather_blocks.default


class PagedLayerCache:
    """Layer n's handle on a `PagedKVCache`: its own pools as attributes, the step's
    placement (`bind`) read from the cache. Under `torch.compile` (the engine's --compile) the
    pools are graph inputs and the placement's sizes symbolic, so every layer shares one
    graph and a new batch size or length compiles nothing new."""

    def __init__(self, cache: PagedKVCache, layer_number: int):
        self.cache = cache
        self.k, self.v = cache.k[layer_number], cache.v.get(layer_number)
        self.latent = not cache.values  # MLA's latent pool (`update_latent`), no K/V

    def update(self, k: torch.Tensor, v: torch.Tensor):
        """Write the new keys / values `[b, g, s, d]` of this layer and return its keys /
        values `[b, g, L, d]` for positions 0..L-1 (see `PagedKVCache`)."""
        work = self.cache._work
        return self.cache._update(self.k, k, work[0]), self.cache._update(self.v, v, work[1])

    def update_latent(self, c: torch.Tensor) -> torch.Tensor:
        """A latent cache's (`values=False`) `update`: write the new `[b, 1, s, d]` latents
        and return `[b, 1, L, d]` for positions 0..L-1."""
        return self.cache._update(self.k, c, self.cache._work[0])


def parse_memory(text: str) -> int | float:
    """`--kv-cache-memory`: bytes (`2147483648`, `2GiB`, `512MiB`, `1.5GB`; K/M/G/T with
    or without `i`, `B` optional) -> int, or a fraction of the free memory in (0, 1]
    (`0.5`) -> float. Raises `ValueError` naming the accepted forms."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):].strip()
    unit = unit[:-1] if unit.endswith("b") else unit
    try:
        value = float(num)
    except ValueError:
        value = float("nan")
    if unit not in units or not value > 0 or value == float("inf"):
        raise ValueError(f"--kv-cache-memory {text!r}: pass bytes (e.g. 2GiB, 512MiB, "
                         f"4000000000) or a fraction of the free memory in (0, 1] (e.g. 0.5)")
    if unit == "" and "." in num and value <= 1:
        return value
    nbytes = int(value * units[unit])
    if nbytes < 1:
        raise ValueError(f"--kv-cache-memory {text!r} is less than one byte")
    return nbytes
