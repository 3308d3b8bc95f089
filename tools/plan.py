"""Plan a training layout: every valid (tp, pp, vpp, cp, dp, micro batch, ZeRO stage,
recompute, sequence parallel, and for a mixture of experts the expert-parallel size) for a
model on a GPU count, with predicted per-rank memory, communication, pipeline bubble, step
time and MFU; the layouts that fit, fastest first, the reasons the others do not, and why the
top one wins.

    python tools/plan.py --model llama-70b --gpus 64 --gpu-memory 80GB --seq-length 4096 \
        --global-batch-size 512
    python tools/plan.py --config configs/tiny-llama.yaml --gpus 4 --gpu-memory 1GB --json
    python tools/plan.py --model mixtral-8x7b --gpus 64 --gpu-memory 80GB --top 5
    python tools/plan.py --model llama-8b --gpus 64 --gpu-memory 80GB --seq-length 131072 \
        --global-batch-size 64

Layouts are validated by train.py's own checks (run_config/checks.py), so every listed
one runs as `train.py --model NAME <its flags>`. Formulas and their sources: docs/PLANNING.md
(planner/). Bad input prints one line (`plan.py: error: ...`) and exits 2.

When stderr is a terminal, one status line there says what it is doing (loading torch and
train.py's checks, then layouts checked of how many) and is erased when the plan prints.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _search():
    """planner.search, imported when first needed, after the status line: it loads
    torch and train.py's checks (seconds on a busy machine, up to minutes on a loaded one)."""
    from planner import search
    return search

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20,
          "gi": 2**30, "ti": 2**40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


class PlanError(ValueError):
    """Bad input: the message names the flag and the fix."""


def parse_bytes(text: str, flag: str, per_second: bool = False) -> float:
    """`80GB`, `80GiB`, `450GB/s`, `1.5e9` -> bytes (GB = 1e9, GiB = 2^30)."""
    pattern = r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]i?)?[bB]?" + (r"(/s)?" if per_second else "") + r"\s*"
    match = re.fullmatch(pattern, text)
    try:
        value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    except (AttributeError, ValueError):
        raise PlanError(f"{flag} {text!r}: write a size like 80GB or 80GiB"
                        + ("/s" if per_second else "")) from None
    if not value > 0:
        raise PlanError(f"{flag} must be positive, got {text!r}")
    return value


def parse_seconds(text: str, flag: str) -> float:
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)?\s*", text)
    try:
        value = float(match.group(1)) * _TIME[match.group(2) or "s"]
    except (AttributeError, ValueError):
        raise PlanError(f"{flag} {text!r}: write a time like 5us or 0.02ms") from None
    if value < 0:
        raise PlanError(f"{flag} must be >= 0, got {text!r}")
    return value


