"""Pipeline schedules as tables: the list of F / B / W actions each pipeline rank runs.

`--pipeline-schedule` names (as Qi et al. 2024 and torchtitan):

- `1f1b` (PipeDream-Flush; Narayanan et al. 2021, SC21, sec. 2.2.1) and `interleaved`
  (sec. 2.2.2, Megatron's order): B is the whole backward (input and weight gradients);
- `zb-h1` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 3.1): 1F1B's
  warm-up and steady order with the backward split into B (input gradient) and W (weight
  gradient); rank r runs its first r W's late, at the end, which fills the cool-down bubble
  while at most `pp` microbatches are in flight on every rank (1F1B's peak, on rank 0).
  With T_F = T_B = T_W the bubble is (p - 1) slots of one pass, a third of 1F1B's;
- `zbv` (sec. 6, "ZB-V"): two chunks per rank in a V: virtual stage s < pp runs on rank s
  (chunk 0), stage s >= pp on rank 2 pp - 1 - s (chunk 1), so rank 0 holds the embedding
  and the loss; the order is the paper's (and torch.distributed.pipelining's
  ScheduleZBVZeroBubble's): warm-up forwards of chunk 0, then chunk 1 with its B and W, a
  steady F0 B0 W0 F1 B1 W1 pattern, then backward-only cool-down and the W's left. With
  T_F = T_B = T_W and m >= 2 pp the bubble is near zero at 1F1B's activation memory (2 pp
  chunk-microbatches of half a stage each).

An `Action` is (kind, chunk, microbatch). `simulate` runs all ranks' tables against the
dependencies (F of a virtual stage after the previous stage's F; B after the next stage's B,
or after its own F on the last stage; W after its B; each rank in its own order), with
per-pass costs, and returns the bubble and in-flight activations of each rank; it raises
`ScheduleError` on a missing or repeated action or a deadlock. `check` is the test
checker. Communication takes no time here; real runs measure it (training/timeline.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")
SPLIT_BACKWARD = ("zb-h1", "zbv")  # schedules with separate B and W
V_SHAPED = ("zbv",)  # schedules whose second chunk runs the stages in reverse rank order


def virtual_stage(pp: int, rank: int, chunk: int, v_shape: bool = False) -> int:
    """Virtual stage of model chunk `chunk` on pipeline rank `rank` (0 embeds, the last one
    holds the loss): `chunk * pp + rank` (interleaved, Narayanan et al. 2021, sec. 2.2.2), or
    in a V (`v_shape`, two chunks) `rank` for chunk 0 and `2 pp - 1 - rank` for chunk 1, so
    rank 0 holds the first and the last virtual stage and rank pp - 1 the two middle ones."""
    if v_shape:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def stage_rank(pp: int, stage: int, v_shape: bool = False) -> tuple[int, int]:
    """(pipeline rank, chunk) holding virtual stage `stage`; the inverse of `virtual_stage`."""
    if v_shape:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


class ScheduleError(ValueError):
    """A schedule table that cannot run: a missing, repeated or unknown action, or a
    deadlock."""


class Action(NamedTuple):
    kind: str  # "F", "B" (input gradient; the whole backward when the schedule is not split), "W"
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


@dataclass
class Schedule:
    name: str
    pp: int
    vpp: int  # chunks per rank
    num_microbatches: int
    actions: list[list[Action]]  # per pipeline rank, in execution order
    split: bool  # B and W are separate actions
    v_shape: bool = False  # chunk 1 runs the stages in reverse rank order (zbv)

    def virtual_stage(self, rank: int, chunk: int) -> int:
        """Virtual stage of `chunk` on `rank` (0 embeds, pp * vpp - 1 holds the loss)."""
        return virtual_stage(self.pp, rank, chunk, self.v_shape)

    def table(self) -> str:
        """One line per rank, the actions in order (`F0.3`: forward, chunk 0, microbatch 3)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts))
                         for r, acts in enumerate(self.actions))


