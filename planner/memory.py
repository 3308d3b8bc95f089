"""Predicted memory per rank: model states (exact, planner/parameters.py), the
activations one microbatch saves for backward on each stage, the microbatches in flight under
the pipeline schedule, and the transient buffers of the sharding strategies.

Activations per microbatch, for a stage's chunks:

- decoder layers: `planner.activations.model_chunk_bytes`, our layer term by term (Korthikanti et
  al. 2022, sec. 4, adapted to SwiGLU/GQA/RMSNorm/SDPA as that module documents), under the
  run's recompute policy and sequence parallelism;
- the first stage: the embedding keeps the token ids (int64 `[b, s]`; under TP also the
  bool mask of the ids outside the rank's vocabulary shard), the position ids of
  learned positions (int64 `[s]`, `[b, s]` with --reset-position-ids) and, with dropout, the
  embedding dropout's mask (`[s, b, h]`, the shard under SP, activation dtype);
- the last stage: the final norm (as a layer's norm), the output layer's input (`[s, b, h]`,
  the shard `[s/t, b, h]` under SP), the cross entropy's float32 softmax `[b, s, V/t]` plus
  its int64 target and two bool masks (the padding columns' mask is applied inside
  the loss's own autograd function, which keeps none), and the loss mask `[b, s]` float32.
- the last stage with multi-token prediction (--mtp-num-layers D): per depth the shifted
  tokens' ids, three norms, eh_proj's input, one transformer layer (never recomputed) and one
  more batch through the shared output head and its loss (planner/mtp.py);
- a LoRA run (`--lora-rank`): a frozen embedding keeps nothing, a frozen output layer no
  input, the final norm no normalized input; the layers as `planner.activations.FrozenBase`
  says (the first layer after the embedding keeps nothing before its first adapter).

Microbatches in flight on pipeline rank `r`: the schedule table's peak
(parallel_state/schedule_tables.py `simulate`, equal pass costs), which is Megatron's warm-up
count for 1F1B, `min(p - r, m)`, and for the interleaved schedule,
`min((p - r - 1) 2 + (v - 1) p + 1, m v)` chunk-microbatches (Narayanan et al. 2021, sec.
2.2), each one chunk's activations; ZB-H1 keeps `min(p, m)` on every rank (Qi et al. 2024,
sec. 3.1: 1F1B's rank-0 peak), counting a microbatch from its forward to its W. Between B and
W a zero-bubble microbatch holds less than its activations (the linears' inputs and output
gradients only), so the count is an upper bound there.

Transient: ZeRO-2/3 keep up to two float32 buckets being reduce-scattered; ZeRO-3 the
gathered units (`gathered_peak_bytes`); at cp > 1 one attention call's K/V blocks in flight
(the ring's) or the whole sequence's K/V (all_gather) and its float32 gradients
(planner/context_parallel.py `attention_buffer_bytes`).
"""
from __future__ import annotations

import functools

from models.pipeline import chunk_roles
from parallel_state import schedule_tables

from .activations import FrozenBase, model_chunk_bytes, norm_bytes
from .context_parallel import attention_buffer_bytes
from .moe import expert_layout
from .mtp import mtp_activation_bytes
from .parameters import (chunk_layout, chunk_sets, frozen_base_prediction, model_state_prediction,
                         rank_chunks)


