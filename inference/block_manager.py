"""The KV cache's book-keeping: fixed-size blocks of `block_size` token positions, a free list,
per-request block tables, and automatic prefix caching (Kwon et al. 2023, "PagedAttention",
sec. 4; vLLM's block pool and prefix cache).

No tensors here: a block is an id; `inference/kv_cache.py` (`PagedKVCache`) holds the keys and
values of block `i` at rows `i * block_size .. (i + 1) * block_size - 1` of every layer's pool.
A request's block table (a list of ids the request keeps) maps its token position p to block
`table[p // block_size]`, offset `p % block_size`.

Prefix caching: a full block is named by `block_hash(parent hash, its token ids)` (SHA-256
over the ids, so every rank of a replica and every run computes the same names; Python's
`hash` is salted per process). Blocks are reference-counted: requests whose token streams
start the same share the blocks of the common full blocks. A block whose count drops to 0
goes to the back of the free list but keeps its hash, so a later request can still hit it;
allocation takes from the front, i.e. evicts the least recently freed cached block first
(LRU; a request's blocks are freed tail first, so a prefix outlives its continuations).
Only full blocks are shared, and a request never writes into a block it did not allocate
for itself, so no copy-on-write is needed.

Placement (`region_blocks` R, the blocks of one max-length request): a request that starts
with no cached block takes the first blocks of a region `first_block + j R ..` that no
request holds, and a table grows into the block after its last one, each only while that
block is free and holds no cached prefix (placement never evicts: the prefix cache stays
LRU). Rows placed so sit at a uniform stride in the pools, and the paged cache then reads a
decode batch as one strided view instead of gathering it (the slot cache's layout, kept
while the cache has room); otherwise blocks come from the front of the free list.

Every rank of a replica calls the same methods in the same order, so the tables are the same
everywhere without communication (see inference/engine.py).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import torch

NULL_BLOCK = 0  # never allocated: table padding and padded rows' writes point here


def block_tables(block_lists, num_blocks: int) -> torch.Tensor:
    """`[b, num_blocks]` int64 block tables of a batch: each row's first `num_blocks`
    blocks of `block_lists[i]`, padded with `NULL_BLOCK` past its own."""
    return torch.tensor([blocks[:num_blocks] + [NULL_BLOCK] * (num_blocks - len(blocks))
                         for blocks in block_lists], dtype=torch.int64).view(-1, num_blocks)


def block_hash(parent: bytes | None, token_ids) -> bytes:
    """The name of a full block: SHA-256 (first 16 bytes) of the parent block's name (b"" for
    the first block) and the block's token ids as little-endian int64."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256((parent or b"") + data).digest()[:16]


