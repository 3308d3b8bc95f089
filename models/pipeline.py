"""Which layers a pipeline rank holds: stages, virtual stages (model chunks), uneven splits.

With `pp` stages and `vpp` chunks per stage the model is cut into `pp * vpp` virtual stages in
order; virtual stage `k = c * pp + s` is chunk `c` of stage `s` (the interleaved assignment of
Narayanan et al. 2021, SC21, sec. 2.2.2, Fig. 4). Stage `s` holds `stage_num_layers[s]` layers
in all, split evenly over its chunks, so an uneven split (fewer layers on the first and last
stages, which also hold the embedding and the loss) composes with interleaving.

In a V (`v_shape`, the ZBV schedule, Qi et al. 2024 sec. 6: two chunks per stage) chunk 0 of
stage `s` is virtual stage `s` and chunk 1 is virtual stage `2 pp - 1 - s`, so stage 0 holds
the embedding and the output layer + loss (`parallel_state.schedule_tables.virtual_stage`).
Layer numbers stay global, so a checkpoint reads the same in every placement.
"""
from __future__ import annotations

from parallel_state.schedule_tables import stage_rank, virtual_stage


def virtual_stage_layers(stage_num_layers: list[int], vpp: int | None,
                         v_shape: bool = False) -> list[list[int]]:
    """Global layer numbers of each virtual stage, in model order (`pp * vpp` lists).

    Raises:
        ValueError: a stage's layers are not divisible by vpp.
    """
    vpp = vpp or 1
    pp = len(stage_num_layers)
    for s, n in enumerate(stage_num_layers):
        if n % vpp:
            raise ValueError(f"stage {s} holds {n} layers, not divisible by vpp {vpp}")
    out, start = [], 0
    for k in range(pp * vpp):
        n = stage_num_layers[stage_rank(pp, k, v_shape)[0]] // vpp
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_chunk_layers(stage_num_layers: list[int], pp_rank: int,
                      vpp: int | None, v_shape: bool = False) -> list[list[int]]:
    """Global layer numbers of each model chunk held by pipeline rank `pp_rank`."""
    pp = len(stage_num_layers)
    virtual = virtual_stage_layers(stage_num_layers, vpp, v_shape)
    return [virtual[virtual_stage(pp, pp_rank, c, v_shape)] for c in range(vpp or 1)]


def chunk_roles(pp: int, pp_rank: int, vpp: int | None,
                v_shape: bool = False) -> list[tuple[bool, bool]]:
    """(pre_process, post_process) of each model chunk of pipeline rank `pp_rank`: the
    embedding on virtual stage 0, the output layer + loss on the last one."""
    v = vpp or 1
    stages = [virtual_stage(pp, pp_rank, c, v_shape) for c in range(v)]
    return [(k == 0, k == pp * v - 1) for k in stages]


def build_model_chunks(model_cls, config, stage_num_layers: list[int], pp_rank: int,
                       vpp: int | None, v_shape: bool = False, **kwargs) -> list:
    """This rank's model chunks: `model_cls(config, pre_process=..., post_process=...,
    layer_numbers=...)` for each chunk (`chunk_roles`, `rank_chunk_layers`)."""
    roles = chunk_roles(len(stage_num_layers), pp_rank, vpp, v_shape)
    return [model_cls(config, pre_process=pre, post_process=post, layer_numbers=layers,
                      **kwargs)
            for (pre, post), layers in zip(roles, rank_chunk_layers(stage_num_layers, pp_rank,
                                                                    vpp, v_shape))]