def chunk_activation_bytes(config, params, pre_process: bool, post_process: bool) -> dict:
    """Predicted saved-for-backward bytes of one microbatch through one chunk:
    `{"layers", "other", "total"}` (the regions of training.memory.SavedTensorMeter) and
    `"mtp"`, the multi-token-prediction depths' share of "other" on the last stage
    (planner/mtp.py; 0 elsewhere and without MTP)."""
    m, t = config.model, config.train
    tp, sp, cp = t.tensor_model_parallel_size, t.sequence_parallel, t.context_parallel_size
    s, b, e = m.seq_length // cp, t.micro_batch_size, 2 if t.bf16 else 4  # a CP rank's tokens
    numbers = sorted({int(p.unit.split()[1]) for p in params if p.unit.startswith("layer ")})
    n = len(numbers)
    lora = FrozenBase.of(t)
    layers = model_chunk_bytes(m, n, s, b, tp, sp, t.recompute_granularity, t.recompute_method,
                               t.recompute_num_layers, e,
                               keyed_dropout=t.dropout_masks == "sample",
                               layer_numbers=numbers, ep=expert_layout(config)[0],
                               context_parallel=cp > 1, lora=lora,
                               frozen_input=pre_process) if n else 0
    s_local = s // tp if sp else s
    other = 0
    if pre_process and lora is None:  # the token ids, learned positions' ids, the embedding
        # dropout's mask (a frozen embedding keeps none: its output needs no gradient)
        # (under TP also the bool mask of the ids outside this rank's vocabulary shard)
        other = (8 + (tp > 1)) * b * s + (e * s_local * b * m.hidden_size
                                          if m.hidden_dropout > 0 else 0)
        if m.position_embedding_type == "learned_absolute":
            other += 8 * s * (b if t.reset_position_ids else 1)
    if post_process:  # a frozen output layer keeps no input
        vt = m.padded_vocab_size(tp) // tp
        other += norm_bytes(m, s_local * b, e, frozen=lora is not None) + \
            (0 if lora else e * s_local * b * m.hidden_size)
        other += 4 * b * s * vt + (8 + 1 + 1) * b * s + 4 * b * s
    mtp = sum(mtp_activation_bytes(m, s, b, tp, sp, e, t.dropout_masks == "sample",
                                   expert_layout(config)[0], cp > 1).values()) \
        if post_process else 0
    return {"layers": layers, "other": other + mtp, "mtp": mtp, "total": layers + other + mtp}


def gathered_peak_bytes(config, chunks) -> int:
    """ZeRO-3's gathered parameters at the busiest moment (data_parallel/fsdp.py
    `predicted_peak_bytes`, summed over chunks): the root unit plus the two largest adjacent
    units (one in use, the next prefetched), each unit its buckets' padded size in the weight
    dtype. `chunks`: `planner.parameters.chunk_sets`; a unit of an MoE layer is its dense and
    its expert buckets together."""
    t = config.train
    w, total = 2 if t.bf16 else 4, 0
    for sets in chunks:
        size: dict[str, int] = {}
        for params, n in sets:
            buckets, _ = chunk_layout(params, n, "optim_grads_params", t.ddp_bucket_size)
            for b in buckets:
                unit = b.params[0].unit
                size[unit] = size.get(unit, 0) + b.end - b.start
        order = [u for u in dict.fromkeys(q.unit for params, _ in sets for q in params)
                 if u != "root"]
        pairs = [size[a] + size[b] for a, b in zip(order, order[1:])]
        total += w * (size.get("root", 0) + max(pairs or [size[u] for u in order] or [0]))
    return total


@functools.lru_cache(maxsize=4096)
def _simulation(pp: int, vpp: int, num_microbatches: int, schedule: str | None):
    """The schedule's simulation at equal pass costs, computed once per (pp, vpp, m, schedule):
    a search asks for the same few tables for each of its thousands of candidate layouts.
    Callers only read the result."""
    name = schedule or ("interleaved" if vpp > 1 else "1f1b")
    return schedule_tables.simulate(schedule_tables.build(name, pp, num_microbatches, vpp))


def in_flight(pp: int, vpp: int, num_microbatches: int, pp_rank: int,
              schedule: str | None = None) -> int:
    """Chunk-microbatches whose activations pipeline rank `pp_rank` holds at its peak under
    `schedule` (--pipeline-schedule; None: interleaved at vpp > 1, else 1f1b)."""
    if pp == 1:
        return 1
    return _simulation(pp, vpp, num_microbatches, schedule).peak_activations[pp_rank]


def pipeline_bubble(config) -> float:
    """Idle / compute of the slowest pipeline rank under the run's schedule, equal F / B / W
    passes (0 without pipelining)."""
    t = config.train
    if t.pipeline_model_parallel_size == 1:
        return 0.0
    return max(_simulation(t.pipeline_model_parallel_size,
                           t.virtual_pipeline_model_parallel_size or 1,
                           config.num_microbatches, t.pipeline_schedule).bubble)


