"""The parameters each rank holds, without building a model: shapes, flags and the flat bucket
layout of data_parallel/ddp.py, and from them the exact model-state bytes per rank.

`chunk_parameters` lists a model chunk's trainable parameters in registration order (the
order `module.parameters()` yields them in models/gpt.py and layers/), with the local (TP
shard) element count and the flags the data-parallel wrapper reads (`shared_embedding`,
`sequence_parallel`). `chunk_layout` feeds them to the wrapper's own bucket layout
(`DistributedDataParallel._layout`, so padding to multiples of dp and the tied embedding's own
bucket are exactly the trainer's) and `model_state_prediction` turns that into bytes with
`planner.parameters.zero_formula_bytes`. Change `chunk_parameters` with the layer code; the
tests compare it with the measured tensors of real runs. In an MoE model a rank holds `E/ep`
routed experts of each MoE layer split over etp, and their bucket set is sharded over the
expert-data-parallel group at ep > 1 (`chunk_sets`, planner/moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from layers.mlp import GATED
from models.pipeline import chunk_roles, rank_chunk_layers
from parallel_state.schedule_tables import V_SHAPED

from data_parallel.ddp import DistributedDataParallel

from .moe import expert_layout


@dataclass(eq=False)  # identity, as torch parameters: the layout keys them by id()
class ParamShape:
    """One parameter of a rank: `name`, local `count` of elements, and the wrapper's flags."""

    name: str
    count: int
    unit: str  # ZeRO-3 gathering unit: "embedding", "layer N", "output", or "root"
    shared_embedding: bool = False
    sequence_parallel: bool = False
    tensor_model_parallel: bool = False
    expert_parallel: bool = False  # a routed expert's weight: reduced over edp, not dp
    rows: int = 0  # a 2-D weight's local rows (stacked experts: all of them), else 0
    layer_linear: bool = False  # a transformer layer's column/row-parallel linear weight

    def numel(self) -> int:
        return self.count


def _norm(prefix: str, m, unit: str, sp: bool, size: int | None = None) -> list[ParamShape]:
    size = size or m.hidden_size
    out = [ParamShape(f"{prefix}.weight", size, unit, sequence_parallel=sp)]
    if m.normalization == "LayerNorm":
        out.append(ParamShape(f"{prefix}.bias", size, unit, sequence_parallel=sp))
    return out


def _mla(prefix: str, m, unit: str, tp: int, sp: bool) -> list[ParamShape]:
    """Multi-head latent attention's weights (layers/mla.py): replicated down-projections and
    latent norms (tagged `sequence_parallel` under SP), column-parallel up-projections over
    heads, row-parallel output."""
    n, h = m.num_attention_heads // tp, m.hidden_size
    qk, kv_lora = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank

    def replicated(name: str, rows: int) -> ParamShape:
        return ParamShape(f"{prefix}.{name}.weight", rows * h, unit, sequence_parallel=sp)

    if m.q_lora_rank is None:
        out = _linear(f"{prefix}.linear_q_proj", n * qk, h, unit, bias=False, row=False, sp=sp)
    else:
        out = [replicated("linear_q_down_proj", m.q_lora_rank),
               *_norm(f"{prefix}.q_layernorm", m, unit, sp, m.q_lora_rank),
               *_linear(f"{prefix}.linear_q_up_proj", n * qk, m.q_lora_rank, unit, bias=False,
                        row=False, sp=sp)]
    return out + [replicated("linear_kv_down_proj", kv_lora + m.qk_rope_head_dim),
                  *_norm(f"{prefix}.kv_layernorm", m, unit, sp, kv_lora),
                  *_linear(f"{prefix}.linear_kv_up_proj", n * (m.qk_nope_head_dim + m.v_head_dim),
                           kv_lora, unit, bias=False, row=False, sp=sp),
                  *_linear(f"{prefix}.linear_proj", h, n * m.v_head_dim, unit, bias=False,
                           row=True, sp=sp)]