def build(name: str, pp: int, num_microbatches: int, vpp: int = 1) -> Schedule:
    """The table of schedule `name` for `pp` ranks and `num_microbatches` microbatches.

    Raises:
        ScheduleError: unknown name, or a layout the schedule does not run (interleaved
            without vpp > 1 or with m % pp != 0; zbv without exactly 2 chunks; pp < 2).
    """
    m = num_microbatches
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of "
                            f"{', '.join(SCHEDULES)}")
    if pp < 2 or m < 1:
        raise ScheduleError(f"pipeline schedule {name} needs pp >= 2 and at least one "
                            f"microbatch (got pp {pp}, {m} microbatches)")
    if name == "1f1b" or name == "zb-h1":
        if vpp != 1:
            raise ScheduleError(f"--pipeline-schedule {name} runs one chunk per rank; drop "
                                f"--virtual-pipeline-model-parallel-size (got {vpp}) or use "
                                f"interleaved / zbv")
        acts = [_one_f_one_b(pp, m, r, split=name == "zb-h1") for r in range(pp)]
        return Schedule(name, pp, 1, m, acts, split=name == "zb-h1")
    if name == "interleaved":
        if vpp < 2 or m % pp:
            raise ScheduleError(f"the interleaved schedule needs vpp >= 2 (got {vpp}) and "
                                f"num_microbatches ({m}) divisible by pp ({pp})")
        return Schedule(name, pp, vpp, m, [_interleaved(pp, vpp, m, r) for r in range(pp)],
                        split=False)
    if vpp != 2:
        raise ScheduleError(f"--pipeline-schedule zbv runs exactly 2 chunks per rank "
                            f"(--virtual-pipeline-model-parallel-size 2; got {vpp})")
    return Schedule(name, pp, 2, m, [_zbv(pp, m, r) for r in range(pp)], split=True,
                    v_shape=True)


def _one_f_one_b(pp: int, m: int, rank: int, split: bool) -> list[Action]:
    """1F1B: (pp - rank - 1) warm-up forwards, then F/B pairs, then the last B's. Split
    (ZB-H1): each B is followed by a W, except that rank r holds back its first r W's (its
    1F1B peak of pp - r in-flight microbatches rises to pp) and runs them after its last B,
    where 1F1B's cool-down bubble was."""
    warmup = min(pp - rank - 1, m)
    out = [Action("F", 0, i) for i in range(warmup)]
    next_w = 0
    for i in range(m):  # the i-th backward, after forward warmup + i (while forwards remain)
        if warmup + i < m:
            out.append(Action("F", 0, warmup + i))
        out.append(Action("B", 0, i))
        if split and i >= rank:
            out.append(Action("W", 0, next_w))
            next_w += 1
    out += [Action("W", 0, j) for j in range(next_w, m)] if split else []
    return out


