"""Every layout of a model on a GPU count: validated as train.py validates it, predicted
(memory, communication, bubble, step time, MFU) and ranked.

A layout is (tp, pp, vpp and pipeline schedule -- 1f1b or zb-h1 at vpp 1, interleaved
above, zbv at vpp 2 --, cp, dp, micro batch, sharding strategy, recompute, sequence parallel, and for an MoE model the expert-parallel size ep: every divisor of num_moe_experts
that divides dp, expert TP = TP; the context-parallel size cp: every divisor of the GPUs left
by tp x pp with seq_length divisible by 2 cp, dense models only, in the comm type asked
for); `enumerate_layouts` builds each one as a
`run_config.config.Config` and runs train.py's own `validate` on it, so a layout this module
lists is one train.py accepts; a rejected one keeps the validation's message (or the
planner's reason: TP across nodes, memory).

Step time (seconds), from the FLOP count of planner/flops.py (Narayanan et al. 2021,
sec. 5.1) at `peak x matmul_efficiency` per GPU:

    t_mb    = max over stages of (training FLOPs of the stage's layers, + logits on the last,
              + recompute: a forward of the recomputed layers, or of the attention core under
              selective) x tokens per microbatch and rank (s b / cp) / tp / rate, + the TP/SP
              collectives and MoE all-to-alls of one microbatch (on the critical path: they
              sit between the matmuls; an EP group spanning two nodes moves at the
              inter-node bandwidth), + the CP attention's exchange that its compute does not
              hide: the ring's transfers overlap the attention core's FLOPs (forward,
              backward, recompute) of the microbatch, so max(0, ring - core) is exposed; the
              all_gather type's collectives are all exposed
    t_pipe  = m t_mb (1 + bubble)                  bubble: the schedule table's, equal
              F / B / W passes (parallel_state/schedule_tables.py): (p - 1) / (v m) for 1F1B
              and interleaved, (p - 1) / (3 m) for ZB-H1 at m >= p
    t_step  = t_pipe + p2p + exposed DP + embedding and norm all-reduces

DP gradient reductions (over dp x cp; the expert gradients' over edp) overlap the last
microbatch's backward (2/3 of t_mb; ZeRO-2/3: every microbatch's), the ZeRO-1/2 parameter
all-gather the next forward (1/3 of t_mb); what does not fit is exposed. MFU = model FLOPs of the step / (t_step x GPUs x peak).

FP8 (--fp8-format in the run file or tools/plan.py): the FP8 GEMMs of the layers in FP8
(planner/flops.py `layer_fp8_forward_flops`) run at `fp8_peak x matmul_efficiency` in t_mb,
and MFU's peak is `blended_peak` of both by their share of the FLOPs (`mfu_peak_tflops`).

Offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021) is searched
only when no layout fits without it (`plan`): ZeRO-2/3 layouts with the optimizer in host
memory or on NVMe, and ZeRO-3 layouts with the parameters there too. Its time, at the
assumed `Hardware.host_bandwidth` (per GPU, PCIe) and `nvme_bandwidth` (per node, shared by
its GPUs), for N = the rank's optimizer elements (psi / dp) and W the weight bytes:

    optimizer:  N (4 + W) / host_bw           gradients to the host, new weights back
              + N 24 / (nvme_bw / node GPUs)  NVMe: main copy and moments read and written
                (exposed: the update runs after backward)
    parameters: m (2 + recompute) N W / bw    each microbatch reads every shard for forward,
                                              backward (and recompute); overlapped with the
                                              pipeline's compute, the excess exposed
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from models.config import ConfigError
from models.pipeline import chunk_roles, rank_chunk_layers
from parallel_state.schedule_tables import V_SHAPED

from data_parallel.ddp import STRATEGIES
from run_config.config import Config
from run_config.fp8 import fp8_layers_kept
from run_config.train_config import TrainConfig

from . import moe
from .memory import pipeline_bubble
from .flops import (GPU_PEAK_BF16_TFLOPS, GPU_PEAK_FP8_TFLOPS, blended_peak, core_attention_flops,
                    fp8_flops_share, layer_forward_flops, layer_fp8_forward_flops,
                    training_flops_per_token)
from .communication import (attention_layers, communication_per_rank, communication_seconds,
                            context_parallel_communication, step_communication)
from .memory import peak_memory
from .parameters import rank_chunks

ZERO_STAGE = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
MICRO_BATCH_SIZES = (1, 2, 4, 8)
MAX_VPP = 8


@dataclass
class Network:
    """Alpha-beta parameters: bytes/s per GPU and seconds per message, inside a node of
    `node_size` GPUs and across nodes."""

    node_size: int = 8
    bandwidth_intra: float = 450e9
    bandwidth_inter: float = 50e9
    latency_intra: float = 5e-6
    latency_inter: float = 20e-6

    def bandwidth(self, inter: bool) -> float:
        return self.bandwidth_inter if inter else self.bandwidth_intra

    def latency(self, inter: bool) -> float:
        return self.latency_inter if inter else self.latency_intra


@dataclass
class Hardware:
    """The machine: `gpus`, `gpu_memory` bytes each (of which `memory_headroom` is kept free
    for the allocator, CUDA context and buffers the planner does not count), `peak_tflops`
    per GPU (dense bf16 data sheet), `matmul_efficiency` (share of the peak matmuls reach)."""

    gpus: int
    gpu_memory: float
    network: Network
    peak_tflops: float = GPU_PEAK_BF16_TFLOPS["H100"]
    # dense FP8 peak per GPU, what an --fp8-format run's FP8 GEMMs reach; None: none (A100)
    fp8_peak_tflops: float | None = GPU_PEAK_FP8_TFLOPS["H100"]
    matmul_efficiency: float = 0.7
    memory_headroom: float = 0.1
    host_bandwidth: float = 25e9  # bytes/s per GPU between device and host (PCIe)
    nvme_bandwidth: float | None = None  # bytes/s per node to its NVMe drives; None: no NVMe
    host_memory: float | None = None  # bytes of host memory per node offload may use

    def host_fits(self, host_bytes_per_gpu: float) -> bool:
        """The node's host memory holds this many offloaded bytes for each of its GPUs."""
        node = min(self.network.node_size, self.gpus)
        return self.host_memory is None or host_bytes_per_gpu * node <= self.host_memory

    @property
    def usable_memory(self) -> float:
        return self.gpu_memory * (1 - self.memory_headroom)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_fields(config: Config) -> dict:
    """The layout of a validated config, as the planner reports it."""
    t = config.train
    return {"tp": t.tensor_model_parallel_size, "pp": t.pipeline_model_parallel_size,
            "ep": t.expert_model_parallel_size, "cp": t.context_parallel_size,
            "cp_comm_type": t.cp_comm_type,
            "vpp": t.virtual_pipeline_model_parallel_size or 1, "dp": config.data_parallel_size,
            "schedule": t.pipeline_schedule or "none",
            "micro_batch_size": t.micro_batch_size, "num_microbatches": config.num_microbatches,
            "sequence_parallel": t.sequence_parallel,
            "sharding": t.data_parallel_sharding_strategy,
            "zero_stage": ZERO_STAGE[t.data_parallel_sharding_strategy],
            "recompute": t.recompute_granularity or "none",
            "optimizer_offload": t.optimizer_offload_device if t.optimizer_cpu_offload else None,
            "param_offload": t.param_offload_device,
            "last_stage_layers": t.decoder_last_pipeline_num_layers}


