"""Call and byte counting of every collective and p2p message, per group and op.

A `CommCounter` is a consumer of parallel_state.collectives (the one place every collective
passes): while registered (`with CommCounter() as c:` or `start()`/`stop()`) it adds each
observed call to `counts[(group, op)] = [calls, bytes]`. Off by default: nothing is counted
and no consumer is registered, so the collectives take their fast path.

What is counted, per rank (the same quantity the planner predicts, planner/):

- group: the group's label (`tp`, `dp`, `pp`, `embedding`, `mp`, `ep`, `edp`, `world`, ...);
  collectives on the TP group that move sequence shards (`all_gather_single`,
  `reduce_scatter_single`) are labelled `sp`, the all-reduces stay `tp`.
- op: the collective's name; a `batch_isend_irecv` counts each message as one `send` or
  `recv` call.
- bytes: the payload of this rank, `Call.nbytes`: the input tensor(s), i.e. the local shard
  for an all-gather, the full input for a reduce-scatter, the tensor for an all-reduce, the
  input for an all-to-all (every row this rank sends, its own split included), the message
  for a send or receive. Object collectives (pickled) count 0 bytes.

`gather_counts(counts)` sums them over all ranks (one all_gather_object on the world; call
it on every rank, after `stop()`).
"""
from __future__ import annotations

from . import collectives

_SEQUENCE_OPS = ("all_gather_single", "reduce_scatter_single")


class CommCounter(collectives.Consumer):
    """Counts calls and payload bytes per (group label, op) while registered."""

    def __init__(self):
        self.counts: dict[tuple[str, str], list[int]] = {}
        self.active = False

    def start(self, call: collectives.Call) -> None:  # noqa: D401 (the Consumer hook)
        counts = self.counts
        label = call.label.rsplit("/", 1)[-1]  # "world/dp": the dp dimension spans the world
        if call.messages is not None:
            for m in call.messages:
                key = (label, m.kind)
                entry = counts.get(key)
                if entry is None:
                    entry = counts[key] = [0, 0]
                entry[0] += 1
                entry[1] += m.tensor.numel() * m.tensor.element_size()
            return
        if label == "tp" and call.op in _SEQUENCE_OPS:
            label = "sp"
        key = (label, call.op)
        entry = counts.get(key)
        if entry is None:
            entry = counts[key] = [0, 0]
        entry[0] += 1
        entry[1] += call.nbytes

    def end(self, call, error) -> None:
        pass

    # ------------------------------------------------------------------ control
    def begin(self) -> "CommCounter":
        """Start counting (from zero)."""
        self.counts = {}
        if not self.active:
            collectives.add_consumer(self)
            self.active = True
        return self

    def stop(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Stop counting; returns `{(group, op): (calls, bytes)}` of this rank."""
        if self.active:
            collectives.remove_consumer(self)
            self.active = False
        return {k: (v[0], v[1]) for k, v in self.counts.items()}

    def __enter__(self) -> "CommCounter":
        return self.begin()

    def __exit__(self, *exc) -> None:
        self.stop()


def gather_counts(counts: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """Sum `{(group, op): (calls, bytes)}` over all ranks of the world (every rank calls it;
    each gets the sum). One object all-gather, not counted by any counter that is stopped."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(counts)
    everyone = [None] * dist.get_world_size()
    collectives.all_gather_object(everyone, counts)
    total: dict[tuple[str, str], list[int]] = {}
    for rank_counts in everyone:
        for key, (calls, nbytes) in rank_counts.items():
            entry = total.setdefault(key, [0, 0])
            entry[0] += calls
            entry[1] += nbytes
    return {k: (v[0], v[1]) for k, v in sorted(total.items())}
