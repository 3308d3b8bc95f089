"""Activation recompute (Megatron's --recompute-granularity / -method / -num-layers).

Trade compute for memory: a checkpointed region keeps only its inputs for backward and runs
its forward again when the backward reaches it (Chen et al. 2016; policies of Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 5).

- ``full``: whole transformer layers are checkpointed, so a layer stores only its input
  (`2sbh` bytes in 16 bit, `2sbh/t` under sequence parallelism). ``uniform`` checkpoints every
  group of ``recompute_num_layers`` consecutive layers of a chunk as one unit (the last group
  may be shorter); ``block`` checkpoints only the first ``recompute_num_layers`` layers of each
  chunk and runs the rest normally (a chunk with fewer layers checkpoints all of them).
- ``selective``: only the core attention (`SelfAttention._core_attention`: SDPA and its
  dropout) is recomputed; it holds the `5as^2b` term of the paper's per-layer formula at a few
  percent of the layer's FLOPs (sec. 5).

Exact replay: `checkpoint` runs `torch.utils.checkpoint` (non-reentrant), which restores the
default generator for the recompute, and also replays dropout's key (the microbatch's sample
ids, layers/dropout.py) and the RNG tracker's named streams (Megatron's scheme): their values
at forward time are swapped in for the recompute (which runs in the backward, possibly while
another microbatch's forward is current) and the live ones put back afterwards, as
Megatron's CheckpointFunction does for the streams. Loss and gradients are then bitwise equal
to a run without recompute.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

import parallel_state as ps


def _tracker_replay_contexts():
    """(forward ctx, recompute ctx) for torch.utils.checkpoint's `context_fn`: called at
    forward time, so the tracker states captured here are the ones the forward drew from."""
    tracker = ps.get_rng_tracker()
    forward_states = tracker.get_states()
    sample_ids = ps.get_dropout_sample_ids()

    @contextlib.contextmanager
    def replay():
        live = tracker.get_states()
        tracker.set_states(forward_states)
        try:
            with ps.dropout_sample_ids(sample_ids):
                yield
        finally:
            tracker.set_states(live)

    return contextlib.nullcontext(), replay()


def checkpoint(function, *args):
    """`function(*args)` keeping only the tensor `args` for backward; the forward is run again
    in backward with the default generator and the RNG tracker's streams as they were, so
    dropout draws the same masks. Tensors must be passed as top-level `args` (not captured or
    nested) so that they are kept and seen by memory accounting."""
    return _torch_checkpoint(function, *args, use_reentrant=False,
                             context_fn=_tracker_replay_contexts)


def recompute_spans(num_layers: int, method: str, recompute_num_layers: int) -> list[tuple[int, int]]:
    """Positions `(start, stop)` of the layer groups of a chunk of `num_layers` layers that are
    each checkpointed as one unit (Megatron's `_checkpointed_forward`).

    >>> recompute_spans(5, "uniform", 2)
    [(0, 2), (2, 4), (4, 5)]
    >>> recompute_spans(5, "block", 2)
    [(0, 2)]
    """
    n = recompute_num_layers
    if n < 1:
        raise ValueError(f"recompute_num_layers must be >= 1, got {n}")
    if method == "uniform":
        return [(i, min(i + n, num_layers)) for i in range(0, num_layers, n)]
    if method == "block":
        return [(0, min(n, num_layers))] if num_layers else []
    raise ValueError(f"recompute method must be 'uniform' or 'block', got {method!r}")


def apply_recompute(chunk: torch.nn.Module, granularity: str | None, method: str | None = None,
                    num_layers: int | None = None) -> None:
    """Set the recompute policy on a model chunk (a module holding a `TransformerBlock` as
    `.decoder`, e.g. GPTModel, or T5Model's encoder and decoder blocks; selective recompute
    covers cross-attention too). Recompute acts only in training mode with grad enabled.

    Args:
        granularity: None (off), "full" or "selective".
        method, num_layers: for "full": "uniform" (default) / "block" and the group size /
            number of checkpointed layers (default 1). Ignored otherwise.
    """
    blocks = chunk.transformer_blocks() if hasattr(chunk, "transformer_blocks") else \
        [chunk.decoder]
    for block in blocks:
        _apply_to_block(block, granularity, method, num_layers)


def _attentions(layer):
    return [a for a in (layer.self_attention, getattr(layer, "cross_attention", None))
            if a is not None]


def _apply_to_block(block, granularity, method, num_layers) -> None:
    block.checkpoint_fn, block.recompute_spans = None, []
    for layer in block.layers.values():
        for attention in _attentions(layer):
            attention.checkpoint_fn = None
    if granularity is None:
        return
    if granularity == "full":
        block.checkpoint_fn = checkpoint
        block.recompute_spans = recompute_spans(len(block.layers), method or "uniform",
                                                num_layers or 1)
    elif granularity == "selective":
        for layer in block.layers.values():
            for attention in _attentions(layer):
                attention.checkpoint_fn = checkpoint
    else:
        raise ValueError(f"recompute granularity must be None, 'full' or 'selective', "
                         f"got {granularity!r}")
