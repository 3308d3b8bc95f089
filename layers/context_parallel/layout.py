"""Which tokens of a sequence a context-parallel rank holds: causal load balance.

Under causal attention a query attends only earlier keys, so a plain split of the sequence
into cp contiguous parts gives the last rank cp times the work of the first. Cutting the
sequence into 2*cp equal chunks and giving rank r chunks r and 2*cp-1-r (one early, one late)
makes every rank's share of the causal triangle equal: rank r's queries see
(r + 1/2) + (2*cp - 1 - r + 1/2) = 2*cp chunk-lengths of keys, the same for every r. This is
the layout of Megatron-Core / TransformerEngine's context parallelism and of torchtitan's
head-tail load balancer (PyTorch's `_context_parallel` attention); Liu et al. 2023 (Ring
Attention) and Brandon et al. 2023 (Striped Attention) study the imbalance it removes.

Chunk c covers global positions `c*L .. (c+1)*L - 1` with `L = s / (2*cp)`; a rank's local
sequence is its two chunks concatenated, early first, so local order is global order.
"""
from __future__ import annotations

import torch


def check_divisible(seq_length: int, cp: int) -> int:
    """The chunk length `seq_length / (2*cp)`; raises ValueError naming
    --context-parallel-size when it is not a positive whole number of tokens."""
    if cp < 1:
        raise ValueError(f"context-parallel-size must be >= 1, got {cp}")
    if seq_length <= 0 or seq_length % (2 * cp) != 0:
        raise ValueError(
            f"sequence length {seq_length} is not divisible by 2 x --context-parallel-size "
            f"= {2 * cp} (each sequence is cut into 2*cp equal chunks for causal load "
            f"balance); pad or choose --seq-length a multiple of {2 * cp}")
    return seq_length // (2 * cp)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks `(rank, 2*cp-1-rank)` that CP rank `rank` holds, early one first."""
    if not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} is outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def split_for_context_parallel(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This CP rank's part of `x` along `dim` (length s): chunks `rank` and `2*cp-1-rank` of
    the 2*cp equal chunks, concatenated in that order -> length `s / cp` along `dim`.

    E.g. tokens `[b, s]` with dim 1, hidden states `[s, b, h]` with dim 0, q/k/v
    `[b, n, s, d]` with dim 2. cp 1 returns `x` itself. Raises ValueError naming
    --context-parallel-size when `s % (2*cp) != 0`, or for a rank outside 0..cp-1.
    """
    length = check_divisible(x.shape[dim], cp)
    first, second = chunk_ids(cp, rank)
    if cp == 1:
        return x
    return torch.cat([x.narrow(dim, first * length, length),
                      x.narrow(dim, second * length, length)], dim=dim)


def local_positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions `[seq_length // cp]` int64 of the tokens CP rank `rank` holds, in its
    local order (`split_for_context_parallel` of `arange(seq_length)`): what RoPE, masks,
    dropout keys and loss bookkeeping use. Raises as `split_for_context_parallel`."""
    length = check_divisible(seq_length, cp)
    first, second = chunk_ids(cp, rank)
    offsets = torch.arange(length, device=device)
    return torch.cat([offsets + first * length, offsets + second * length])


def chunk_ranges(seq_length: int, cp: int, rank: int) -> tuple[range, range]:
    """The global positions of rank `rank`'s two chunks as Python ranges (no tensors: what
    the ring's block plan reasons with)."""
    length = check_divisible(seq_length, cp)
    return tuple(range(c * length, (c + 1) * length) for c in chunk_ids(cp, rank))