def rank_memory(config, pp_rank: int, base_formats: dict | None = None) -> dict:
    """Predicted device bytes of a rank of pipeline stage `pp_rank`: `{"model_states",
    "frozen_base", "fp8_buffers" (`fp8_buffer_bytes`), "activations_per_microbatch" (of
    which "mtp_activations_per_microbatch": the multi-token-prediction depths', last stage),
    "activations", "in_flight", "transient" (of
    which "gathered_params"), "total", "host", "nvme"}` (host and NVMe: offloaded model
    states and the NVMe streaming buffers). Under --lora-rank the model states are the
    adapters' (weights, gradients, optimizer state) and `frozen_base` the base's bytes
    (`planner.parameters.frozen_base_prediction`; `base_formats`: the formats of a base kept
    as a GGUF file stores it); a full fine-tune has no frozen base (0)."""
    t = config.train
    pp, v = t.pipeline_model_parallel_size, t.virtual_pipeline_model_parallel_size or 1
    states = model_state_prediction(config, pp_rank)
    chunks = rank_chunks(config, pp_rank, base=True)
    sets = chunk_sets(config, pp_rank)
    roles = chunk_roles(pp, pp_rank, v, t.pipeline_schedule in schedule_tables.V_SHAPED)
    per_chunk = [chunk_activation_bytes(config, params, pre, post)
                 for (pre, post), params in zip(roles, chunks)]
    per_mb = sum(c["total"] for c in per_chunk)
    held = in_flight(pp, v, config.num_microbatches, pp_rank, t.pipeline_schedule)
    activations = per_mb * held / v
    transient = 0
    strategy = t.data_parallel_sharding_strategy
    if strategy in ("optim_grads", "optim_grads_params"):
        sizes = sorted((b.end - b.start for chunk in sets for params, n in chunk if n > 1
                        for b in chunk_layout(params, n, strategy, t.ddp_bucket_size)[0]),
                       reverse=True)
        transient += 4 * sum(sizes[:2])  # two float32 buckets being reduced (distributed.py)
    gathered = gathered_peak_bytes(config, sets) if strategy == "optim_grads_params" else 0
    transient += gathered
    if t.context_parallel_size > 1 and any(p.unit.startswith("layer ") for c in chunks
                                           for p in c):
        transient += attention_buffer_bytes(config.model, config.model.seq_length,
                                            t.micro_batch_size, t.tensor_model_parallel_size,
                                            t.context_parallel_size, 2 if t.bf16 else 4,
                                            t.cp_comm_type)
    frozen = frozen_base_prediction(config, pp_rank, base_formats)
    fp8 = fp8_buffer_bytes(config, chunks)
    total = states["total"] + frozen + fp8 + activations + transient
    return {"model_states": states["total"], "frozen_base": frozen, "fp8_buffers": fp8,
            "activations_per_microbatch": per_mb,
            "mtp_activations_per_microbatch": sum(c["mtp"] for c in per_chunk),
            "activations": int(activations), "in_flight": held, "transient": transient,
            "gathered_params": gathered,
            "total": int(total), "host": states["host_total"], "nvme": states["nvme_total"]}


def fp8_buffer_bytes(config, chunks) -> int:
    """Bytes of the FP8 state of a rank holding `chunks` (`rank_chunks`), which
    layers/fp8.py `fp8_state_bytes` measures: under --fp8-recipe delayed a float32 amax history
    `[--fp8-amax-history-len, 3]` and running amaxes `[3]` per FP8 linear (a transformer
    layer's self-attention and dense-MLP linears outside the layers kept in higher precision,
    run_config/fp8.py `fp8_layers_kept`); 0 for the other recipes and without FP8."""
    from run_config.fp8 import fp8_layers_kept

    t, m = config.train, config.model
    if t.fp8_format is None or t.fp8_recipe != "delayed":
        return 0
    start, end = fp8_layers_kept(m, t)
    count = 0
    for p in (p for c in chunks for p in c):
        if not (p.layer_linear and p.unit.startswith("layer ")) or p.expert_parallel:
            continue
        n = int(p.unit.split()[1])
        in_fp8 = start <= n < m.num_layers - end
        if in_fp8 and (".self_attention." in p.name or (".mlp." in p.name
                                                       and not m.is_moe_layer(n))):
            count += 1
    return count * 4 * 3 * (t.fp8_amax_history_len + 1)


def peak_memory(config) -> dict:
    """`rank_memory` of the pipeline stage needing the most device memory, with `pp_rank`
    and "last_stage_mtp_per_microbatch" (the last stage's multi-token-prediction share of
    a microbatch's activations, whichever stage peaks)."""
    best, mtp = None, 0
    for r in range(config.train.pipeline_model_parallel_size):
        mem = rank_memory(config, r)
        mtp = max(mtp, mem["mtp_activations_per_microbatch"])
        if best is None or mem["total"] > best["total"]:
            best = dict(mem, pp_rank=r)
    return dict(best, last_stage_mtp_per_microbatch=mtp)
