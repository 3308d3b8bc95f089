"""Every collective the inference engine and controller issue, in one module; each goes
through parallel_state.collectives (observed like training's).

- `broadcast_tokens(tokens [b] | None, b)`: the sampled ids from the last pipeline stage's TP
  rank 0 to every rank of this model replica (tp x pp ranks).
- `broadcast_logprobs(values | None, rows, k)`: the same for the log-probabilities of the rows
  that asked for them (only on steps where some did).
- `replica_min(value)`: the smallest of an integer over the ranks of this model replica
  (start-up: the KV cache blocks every stage has room for).
- `broadcast_control(obj)`: a picklable object from global rank 0 to every rank.
- `gather_to_rank0(obj)`: a list (by global rank) of every rank's object on rank 0, None
  elsewhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import parallel_state as ps
from parallel_state import collectives


def replica_ranks() -> tuple[int, int]:
    """(global rank of this replica's first rank, of its last stage's TP rank 0)."""
    g = ps.get_grid()
    tp, dp, pp = (g.tensor_model_parallel_size, g.data_parallel_size,
                  g.pipeline_model_parallel_size)
    return g.dp_rank * tp, ((pp - 1) * dp + g.dp_rank) * tp


def broadcast_tokens(tokens: torch.Tensor | None, b: int) -> torch.Tensor:
    """`[b]` int64 ids, identical on every rank of the replica (source: last stage, tp 0)."""
    return _from_last_stage(tokens, (b,), torch.int64)


def broadcast_logprobs(values: torch.Tensor | None, rows: int, k: int) -> torch.Tensor:
    """`[rows, 1 + 2k]` float64 (inference/sampling.py `token_logprobs`: the rows that asked
    for log-probabilities), identical on every rank of the replica (source: last stage, tp 0).
    Called only on steps where some row asked, the same steps on every rank."""
    return _from_last_stage(values, (rows, 1 + 2 * k), torch.float64)


def broadcast_prompt_logprobs(values: torch.Tensor | None, rows: int, k: int) -> torch.Tensor:
    """`[rows, 2 + 2k]` float64 (inference/sampling.py `prompt_token_logprobs`: one prompt
    chunk's tokens), identical on every rank of the replica (source: last stage, tp 0)."""
    return _from_last_stage(values, (rows, 2 + 2 * k), torch.float64)


def _from_last_stage(t: torch.Tensor | None, shape: tuple, dtype) -> torch.Tensor:
    """`t` (given on the last stage's TP rank 0, None elsewhere) on every replica rank (CPU)."""
    g = ps.get_grid()
    if g.tensor_model_parallel_size * g.pipeline_model_parallel_size == 1:
        return t
    src = replica_ranks()[1]
    buf = t.to(dtype).contiguous() if dist.get_rank() == src else \
        torch.empty(shape, dtype=dtype, device=g.device)
    if buf.device.type == "cpu" and g.device.type == "cuda":
        buf = buf.to(g.device)
    collectives.broadcast(buf, src=src, group=g.model_parallel_group)
    return buf.cpu()


def replica_min(value: int) -> int:
    """The smallest `value` over this replica's tp x pp ranks (every rank calls it)."""
    g = ps.get_grid()
    if g.tensor_model_parallel_size * g.pipeline_model_parallel_size == 1:
        return value
    buf = torch.tensor([value], dtype=torch.int64, device=g.device)
    collectives.all_reduce(buf, op=dist.ReduceOp.MIN, group=g.model_parallel_group)
    return int(buf.cpu())


def broadcast_control(obj):
    """`obj` of global rank 0 on every rank."""
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    collectives.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_rank0(obj) -> list | None:
    """`[obj of rank 0, obj of rank 1, ...]` on rank 0, None elsewhere."""
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    collectives.gather_object(obj, out, dst=0)
    return out