class Status:
    """One line of progress on `stream`, rewritten in place, when it is a terminal (nothing
    otherwise: a log or a pipe keeps only the plan). `say(text)` shows text now; `tick(text)`
    at most every `every` seconds; `clear()` erases the line before the results print."""

    def __init__(self, stream=None, every: float = 0.25):
        self.stream = stream or sys.stderr
        self.on = self.stream.isatty()
        self.every, self.last, self.shown = every, 0.0, False

    def say(self, text: str) -> None:
        if self.on:
            self.last, self.shown = time.monotonic(), True
            self.stream.write("\r\x1b[K" + text)
            self.stream.flush()

    def tick(self, text) -> None:
        """`text`: a string, or a function making it (called only when shown)."""
        if self.on and time.monotonic() - self.last >= self.every:
            self.say(text() if callable(text) else text)

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise PlanError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="NAME", help="configs/models/NAME.yaml (or a .yaml path)")
    src.add_argument("--config", metavar="FILE.yaml", help="a train.py run file (its model and "
                     "non-layout settings: bucket size, bf16, ...)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in total")
    p.add_argument("--gpu-memory", default="80GB", help="memory per GPU (default 80GB)")
    p.add_argument("--nodes-of", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--bandwidth-intra", default="450GB/s", help="per GPU inside a node")
    p.add_argument("--bandwidth-inter", default="50GB/s", help="per GPU across nodes")
    p.add_argument("--latency-intra", default="5us", help="per message inside a node")
    p.add_argument("--latency-inter", default="20us", help="per message across nodes")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak per GPU (default 989: H100/H200 data sheet)")
    p.add_argument("--fp8-peak-tflops", type=float, default=1979.0,
                   help="dense FP8 peak per GPU, what FP8 GEMMs reach (default 1979: H100/H200 "
                        "data sheet; 0: the GPU has none, FP8 GEMMs at --peak-tflops)")
    p.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None,
                   help="plan FP8 training (train.py's --fp8-format; the run file's otherwise)")
    p.add_argument("--matmul-efficiency", type=float, default=0.7,
                   help="share of the peak that the matmuls reach (default 0.7)")
    p.add_argument("--memory-headroom", type=float, default=0.1,
                   help="share of GPU memory kept free for what is not modelled (default 0.1)")
    p.add_argument("--seq-length", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--global-batch-size", type=int,
                   help="sequences per step (default: 8 per GPU, at least 64)")
    p.add_argument("--fp32", action="store_true", help="plan float32 training (default bf16; "
                   "with --config, the run file's --bf16 setting)")
    p.add_argument("--expert-model-parallel-size", type=int, metavar="EP",
                   help="an MoE model: only layouts with this expert-parallel size (a divisor "
                   "of --num-experts that divides the data-parallel size; default: search "
                   "every one)")
    p.add_argument("--context-parallel-size", type=int, metavar="CP",
                   help="only layouts with this context-parallel size (2 x cp must divide "
                   "--seq-length; default: search every one)")
    p.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), default=None,
                   help="the cp > 1 layouts' K/V exchange: p2p (ring, default) or all_gather")
    p.add_argument("--host-bandwidth", default="25GB/s",
                   help="offload: device <-> host memory per GPU (PCIe; default 25GB/s)")
    p.add_argument("--nvme-bandwidth", default=None,
                   help="offload: a node's NVMe read/write bandwidth, shared by its GPUs (e.g. "
                        "25GB/s; default: no NVMe, offload only to host memory)")
    p.add_argument("--host-memory", default=None,
                   help="offload: host memory per node it may fill (e.g. 2TB; default: no "
                        "limit)")
    p.add_argument("--no-offload", action="store_true",
                   help="do not search offload when nothing fits without it")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="plan a LoRA fine-tune: rank-R adapters on a frozen base (train.py's "
                        "--lora-rank; the base's bytes apart, adapters' states ZeRO-sharded)")
    p.add_argument("--lora-target-modules", default=None,
                   help="with --lora-rank: the adapted modules (default all-linear)")
    p.add_argument("--lora-base-quantization", default=None,
                   help="with --lora-rank: QLoRA's low-bit base (int8, int4, q8_0, q4_0, q4_1)")
    p.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    return p


