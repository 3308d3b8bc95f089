"""Elastic data parallelism: what a restart at another world size changes.

Under `torchrun --nnodes MIN:MAX --rdzv-backend c10d` the elastic agent restarts the worker
group when a node is lost or joins, and the new group may be smaller or larger. Nothing in
shardzoo is tied to the world size it started with: `Config.validate(world_size)` re-derives
dp = world / (tp cp pp) and the microbatches per step (--global-batch-size / (micro x dp)) so
the global batch stays the same (or refuses, naming the sizes, when the new dp does not divide
it), `load_checkpoint` reshards the layout-free checkpoint onto the new layout, and the data
continues from `consumed_samples`, so the run follows the loss curve of an uninterrupted run of
the same global batch, up to float32 rounding of the other summation order (the RNG streams are
reseeded; dropout masks keyed by sample are the same at any layout). `elastic_notice` is the
one line such a resume prints.

Growing back needs `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in every agent's environment. By
default (torch >= 2.4) the agents share one TCP store with their workers, and the rank-0 agent
publishes its address (the MASTER_ADDR / MASTER_PORT keys of the rendezvous round) only in the
first round it is rank 0 (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
`next_rendezvous`). A node that joins a later round waits for that round's MASTER_ADDR, which
nobody writes: both agents fail with `DistStoreError: wait timeout ... MASTER_ADDR` (the
joining node) and `... role_info` (the running one). With the variable set, rank 0 publishes a
fresh address every round and the workers make their own store. `rejoin_warning` says so
when a run has shrunk under the shared store.
"""
from __future__ import annotations

import os


def elastic_notice(meta: dict, config, iteration: int, consumed: int) -> str | None:
    """The line a resume prints when the checkpoint's world size (metadata.json `layout`)
    differs from this run's, else None: old -> new world size, dp and microbatches per step
    at the kept global batch, the resharding, the data position."""
    old = meta.get("layout", {})
    t = config.train
    if old.get("world_size") in (None, config.world_size):
        return None
    old_dp, gbs = old.get("dp"), int(meta.get("global_batch_size") or t.global_batch_size)
    old_micro = old.get("micro_batch_size")
    old_mbs = gbs // (old_micro * old_dp) if old_micro and old_dp else None
    kept = ("keeping --global-batch-size " + str(gbs) if gbs == t.global_batch_size else
            f"with --global-batch-size {gbs} -> {t.global_batch_size}")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return (f"elastic restart: world size {old['world_size']} -> {config.world_size}"
            + (f" (torchrun restart {restart})" if restart not in (None, "0") else "")
            + f": dp {old_dp} -> {config.data_parallel_size}, "
            f"{old_mbs if old_mbs is not None else '?'} -> {config.num_microbatches} "
            f"microbatches of {t.micro_batch_size} per step, {kept}; checkpoint iteration "
            f"{iteration} resharded to tp {t.tensor_model_parallel_size} x pp "
            f"{t.pipeline_model_parallel_size} x dp {config.data_parallel_size}; the data "
            f"continues at sample {consumed}")


def rejoin_warning(meta: dict, config) -> str | None:
    """A warning when the world shrank (checkpoint `layout.world_size` > this run's) under
    torchrun's shared agent store (env TORCHELASTIC_USE_AGENT_STORE "True"): a node that joins
    later would time out (module docstring), unless every agent runs with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. None otherwise."""
    old = meta.get("layout", {}).get("world_size")
    if old is None or old <= config.world_size or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return ("WARNING: no node can re-join this job: torchrun's agents share their TCP store "
            "with the workers and the rank-0 agent does not publish MASTER_ADDR for later "
            "rendezvous rounds, so a joining agent and this one would fail with DistStoreError "
            "(wait timeout ... MASTER_ADDR); start every agent with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to let nodes join a running job")