def _qk_norms(prefix: str, m, unit: str, tp: int) -> list[ParamShape]:
    """`qk_layernorm`'s q and k norms: per head (`[d]`, replicated; gradients summed over TP,
    the `sequence_parallel` tag) or over the whole projections (split over TP)."""
    if not m.qk_layernorm:
        return []
    if m.qk_norm_over_heads:
        return [ParamShape(f"{prefix}.q_layernorm.weight", m.query_projection_size // tp, unit,
                           tensor_model_parallel=True),
                ParamShape(f"{prefix}.k_layernorm.weight", m.kv_projection_size // tp, unit,
                           tensor_model_parallel=True)]
    out = []
    for which in ("q", "k"):
        names = ("weight", "bias") if m.normalization == "LayerNorm" else ("weight",)
        out += [ParamShape(f"{prefix}.{which}_layernorm.{n}", m.kv_channels, unit,
                           sequence_parallel=tp > 1) for n in names]
    return out


def _linear(prefix: str, out_local: int, in_local: int, unit: str, *, bias: bool,
            row: bool, sp: bool) -> list[ParamShape]:
    """Column (`row=False`: output dim split, bias split) or row linear (input dim split,
    bias replicated and tagged sequence_parallel under SP)."""
    out = [ParamShape(f"{prefix}.weight", out_local * in_local, unit, tensor_model_parallel=True,
                      rows=out_local, layer_linear=True)]
    if bias:
        out.append(ParamShape(f"{prefix}.bias", out_local, unit,
                              sequence_parallel=sp and row, tensor_model_parallel=not row))
    return out


def _moe_mlp(p: str, m, unit: str, tp: int, sp: bool, ep: int, etp: int) -> list[ParamShape]:
    """An MoE MLP's parameters (layers/moe/moe_layer.py, registration order): the router
    `[E, h]` (replicated over TP, SP-tagged), the stacked experts of this EP rank
    `[E/ep, fc1_out/etp, h]` and `[E/ep, h, f/etp]` (tagged `expert_parallel`), the shared
    experts (a dense MLP) and their gate `[1, h]`."""
    h, local = m.hidden_size, m.num_moe_experts // ep
    f = m.moe_ffn_hidden_size // etp
    fc1 = 2 * f if m.activation in GATED else f
    bias = m.add_bias_linear  # gpt-oss: router logit bias [E], expert biases [E/ep, out]
    out = [ParamShape(f"{p}.mlp.router.weight", m.num_moe_experts * h, unit,
                      sequence_parallel=sp)]
    if bias:
        out.append(ParamShape(f"{p}.mlp.router.bias", m.num_moe_experts, unit,
                              sequence_parallel=sp))
    for name, rows, cols, split in (("linear_fc1", fc1, h, True), ("linear_fc2", h, f, False)):
        out.append(ParamShape(f"{p}.mlp.experts.{name}.weight", local * rows * cols, unit,
                              tensor_model_parallel=True, expert_parallel=True,
                              rows=local * rows))
        if bias:
            out.append(ParamShape(f"{p}.mlp.experts.{name}.bias", local * rows, unit,
                                  tensor_model_parallel=split, expert_parallel=True))
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        fs = shared // tp
        out += _linear(f"{p}.mlp.shared_experts.linear_fc1", 2 * fs if m.activation in
                       GATED else fs, h, unit, bias=False, row=False, sp=sp)
        out += _linear(f"{p}.mlp.shared_experts.linear_fc2", h, fs, unit, bias=False, row=True,
                       sp=sp)
        if m.moe_shared_expert_gate:
            out.append(ParamShape(f"{p}.mlp.shared_expert_gate.weight", h, unit,
                                  sequence_parallel=sp))
    return out