def _inputs(args):
    from training.arguments import parse_config

    Hardware, Network = _search().Hardware, _search().Network
    if args.gpus < 1:
        raise PlanError(f"--gpus must be a positive integer, got {args.gpus}")
    if args.nodes_of < 1:
        raise PlanError(f"--nodes-of must be a positive integer, got {args.nodes_of}")
    if args.gpus > args.nodes_of and args.gpus % args.nodes_of:
        raise PlanError(f"--gpus {args.gpus} is not a multiple of --nodes-of {args.nodes_of}: "
                        f"use whole nodes (e.g. --gpus {args.gpus // args.nodes_of * args.nodes_of}"
                        f" or {-(-args.gpus // args.nodes_of) * args.nodes_of})")
    for name in ("matmul_efficiency", "memory_headroom"):
        value = getattr(args, name)
        if not 0 <= value < 1 or (name == "matmul_efficiency" and value == 0):
            raise PlanError(f"--{name.replace('_', '-')} must be in (0, 1), got {value}")
    if not args.peak_tflops > 0:
        raise PlanError(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if not args.fp8_peak_tflops >= 0:
        raise PlanError(f"--fp8-peak-tflops must be >= 0 (0: no FP8 peak), got "
                        f"{args.fp8_peak_tflops}")
    config = parse_config(["--model", args.model] if args.model else ["--config", args.config])
    model = config.model
    if args.seq_length is not None:
        if args.seq_length < 1:
            raise PlanError(f"--seq-length must be positive, got {args.seq_length}")
        model.seq_length = args.seq_length
    model.validate(1)
    if args.expert_model_parallel_size is not None:
        from planner.moe import check_expert_count
        check_expert_count(model, args.expert_model_parallel_size)
    _check_context_parallel(args, model)
    train = config.train
    _lora_inputs(args, train)
    if args.fp8_format is not None:
        train.fp8_format = args.fp8_format
    if args.cp_comm_type is not None:
        train.cp_comm_type = args.cp_comm_type
    gbs = args.global_batch_size or _search().global_batch_default(args.gpus)
    if gbs < 1:
        raise PlanError(f"--global-batch-size must be positive, got {gbs}")
    network = Network(node_size=min(args.nodes_of, args.gpus),
                      bandwidth_intra=parse_bytes(args.bandwidth_intra, "--bandwidth-intra", True),
                      bandwidth_inter=parse_bytes(args.bandwidth_inter, "--bandwidth-inter", True),
                      latency_intra=parse_seconds(args.latency_intra, "--latency-intra"),
                      latency_inter=parse_seconds(args.latency_inter, "--latency-inter"))
    hw = Hardware(gpus=args.gpus, gpu_memory=parse_bytes(args.gpu_memory, "--gpu-memory"),
                  network=network, peak_tflops=args.peak_tflops,
                  fp8_peak_tflops=args.fp8_peak_tflops or None,
                  matmul_efficiency=args.matmul_efficiency, memory_headroom=args.memory_headroom,
                  host_bandwidth=parse_bytes(args.host_bandwidth, "--host-bandwidth", True),
                  nvme_bandwidth=None if args.nvme_bandwidth is None else
                  parse_bytes(args.nvme_bandwidth, "--nvme-bandwidth", True),
                  host_memory=None if args.host_memory is None else
                  parse_bytes(args.host_memory, "--host-memory"))
    return model, train, hw, gbs


def _lora_inputs(args, train) -> None:
    """--lora-rank / --lora-target-modules / --lora-base-quantization onto the TrainConfig
    the layouts start from (checked as train.py checks them: run_config/checks.py)."""
    if args.lora_rank is None:
        if args.lora_target_modules or args.lora_base_quantization:
            raise PlanError("--lora-target-modules and --lora-base-quantization plan a LoRA "
                            "fine-tune: add --lora-rank R")
        return
    if args.lora_rank < 1:
        raise PlanError(f"--lora-rank must be a positive integer, got {args.lora_rank}")
    from layers.lora import resolve_targets
    from run_config.checks import QLORA_FORMATS

    fmt = args.lora_base_quantization
    if fmt == "gguf":
        raise PlanError("--lora-base-quantization gguf keeps a GGUF file's own formats; plan "
                        "with the format its layer linears are stored in (e.g. q4_1)")
    if fmt is not None and fmt not in QLORA_FORMATS:
        raise PlanError(f"--lora-base-quantization {fmt} is not one of "
                        f"{', '.join(QLORA_FORMATS)}")
    train.lora_rank = args.lora_rank
    if args.lora_target_modules:
        try:
            resolve_targets(args.lora_target_modules)
        except ValueError as e:
            raise PlanError(str(e)) from None
        train.lora_target_modules = args.lora_target_modules
    if args.lora_base_quantization:
        train.lora_base_quantization = args.lora_base_quantization


def _check_context_parallel(args, model) -> None:
    """--context-parallel-size: positive, a divisor of --gpus, a size train.py builds for
    this model (run_config/checks.py: 2 cp divides the sequence, no T5), and a dense model
    (the planner's search does not model MoE at cp > 1)."""
    from run_config.checks import check_context_parallel
    from run_config.train_config import TrainConfig

    cp = args.context_parallel_size
    if cp is None:
        return
    if cp < 1:
        raise PlanError(f"--context-parallel-size must be a positive integer, got {cp}")
    if args.gpus % cp:
        raise PlanError(f"--context-parallel-size {cp} does not divide --gpus {args.gpus}: "
                        f"use a divisor of the GPU count")
    check_context_parallel(model, TrainConfig(context_parallel_size=cp))
    if cp > 1 and model.num_moe_experts is not None:
        raise PlanError(f"--context-parallel-size {cp} with a mixture of experts: train.py "
                        f"runs it (dropless routing), but the planner does not model expert "
                        f"layouts under context parallelism yet; plan at cp 1")


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _s(x: float) -> str:
    """Seconds with 3 significant digits, in ms below a second."""
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def table(fits: list[dict], top: int) -> str:
    """The top layouts, one row each; an `ep` column when some layout has expert parallelism
    to choose (an MoE model)."""
    moe = any(p.get("ep", 1) > 1 for p in fits)
    cp = any(p.get("cp", 1) > 1 for p in fits)
    off = any(p.get("optimizer_offload") or p.get("param_offload") for p in fits)
    lora = any(p["memory"].get("frozen_base") for p in fits)  # a LoRA fine-tune's base
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} " + (f"{'ep':>3} " if moe else "") +
            (f"{'cp':>3} " if cp else "") +
            f"{'vpp':>3} {'dp':>4} {'mbs':>3} {'m':>5} {'sp':>3} "
            f"{'zero':>4} {'recompute':>9} " + (f"{'offload opt/par':>15} " if off else "") +
            f"{'mem GB':>7} {'states':>7} " + (f"{'base':>7} " if lora else "") +
            f"{'activ':>7} {'bubble':>6} {'sent GB':>8} {'step s':>8} {'tok/s':>9} {'MFU':>6}")
    rows = [head]
    for i, p in enumerate(fits[:top], 1):
        mem = p["memory"]
        comm = sum(g["sent_bytes"] for g in p["comm"].values())
        rows.append(f"{i:>3} {p['tp']:>3} {p['pp']:>3} " + (f"{p['ep']:>3} " if moe else "") +
                    (f"{p.get('cp', 1):>3} " if cp else "") +
                    f"{p['vpp']:>3} {p['dp']:>4} "
                    f"{p['micro_batch_size']:>3} {p['num_microbatches']:>5} "
                    f"{'on' if p['sequence_parallel'] else '-':>3} {p['zero_stage']:>4} "
                    f"{p['recompute']:>9} " +
                    (f"{(p.get('optimizer_offload') or '-') + '/' + (p.get('param_offload') or '-'):>15} "
                     if off else "") +
                    f"{_gb(mem['total']):>7} {_gb(mem['model_states']):>7} " +
                    (f"{_gb(mem['frozen_base']):>7} " if lora else "") +
                    f"{_gb(mem['activations']):>7} {p['bubble']:>6.3f} {_gb(comm):>8} "
                    f"{p['step_seconds']:>8.3f} {p['tokens_per_s']:>9,.0f} {p['mfu']:>6.1%}")
    rows.append("(mem GB: predicted peak per GPU" + ("; states: the adapters' weights, "
                "gradients and optimizer; base: the frozen base" if lora else "") + "; sent GB: bytes each GPU sends per step in "
                "ring collectives and p2p; docs/PLANNING.md)")
    return "\n".join(rows)