def token_block_hashes(tokens, block_size: int, known: list[bytes],
                       root: bytes | None = None) -> list[bytes]:
    """`known` (the names of the first full blocks of `tokens`, computed before) extended in
    place to every full block of `tokens`; returns it. `root`: the first block's parent
    name (a request's LoRA adapter, inference/lora.py: the same tokens under another root
    never share a block)."""
    for i in range(len(known), len(tokens) // block_size):
        known.append(block_hash(known[-1] if known else root,
                                tokens[i * block_size:(i + 1) * block_size]))
    return known


class BlockManager:
    """Blocks `first_block .. num_blocks - 1` of one replica's KV cache (block 0 is the
    paged cache's `NULL_BLOCK` when `first_block` is 1).

    Args:
        num_blocks: blocks in the cache, counting the reserved ones below `first_block`.
        block_size: token positions per block.
        enable_prefix_caching: keep full blocks named by `block_hash` for reuse.
        first_block: the lowest id handed out.
        region_blocks: blocks of one placement region (see the module docstring); None =
            no placement, the front of the free list always.
    Raises `ValueError` when no block is left to hand out.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 first_block: int = 1, region_blocks: int | None = None):
        if block_size < 1:
            raise ValueError(f"--kv-block-size must be >= 1, got {block_size}")
        if num_blocks - first_block < 1:
            raise ValueError(f"the KV cache holds no block of {block_size} tokens; raise "
                             f"--kv-cache-memory")
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.num_blocks, self.first_block = num_blocks, first_block
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block name -> block holding it
        # blocks with no reference, least recently freed first (cached ones keep their name)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(first_block, num_blocks))
        self.region = region_blocks if region_blocks and region_blocks > 0 else None
        regions = (num_blocks - first_block) // self.region if self.region else 0
        self.held = [0] * regions  # blocks with references, per placement region

    @property
    def capacity(self) -> int:
        """Blocks a request may hold at most (every block but the reserved ones)."""
        return self.num_blocks - self.first_block

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now (free, or cached with no reference)."""
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of the blocks held by requests (0-1); cached free blocks count as free."""
        return 1 - self.num_free / self.capacity

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match(self, hashes: list[bytes], max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, at most `max_blocks` (none
        without prefix caching); nothing is taken until `allocate(cached=...)`."""
        blocks = []
        if self.enable_prefix_caching:
            for h in hashes[:max_blocks]:
                b = self.cached.get(h)
                if b is None:
                    break
                blocks.append(b)
        return blocks

    def allocate(self, table: list[int], num_tokens: int, cached: list[int] = ()) -> bool:
        """Extend `table` so that it covers positions 0..num_tokens-1: first with the
        `cached` blocks (from `match`, shared: one more reference each), then with blocks
        from the front of the free list. False, and nothing changed, when too few are free."""
        need = self.blocks_for(num_tokens) - len(table) - len(cached)
        idle = sum(self.ref[b] == 0 for b in cached)  # cached blocks that leave the free list
        if need > self.num_free - idle:
            return False
        for b in cached:
            self._take(b, keep_name=True)
            table.append(b)
        for _ in range(max(need, 0)):
            b = self._placed(table)
            self._take(b, keep_name=False)
            table.append(b)
        return True

    def _placed(self, table: list[int]) -> int:
        """The free block `table` grows into: the next one in its region's order, else the
        front of the free list (module docstring, "Placement")."""
        if self.region:
            if table:
                b = table[-1] + 1
                if b < self.num_blocks and self.ref[b] == 0 and self.hash_of[b] is None:
                    return b
            else:  # a region no request holds, its first block not a cached one
                b = next((self.first_block + j * self.region for j, n in enumerate(self.held)
                          if n == 0 and self.hash_of[self.first_block + j * self.region]
                          is None), None)
                if b is not None:
                    return b
        return next(iter(self.free_queue))

    def _take(self, b: int, keep_name: bool) -> None:
        """One more reference to `b`; a free block taken for new contents loses its name."""
        if self.ref[b] == 0:
            del self.free_queue[b]
            self._count(b, 1)
            h = self.hash_of[b]
            if h is not None and not keep_name:  # evicted from the prefix cache
                del self.cached[h]
                self.hash_of[b] = None
        self.ref[b] += 1

    def _count(self, b: int, change: int) -> None:
        if self.region:
            j = (b - self.first_block) // self.region
            if j < len(self.held):
                self.held[j] += change

    def register(self, table: list[int], hashes: list[bytes], start: int, end: int) -> None:
        """Name blocks `table[start:end]` (full, their contents computed or being computed
        by a forward already launched) with `hashes[start:end]`, so later requests can share
        them. A name another block holds already stays there."""
        if not self.enable_prefix_caching:
            return
        for i in range(start, min(end, len(hashes), len(table))):
            b, h = table[i], hashes[i]
            if self.hash_of[b] is None and h not in self.cached:
                self.hash_of[b] = h
                self.cached[h] = b

    def free(self, table: list[int]) -> None:
        """Drop `table`'s references (tail first, so its prefix is evicted last) and clear
        it."""
        for b in reversed(table):
            self.ref[b] -= 1
            if self.ref[b] < 0:
                raise RuntimeError(f"KV cache block {b} freed more often than taken")
            if self.ref[b] == 0:
                self._count(b, -1)
                if self.hash_of[b] is None:  # nothing to keep: reuse it first
                    self.free_queue[b] = None
                    self.free_queue.move_to_end(b, last=False)
                else:
                    self.free_queue[b] = None
        table.clear()