def chunk_parameters(m, tp: int, layer_numbers: list[int], pre_process: bool,
                     post_process: bool, sequence_parallel: bool, ep: int = 1,
                     etp: int | None = None) -> list[ParamShape]:
    """Trainable parameters of one GPTModel chunk on one TP rank, in registration order.

    `m`: a models.ModelConfig. Element counts are local (`[V/tp, h]` embedding, `[(q + 2kv)/tp,
    h]` fused QKV, ...), as layers/ allocates them; an MoE layer's routed experts are this
    rank's `E/ep` experts split over `etp` (default tp).
    """
    sp = sequence_parallel and tp > 1
    h, vocab = m.hidden_size, m.padded_vocab_size(tp) // tp
    tied = not m.untie_embeddings_and_output_weights
    tied_here = tied and pre_process and post_process
    out: list[ParamShape] = []
    # the root unit also holds an embedding that multi-token prediction reads (models/gpt.py)
    emb_unit = "root" if tied_here or (post_process and m.mtp_num_layers) else "embedding"
    if pre_process:
        out.append(ParamShape("embedding.word_embeddings.weight", vocab * h, emb_unit,
                              shared_embedding=(tied or bool(m.mtp_num_layers)) and
                              not post_process,
                              tensor_model_parallel=True, rows=vocab))
        if m.position_embedding_type == "learned_absolute":
            out.append(ParamShape("embedding.position_embeddings.weight",
                                  m.max_position_embeddings * h, emb_unit, sequence_parallel=sp))
    for n in layer_numbers:
        out += _layer(m, f"decoder.layers.{n}", n, f"layer {n}", tp, sp, ep, etp)
    if post_process:
        out += _norm("decoder.final_layernorm", m, "root", sp)
        if not tied_here:
            out.append(ParamShape("output_layer.weight", vocab * h, "output",
                                  shared_embedding=tied, tensor_model_parallel=True, rows=vocab))
    if post_process and m.mtp_num_layers:  # models/mtp.py, after the output layer
        out += _mtp(m, vocab, tp, sp, ep, etp, own_embedding=not pre_process)
    return out


def _mtp(m, vocab: int, tp: int, sp: bool, ep: int, etp, own_embedding: bool
         ) -> list[ParamShape]:
    """The multi-token-prediction depths' parameters (one unit, "mtp"): per depth enorm,
    hnorm, eh_proj `[h, 2h]` (replicated), a layer numbered after the model's, final norm;
    then the last stage's copy of the word embedding when the chunk has none."""
    h, out = m.hidden_size, []
    for j in range(m.mtp_num_layers):
        p = f"mtp.layers.{j}"
        out += _norm(f"{p}.enorm", m, "mtp", sp) + _norm(f"{p}.hnorm", m, "mtp", sp)
        out.append(ParamShape(f"{p}.eh_proj.weight", 2 * h * h, "mtp", sequence_parallel=sp))
        out += _layer(m, f"{p}.transformer_layer", m.num_layers + j, "mtp", tp, sp, ep, etp)
        out += _norm(f"{p}.final_layernorm", m, "mtp", sp)
    if own_embedding:
        out.append(ParamShape("mtp.word_embeddings.weight", vocab * h, "mtp",
                              shared_embedding=True, tensor_model_parallel=True, rows=vocab))
    return out


def _layer(m, p: str, n: int, unit: str, tp: int, sp: bool, ep: int, etp
           ) -> list[ParamShape]:
    """One transformer layer's parameters (global number `n`, names under `p`)."""
    h, out = m.hidden_size, []
    q, kv = m.query_projection_size // tp, m.kv_projection_size // tp
    f = m.ffn_hidden_size // tp
    fc1 = 2 * f if m.activation in GATED else f
    if m.pre_layernorm:
        out += _norm(f"{p}.input_layernorm", m, unit, sp)
    if m.multi_latent_attention:
        out += _mla(f"{p}.self_attention", m, unit, tp, sp)
    else:
        if m.softmax_type == "learnable":  # gpt-oss's sinks (the module's own parameter,
            # listed before its submodules'): one logit per local head
            out.append(ParamShape(f"{p}.self_attention.sinks", m.num_attention_heads // tp,
                                  unit, tensor_model_parallel=True))
        out += _linear(f"{p}.self_attention.linear_qkv", q + 2 * kv, h, unit,
                       bias=m.add_qkv_bias, row=False, sp=sp)
        out += _linear(f"{p}.self_attention.linear_proj", h, q, unit,
                       bias=m.add_bias_linear, row=True, sp=sp)
        out += _qk_norms(f"{p}.self_attention", m, unit, tp)
    if m.pre_layernorm:
        out += _norm(f"{p}.pre_mlp_layernorm", m, unit, sp)
    if m.is_moe_layer(n):
        out += _moe_mlp(p, m, unit, tp, sp, ep, tp if etp is None else etp)
    else:
        out += _linear(f"{p}.mlp.linear_fc1", fc1, h, unit, bias=m.add_bias_linear,
                       row=False, sp=sp)
        out += _linear(f"{p}.mlp.linear_fc2", h, f, unit, bias=m.add_bias_linear, row=True,
                       sp=sp)
    for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):  # after the MLP
        if getattr(m, name):
            out += _norm(f"{p}.{name}", m, unit, sp)
    return out


