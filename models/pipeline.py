"""Which layers a pipeline rank holds: stages, virtual stages (model chunks), uneven splits.

With `pp` stages and `vpp` chunks per stage the model is cut into `pp * vpp` virtual stages in
order; virtual stage `k = c * pp + s` is chunk `c` of stage `s` (the interleaved assignment of
Narayanan et al. 2021, SC21, sec. 2.2.2, Fig. 4). Stage `s` holds `stage_num_layers[s]` layers
in all, split evenly over its chunks, so an uneven split (fewer layers on the first and last
stages, which also hold the embedding and the loss) composes with interleaving.
"""
from __future__ import annotations


def virtual_stage_layers(stage_num_layers: list[int], vpp: int | None) -> list[list[int]]:
    """Global layer numbers of each virtual stage, in model order (`pp * vpp` lists)."""
    vpp = vpp or 1
    pp = len(stage_num_layers)
    for s, n in enumerate(stage_num_layers):
        if n % vpp:
            raise ValueError(f"stage {s} holds {n} layers, not divisible by vpp {vpp}")
    out, start = [], 0
    for c in range(vpp):
        for s in range(pp):
            n = stage_num_layers[s] // vpp
            out.append(list(range(start, start + n)))
            start += n
    return out


def rank_chunk_layers(stage_num_layers: list[int], pp_rank: int,
                      vpp: int | None) -> list[list[int]]:
    """Global layer numbers of each model chunk held by pipeline rank `pp_rank`."""
    pp = len(stage_num_layers)
    virtual = virtual_stage_layers(stage_num_layers, vpp)
    return [virtual[c * pp + pp_rank] for c in range(vpp or 1)]


def build_model_chunks(model_cls, config, stage_num_layers: list[int], pp_rank: int,
                       vpp: int | None, **kwargs) -> list:
    """This rank's model chunks: `model_cls(config, pre_process=..., post_process=...,
    layer_numbers=...)` for each chunk, pre_process on chunk 0 of stage 0 and post_process on
    the last chunk of the last stage."""
    pp, v = len(stage_num_layers), vpp or 1
    chunks = []
    for c, layers in enumerate(rank_chunk_layers(stage_num_layers, pp_rank, vpp)):
        chunks.append(model_cls(config, pre_process=(pp_rank == 0 and c == 0),
                                post_process=(pp_rank == pp - 1 and c == v - 1),
                                layer_numbers=layers, **kwargs))
    return chunks