def explain(best: dict, runner: dict | None, hw, model_name: str) -> str:
    """A short paragraph on why the top layout wins."""
    mem, net, flags = best["memory"], hw.network, _search().flags
    comm = best["comm"]

    def secs(group):
        return comm.get(group, {}).get("seconds", 0.0)
    tp_where = "inside a node" if best["tp"] <= net.node_size else "across nodes"
    ep = best.get("ep", 1)
    cp = best.get("cp", 1)
    parts = [f"Top choice for {model_name} on {hw.gpus} GPUs: tp {best['tp']} x pp {best['pp']}"
             + (f" x cp {cp}" if cp > 1 else "") +
             f" x dp {best['dp']}" + (f" (expert parallel {ep} within dp)" if ep > 1 else "")
             + (f" with {best['vpp']} virtual stages" if best["vpp"] > 1 else "") +
             f", micro batch {best['micro_batch_size']} ({best['num_microbatches']} microbatches"
             f" per step), sequence parallel {'on' if best['sequence_parallel'] else 'off'}, "
             f"ZeRO-{best['zero_stage']}, recompute {best['recompute']}."]
    parts.append(f"It needs {_gb(mem['total'])} GB per GPU of {_gb(hw.usable_memory)} usable "
                 f"(model states {_gb(mem['model_states'])}, " +
                 (f"frozen base {_gb(mem['frozen_base'])}, " if mem.get("frozen_base") else "")
                 + f"activations "
                 f"{_gb(mem['activations'])} for {mem['in_flight']} microbatch(es) in flight on "
                 f"stage {mem['pp_rank']}).")
    if mem.get("last_stage_mtp_per_microbatch"):
        parts.append(f"Multi-token prediction (--mtp-num-layers) adds "
                     f"{mem['last_stage_mtp_per_microbatch'] / 1e9:.3g} GB of activations per "
                     f"microbatch on the last stage (its layers, head and loss).")
    if best["tp"] > 1:
        parts.append(f"TP {best['tp']} stays {tp_where}, so its per-layer collectives cost "
                     f"{_s(secs('tp') + secs('sp'))} per step at "
                     f"{net.bandwidth(best['tp'] > net.node_size) / 1e9:g} GB/s.")
    if ep > 1:
        from planner.communication import crosses_nodes
        inter = crosses_nodes("ep", best["tp"], best["dp"], best["pp"], net.node_size, ep)
        parts.append(f"Each rank holds 1/{ep} of every MoE layer's experts; the token "
                     f"all-to-alls over EP {ep} ({'across' if inter else 'inside a'} node"
                     f"{'s' if inter else ''}) cost {_s(secs('ep'))} per step at "
                     f"{net.bandwidth(inter) / 1e9:g} GB/s (balanced routing assumed).")
    if cp > 1:
        from planner.communication import crosses_nodes
        inter = crosses_nodes("cp", best["tp"], best["dp"], best["pp"], net.node_size, 1, cp)
        ring = best["cp_comm_type"] == "p2p"
        parts.append(f"Each rank holds 1/{cp} of every sequence ({2 * cp} load-balanced "
                     f"chunks); the attention's K/V " + ("ring" if ring else "all-gathers")
                     + f" over CP {cp} ({'across' if inter else 'inside a'} node"
                     f"{'s' if inter else ''}) takes {_s(best['cp_attention_seconds'])} of "
                     f"transfers per step, {_s(best['cp_exposed_seconds'])} of it not hidden"
                     + (" behind the attention's compute" if ring else "") +
                     "; gradients reduce over dp x cp.")
    if best["pp"] > 1:
        parts.append(f"The pipeline bubble is (p-1)/(v m) = {best['bubble']:.3f} of the compute;"
                     f" stage-to-stage messages add {_s(secs('pp'))}.")
    if best["dp"] * cp > 1:
        from planner.context_parallel import gradient_group_label
        label = gradient_group_label(best["dp"], cp)  # "cp" also carries the attention's
        data = secs(label) - (best["cp_attention_seconds"] if label == "cp" else 0.0)
        parts.append(f"Data-parallel traffic ({_s(data)} of transfers"
                     + (" over dp x cp" if cp > 1 else "") + f") leaves "
                     f"{_s(best['exposed_dp_seconds'])} exposed after overlap with compute.")
    parts.append(f"Predicted step {best['step_seconds']:.3f} s, {best['tokens_per_s']:,.0f} "
                 f"tokens/s, MFU {best['mfu']:.1%} (matmuls at {hw.matmul_efficiency:.0%} of "
                 f"{hw.peak_tflops:g} TFLOP/s).")
    if runner is not None:
        slower = runner["step_seconds"] / best["step_seconds"] - 1
        why = (f"{slower:.1%} slower" if slower > 1e-3 else
               f"as fast but with more communication ({_s(runner['comm_seconds'])} vs "
               f"{_s(best['comm_seconds'])})" if runner["comm_seconds"] > best["comm_seconds"]
               else f"as fast but needs more memory ({_gb(runner['memory']['total'])} GB)")
        parts.append(f"Runner-up ({flags(runner)}): {why}.")
    return " ".join(parts)