def lora_parameters(m, tp: int, layer_numbers: list[int], sequence_parallel: bool, rank: int,
                    target_modules) -> list[ParamShape]:
    """The LoRA adapters `layers.lora.add_lora` gives one GPTModel chunk on one TP rank, in
    registration order (the only trainable parameters of a LoRA run): per layer, the
    attention's `linear_qkv` (A of each targeted part of q_proj, k_proj, v_proj, then their
    B), `linear_proj` (o_proj), and in a dense (not MoE) layer the MLP's `linear_fc1`
    (gate_proj, up_proj) and `linear_fc2` (down_proj). A column-parallel base's A is whole
    `[r, h]` (tagged `sequence_parallel` under SP: its gradient is summed over TP) and its
    B `[rows / tp, r]`; a row-parallel base's A is `[r, in / tp]` and its B whole `[h, r]`.
    ValueError for unknown targets (`layers.lora.resolve_targets`)."""
    from layers.lora import resolve_targets

    targets = resolve_targets(target_modules)
    sp = sequence_parallel and tp > 1
    h, q, kv = m.hidden_size, m.query_projection_size // tp, m.kv_projection_size // tp
    f = m.ffn_hidden_size // tp
    gated = m.activation in GATED
    hosts = [("self_attention.linear_qkv", False, h, [("q_proj", q), ("k_proj", kv),
                                                      ("v_proj", kv)]),
             ("self_attention.linear_proj", True, q, [("o_proj", h)])]
    mlp = [("mlp.linear_fc1", False, h, ([("gate_proj", f)] if gated else []) +
            [("up_proj", f)]), ("mlp.linear_fc2", True, f, [("down_proj", h)])]
    out: list[ParamShape] = []
    for n in layer_numbers:
        unit = f"layer {n}"
        for host, row, inputs, parts in hosts + ([] if m.is_moe_layer(n) else mlp):
            parts = [(name, rows) for name, rows in parts if name in targets]
            prefix = f"decoder.layers.{n}.{host}.lora"
            out += [ParamShape(f"{prefix}.A.{name}", rank * inputs, unit,
                               sequence_parallel=sp and not row, tensor_model_parallel=row)
                    for name, _ in parts]
            out += [ParamShape(f"{prefix}.B.{name}", rows * rank, unit,
                               tensor_model_parallel=not row) for name, rows in parts]
    return out