def flags(layout: dict) -> str:
    """train.py flags of a layout."""
    out = [f"--tp {layout['tp']}", f"--pp {layout['pp']}"]
    if layout.get("schedule") in ("zb-h1", "zbv"):
        out.append(f"--pipeline-schedule {layout['schedule']}")  # zbv sets vpp 2 itself
    elif layout["vpp"] > 1:
        out.append(f"--vpp {layout['vpp']}")
    if layout.get("ep", 1) > 1:
        out.append(f"--expert-model-parallel-size {layout['ep']}")
    if layout.get("cp", 1) > 1:
        out.append(f"--context-parallel-size {layout['cp']}")
        if layout.get("cp_comm_type", "p2p") != "p2p":
            out.append(f"--cp-comm-type {layout['cp_comm_type']}")
    if layout.get("last_stage_layers"):
        out.append(f"--decoder-last-pipeline-num-layers {layout['last_stage_layers']}")
    out.append(f"--micro-batch-size {layout['micro_batch_size']}")
    if layout["sequence_parallel"]:
        out.append("--sequence-parallel")
    if layout["sharding"] != "no_shard":
        out.append(f"--data-parallel-sharding-strategy {layout['sharding']}")
    if layout["recompute"] != "none":
        out.append(f"--recompute-granularity {layout['recompute']}")
    if layout.get("optimizer_offload"):
        out.append(f"--optimizer-offload-device {layout['optimizer_offload']}")
    if layout.get("param_offload"):
        out.append(f"--param-offload-device {layout['param_offload']}")
    if "nvme" in (layout.get("optimizer_offload"), layout.get("param_offload")):
        out.append("--offload-path DIR")
    return " ".join(out)