def offload_note(best: dict, hw) -> str:
    """What the offload of the top layout costs and assumes (ZeRO-Infinity)."""
    mem = best["memory"]
    where = [f"optimizer states on {best['optimizer_offload']}"] if best["optimizer_offload"] \
        else []
    where += [f"parameter shards on {best['param_offload']}"] if best["param_offload"] else []
    nvme = (f"NVMe {hw.nvme_bandwidth / 1e9:g} GB/s per node (--nvme-bandwidth) shared by "
            f"{min(hw.network.node_size, hw.gpus)} GPUs" if hw.nvme_bandwidth else
            "no NVMe (--nvme-bandwidth not given)")
    return (f"No layout fits without offload; with {' and '.join(where)} (ZeRO-Infinity) it "
            f"needs {_gb(mem['host'])} GB of host memory and {_gb(mem['nvme'])} GB of NVMe per "
            f"GPU, and the transfers add {_s(best['offload_seconds'])} per step, assuming "
            f"{hw.host_bandwidth / 1e9:g} GB/s device-host per GPU (--host-bandwidth) and "
            f"{nvme}.")


def rejected_summary(rejected: list[dict], limit: int = 8) -> str:
    flags = _search().flags
    kinds = Counter(re.sub(r"\d+(\.\d+)?", "N", r["reason"].split(";")[0]) for r in rejected)
    example = {}
    for r in rejected:
        example.setdefault(re.sub(r"\d+(\.\d+)?", "N", r["reason"].split(";")[0]), r)
    lines = [f"{len(rejected)} layouts rejected; the reasons, most common first:"]
    for kind, n in kinds.most_common(limit):
        r = example[kind]
        lines.append(f"  {n:>6} x  e.g. {flags(r)}: {r['reason']}")
    if len(kinds) > limit:
        lines.append(f"  ... and {len(kinds) - limit} other reasons (--json lists every layout)")
    return "\n".join(lines)


