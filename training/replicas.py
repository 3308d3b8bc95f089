"""Replicas that must hold the same weights are checked to hold them
(--check-weight-hash-across-dp-replicas-interval N, Megatron's flag; nanotron checks its
replicas the same way).

Every N steps each rank hashes (sha256 of the bytes) every parameter of its model chunks and
compares the hashes

- across its data-parallel group: every parameter (each DP replica holds the whole of its
  stage and TP shard; under ZeRO-3 the DP ranks hold different shards, so the check gathers
  the parameters first and compares the gathered copies: nothing to find there, but the TP
  check below still runs). A routed expert's weight at expert parallelism > 1 holds another
  block of experts on each EP rank, so it is compared across the expert-data-parallel group
  only (the ranks holding the same experts);
- across its tensor-parallel group: the parameters TP does not shard (norms, the biases of
  row-parallel layers, learned positions), which every TP rank holds whole. Their gradients
  are equal by construction (replicated inputs) or all-reduced (sequence parallelism), so a
  difference means a rank computed something else: dropout masks that differ, a missed
  reduction, a bit flip.

The verdict is agreed by the whole world (one all-reduce), so every rank stops together with
`ReplicaMismatchError`, naming each differing parameter and the ranks on each side.
"""
from __future__ import annotations

import hashlib

import torch

import parallel_state as ps
from data_parallel.grad_norm import is_expert_parallel
from parallel_state import collectives


class ReplicaMismatchError(RuntimeError):
    """Weights that must be identical on several ranks differ."""


def _digest(p: torch.Tensor) -> int:
    # a copy: numpy() would pin the parameter's own storage (ZeRO-3 resizes it)
    data = p.detach().to("cpu", copy=True).contiguous().view(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


def _compare(named: list[tuple[str, torch.Tensor]], group, what: str) -> list[str]:
    """Problems: the parameters whose hashes differ across `group`, with the ranks of each
    distinct value (global ranks)."""
    size = torch.distributed.get_world_size(group)
    if size == 1 or not named:
        return []
    mine = torch.tensor([_digest(p) for _, p in named], dtype=torch.int64,
                        device=ps.get_device())
    gathered = [torch.empty_like(mine) for _ in range(size)]
    collectives.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()  # [group size, parameters]
    ranks = collectives.group_ranks(group)
    problems = []
    for j, (name, _) in enumerate(named):
        column = table[:, j].tolist()
        if len(set(column)) > 1:
            sides = {}
            for rank, value in zip(ranks, column):
                sides.setdefault(value, []).append(rank)
            problems.append(f"{name} differs across {what}: ranks "
                            f"{' vs '.join(str(r) for r in sides.values())}")
    return problems


def check_replicas(model: list, iteration: int) -> None:
    """Compare the weights of `model` (this rank's chunks, DDP-wrapped or not) across DP
    replicas and across TP ranks for TP-replicated parameters (module docstring).
    Collective over the world. Raises `ReplicaMismatchError` on every rank if any differ."""
    for ddp in model:
        if hasattr(ddp, "finish_param_sync"):
            ddp.finish_param_sync()  # in-flight all-gathers; ZeRO-3: gather every unit
    named = [(name, p) for chunk in model
             for name, p in getattr(chunk, "module", chunk).named_parameters()
             if p.numel() > 0]
    dense = [(n, p) for n, p in named if not is_expert_parallel(p)]
    problems = _compare(dense, ps.get_data_parallel_group(with_context_parallel=True),
                        "data-parallel replicas")
    problems += _compare([(n, p) for n, p in named if is_expert_parallel(p)],
                         ps.get_expert_data_parallel_group(),
                         "expert-data-parallel replicas (the ranks holding these experts)")
    replicated = [(n, p) for n, p in named if not getattr(p, "tensor_model_parallel", False)
                  and getattr(p, "kv_replicas", 1) == 1]
    problems += _compare(replicated, ps.get_tensor_model_parallel_group(),
                         "tensor-parallel ranks (a TP-replicated parameter)")
    for ddp in model:
        if hasattr(ddp, "release_params"):
            ddp.release_params()
    flag = torch.tensor([len(problems)], dtype=torch.int64, device=ps.get_device())
    collectives.all_reduce(flag)
    if int(flag) == 0:
        return
    everyone = [None] * torch.distributed.get_world_size()
    collectives.all_gather_object(everyone, problems)
    lines = sorted({line for found in everyone for line in found})
    raise ReplicaMismatchError(
        f"after iteration {iteration}, weights differ between ranks that must hold the same "
        f"values ({len(lines)} difference(s)): " + "; ".join(lines[:20])
        + (f"; ... {len(lines) - 20} more" if len(lines) > 20 else "")
        + ". Nothing was saved after this step; a checkpoint written at or before the last "
          "passing check holds consistent weights. Look for what these ranks compute "
          "differently")