def base_bytes(params: list[ParamShape], weight_bytes: int, low_bit: str | None = None,
               formats: dict | None = None) -> int:
    """Bytes of a LoRA run's frozen base `params` (`chunk_parameters`' list): every parameter
    in `weight_bytes` (4, or 2 under bf16), except that QLoRA's low-bit layer linears
    (`layer_linear`: the column- and row-parallel weights of the transformer layers, not
    routed experts, embedding or output layer) take `layers.quant.storage_bytes` of format
    `low_bit` (int4 in groups of `layers.quantized.QLORA_GROUP_SIZE`). `formats`
    (`{parameter name: format}`: a base read from a GGUF file as it stores it) gives the
    format of each parameter it names instead, and the rest stay float."""
    from layers.quant import storage_bytes
    from layers.quantized import QLORA_GROUP_SIZE

    total = 0
    for p in params:
        fmt = formats.get(p.name) if formats is not None else \
            low_bit if p.layer_linear else None
        total += weight_bytes * p.count if fmt is None else \
            storage_bytes(fmt, p.rows, p.count // p.rows, QLORA_GROUP_SIZE)
    return total


_CACHE: dict = {}  # the planner asks for the same stages under many batch/recompute settings
_CACHE_LIMIT = 20000


def _cached(key, make):
    value = _CACHE.get(key)
    if value is None:
        if len(_CACHE) > _CACHE_LIMIT:
            _CACHE.clear()
        value = _CACHE[key] = make()
    return value


def rank_chunks(config, pp_rank: int, base: bool = False) -> list[list[ParamShape]]:
    """The trainable parameters of each model chunk of pipeline rank `pp_rank` (a validated
    run_config.config.Config): every parameter, or under --lora-rank the adapters
    (`lora_parameters`); `base`: every parameter of the chunk whatever trains (a LoRA run's
    frozen base). Cached by the model and the layout: treat as read-only."""
    t = config.train
    pp, v = t.pipeline_model_parallel_size, t.virtual_pipeline_model_parallel_size or 1
    ep, etp, _ = expert_layout(config)
    lora = (t.lora_rank, t.lora_target_modules) if t.lora_rank and not base else None
    v_shape = t.pipeline_schedule in V_SHAPED
    key = ("chunks", repr(config.model), t.tensor_model_parallel_size, pp, v,
           t.sequence_parallel, t.decoder_first_pipeline_num_layers,
           t.decoder_last_pipeline_num_layers, pp_rank, ep, etp, lora, v_shape)

    def make():
        chunks = rank_chunk_layers(config.stage_num_layers(), pp_rank,
                                   t.virtual_pipeline_model_parallel_size, v_shape)
        if lora:
            return [lora_parameters(config.model, t.tensor_model_parallel_size, layers,
                                    t.sequence_parallel, *lora) for layers in chunks]
        return [chunk_parameters(config.model, t.tensor_model_parallel_size, layers,
                                 pre_process=pre, post_process=post,
                                 sequence_parallel=t.sequence_parallel, ep=ep, etp=etp)
                for (pre, post), layers in zip(chunk_roles(pp, pp_rank, v, v_shape), chunks)]
    return _cached(key, make)


def frozen_base_prediction(config, pp_rank: int = 0, formats: dict | None = None) -> int:
    """Predicted bytes of a LoRA run's frozen base on a rank of pipeline stage `pp_rank`
    (`base_bytes` over its chunks: float in the run's dtype, QLoRA's layer linears in
    --lora-base-quantization's format, or the `formats` a GGUF base is stored in); 0 when
    every weight trains. training/memory.py `model_state_bytes` measures it (`frozen_params`
    + `frozen_low_bit`)."""
    t = config.train
    if not t.lora_rank:
        return 0
    low_bit = None if t.lora_base_quantization in ("none", "gguf") else \
        t.lora_base_quantization
    return sum(base_bytes(params, 2 if t.bf16 else 4, low_bit, formats)
               for params in rank_chunks(config, pp_rank, base=True))


_NO_EXPERTS: list[ParamShape] = []  # shared, so that layouts of it are cached once


def split_experts(params: list[ParamShape]) -> tuple[list[ParamShape], list[ParamShape]]:
    """(dense, expert) parameters of a chunk: the dense ones reduce over dp, the routed
    experts' (`expert_parallel`) over the expert-data-parallel group. A chunk without
    experts returns itself as the dense list. Cached: treat as read-only."""
    if not any(p.expert_parallel for p in params):
        return params, _NO_EXPERTS

    def make():
        return params, [p for p in params if not p.expert_parallel], \
            [p for p in params if p.expert_parallel]
    return _cached(("split", id(params)), make)[1:]


def gradient_data_parallel_size(config) -> int:
    """The ranks a dense weight's gradient is reduced and ZeRO-sharded over: dp x cp
    (context-parallel ranks hold the same weights and see different tokens, so the trainer
    wraps the model with `parallel_state.get_data_parallel_group(with_context_parallel=True)`,
    as Megatron-Core does)."""
    return config.data_parallel_size * config.train.context_parallel_size


def chunk_sets(config, pp_rank: int) -> list[list[tuple[list[ParamShape], int]]]:
    """Per model chunk of pipeline rank `pp_rank`, its bucket sets as (parameters,
    data-parallel size): at ep > 1 the dense parameters over dp, then the routed experts
    over edp (data_parallel/ddp.py gives them buckets of their own, padded to edp, laid out
    as the dense ones); at ep 1 all parameters over dp x cp
    (`gradient_data_parallel_size`), in one set, as the wrapper does."""
    ep, _, edp = expert_layout(config)
    dp = gradient_data_parallel_size(config)
    out = []
    for params in rank_chunks(config, pp_rank):
        dense, experts = split_experts(params) if ep > 1 else (params, _NO_EXPERTS)
        out.append([(dense, dp)] + ([(experts, edp)] if experts else []))
    return out



def _unit_groups(params: list[ParamShape]) -> list[list[ParamShape]]:
    """ZeRO-3's parameter groups (data_parallel/fsdp.py `param_groups`): one per unit in backward
    order, the root unit (final norm, a tied embedding) last."""
    order: dict[str, list[ParamShape]] = {}
    for p in params:
        if p.unit != "root":
            order.setdefault(p.unit, []).append(p)
    root = [p for p in params if p.unit == "root"]
    return list(reversed(([root] if root else []) + list(order.values())))


def chunk_layout(params: list[ParamShape], dp: int, strategy: str, bucket_size: int):
    """The data-parallel wrapper's buckets for one chunk: `(buckets, offsets)` exactly as
    `DistributedDataParallel._layout` makes them (buckets have `start`, `end` (padded),
    `params`). Cached: treat as read-only."""
    def make():
        groups = _unit_groups(params) if strategy == "optim_grads_params" else [params]
        pad = dp if strategy != "no_shard" else 1
        return params, DistributedDataParallel._layout(groups, bucket_size, pad)
    return _cached(("layout", id(params), dp, strategy, bucket_size), make)[1]


def main_copy(strategy: str, bf16: bool, distributed_optimizer: bool) -> bool:
    """A separate fp32 main copy of the weights (training/memory.py `model_state_bytes`):
    bf16 weights, or the distributed optimizer without a flat parameter store (no_shard)."""
    return bf16 or (strategy == "no_shard" and distributed_optimizer)


def model_state_prediction(config, pp_rank: int = 0) -> dict:
    """Predicted model-state bytes of a rank of pipeline stage `pp_rank` (every TP and DP rank
    of a stage holds the same amount, padding included): `{"total", "host_total",
    "nvme_total", "psi", "psi_padded", "strategy", "dp", "edp"}`, the quantities
    `training.memory.model_state_bytes` measures (`predicted_total` there uses the same formula
    on the real tensors). In an MoE model the routed experts' bytes follow the same ZeRO
    formula with N_d = edp (`chunk_sets`): `zero(dense psi, dp) + zero(expert psi, edp)`. Under
    context parallelism N_d is dp x cp (`gradient_data_parallel_size`), and so is "dp".

    Offload (ZeRO-Offload / ZeRO-Infinity): the first `--optimizer-offload-fraction` of the
    rank's optimizer elements (in bucket order, as the optimizer cuts them) leave the device:
    to host memory at 16 B each (main copy, two moments, gradient copy), or to NVMe at 12 B
    each (main copy, two moments) plus `--offload-buffer-count` host buffers of 16 B x the
    largest offloaded shard or `--offload-buffer-size`, whichever is less (`offload_layout`). `--param-offload-device` (ZeRO-3) moves the
    W psi / N_d weight shards to host memory or NVMe the same way."""
    t, dp = config.train, gradient_data_parallel_size(config)
    strategy = t.data_parallel_sharding_strategy
    uses_dist_opt = t.use_distributed_optimizer or t.bf16 or t.optimizer_cpu_offload
    psi, padded, shards = {}, {}, []  # by bucket set: 0 dense (over dp), 1 experts (over edp)
    for chunk in chunk_sets(config, pp_rank):
        for key, (params, n) in enumerate(chunk):
            buckets, _ = chunk_layout(params, n, strategy, t.ddp_bucket_size)
            psi[key, n] = psi.get((key, n), 0) + sum(p.count for p in params)
            padded[key, n] = padded.get((key, n), 0) + (buckets[-1].end if buckets else 0)
            shards += [((b.end - b.start) // (n if strategy != "no_shard" else 1), key, n)
                       for b in buckets]
    fraction = (t.optimizer_offload_fraction or 0.0) if t.optimizer_cpu_offload else 0.0
    nvme = t.optimizer_offload_device == "nvme"
    offloaded, biggest = offload_layout([size for size, _, _ in shards], fraction)
    biggest = min(biggest, t.offload_buffer_size)  # NVMe streams longer shards in pieces
    by_set = {}
    for (size, key, n), off in zip(shards, offloaded):
        by_set[key, n] = by_set.get((key, n), 0) + off
    w = 2 if t.bf16 else 4
    device = host_bytes = nvme_bytes = 0
    for (key, n), count in padded.items():
        off = by_set.get((key, n), 0)
        d, hb = zero_formula_bytes(
            count, strategy=strategy, dp=n, weight_bytes=w,
            main_copy=main_copy(strategy, t.bf16, uses_dist_opt) or bool(t.param_offload_device),
            host_elements=0 if nvme else off, nvme_elements=off if nvme else 0)
        device, host_bytes, nvme_bytes = device + d, host_bytes + hb, nvme_bytes + 12 * off * nvme
        if t.param_offload_device:  # ZeRO-3 weight shards off the device
            device -= w * (count // n)
            if t.param_offload_device == "nvme":
                nvme_bytes += w * (count // n)
            else:
                host_bytes += w * (count // n)
    if nvme and biggest:
        host_bytes += t.offload_buffer_count * 16 * biggest
    _, _, edp = expert_layout(config)
    return {"total": device, "host_total": host_bytes, "nvme_total": nvme_bytes,
            "psi": sum(psi.values()), "psi_padded": sum(padded.values()),
            "strategy": strategy, "dp": dp, "edp": edp}


def offload_layout(shard_sizes: list[int], fraction: float) -> tuple[list[int], int]:
    """Elements offloaded from each of a rank's optimizer shards (in bucket order) when the
    first `fraction` of them (int(fraction x total)) go, and the largest offloaded piece (the
    NVMe buffers' size): data_parallel/distributed_optimizer.py cuts them so."""
    cut = int(fraction * sum(shard_sizes))
    out = []
    for size in shard_sizes:
        take = min(size, max(cut, 0))
        cut -= take
        out.append(take)
    return out, max(out, default=0)


def zero_formula_bytes(psi: int, *, strategy: str, dp: int, weight_bytes: int,
                       main_copy: bool, host_elements: int = 0,
                       nvme_elements: int = 0) -> tuple[int, int]:
    """(device, host) model-state bytes per rank for `psi` parameters on this rank (ZeRO,
    Rajbhandari et al. 2020, sec. 5, with our byte counts): weights W = 2 (bf16) or 4 (fp32),
    gradients G = 4 (accumulated in fp32), optimizer K = 8 (two Adam moments) plus 4 for a
    separate fp32 main copy (`main_copy`: bf16 weights, or no flat parameter store), so K = 12
    in bf16 as in the paper. Per strategy, with N_d = dp:

    - no_shard (stage 0): `(W + G + K) psi`
    - optim (stage 1): `(W + G) psi + K psi / N_d`
    - optim_grads (stage 2): `W psi + (G + K) psi / N_d`
    - optim_grads_params (stage 3): `(W + G + K) psi / N_d`

    With offload, `host_elements` of the optimizer's `psi / N_d` (`psi` unsharded) elements
    move to host memory with 16 bytes each (fp32 main copy, two moments, gradient copy), and
    `nvme_elements` leave the device for files (their 12 bytes each on disk, counted by the
    caller with the host buffers: `model_state_prediction`).
    """
    n_opt = psi // dp if strategy != "no_shard" else psi
    w = weight_bytes * (psi // dp if strategy == "optim_grads_params" else psi)
    g = 4 * (psi // dp if strategy in ("optim_grads", "optim_grads_params") else psi)
    k = (8 + 4 * main_copy) * (n_opt - host_elements - nvme_elements)
    return w + g + k, 16 * host_elements