def main(argv=None) -> int:
    status = Status()
    try:
        args = build_parser().parse_args(argv)
    except PlanError as e:
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    status.say("plan.py: loading train.py's checks and the planner (torch) ...")
    from models.config import ConfigError

    search = _search()
    try:
        model, base, hw, gbs = _inputs(args)
        if model.is_encoder_decoder:
            raise PlanError(f"{model.name or 'this model'} is an encoder-decoder (T5): the "
                            f"planner's formulas are for decoder-only models; T5 is not "
                            f"modelled")
        bf16 = not args.fp32 and (base.bf16 if args.config else True)
        ep, cp = args.expert_model_parallel_size, args.context_parallel_size
        total = search.layout_count(model, hw.gpus, ep, cp)
        if not total:
            raise PlanError(f"--expert-model-parallel-size {ep} must divide the data-parallel "
                            f"size, and no split of {hw.gpus} GPUs into tp x pp x dp has a dp "
                            f"divisible by {ep}: use more GPUs or a smaller EP size")
        status.say(f"plan.py: checking {total:,} layouts ...")

        def progress(checked: int, fitting: int) -> None:
            status.tick(lambda: f"plan.py: {checked:,} of {total:,} layouts checked, "
                                f"{fitting:,} fit ...")
        result = search.plan(model, hw, gbs, bf16=bf16, base=base, progress=progress, ep=ep,
                             cp=cp, offload=not args.no_offload)
        if not result["fits"]:
            status.say("plan.py: nothing fits; looking for the GPU count that would ...")
            raise PlanError(f"no layout of {model.name or 'the model'} fits {hw.gpus} GPUs of "
                            f"{hw.gpu_memory / 1e9:g} GB: " + search.smallest_fit(
                                model, hw, gbs, bf16=bf16,
                                rejected=result["rejected"]))
    except (PlanError, ConfigError) as e:
        status.clear()
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    status.clear()
    name = model.name or "the model"
    if args.json:
        print(json.dumps({"model": name, "gpus": hw.gpus, "gpu_memory": hw.gpu_memory,
                          "global_batch_size": gbs, "seq_length": model.seq_length,
                          "fits": [dict(p, flags=search.flags(p)) for p in result["fits"]],
                          "rejected": [dict(r, flags=search.flags(r))
                                       for r in result["rejected"]]}))
        return 0
    fits = result["fits"]
    from planner.moe import describe_parameters
    print(f"{name}: {describe_parameters(model)}, seq {model.seq_length}, "
          f"global batch {gbs}, {'bf16' if bf16 else 'fp32'}; {hw.gpus} GPUs of "
          f"{hw.gpu_memory / 1e9:g} GB ({hw.network.node_size} per node); {len(fits)} layouts "
          f"fit, the fastest {min(args.top, len(fits))}:")
    print(table(fits, args.top))
    print()
    print(explain(fits[0], fits[1] if len(fits) > 1 else None, hw, name))
    if result.get("offload"):
        print(offload_note(fits[0], hw))
    source = f"--model {args.model}" if args.model else f"--config {args.config}"
    lora = (f" --lora-rank {base.lora_rank} --lora-target-modules {base.lora_target_modules}"
            + (f" --lora-base-quantization {base.lora_base_quantization}"
               if base.lora_base_quantization != "none" else "")) if base.lora_rank else ""
    print(f"Run it: train.py {source} {search.flags(fits[0])} --global-batch-size {gbs} "
          f"--seq-length {model.seq_length}" + (" --bf16" if bf16 else "") + lora)
    print()
    print(rejected_summary(result["rejected"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