def offload_choices(nvme: bool) -> list[tuple[str, str | None]]:
    """(optimizer, parameters) offload devices the search tries when nothing else fits:
    host memory, then NVMe if the machine has it (`nvme`)."""
    devices = ["cpu"] + (["nvme"] if nvme else [])
    return [(d, None) for d in devices] + [(d, d) for d in devices]


def enumerate_layouts(model, gpus: int, global_batch_size: int, *, bf16: bool = True,
                      node_size: int | None = None, base: TrainConfig | None = None,
                      ep: int | None = None, cp: int | None = None,
                      offload: list[tuple] | None = None):
    """Yield `(config, None)` for each layout train.py accepts and `(fields, reason)` for each
    it (or the planner: TP across nodes) rejects. `model`: a models.ModelConfig (not
    modified); `base`: the TrainConfig the layouts start from (default: train.py's defaults;
    its `cp_comm_type` is the comm type of the cp > 1 layouts); `ep`, `cp`: only this
    expert-parallel / context-parallel size (default: every one, `_parallel_sizes`);
    `offload`: instead of the plain layouts, the ZeRO-2/3 ones with each of these
    (optimizer, parameters) offload devices (`offload_choices`; parameters: ZeRO-3 only)."""
    base = base or TrainConfig()
    choices = [(None, None)] if offload is None else offload
    for tp, pp, vpp, schedule, sp, e, c in _parallel_sizes(model, gpus, ep, cp):
        for mbs in MICRO_BATCH_SIZES:
            for strategy in STRATEGIES if offload is None else ("optim_grads",
                                                                "optim_grads_params"):
                for recompute in _RECOMPUTE:
                    for opt, par in choices:
                        if par and strategy != "optim_grads_params":
                            continue
                        yield _candidate(model, gpus, global_batch_size, base, bf16,
                                         node_size, tp, pp, vpp, sp, mbs, strategy, recompute,
                                         e, c, opt, par, schedule)


_RECOMPUTE = (None, "selective", "full")


def expert_parallel_sizes(model, dp: int) -> list[int]:
    """The ep sizes the search tries at data-parallel size `dp`: 1 for a dense model; for an
    MoE model every divisor of num_moe_experts that divides dp (expert TP = TP, so ep must
    divide dp * tp / etp = dp: run_config/checks.py `expert_layout`)."""
    if not moe.is_moe(model):
        return [1]
    return [e for e in _divisors(model.num_moe_experts) if dp % e == 0]


