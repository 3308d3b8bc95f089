"""The dense (unsharded) state of a model distributed over TP and PP ranks.

Parameter names already use global layer numbers, so gathering is: all-gather each tensor's
shards over TP and undo the sharding (layers.sharding.unshard_tensors), join a routed expert
weight's blocks of experts over the expert-parallel ranks (dim 0), then merge the
name->tensor maps of the pipeline stages. Vocab padding rows are cut off, so the result is the
same at any layout. Collective: every rank of the model-parallel group (and, with experts
split over ranks, of the expert-parallel group) must call it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import parallel_state as ps
from parallel_state import collectives
from layers import unshard_tensors
from layers.quantized import refuse_quantized
from layers.sharding import is_embedding_copy, tensor_parallel_size_of


@torch.no_grad()
def gather_full_state_dict(chunks) -> dict[str, torch.Tensor]:
    """`{name: dense float32 CPU tensor}` of all parameters of the model, on every rank.

    `chunks` are this rank's model chunks. The tied embedding's second copy on the last stage
    (`output_layer.weight`, `mtp.word_embeddings.weight`) is left out: it equals the embedding.
    Raises ValueError for low-bit weights (layers/quantized.py `refuse_quantized`).
    """
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        refuse_quantized(chunk, "gathering the dense float weights")
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if is_embedding_copy(name, p):
                continue
            t = p.detach().float().contiguous()
            split = tensor_parallel_size_of(p)  # tp, or expert TP for an expert weight
            if getattr(p, "tensor_model_parallel", False) and split > 1:
                parts = [torch.empty_like(t) for _ in range(split)]
                group = ps.get_expert_tensor_parallel_group() if getattr(
                    p, "expert_parallel", False) else ps.get_tensor_model_parallel_group()
                collectives.all_gather(parts, t, group=group)
                t = unshard_tensors(parts, p)
            ep = ps.get_expert_model_parallel_world_size()
            if getattr(p, "expert_parallel", False) and ep > 1:  # blocks of experts, in order
                blocks = [torch.empty_like(t) for _ in range(ep)]
                collectives.all_gather(blocks, t, group=ps.get_expert_model_parallel_group())
                t = torch.cat(blocks)
            rows = getattr(p, "full_rows", None)
            if rows is not None:
                t = t[:rows]
            local[name] = t.to("cpu", copy=True)  # never a view of a live parameter
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return local
    stages: list = [None] * ps.get_pipeline_model_parallel_world_size()
    collectives.all_gather_object(stages, local, group=ps.get_pipeline_model_parallel_group())
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        merged.update(stage)
    return merged
