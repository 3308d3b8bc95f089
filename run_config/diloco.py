"""Checks of --diloco-sync-every and its outer optimizer (training/diloco.py), and of
--straggler-threshold (training/stragglers.py): values, and the settings DiLoCo cannot run with,
refused with `ConfigError` before any process-group work (called from run_config/checks.py)."""
from __future__ import annotations

import math

from models.config import ConfigError

from .train_config import TrainConfig


def check_diloco(t: TrainConfig) -> None:
    """Raise `ConfigError` naming the flag and the fix; `t.data_parallel_sharding_strategy`
    must already be resolved (checks.py `_check_sharding`)."""
    if t.straggler_threshold is not None and not 1.0 < t.straggler_threshold < math.inf:
        raise ConfigError(f"--straggler-threshold must be a finite ratio above 1 (a rank's "
                          f"compute time over the median rank's), got {t.straggler_threshold}")
    h = t.diloco_sync_every
    if h is None:
        return
    if h < 1:
        raise ConfigError(f"--diloco-sync-every must be a positive integer (inner steps between "
                          f"outer steps), got {h}")
    if not 0.0 < t.diloco_outer_lr < math.inf or not 0.0 <= t.diloco_outer_momentum < 1.0:
        raise ConfigError(f"need a finite --diloco-outer-lr > 0 (got {t.diloco_outer_lr}) and "
                          f"0 <= --diloco-outer-momentum < 1 (got {t.diloco_outer_momentum})")
    hash_every = t.check_weight_hash_across_dp_replicas_interval
    refused = [(t.data_parallel_sharding_strategy not in (None, "no_shard"),
                f"--data-parallel-sharding-strategy {t.data_parallel_sharding_strategy} (or "
                f"--use-distributed-optimizer) shards the optimizer over dp, which needs every "
                f"step's gradient reduction that DiLoCo leaves out; drop it (each replica keeps "
                f"its own full AdamW)"),
               (t.bf16 or t.optimizer_cpu_offload,
                "--bf16 / optimizer offload keep the main weights in the distributed "
                "optimizer, which DiLoCo's outer step does not drive; train in float32 "
                "without offload"),
               (t.expert_model_parallel_size > 1,
                "--expert-model-parallel-size > 1 splits experts over the data-parallel ranks, "
                "so a replica would not hold its whole model; use --ep 1"),
               (t.context_parallel_size > 1,
                "--context-parallel-size > 1 with DiLoCo is not built; use --cp 1"),
               (bool(hash_every) and hash_every % h,
                f"--check-weight-hash-across-dp-replicas-interval {hash_every} must be a "
                f"multiple of it: replicas differ between outer steps"),
               (bool(t.eval_interval) and t.eval_interval % h,
                f"--eval-interval {t.eval_interval} must be a multiple of it: between outer "
                f"steps the replicas hold different weights, and validation should see the "
                f"global copy")]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"--diloco-sync-every {h}: {why}")