def context_parallel_sizes(model, ranks: int) -> list[int]:
    """The cp sizes the search tries with `ranks` GPUs left after tp x pp: 1, and for a
    dense decoder every divisor of `ranks` for which seq_length splits into 2 cp equal
    chunks (run_config/checks.py refuses the rest, and MoE, T5 at cp > 1)."""
    if moe.is_moe(model) or model.is_encoder_decoder:
        return [1]
    return [c for c in _divisors(ranks) if c == 1 or model.seq_length % (2 * c) == 0]


def _parallel_sizes(model, gpus: int, ep: int | None = None,
                    cp: int | None = None) -> list[tuple]:
    """Every (tp, pp, vpp, pipeline schedule, sequence parallel, ep, cp) the search tries for
    `gpus` (`ep`, `cp`: only that expert-parallel / context-parallel size): at pp > 1 and
    vpp 1 both 1f1b and zb-h1, at vpp > 1 interleaved, at vpp 2 also zbv."""
    out = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            per_stage = model.num_layers // pp if model.num_layers % pp == 0 else 0
            vpps = [(None, "1f1b"), (None, "zb-h1")] + [
                (v, "interleaved") for v in _divisors(per_stage) if 1 < v <= MAX_VPP] + (
                [(2, "zbv")] if per_stage % 2 == 0 else []) \
                if pp > 1 and per_stage else [(None, "1f1b"), (None, "zb-h1")] \
                if pp > 1 and uneven_last_stage_layers(model, pp) else [(None, None)]
            for c in context_parallel_sizes(model, gpus // (tp * pp)):
                if cp is not None and c != cp:
                    continue
                eps = [e for e in expert_parallel_sizes(model, gpus // (tp * pp * c))
                       if ep is None or e == ep]
                out += [(tp, pp, vpp, schedule, sp, e, c) for vpp, schedule in vpps
                        for sp in ((False, True) if tp > 1 else (False,)) for e in eps]
    return out


def layout_count(model, gpus: int, ep: int | None = None, cp: int | None = None) -> int:
    """How many layouts `enumerate_layouts` yields (valid or not): the search's length."""
    return len(_parallel_sizes(model, gpus, ep, cp)) * len(MICRO_BATCH_SIZES) \
        * len(STRATEGIES) * len(_RECOMPUTE)


def uneven_last_stage_layers(model, pp: int) -> int | None:
    """The last stage's layers when a decoder's `num_layers` does not split evenly over `pp`
    stages: the other stages take `ceil(num_layers / pp)` each and the last (which also holds
    the output layer and the loss) the rest (DeepSeek-V3's 61 layers over 2: 31 + 30; over
    16: 15 x 4 + 1); None when the split is even, no such rest is left, or for T5."""
    n = model.num_layers
    each = -(-n // pp)
    if pp < 2 or n % pp == 0 or model.is_encoder_decoder or n - (pp - 1) * each < 1:
        return None
    return n - (pp - 1) * each


def _candidate(model, gpus, gbs, base, bf16, node_size, tp, pp, vpp, sp, mbs, strategy,
               recompute, ep=1, cp=1, optimizer_offload=None, param_offload=None,
               schedule=None):
    uneven = base.decoder_first_pipeline_num_layers is None and \
        base.decoder_last_pipeline_num_layers is None and uneven_last_stage_layers(model, pp)
    if uneven:
        base = dataclasses.replace(base, decoder_last_pipeline_num_layers=uneven)
    train = dataclasses.replace(
        base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, num_layers_per_virtual_pipeline_stage=None,
        pipeline_schedule=schedule,
        sequence_parallel=sp, micro_batch_size=mbs, global_batch_size=gbs,
        data_parallel_sharding_strategy=strategy, use_distributed_optimizer=False,
        recompute_granularity=recompute, recompute_method=None, recompute_num_layers=None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=None,
        context_parallel_size=cp, optimizer_cpu_offload=False,
        optimizer_offload_device=optimizer_offload, optimizer_offload_fraction=None,
        param_offload_device=param_offload,
        offload_path="DIR" if "nvme" in (optimizer_offload, param_offload) else None,
        bf16=bf16, log_dir="", save=None, save_replica=None, tensorboard=False)
    fields = {"tp": tp, "pp": pp, "ep": ep, "cp": cp, "cp_comm_type": train.cp_comm_type,
              "vpp": vpp or 1, "schedule": schedule or "none", "dp": gpus // (tp * pp * cp),
              "micro_batch_size": mbs, "sequence_parallel": sp, "sharding": strategy,
              "zero_stage": ZERO_STAGE[strategy], "recompute": recompute or "none",
              "optimizer_offload": optimizer_offload, "param_offload": param_offload,
              "last_stage_layers": uneven or None}
    if node_size and tp > node_size:
        return fields, (f"tensor parallel size {tp} exceeds the {node_size} GPUs of a node: "
                        f"its per-layer all-reduces would cross the inter-node network")
    config = Config(model=copy.copy(model), train=train)
    try:
        config.validate(gpus)
    except ConfigError as e:
        return fields, str(e)
    return config, None


def _compute_seconds_per_microbatch(config: Config, hw: Hardware) -> float:
    """The slowest stage's matmul time for one microbatch (module docstring): training FLOPs
    of its layers (planner/flops.py `layer_forward_flops`: an MoE layer's active experts; with
    expert parallelism a rank runs its experts on the rows it receives, as many as it sends
    under balanced routing, so the per-rank work is the same) and the logits on the last, plus
    recompute's extra forward, over tp."""
    m, t = config.model, config.train
    tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
    rate = hw.peak_tflops * 1e12 * hw.matmul_efficiency
    fp8_rate, fp8_layers = _fp8_rate(config, hw)
    logits = 2.0 * m.hidden_size * m.padded_vocab_size(tp)
    attention_core = core_attention_flops(m, m.seq_length)
    tokens = t.micro_batch_size * m.seq_length // t.context_parallel_size  # a CP rank's
    stages = config.stage_num_layers()
    t_mb = 0.0
    v_shape = t.pipeline_schedule in V_SHAPED
    for r in range(pp):
        numbers = [n for chunk in rank_chunk_layers(stages, r,
                                                    t.virtual_pipeline_model_parallel_size,
                                                    v_shape)
                   for n in chunk]
        layers = sum(layer_forward_flops(m, n) for n in numbers)
        fp8 = sum(layer_fp8_forward_flops(m, n) for n in numbers if n in fp8_layers)
        loss_here = any(post for _, post in chunk_roles(
            pp, r, t.virtual_pipeline_model_parallel_size, v_shape))
        flops = 3 * (layers - fp8 + (logits if loss_here else 0))
        if t.recompute_granularity == "full":
            flops, fp8 = flops + layers - fp8, 4 * fp8
        else:
            fp8 *= 3
        if t.recompute_granularity == "selective":
            flops += len(numbers) * attention_core
        t_mb = max(t_mb, (flops / rate + fp8 / fp8_rate) * tokens / tp)
    return t_mb


def _fp8_rate(config: Config, hw: Hardware) -> tuple[float, range]:
    """(FLOP/s the FP8 GEMMs run at, the layers in FP8): the FP8 peak x matmul efficiency
    (the bf16 rate where the GPU has no FP8 peak) and no layer without --fp8-format."""
    m, t = config.model, config.train
    rate = (hw.fp8_peak_tflops or hw.peak_tflops) * 1e12 * hw.matmul_efficiency
    if t.fp8_format is None:
        return rate, range(0)
    start, end = fp8_layers_kept(m, t)
    return rate, range(start, m.num_layers - end)


def mfu_peak_tflops(config: Config, hw: Hardware) -> float:
    """The peak MFU divides by (planner/flops.py `blended_peak`): `hw.peak_tflops`, blended
    with `hw.fp8_peak_tflops` by the FP8 GEMMs' share of the model FLOPs under --fp8-format."""
    if config.train.fp8_format is None or not hw.fp8_peak_tflops:
        return hw.peak_tflops
    share = fp8_flops_share(config.model, *fp8_layers_kept(config.model, config.train))
    return blended_peak(hw.peak_tflops, hw.fp8_peak_tflops, share)


def _attention_core_seconds(config: Config, hw: Hardware) -> float:
    """The slowest stage's attention-core matmul time for one microbatch on a rank (what the
    ring's transfers overlap): `2 x 2 s q` FLOPs per token and layer (QK^T and PV) x 3
    (forward and backward) plus a forward per recomputed layer, x `s b / cp` tokens / tp."""
    m, t = config.model, config.train
    rate = hw.peak_tflops * 1e12 * hw.matmul_efficiency
    core = core_attention_flops(m, m.seq_length)
    tokens = t.micro_batch_size * m.seq_length // t.context_parallel_size
    worst = 0.0
    for r in range(t.pipeline_model_parallel_size):
        layers, recomputed = attention_layers(config, rank_chunks(config, r, base=True))
        worst = max(worst, (3 * layers + recomputed) * core * tokens
                    / t.tensor_model_parallel_size / rate)
    return worst


def predict(config: Config, hw: Hardware) -> dict:
    """Memory, communication, bubble, step time and MFU of a validated layout (see module)."""
    m, t = config.model, config.train
    tp, pp, dp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, \
        config.data_parallel_size
    cp = t.context_parallel_size
    v, mb = t.virtual_pipeline_model_parallel_size or 1, config.num_microbatches
    ep = moe.expert_layout(config)[0]
    memory = peak_memory(config)
    comm = step_communication(config)
    per_group = communication_per_rank(comm, tp, dp, pp, hw.network, ep, cp)
    seconds = {group: row["seconds"] for group, row in per_group.items()}
    attention = context_parallel_communication(config)  # the CP ring / all-gather
    t_cp = communication_seconds(attention, tp, dp, pp, hw.network, ep, cp).get("cp", 0.0)
    rest = {k: (c - attention.get(k, (0, 0))[0], b - attention.get(k, (0, 0))[1])
            for k, (c, b) in comm.items()}
    rest = {k: cb for k, cb in rest.items() if cb[0]}
    t_mb = _compute_seconds_per_microbatch(config, hw)
    exposed_cp = t_cp / mb
    if t.cp_comm_type == "p2p":  # the ring's transfers run under the attention core
        exposed_cp = max(0.0, exposed_cp - _attention_core_seconds(config, hw))
    # TP/SP collectives and the MoE all-to-alls sit between dependent matmuls
    t_stage = t_mb + (seconds.get("tp", 0.0) + seconds.get("sp", 0.0)
                      + seconds.get("ep", 0.0)) / mb + exposed_cp
    bubble = pipeline_bubble(config)
    t_pipe = mb * t_stage * (1 + bubble)
    data = ("dp", "edp", "cp", "dp-cp")  # gradient groups (cp: dp x cp at dp 1)
    grad_keys = [k for k in rest
                 if k[0] in data and k[1] in ("all_reduce", "reduce_scatter_single")]
    grad_seconds = communication_seconds({k: rest[k] for k in grad_keys}, tp, dp, pp,
                                         hw.network, ep, cp)
    t_grad = sum(grad_seconds.get(g, 0.0) for g in data)
    t_gather = sum(communication_seconds({k: rest[k] for k in rest if k[0] in data}, tp, dp,
                                         pp, hw.network, ep, cp).values()) - t_grad
    strategy = t.data_parallel_sharding_strategy
    if strategy in ("optim_grads", "optim_grads_params"):  # every microbatch's backward
        exposed = mb * max(0.0, t_grad / mb - 2 / 3 * t_mb)
        exposed += mb * max(0.0, t_gather / mb - (1 / 3 if strategy == "optim_grads" else 1)
                            * t_mb)
    else:
        exposed = max(0.0, t_grad - 2 / 3 * t_mb) + max(0.0, t_gather - 1 / 3 * t_mb)
    other = seconds.get("pp", 0.0) + seconds.get("embedding", 0.0) + seconds.get("mp", 0.0)
    offload = offload_seconds(config, hw, memory["pp_rank"], t_pipe)
    step = t_pipe + exposed + other + offload
    flops_step = training_flops_per_token(m) * t.global_batch_size * m.seq_length
    world = tp * pp * cp * dp
    fits = memory["total"] <= hw.usable_memory and hw.host_fits(memory["host"])
    return {**layout_fields(config), "memory": memory, "fits": fits,
            "comm": per_group, "comm_seconds": sum(seconds.values()), "bubble": bubble,
            "compute_seconds_per_microbatch": t_mb, "cp_attention_seconds": t_cp,
            "cp_exposed_seconds": exposed_cp * mb,
            "step_seconds": step, "pipeline_seconds": t_pipe, "exposed_dp_seconds": exposed,
            "offload_seconds": offload,
            "tokens_per_s": t.global_batch_size * m.seq_length / step,
            "mfu": flops_step / (step * world * mfu_peak_tflops(config, hw) * 1e12)}


def offload_seconds(config: Config, hw: Hardware, pp_rank: int, t_pipe: float) -> float:
    """Exposed offload time of a step on a rank of stage `pp_rank` (module docstring)."""
    from .parameters import model_state_prediction

    t = config.train
    if not t.optimizer_cpu_offload and not t.param_offload_device:
        return 0.0
    states = model_state_prediction(config, pp_rank)
    n = states["psi_padded"] // states["dp"]
    w = 2 if t.bf16 else 4
    node_gpus = min(hw.network.node_size, hw.gpus)
    nvme_bw = (hw.nvme_bandwidth or 0.0) / node_gpus

    def rate(device):
        return hw.host_bandwidth if device == "cpu" else nvme_bw

    out = 0.0
    if t.optimizer_cpu_offload:
        out += n * (4 + w) / hw.host_bandwidth
        if t.optimizer_offload_device == "nvme":
            out += 24 * n / nvme_bw
    if t.param_offload_device:
        reads = 2 + (t.recompute_granularity == "full")
        io = config.num_microbatches * reads * n * w / rate(t.param_offload_device)
        out += max(0.0, io - t_pipe) + n * w / rate(t.param_offload_device)
    return out


def plan(model, hw: Hardware, global_batch_size: int, *, bf16: bool = True,
         base: TrainConfig | None = None, progress=None, ep: int | None = None,
         cp: int | None = None, offload: bool = True) -> dict:
    """`{"fits": [predictions, fastest first], "rejected": [{layout fields, "reason"}]}`.

    `progress(checked, fitting)`, if given, is called before each layout with the counts so
    far (tools/plan.py shows them against `layout_count`); `ep`: only layouts of that
    expert-parallel size (default: every one); `cp`: only layouts of that context-parallel
    size (default: every one). When no layout fits, the search runs again over the offload
    choices (`offload_choices`; NVMe when `hw.nvme_bandwidth`), and the result says so
    (`"offload": True`); `offload=False` does not."""
    result = _search_layouts(model, hw, global_batch_size, bf16, base, progress, ep, cp, None)
    result["offload"] = False
    if not result["fits"] and offload:
        again = _search_layouts(model, hw, global_batch_size, bf16, base, progress, ep, cp,
                        offload_choices(hw.nvme_bandwidth is not None))
        result = {"fits": again["fits"], "rejected": result["rejected"] + again["rejected"],
                  "offload": True}
    return result


def _search_layouts(model, hw, global_batch_size, bf16, base, progress, ep, cp, offload) -> dict:
    fits, rejected = [], []
    for item, reason in enumerate_layouts(model, hw.gpus, global_batch_size, bf16=bf16,
                                          node_size=hw.network.node_size, base=base, ep=ep,
                                          cp=cp, offload=offload):
        if progress is not None:
            progress(len(fits) + len(rejected), len(fits))
        if reason is not None:
            rejected.append({**item, "reason": reason})
            continue
        p = predict(item, hw)
        if p["fits"]:
            fits.append(p)
        else:
            worst = p["memory"]
            if worst["total"] <= hw.usable_memory:  # the device fits, the host does not
                rejected.append({**layout_fields(item), "reason": (
                    f"needs {worst['host'] / 1e9:.1f} GB of host memory per GPU, more than "
                    f"{hw.host_memory / 1e9:g} GB per node holds for its GPUs")})
                continue
            rejected.append({**layout_fields(item), "reason": (
                f"needs {worst['total'] / 1e9:.1f} GB on pipeline stage {worst['pp_rank']} "
                f"(model states {worst['model_states'] / 1e9:.1f}, activations "
                f"{worst['activations'] / 1e9:.1f} for {worst['in_flight']} microbatch(es) in "
                f"flight) > {hw.usable_memory / 1e9:.1f} GB usable"),
                "memory_bytes": worst["total"]})
    # ties (communication hidden behind compute) go to less traffic, then less memory
    # step times within 0.1% of each other are a tie (the model is not that precise): the
    # layout with less communication time wins, then the one with less memory
    fits.sort(key=lambda p: (round(math.log(p["step_seconds"]), 3), p["comm_seconds"],
                             p["memory"]["total"]))
    return {"fits": fits, "rejected": rejected}


def smallest_fit(model, hw: Hardware, global_batch_size: int, *, bf16: bool = True,
                 rejected: list[dict]) -> str:
    """The one-line advice when nothing fits: the least memory any valid layout needs, and
    the smallest GPU count (multiples of the node, up to 64x) where some layout fits."""
    mem = [r["memory_bytes"] for r in rejected if "memory_bytes" in r]
    need = min(mem) if mem else None
    step = hw.network.node_size if hw.gpus >= hw.network.node_size else 1
    more = None
    for gpus in range(hw.gpus + step, hw.gpus * 64 + 1, step):
        bigger = dataclasses.replace(hw, gpus=gpus)
        if _any_fits(model, bigger, global_batch_size, bf16):
            more = gpus
            break
    parts = []
    if need is not None:
        parts.append(f"the smallest valid layout needs {need / 1e9:.1f} GB per GPU "
                     f"({need / (1 - hw.memory_headroom) / 1e9:.1f} GB with the "
                     f"{hw.memory_headroom:.0%} headroom)")
    if more is not None:
        parts.append(f"with {hw.gpu_memory / 1e9:g} GB GPUs at least {more} GPUs would fit")
    return "; ".join(parts) or "no valid layout for this GPU count"


def _any_fits(model, hw: Hardware, gbs: int, bf16: bool) -> bool:
    """Cheap check: only the most memory-frugal settings (ZeRO-3, full recompute, micro
    batch 1, the largest context- and expert-parallel sizes) of each (tp, pp)."""
    for tp in _divisors(hw.gpus):
        if tp > hw.network.node_size:
            continue
        for pp in _divisors(hw.gpus // tp):
            cp = max(context_parallel_sizes(model, hw.gpus // (tp * pp)))
            ep = max(expert_parallel_sizes(model, hw.gpus // (tp * pp * cp)))
            for sp in ((True,) if tp > 1 else (False,)):
                item, reason = _candidate(model, hw.gpus, gbs, TrainConfig(), bf16,
                                          hw.network.node_size, tp, pp, None, sp, 1,
                                          "optim_grads_params", "full", ep, cp)
                if reason is None and peak_memory(item)["total"] <= hw.usable_memory:
                    return True
    return False


def global_batch_default(gpus: int) -> int:
    """A global batch when none is given: 8 sequences per GPU, at least 64 (a power of 2)."""
    return max(64, 2 ** math.ceil(math.log2(8 * gpus)))
