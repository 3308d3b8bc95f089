"""Predicted communication of one training step: calls and bytes per (group, op), and their
time under the alpha-beta model.

`step_communication(config)` lists what the trainer (training/loop.py `train_step`, one
optimizer step) makes every rank send through parallel_state.collectives, summed over all
ranks, in the quantities `parallel_state.comm_counter` counts (the payload of each rank: an
all-gather's local shard, a reduce-scatter's full input, an all-reduce's tensor, a p2p
message). Per microbatch and layer, with `e` bytes per activation value, `A = s b h e` and
`A / t` the sequence shard (Shoeybi et al. 2019, sec. 3; Korthikanti et al. 2022, sec. 4.2.2):

- tp, no SP: forward all-reduces after the attention projection and fc2 (`g`), backward
  all-reduces before QKV and fc1 (`f`): 4 of `A` per layer, 2 more per recomputed layer
  (full recompute runs the forward again) less 1 per checkpointed span (the span's last
  reduction is not rerun: torch.utils.checkpoint stops early); the embedding's forward and
  the output layer's input gradient: 1 each; vocab-parallel cross entropy: 3 of `[b, s]`
  float32 (max, target logit, sum of exponentials).
- sp: per layer, all-gathers of the shard `A / t` before QKV and fc1 (forward, and again in
  backward: the shard is what is kept) and of the gradients of the two reduce-scatters: 6;
  reduce-scatters of `A` after the projection and fc2 and of the gradients of QKV and fc1
  inputs: 4; recompute adds 2 and 2 (less 1 reduce-scatter per span); embedding 1 + 1,
  output layer 2 all-gathers + 1 reduce-scatter. After backward, one all-reduce over tp of
  the sequence-parallel weights' float32 gradients (norms, row biases).
- dp: per bucket (data_parallel/ddp.py) an all-reduce of its float32 gradient (no_shard),
  or a reduce-scatter of it (optim: once per step; optim_grads: every microbatch) and an
  all-gather of the updated weight shard (weight dtype); ZeRO-3 (optim_grads_params) gathers
  each unit before forward and backward instead (`_zero3_gathers`). Scalars: the token
  count and loss sums, and the gradient norm (sharded).
- pp: `2 (v p - 1)` messages of the stage tensor per microbatch per replica (forward
  activations, backward gradients); the loss sum over stages.
- embedding (tied weights, pp > 1): the word-embedding gradient (or this rank's shard of it)
  all-reduced between the first and last stage.
- mp: the squared gradient norm over tp x pp.
- world (`--check-for-nan-in-loss-and-grad`, on by default): the verdict on non-finite losses
  and gradients, one all-reduce of 2 float32 flags per rank (training/nonfinite.py). When
  only one dimension exceeds 1 the world is that dimension's group, and so is the label.
- cp (context parallelism, cp > 1): each rank's activations are its `s / cp` tokens (so `A`
  and every `[b, s]` term above are per rank), the attention's K/V ring (or all-gather) per
  layer and microbatch (planner/context_parallel.py `layer_communication`), and the dp
  traffic above (gradients, ZeRO gathers, loss and token sums, the sharded norm) runs over
  the dp x cp ranks, labelled `gradient_group_label` ("cp" at dp 1, "dp-cp" otherwise).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import moe
from .context_parallel import gradient_group_label, layer_communication
from .parameters import chunk_layout, chunk_sets, rank_chunks
from layers.recompute import recompute_spans


def _add(out: dict, key: tuple[str, str], calls: int, nbytes: int) -> None:
    if calls:
        c, b = out.get(key, (0, 0))
        out[key] = (c + calls, b + nbytes)


def _recomputed(n: int, t) -> tuple[int, int]:
    """(layers inside checkpointed spans, spans) of a chunk of `n` layers."""
    if t.recompute_granularity != "full" or not n:
        return 0, 0
    spans = recompute_spans(n, t.recompute_method or "uniform", t.recompute_num_layers or 1)
    return sum(b - a for a, b in spans), len(spans)


def _recomputed_layers(n: int, t) -> set[int]:
    """Indices (within the chunk) of the layers inside checkpointed spans."""
    if t.recompute_granularity != "full" or not n:
        return set()
    spans = recompute_spans(n, t.recompute_method or "uniform", t.recompute_num_layers or 1)
    return {i for a, b in spans for i in range(a, b)}


def _owned(bucket, lo: int, hi: int, dp: int, rank: int, shard: bool) -> int:
    """Elements of flat range [lo, hi) in `bucket` owned by DP rank `rank`."""
    if not shard:
        return hi - lo
    size = (bucket.end - bucket.start) // dp
    a = bucket.start + rank * size
    return max(0, min(hi, a + size) - max(lo, a))


def _zero3_gathers(chunks, layouts, pp_rank: int, pp: int, v: int, mb: int,
                   first_step: bool) -> tuple[int, int]:
    """(all-gather calls, gathered elements) of one ZeRO-3 step on one rank (data_parallel/fsdp.py):
    every unit is gathered for each microbatch's forward and again for its backward (or for
    the recompute inside it), except the root and the last unit, which stay gathered while
    microbatches are pending: once per step on a stage that runs warm-up forwards, once per
    microbatch where each forward is followed by its backward (the last stage, no pipeline).
    The optimizer step prefetches the first unit for the next step, so the first step of a
    run gathers that unit once more. Interleaved schedules: the warm-up count per rank decides
    (matched the counter at pp 2 x vpp 2; not proven for every interleaved order)."""
    warmup = (pp - pp_rank - 1) * 2 + (v - 1) * pp if v > 1 else pp - pp_rank - 1
    episodes = 1 if warmup > 0 else mb
    calls = elements = 0
    for params, (buckets, _) in zip(chunks, layouts):
        units: dict[str, list] = {}
        for b in buckets:
            units.setdefault(b.params[0].unit, []).append(b.end - b.start)
        order = [u for u in dict.fromkeys(p.unit for p in params) if u != "root"]
        kept = {"root", order[-1]} if order else {"root"}
        first = "root" if "root" in units else (order[0] if order else None)
        for unit, sizes in units.items():
            times = episodes if unit in kept else 2 * mb
            times += first_step and unit == first
            calls, elements = calls + times * len(sizes), elements + times * sum(sizes)
    return calls, elements


@dataclass(frozen=True)
class _StepShape:
    """The layout and sizes every count of one step reads (from a validated Config)."""

    tp: int
    pp: int
    dp: int
    cp: int
    v: int  # model chunks per pipeline rank (1 without interleaving)
    mb: int  # microbatches per step
    s: int  # tokens of a sequence on a rank: seq_length / cp
    b: int
    e: int  # bytes per activation value, and per stored weight (2 under bf16, else 4)
    act: int  # `A = s b h e`: bytes of one [s, b, h] activation (a CP rank's s)
    sp: bool
    strategy: str  # data_parallel_sharding_strategy

    @classmethod
    def of(cls, config) -> _StepShape:
        m, t = config.model, config.train
        e, cp = 2 if t.bf16 else 4, t.context_parallel_size
        s = m.seq_length // cp
        return cls(tp=t.tensor_model_parallel_size, pp=t.pipeline_model_parallel_size,
                   dp=config.data_parallel_size, cp=cp,
                   v=t.virtual_pipeline_model_parallel_size or 1,
                   mb=config.num_microbatches, s=s, b=t.micro_batch_size, e=e,
                   act=s * t.micro_batch_size * m.hidden_size * e,
                   sp=t.sequence_parallel, strategy=t.data_parallel_sharding_strategy)

    @property
    def shard_grads(self) -> bool:
        """Each DP rank keeps only its shard of the gradient (ZeRO-2 and ZeRO-3)."""
        return self.strategy in ("optim_grads", "optim_grads_params")

    @property
    def replicas(self) -> int:
        """Ranks of each pipeline stage: tp x cp x dp."""
        return self.tp * self.cp * self.dp

    @property
    def gdp(self) -> int:
        """The ranks gradients reduce (and ZeRO shards) over: dp x cp."""
        return self.dp * self.cp

    @property
    def grad_label(self) -> str:
        return gradient_group_label(self.dp, self.cp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


def _tp_activation_collectives(out: dict, st: _StepShape, t, r: int, chunks) -> None:
    """Add the TP (or SP) collectives of the activations on pipeline stage `r`, all
    microbatches, all ranks of the stage: per layer 4 all-reduces of `A` (SP: 6 all-gathers of
    `A / t`, 4 reduce-scatters of `A`), recompute's extra ones, the embedding's and output
    layer's, and vocab-parallel cross entropy's 3 float32 `[b, s]` all-reduces (module)."""
    for c, params in enumerate(chunks):
        n = len({p.unit for p in params if p.unit.startswith("layer")})
        # full recompute runs each span's forward again in backward, but
        # torch.utils.checkpoint stops once the saved tensors are rebuilt: the span's
        # last reduction (fc2's output is not saved) is not repeated
        rec_layers, spans = _recomputed(n, t)
        ag, red = 2 * rec_layers, 2 * rec_layers - spans
        pre = r == 0 and c == 0
        post = r == st.pp - 1 and c == st.v - 1
        k = st.replicas * st.mb
        if st.sp:
            calls = 6 * n + ag + pre + 2 * post
            _add(out, ("sp", "all_gather_single"), k * calls, k * calls * st.act // st.tp)
            calls = 4 * n + red + pre + post
            _add(out, ("sp", "reduce_scatter_single"), k * calls, k * calls * st.act)
        else:
            calls = 4 * n + red + pre + post
            _add(out, ("tp", "all_reduce"), k * calls, k * calls * st.act)
        if post:
            _add(out, ("tp", "all_reduce"), 3 * k, 3 * k * 4 * st.b * st.s)


def _sp_and_embedding_grad_all_reduces(out: dict, st: _StepShape, layouts) -> None:
    """Add, for one pipeline stage (`layouts`: its chunks' bucket layouts), the all-reduce over
    tp of the sequence-parallel weights' float32 gradients and the tied word embedding's
    between the first and last stage (pp > 1). Counted per DP rank when gradients are
    sharded: each rank reduces only the part of those weights its shard owns."""
    wanted = [(bucket, offsets[id(p)], p) for buckets, offsets in layouts
              for bucket in buckets for p in bucket.params
              if (st.sp and p.sequence_parallel) or (p.shared_embedding and st.pp > 1)]
    for d in range(st.gdp if st.shard_grads else 1):
        sp_bytes = emb_calls = emb_bytes = 0
        for bucket, lo, p in wanted:
            n_own = _owned(bucket, lo, lo + p.count, st.gdp, d, st.shard_grads)
            if st.sp and p.sequence_parallel:
                sp_bytes += 4 * n_own
            if p.shared_embedding and st.pp > 1 and n_own:
                emb_calls, emb_bytes = emb_calls + 1, emb_bytes + 4 * n_own
        k = st.tp * (1 if st.shard_grads else st.gdp)  # ranks alike
        if st.sp and sp_bytes:
            _add(out, ("tp", "all_reduce"), k, k * sp_bytes)
        _add(out, ("embedding", "all_reduce"), k * emb_calls, k * emb_bytes)


def _dp_bucket_collectives(out: dict, st: _StepShape, r: int, chunks, layouts,
                           first_step: bool, dp: int, label: str = "dp") -> None:
    """Add the DP gradient and weight traffic of pipeline stage `r`'s buckets over a group of
    `dp` > 1 ranks labelled `label` (the dense buckets over dp; an MoE model's expert
    buckets over edp): an all-reduce of each float32 bucket (no_shard); a reduce-scatter
    (optim: once a step, optim_grads: every microbatch) and an all-gather of the updated
    weight shard; ZeRO-3's reduce-scatter every microbatch and per-unit gathers
    (`_zero3_gathers`)."""
    w = st.e  # weights are stored in the activation dtype (bf16 or fp32)
    sizes = [b.end - b.start for buckets, _ in layouts for b in buckets]
    n, k = sum(sizes), len(sizes) * st.replicas  # elements, and calls of one kind
    if st.strategy == "no_shard":
        _add(out, (label, "all_reduce"), k, st.replicas * 4 * n)
    elif st.strategy in ("optim", "optim_grads"):
        times = st.mb if st.strategy == "optim_grads" else 1
        _add(out, (label, "reduce_scatter_single"), k * times, times * st.replicas * 4 * n)
        _add(out, (label, "all_gather_single"), k, st.replicas * w * n // dp)
    else:  # optim_grads_params
        _add(out, (label, "reduce_scatter_single"), k * st.mb, st.mb * st.replicas * 4 * n)
        calls, elements = _zero3_gathers(chunks, layouts, r, st.pp, st.v, st.mb, first_step)
        _add(out, (label, "all_gather_single"), st.replicas * calls,
             st.replicas * w * elements // dp)


def _moe_collectives(out: dict, st: _StepShape, config, r: int, chunks, ep: int) -> None:
    """Add what the MoE layers of pipeline stage `r` exchange (planner/moe.py
    `layer_collectives` per layer and microbatch, `step_collectives` once a step), on every
    rank of the stage."""
    m, t = config.model, config.train
    layers = 0
    for params in chunks:
        numbers = list(dict.fromkeys(int(p.unit.split()[1]) for p in params
                                     if p.unit.startswith("layer ")))
        inside = _recomputed_layers(len(numbers), t)
        for i, n in enumerate(numbers):
            if not m.is_moe_layer(n):
                continue
            layers += 1
            per_mb = moe.layer_collectives(m, st.s, st.b, st.tp, st.sp, st.e, ep, i in inside,
                                           st.cp)
            for key, (calls, nbytes) in per_mb.items():
                _add(out, key, calls * st.replicas * st.mb, nbytes * st.replicas * st.mb)
    for key, (calls, nbytes) in moe.step_collectives(m, layers, st.dp, st.tp, st.sp,
                                                     st.cp).items():
        _add(out, key, calls * st.replicas, nbytes * st.replicas)


def attention_layers(config, chunks) -> tuple[int, int]:
    """(attention layers, of which recomputed: their attention forward runs again in
    backward) of a stage's `chunks`: every layer under selective recompute (the core
    attention is what it checkpoints), the layers inside spans under full recompute."""
    t = config.train
    layers = recomputed = 0
    for params in chunks:
        n = len({p.unit for p in params if p.unit.startswith("layer ")})
        layers += n
        recomputed += n if t.recompute_granularity == "selective" \
            else len(_recomputed_layers(n, t))
    return layers, recomputed


def _context_parallel_attention(out: dict, st: _StepShape, config, chunks) -> None:
    """Add the CP attention's K/V exchange of a stage (planner/context_parallel.py
    `layer_communication` per layer and microbatch) on every rank of the stage."""
    m, t = config.model, config.train
    layers, recomputed = attention_layers(config, chunks)
    for again, count in ((False, layers - recomputed), (True, recomputed)):
        per_layer = layer_communication(m, m.seq_length, st.b, st.tp, st.cp, st.e,
                                        t.cp_comm_type, again)
        k = count * st.replicas * st.mb
        for key, (calls, nbytes) in per_layer.items():
            _add(out, key, k * calls, k * nbytes)


def context_parallel_communication(config) -> dict[tuple[str, str], tuple[int, int]]:
    """The part of `step_communication` that the CP attention exchanges (cp > 1; else
    empty), summed over all ranks."""
    st, out = _StepShape.of(config), {}
    if st.cp > 1:
        for r in range(st.pp):
            _context_parallel_attention(out, st, config, rank_chunks(config, r, base=True))
    return out


def _pipeline_p2p(out: dict, st: _StepShape) -> None:
    """Add the stage tensors sent between pipeline stages (pp > 1): `2 (v p - 1)` messages per
    microbatch per replica, each `A` (`A / t` under SP), and their matching receives."""
    msgs = st.replicas * st.mb * 2 * (st.v * st.pp - 1)
    stage = st.act // st.tp if st.sp else st.act
    _add(out, ("pp", "send"), msgs, msgs * stage)
    _add(out, ("pp", "recv"), msgs, msgs * stage)


def _scalar_all_reduces(out: dict, st: _StepShape, t, ep: int = 1) -> None:
    """Add the float32 scalars every rank all-reduces once a step: the token count and loss
    sum over dp (and the sharded optimizer's squared norms, dense and expert: 2 floats,
    data_parallel/grad_norm.py `global_norm`), unsharded at ep > 1 the experts' squared norm
    over ep, the loss sum over pp, the squared gradient norm over tp x pp, and the
    non-finite verdict (2 flags) over the world."""
    world = st.world
    distributed_opt = t.use_distributed_optimizer or t.bf16 or t.optimizer_cpu_offload
    sharded_norm = distributed_opt and t.use_distributed_optimizer and st.gdp > 1
    if st.gdp > 1:  # token count and loss sum; the sharded optimizer's squared norms
        _add(out, (st.grad_label, "all_reduce"), (2 + sharded_norm) * world,
             (2 + 2 * sharded_norm) * world * 4)
    if ep > 1 and not sharded_norm:
        _add(out, ("ep", "all_reduce"), world, world * 4)
    if st.pp > 1:
        _add(out, ("pp", "all_reduce"), world, world * 4)
    if st.tp * st.pp > 1:
        _add(out, ("mp", "all_reduce"), world, world * 4)
    if t.check_for_nan_in_loss_and_grad and world > 1:
        spanning = [name for name, size in (("tp", st.tp), ("dp", st.dp), ("pp", st.pp),
                                            ("cp", st.cp)) if size > 1]
        label = spanning[0] if len(spanning) == 1 else "world"
        _add(out, (label, "all_reduce"), world, world * 2 * world * 4)


def step_communication(config, first_step: bool = False) -> dict[tuple[str, str], tuple[int, int]]:
    """`{(group, op): (calls, bytes)}` of one training step, summed over all ranks (a
    validated run_config.config.Config). Groups: tp, sp, dp, pp, embedding, mp, world, in
    an MoE model ep and edp (planner/moe.py), at cp > 1 cp and dp-cp.
    `first_step`: the first step of a run (ZeRO-3 gathers one unit more, see `_zero3_gathers`);
    otherwise a steady-state step."""
    st, t = _StepShape.of(config), config.train
    ep, etp, edp = moe.expert_layout(config)
    out: dict = {}
    for r in range(st.pp):
        chunks = rank_chunks(config, r, base=True)  # the layers (a LoRA run's too)
        sets = chunk_sets(config, r)  # at ep > 1: the experts' buckets apart, over edp
        dense = [chunk[0][0] for chunk in sets]
        experts = [chunk[1][0] for chunk in sets if len(chunk) > 1]
        layouts = [chunk_layout(c, st.gdp, st.strategy, t.ddp_bucket_size) for c in dense]
        if st.tp > 1:  # per microbatch, on each TP rank of the stage
            _tp_activation_collectives(out, st, t, r, chunks)
        if st.cp > 1:
            _context_parallel_attention(out, st, config, chunks)
        if moe.is_moe(config.model):
            _moe_collectives(out, st, config, r, chunks, ep)
        _sp_and_embedding_grad_all_reduces(out, st, layouts)  # per step, per DP rank
        if st.gdp > 1:
            _dp_bucket_collectives(out, st, r, dense, layouts, first_step, st.gdp,
                                   st.grad_label)
        if edp > 1 and experts:
            _dp_bucket_collectives(out, st, r, experts, [
                chunk_layout(c, edp, st.strategy, t.ddp_bucket_size) for c in experts],
                first_step, edp, moe.edp_label(st.tp, ep, etp))
    if st.pp > 1:
        _pipeline_p2p(out, st)
    _scalar_all_reduces(out, st, t, ep)
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------- alpha-beta time
def group_size(group: str, tp: int, dp: int, pp: int, ep: int = 1, cp: int = 1) -> int:
    return {"tp": tp, "sp": tp, "dp": dp, "pp": pp, "embedding": 2, "mp": tp * pp,
            "world": tp * cp * dp * pp, "ep": ep, "edp": dp // ep, "cp": cp,
            "dp-cp": dp * cp}[group]


def group_ranks(group: str, tp: int, dp: int, pp: int, ep: int = 1,
                cp: int = 1) -> list[list[int]]:
    """Global ranks of every group of a kind (tp fastest, then cp, dp, pp: parallel_state,
    Megatron's order tp-cp-dp-pp; the expert groups, cp 1, with etp = tp: ep takes `ep`
    consecutive DP ranks, edp every `ep`th)."""
    if cp > 1:
        return _cp_group_ranks(group, tp, dp, pp, cp)

    def rank(p, d, t):
        return (p * dp + d) * tp + t
    if group in ("tp", "sp"):
        return [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)]
    if group == "dp":
        return [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    if group == "ep":
        return [[rank(p, d + e, t) for e in range(ep)] for p in range(pp)
                for d in range(0, dp, ep) for t in range(tp)]
    if group == "edp":
        return [[rank(p, d, t) for d in range(e, dp, ep)] for p in range(pp)
                for e in range(ep) for t in range(tp)]
    if group == "pp":  # a p2p link: adjacent stages
        return [[rank(p, d, t), rank(p + 1, d, t)] for p in range(pp - 1) for d in range(dp)
                for t in range(tp)]
    if group == "embedding":
        return [[rank(0, d, t), rank(pp - 1, d, t)] for d in range(dp) for t in range(tp)]
    if group == "world":
        return [list(range(tp * dp * pp))]
    return [[rank(p, d, t) for p in range(pp) for t in range(tp)] for d in range(dp)]


def _cp_group_ranks(group: str, tp: int, dp: int, pp: int, cp: int) -> list[list[int]]:
    """`group_ranks` at cp > 1: rank `((p dp + d) cp + c) tp + t` (no expert groups: MoE
    runs at cp 1)."""
    def rank(p, d, c, t):
        return ((p * dp + d) * cp + c) * tp + t
    stage = [(p, d, c, t) for p in range(pp) for d in range(dp) for c in range(cp)
             for t in range(tp)]
    key = {"tp": lambda p, d, c, t: (p, d, c), "sp": lambda p, d, c, t: (p, d, c),
           "cp": lambda p, d, c, t: (p, d, t), "dp": lambda p, d, c, t: (p, c, t),
           "dp-cp": lambda p, d, c, t: (p, t), "world": lambda p, d, c, t: 0,
           "mp": lambda p, d, c, t: (d, c)}
    if group in ("pp", "embedding"):  # p2p links: adjacent stages; the first and the last
        pairs = [(p, p + 1) for p in range(pp - 1)] if group == "pp" else [(0, pp - 1)]
        return [[rank(a, d, c, t), rank(z, d, c, t)] for a, z in pairs
                for d in range(dp) for c in range(cp) for t in range(tp)]
    groups: dict = {}
    for p, d, c, t in stage:
        groups.setdefault(key[group](p, d, c, t), []).append(rank(p, d, c, t))
    return list(groups.values())


@functools.lru_cache(maxsize=4096)
def crosses_nodes(group: str, tp: int, dp: int, pp: int, node_size: int, ep: int = 1,
                  cp: int = 1) -> bool:
    """True when some group of this kind has ranks on two nodes (`node_size` GPUs each)."""
    return any(len({r // node_size for r in ranks}) > 1
               for ranks in group_ranks(group, tp, dp, pp, ep, cp))


def ring_traffic(op: str, payload_bytes: float, n: int) -> tuple[int, float]:
    """(latency steps, bytes each rank sends) of one call with ring algorithms (Thakur et al.
    2005; Patarasuk & Yuan 2009), `payload_bytes` as counted (see module docstring):

    - all-reduce of B: `2 (n - 1)` steps, `2 (n - 1) B / n` bytes (reduce-scatter + all-gather)
    - reduce-scatter of a full input B: `n - 1` steps, `(n - 1) B / n` bytes
    - all-gather of a local shard B: `n - 1` steps, `(n - 1) B` bytes
    - send: 1 step, B bytes; recv: nothing (its time is the matching send's)
    - all-to-all of B (every row a rank sends, its own included): pairwise exchange, `n - 1`
      steps, `(n - 1) B / n` bytes when the rows are spread evenly (balanced routing)
    """
    if op == "send":
        return 1, payload_bytes
    if op == "recv" or n == 1:
        return 0, 0.0
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) * payload_bytes / n
    if op in ("reduce_scatter_single", "all_to_all_single"):
        return n - 1, (n - 1) * payload_bytes / n
    if op == "all_gather_single":
        return n - 1, (n - 1) * payload_bytes
    raise ValueError(f"no time model for op {op!r}")


def collective_seconds(op: str, payload_bytes: float, n: int, bandwidth: float,
                       latency: float) -> float:
    """Alpha-beta time of one call: `steps x latency + bytes sent / bandwidth` (`ring_traffic`;
    `bandwidth` in bytes/s per GPU, `latency` in seconds per step)."""
    steps, sent = ring_traffic(op, payload_bytes, n)
    return steps * latency + sent / bandwidth


def participants(group: str, tp: int, dp: int, pp: int, cp: int = 1) -> int:
    """Ranks taking part in the calls of a group kind (the embedding group: 2 stages)."""
    world = tp * cp * dp * pp
    return 2 * tp * cp * dp if group == "embedding" else world


def communication_per_rank(comm: dict, tp: int, dp: int, pp: int, network,
                           ep: int = 1, cp: int = 1) -> dict[str, dict]:
    """Per group kind, the mean over the ranks that take part of: calls, payload bytes, bytes
    sent on the wire (ring algorithms) and seconds per step: `{group: {"calls", "payload_bytes",
    "sent_bytes", "seconds"}}`. `network`: `.node_size`, `.bandwidth(inter)`, `.latency(inter)`
    (a group with ranks on two nodes moves all its bytes at the inter-node figures)."""
    out: dict[str, dict] = {}
    for (group, op), (calls, nbytes) in comm.items():
        ranks = participants(group, tp, dp, pp, cp)
        n = group_size(group, tp, dp, pp, ep, cp)
        inter = crosses_nodes(group, tp, dp, pp, network.node_size, ep, cp)
        steps, sent = ring_traffic(op, nbytes / calls, n)
        g = out.setdefault(group, {"calls": 0.0, "payload_bytes": 0.0, "sent_bytes": 0.0,
                                   "seconds": 0.0})
        g["calls"] += calls / ranks
        g["payload_bytes"] += nbytes / ranks
        g["sent_bytes"] += calls / ranks * sent
        g["seconds"] += calls / ranks * (steps * network.latency(inter)
                                         + sent / network.bandwidth(inter))
    return out


def communication_seconds(comm: dict, tp: int, dp: int, pp: int, network,
                          ep: int = 1, cp: int = 1) -> dict[str, float]:
    """Seconds per step each rank spends in each group kind (`communication_per_rank`)."""
    return {g: v["seconds"]
            for g, v in communication_per_rank(comm, tp, dp, pp, network, ep, cp).items()}
