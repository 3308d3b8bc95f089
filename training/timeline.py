"""Pipeline schedule timeline (`--profile-pipeline`): what each rank did when, and the bubble.

Each rank records the start and end of every forward (F), backward (B: the whole backward,
or under a zero-bubble schedule its input-gradient part), weight-gradient (W, zero-bubble
schedules only) and communication (C) span of one training step, with wall-clock times and
this thread's CPU time. Rank 0 gathers all ranks' spans and reports, per pipeline rank, the
bubble fraction beside the schedule's prediction: its table (parallel_state/schedule_tables.py)
run with equal pass costs, which gives Narayanan et al. 2021 (SC21), sec. 2.2's (p - 1) / (v m)
for 1F1B and interleaved 1F1B (B = 2 passes) and Qi et al. 2024, sec. 3.1's (p - 1) / (3 m)
for ZB-H1. It also reports each rank's peak of chunk-microbatches whose activations are held
(from a forward to the end of its backward, or of its W), beside the table's.

Two measurements are reported:

- *wall*: (step time - compute time) / compute time on each rank, from wall clocks. This is
  the number to read on dedicated devices (GPUs).
- *replay*: the executed schedule re-timed with each span's measured CPU time, every rank on
  its own device: an F or B starts when the rank's previous span ended and its input (the
  neighbouring virtual stage's output for that microbatch) exists; communication is taken as
  instantaneous. On a CPU machine where several ranks share a core, wall times mix in the
  other ranks' work; the replay removes that and measures the schedule itself.

The spans are also written as a Chrome trace (`pipeline_timeline.json`, open in
chrome://tracing or ui.perfetto.dev) and, when matplotlib is installed, a PNG.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

import parallel_state as ps
from parallel_state import collectives, schedule_tables


@dataclass
class Span:
    kind: str  # "F", "B", "W" or "C"
    chunk: int
    microbatch: int
    start: float  # wall seconds
    end: float
    cpu: float  # this thread's CPU seconds spent inside the span


class Timeline:
    """Spans of one rank for one training step."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    @contextlib.contextmanager
    def span(self, kind: str, chunk: int = -1, microbatch: int = -1):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.spans.append(Span(kind, chunk, microbatch, t0, time.perf_counter(),
                                   time.thread_time() - c0))


def schedule_name(schedule: str | None, vpp: int) -> str:
    """--pipeline-schedule as resolved (None: interleaved with vpp > 1, else 1f1b)."""
    return schedule or ("interleaved" if vpp > 1 else "1f1b")


def predicted(schedule: str | None, pp: int, vpp: int, num_microbatches: int,
              costs: tuple[float, float, float] = (1.0, 1.0, 1.0)):
    """The schedule table's `Simulation` with pass costs `costs` = (F, B, W) (an unsplit B
    costs B + W): by default equal, which gives the bubble per rank (p - 1) / (v m) for 1F1B
    / interleaved (Narayanan et al. 2021, sec. 2.2) and (p - 1) / (3 m) for ZB-H1 at m >= p
    (Qi et al. 2024, sec. 3.1), and the peak in-flight chunk-microbatches per rank; without
    pipelining no bubble and one microbatch at a time."""
    if pp == 1:
        return schedule_tables.Simulation([0.0], [1], [0.0], 0.0)
    return schedule_tables.simulate(schedule_tables.build(
        schedule_name(schedule, vpp), pp, num_microbatches, vpp), *costs)


def pass_costs(per_rank: list[list[Span]]) -> tuple[float, float, float]:
    """Median CPU seconds of an F, a B and a W span over all ranks (W 0 when none ran: B then
    holds the whole backward)."""
    med = lambda k: float(np.median([s.cpu for spans in per_rank for s in spans  # noqa: E731
                                     if s.kind == k] or [0.0]))
    return med("F"), med("B"), med("W")


def wall_bubble(spans: list[Span]) -> float:
    """(step time - compute time) / compute time from wall clocks of one rank."""
    compute = [s for s in spans if s.kind in "FBW"]
    busy = sum(s.end - s.start for s in compute)
    total = max(s.end for s in spans) - min(s.start for s in spans)
    return (total - busy) / busy