def _interleaved(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B (training/schedules.py runs it): forward k on chunk
    (k mod pp vpp) // pp, microbatch (k // (pp vpp)) pp + k mod pp; backward k the same with
    the chunks reversed; (pp - rank - 1) 2 + (vpp - 1) pp warm-up forwards (all when m = pp)."""
    total = m * vpp

    def chunk(k: int, forward: bool) -> int:
        c = (k % (pp * vpp)) // pp
        return c if forward else vpp - 1 - c

    def mb(k: int) -> int:
        return (k // (pp * vpp)) * pp + k % pp

    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    out = [Action("F", chunk(k, True), mb(k)) for k in range(warmup)]
    for b in range(total):
        if warmup + b < total:
            out.append(Action("F", chunk(warmup + b, True), mb(warmup + b)))
        out.append(Action("B", chunk(b, False), mb(b)))
    return out


def _zbv(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, sec. 6, Fig. 8): built for max(m, 2 pp - 1) microbatches, the
    ones past m dropped (the pattern needs 2 pp - 1 to fill the V)."""
    n = max(m, 2 * pp - 1)
    out: list[Action] = []
    f = [0, 0]
    b = [0, 0]
    w = [0, 0]

    def add(*steps: str) -> None:  # "F0": the next forward of chunk 0, ...
        for step in steps:
            kind, c = step[0], int(step[1])
            count = {"F": f, "B": b, "W": w}[kind]
            out.append(Action(kind, c, count[c]))
            count[c] += 1

    for _ in range(2 * (pp - rank) - 1):  # warm-up: chunk 0's forwards, then both chunks
        add("F0")
    for _ in range(rank):
        add("F1", "F0")
    for _ in range(pp - rank):  # chunk 1's first backwards, at the bottom of the V
        add("F1", "B1", "W1")
    while f[1] < f[0] or f[0] < n:  # steady state
        add(*(["F0"] if f[0] < n else []), "B0", "W0", "F1", "B1", "W1")
    for _ in range(rank):  # cool-down: backwards first, the W's they leave at the end
        add("B0", "B1")
    for _ in range(pp - rank):
        add("B0", "W0")
    add(*["W1"] * (b[1] - w[1]))
    add(*["W0"] * (b[0] - w[0]))
    return [a for a in out if a.microbatch < m]


@dataclass
class Simulation:
    bubble: list[float]  # per rank: (makespan - busy) / busy
    peak_activations: list[int]  # per rank: most chunk-microbatches between F and W at once
    finish: list[float]  # per rank: when its last action ended
    makespan: float


def simulate(s: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Simulation:
    """Run every rank's table with pass costs `f`, `b`, `w` (B of an unsplit schedule costs
    b + w): each action starts when the rank's previous one ended and its dependency is done.
    A chunk-microbatch's activations are alive from its F until its W (the unsplit B).

    Raises:
        ScheduleError: an action repeated or missing, or no rank can go on (deadlock).
    """
    last = s.pp * s.vpp - 1
    cost = {"F": f, "B": b if s.split else b + w, "W": w}
    expected = {(k, c, j) for c in range(s.vpp) for j in range(s.num_microbatches)
                for k in ("FBW" if s.split else "FB")}
    for r, acts in enumerate(s.actions):
        seen = set(acts)
        if len(seen) != len(acts):
            dup = next(a for a in acts if acts.count(a) > 1)
            raise ScheduleError(f"{s.name}: rank {r} runs {dup} twice")
        if {tuple(a) for a in acts} != expected:
            missing = sorted(expected - {tuple(a) for a in acts})
            extra = sorted({tuple(a) for a in acts} - expected)
            raise ScheduleError(f"{s.name}: rank {r} misses {missing[:3]} / has unknown "
                                f"{extra[:3]} actions")
    done: dict[tuple[str, int, int], float] = {}
    clock, busy = [0.0] * s.pp, [0.0] * s.pp
    live, peak = [0] * s.pp, [0] * s.pp
    pos = [0] * s.pp
    while any(pos[r] < len(s.actions[r]) for r in range(s.pp)):
        progressed = False
        for r in range(s.pp):
            while pos[r] < len(s.actions[r]):
                a = s.actions[r][pos[r]]
                vs = s.virtual_stage(r, a.chunk)
                if a.kind == "F":
                    dep = ("F", vs - 1, a.microbatch) if vs > 0 else None
                elif a.kind == "B":
                    dep = ("B", vs + 1, a.microbatch) if vs < last else ("F", vs, a.microbatch)
                else:
                    dep = ("B", vs, a.microbatch)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + cost[a.kind]
                busy[r] += cost[a.kind]
                done[(a.kind, vs, a.microbatch)] = clock[r]
                if a.kind == "F":
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif a.kind == "W" or not s.split:
                    live[r] -= 1
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(s.actions[r][pos[r]]) for r in range(s.pp)
                     if pos[r] < len(s.actions[r])}
            raise ScheduleError(f"{s.name}: deadlock (pp {s.pp}, m {s.num_microbatches}); "
                                f"ranks wait at {stuck}")
    makespan = max(clock)
    return Simulation([(makespan - x) / x for x in busy], peak, clock, makespan)


def check(s: Schedule) -> Simulation:
    """Raise `ScheduleError` unless every rank runs each of its actions once and the tables
    run to the end without deadlock; returns the unit-cost simulation."""
    return simulate(s)