def replay(per_rank: list[list[Span]], pp: int, vpp: int, v_shape: bool = False) -> list[float]:
    """Bubble per pipeline rank of the executed order re-timed with CPU durations.

    `per_rank[r]` are pipeline rank r's spans in execution order. Virtual stage of chunk c on
    rank r is c * pp + r, or in a V (`v_shape`, ZBV) r for chunk 0 and 2 pp - 1 - r for chunk
    1 (`schedule_tables.virtual_stage`); F(vs, j) needs F(vs - 1, j) done, B(vs, j) needs
    B(vs + 1, j) done (and, on the last virtual stage, its own F), W(vs, j) its own B.
    """
    last_vs = pp * vpp - 1
    done: dict[tuple[str, int, int], float] = {}
    queues = [[s for s in spans if s.kind in "FBW"] for spans in per_rank]
    clock, busy = [0.0] * pp, [0.0] * pp
    pos = [0] * pp
    while any(pos[r] < len(queues[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] >= len(queues[r]):
                continue
            s = queues[r][pos[r]]
            vs = schedule_tables.virtual_stage(pp, r, s.chunk, v_shape)
            if s.kind == "F":
                dep = ("F", vs - 1, s.microbatch) if vs > 0 else None
            elif s.kind == "W":
                dep = ("B", vs, s.microbatch)
            else:
                dep = ("B", vs + 1, s.microbatch) if vs < last_vs else ("F", vs, s.microbatch)
            if dep is not None and dep not in done:
                continue
            start = max(clock[r], done[dep] if dep is not None else 0.0)
            clock[r] = start + s.cpu
            busy[r] += s.cpu
            done[(s.kind, vs, s.microbatch)] = clock[r]
            pos[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("timeline replay is stuck: the recorded schedule is inconsistent")
    total = max(clock)
    return [(total - b) / b for b in busy]


def stage_compute(per_rank: list[list[Span]]) -> list[float]:
    """CPU seconds of forward and backward work of each pipeline rank (what replay times)."""
    return [sum(s.cpu for s in spans if s.kind in "FBW") for spans in per_rank]


def peak_in_flight(spans: list[Span]) -> int:
    """Most chunk-microbatches one rank held activations for at once: from a forward's start
    to the end of its W (split schedules) or of its backward."""
    split = any(s.kind == "W" for s in spans)
    live = peak = 0
    for s in spans:
        if s.kind == "F":
            live += 1
            peak = max(peak, live)
        elif s.kind == ("W" if split else "B"):
            live -= 1
    return peak


def suggest_split(compute: list[float], layers: list[int], vpp: int = 1,
                  tolerance: float = 0.05) -> dict | None:
    """Layers for the first and last pipeline stage that would balance measured stage work.

    `compute[s]` is stage s's measured compute time and `layers[s]` its decoder layers. The
    per-layer cost comes from the middle stages (median of compute / layers) or, at pp = 2,
    from the first stage (its embedding lookup is negligible); the first stage's and last
    stage's extra work (embedding; final norm, output layer and loss) is what is left over.
    Every split the trainer accepts (first/last >= 1, the middle stages even, each stage's
    layers divisible by vpp) is scored by its slowest stage (ties: by the next slowest).

    Returns None when there is nothing to estimate from (pp 1, an empty stage), else
    `{"first", "last", "better", "layer_cost", "extra_first", "extra_last",
    "predicted_share"}`: the best split, whether it beats the current one by more than
    `tolerance` (else first/last are the current ones), the extras in layers' worth of work.
    """
    from types import SimpleNamespace

    from models.config import ConfigError

    from run_config.checks import stage_layers

    pp, total = len(layers), sum(layers)
    if pp < 2 or min(layers) < 1 or min(compute) <= 0:
        return None
    per_layer = sorted(c / n for c, n in zip(compute[1:-1], layers[1:-1])) if pp > 2 else \
        [compute[0] / layers[0]]
    layer = per_layer[len(per_layer) // 2]
    extra_first = max(0.0, compute[0] - layers[0] * layer) if pp > 2 else 0.0
    extra_last = max(0.0, compute[-1] - layers[-1] * layer)

    def cost(split):
        out = [n * layer for n in split]
        out[0] += extra_first
        out[-1] += extra_last
        return out

    best = list(layers)
    for first in range(1, total):
        for last in range(1, total - first + 1):
            try:
                split = stage_layers(total, SimpleNamespace(
                    pipeline_model_parallel_size=pp, decoder_first_pipeline_num_layers=first,
                    decoder_last_pipeline_num_layers=last))
            except ConfigError:
                continue
            if any(n % vpp for n in split) or sum(split) != total:
                continue
            if sorted(cost(split), reverse=True) < sorted(cost(best), reverse=True):
                best = split  # the slowest stage first, then the next slowest, ...
    better = max(cost(best)) < max(cost(layers)) * (1 - tolerance)
    if not better:
        best = list(layers)
    predicted = cost(best)
    return {"first": best[0], "last": best[-1], "better": better, "layer_cost": layer,
            "extra_first": extra_first / layer, "extra_last": extra_last / layer,
            "predicted_share": [c / sum(predicted) for c in predicted]}


def report(per_rank: list[list[Span]], pp: int, vpp: int, num_microbatches: int,
           log_dir: str | None, schedule: str | None = None) -> dict:
    """Bubble numbers per pipeline rank (`per_rank` ordered by pipeline rank), written to
    `<log_dir>/pipeline_timeline.json` (+ PNG) when log_dir is given."""
    sim = predicted(schedule, pp, vpp, num_microbatches)
    costs = pass_costs(per_rank)
    wall = [wall_bubble(s) for s in per_rank]
    replayed = replay(per_rank, pp, vpp,
                      schedule_name(schedule, vpp) in schedule_tables.V_SHAPED)
    result = {"pp": pp, "vpp": vpp, "num_microbatches": num_microbatches,
              "schedule": schedule_name(schedule, vpp),
              "bubble_theory": max(sim.bubble), "pass_costs": costs,
              "bubble_predicted": predicted(schedule, pp, vpp, num_microbatches,
                                            costs).bubble,
              "bubble_wall": wall, "bubble_replay": replayed,
              "compute": stage_compute(per_rank),
              "in_flight_peak": [peak_in_flight(s) for s in per_rank],
              "in_flight_peak_predicted": sim.peak_activations}
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        t0 = min(s.start for spans in per_rank for s in spans)
        events = []
        for r, spans in enumerate(per_rank):
            for s in spans:
                events.append({"name": f"{s.kind} c{s.chunk} mb{s.microbatch}", "ph": "X",
                               "pid": 0, "tid": r, "ts": (s.start - t0) * 1e6,
                               "dur": (s.end - s.start) * 1e6, "cat": s.kind})
        with open(os.path.join(log_dir, "pipeline_timeline.json"), "w") as f:
            json.dump({"traceEvents": events, "metadata": result}, f)
        _maybe_png(per_rank, t0, os.path.join(log_dir, "pipeline_timeline.png"))
    return result


def _maybe_png(per_rank: list[list[Span]], t0: float, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the PNG is optional
        return
    colors = {"F": "tab:blue", "B": "tab:green", "W": "tab:orange", "C": "lightgray"}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(per_rank) + 1))
    for r, spans in enumerate(per_rank):
        for s in spans:
            ax.barh(r, s.end - s.start, left=s.start - t0, color=colors[s.kind],
                    edgecolor="black" if s.kind != "C" else None, linewidth=0.3)
            if s.kind != "C":
                ax.text(s.start - t0 + (s.end - s.start) / 2, r, str(s.microbatch),
                        ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(per_rank)), [f"stage {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (wall)")
    ax.set_title("pipeline timeline: F blue, B green, W orange, communication gray")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------- in a training run
def gather_timeline(timeline: Timeline):
    """Spans of the pipeline of DP replica 0 / TP rank 0, ordered by stage (on every rank)."""
    everyone = [None] * dist.get_world_size()
    collectives.all_gather_object(everyone, timeline.spans)
    stride = ps.get_data_parallel_world_size(with_context_parallel=True) * \
        ps.get_tensor_model_parallel_world_size()
    return [everyone[p * stride] for p in range(ps.get_pipeline_model_parallel_world_size())]


def report_bubble(profiles, config, logger) -> dict:
    """Median bubble per stage over the profiled steps, beside the schedule's theory and its
    prediction from the measured pass costs, the activations held at peak, each stage's share
    of the compute (the theory assumes equal shares) and, when the stages are unbalanced, the
    --decoder-first/last-pipeline-num-layers that would balance them; logged on rank 0."""
    t = config.train
    pp, vpp = t.pipeline_model_parallel_size, t.virtual_pipeline_model_parallel_size or 1
    steps = [report(p, pp, vpp, config.num_microbatches,
                    t.log_dir if i == len(profiles) - 1 else None, t.pipeline_schedule)
             for i, p in enumerate(profiles)]
    med = lambda xs: float(np.median(xs))  # noqa: E731
    compute = [med([s["compute"][r] for s in steps]) for r in range(pp)]
    layers = config.stage_num_layers()
    rec = {"iteration": t.train_iters, "bubble_theory": steps[0]["bubble_theory"],
           "bubble_wall": [med([s["bubble_wall"][r] for s in steps]) for r in range(pp)],
           "bubble_replay": [med([s["bubble_replay"][r] for s in steps]) for r in range(pp)],
           "compute_share": [c / sum(compute) for c in compute], "stage_layers": layers,
           "profiled_steps": len(steps), "pp": pp, "vpp": vpp,
           "num_microbatches": config.num_microbatches, "schedule": steps[0]["schedule"],
           "bubble_predicted": [med([s["bubble_predicted"][r] for s in steps])
                                for r in range(pp)],
           "pass_costs": [med([s["pass_costs"][k] for s in steps]) for k in range(3)],
           "in_flight_peak": steps[-1]["in_flight_peak"],
           "in_flight_peak_predicted": steps[-1]["in_flight_peak_predicted"]}
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    v_shape = rec["schedule"] in schedule_tables.V_SHAPED
    hint = None if v_shape else suggest_split(compute, layers, vpp)
    share = rec["compute_share"]
    if v_shape and max(share) * pp > 1.1:  # the embedding and the output layer on stage 0
        balance = ("unbalanced (in the V stage 0 holds the embedding and the output layer: "
                   "--decoder-first-pipeline-num-layers moves layers off it)")
    elif hint is None or max(share) * pp <= 1.1:
        balance = "balanced"
    else:
        rec["suggested_split"] = hint
        balance = (f"unbalanced, so the bubble exceeds the theory (extra work of the first "
                   f"stage: {hint['extra_first']:.1f} layers' worth, of the last: "
                   f"{hint['extra_last']:.1f}, e.g. the output layer); ")
        balance += (f"--decoder-first-pipeline-num-layers {hint['first']} "
                    f"--decoder-last-pipeline-num-layers {hint['last']} would give shares "
                    f"{fmt(hint['predicted_share'])}" if hint["better"] else
                    f"no other split of the {sum(layers)} layers is faster")
    logger.log(rec, f"pipeline bubble (idle / compute, median of {len(steps)} steps) of "
                    f"{rec['schedule']} for pp={pp} vpp={vpp} m={config.num_microbatches}: "
                    f"theory {rec['bubble_theory']:.3f} for equal stages and passes | predicted "
                    f"from the measured F/B/W costs: {fmt(rec['bubble_predicted'])} | "
                    f"replayed per stage: "
                    f"{fmt(rec['bubble_replay'])} | wall per stage: {fmt(rec['bubble_wall'])} "
                    f"| activations held at peak (chunk-microbatches) per stage: "
                    f"{rec['in_flight_peak']} (table: {rec['in_flight_peak_predicted']}) "
                    f"| compute share per stage: {fmt(rec['compute_share'])} ({layers} layers): "
                    f"{balance} | timeline: {os.path.join(t.log_dir, 'pipeline_timeline.json')}",
               prefix="pipeline")
    return rec
