"""The process grid: one DeviceMesh with dims ("pp", "dp", "cp", "tp") and Megatron-style
getters.

Rank order is Megatron's (tp-cp-dp-pp): tensor-parallel ranks are adjacent (fastest varying),
then context parallel, then data parallel, then pipeline, so global rank =
((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank and a TP group sits inside one node.
Context-parallel ranks (cp) hold different parts of the same sequences and the same weights,
so weight gradients reduce, and ZeRO shards, over the dp x cp ranks of a stage
(`get_data_parallel_group(with_context_parallel=True)`, Megatron's name); the data loader's
replicas are the dp ranks alone. At cp 1 the grid is the (pp, dp, tp) grid it always was.

The expert layers of a mixture of experts see the same ranks of each pipeline stage as
etp x ep x edp (Megatron-Core's expert RankGenerator, order tp-ep-dp-pp, which leaves cp out):
expert-tensor-parallel ranks adjacent, then expert-parallel, then expert-data-parallel, so
global rank = (pp_rank * edp + edp_rank) * ep * etp + ep_rank * etp + etp_rank and
dp * cp * tp == edp * ep * etp. The expert-parallel ranks are thus carved out of the
data-parallel x context-parallel (and, when etp < tp, the tensor-parallel) ranks of a stage.

The grid is one object (`Grid`); the module keeps the current one so layers can ask for their
groups without threading it through every constructor, and the getters below read it.
"""
from __future__ import annotations

import math
import os
import socket
import sys
from datetime import timedelta
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import collectives
from .transport import shm, shm_setup


class GridError(RuntimeError):
    """The process grid cannot be built (or used) as asked; the message says how to fix it."""


@dataclass
class Grid:
    """Sizes, this process's coordinates and the process groups of the (pp, dp, cp, tp) grid."""

    mesh: DeviceMesh
    tensor_model_parallel_size: int
    data_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    device: torch.device
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup  # tp x pp ranks of one model replica
    embedding_group: dist.ProcessGroup | None  # first + last pipeline stage (tied embeddings)
    # stages that hold copies of one replicated parameter (T5: each stack's position-bias
    # table on every stage of that stack), by name; this rank's group or None
    stage_groups: dict = field(default_factory=dict)
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of this pipeline, by stage
    virtual_pipeline_rank: int = 0  # the model chunk currently running (set by schedules)
    # ZBV's V placement (models/pipeline.py): chunk 1 of stage s is virtual stage 2 pp - 1 - s,
    # so stage 0 holds the loss; its chunk-1 messages travel on their own group of the same
    # ranks (`get_pipeline_model_parallel_group(1)`)
    pipeline_v_shape: bool = False
    pp_v_group: dist.ProcessGroup | None = None
    # context parallel (see the module docstring): size, this rank's coordinate, its groups
    context_parallel_size: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    dp_cp_group: dist.ProcessGroup | None = None  # dp x cp ranks: weight gradients, ZeRO
    # expert layers (see the module docstring): sizes, this rank's coordinates, its groups
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    etp_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None  # expert gradients reduce over it
    etp_ep_group: dist.ProcessGroup | None = None  # etp x ep ranks of one expert replica


_GRID: Grid | None = None
_OWNS_WORLD = False  # we created the default process group (single-process runs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> torch.device:
    """CUDA device of this local rank when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def initialize_distributed(device: torch.device | str | None = None,
                           timeout: timedelta | None = None) -> torch.device:
    """Start the default process group (NCCL on CUDA, gloo on CPU) if it is not running.

    Under `torchrun` the rank/world come from the environment; a plain `python train.py`
    becomes a world of one on a free localhost port, so every code path runs the same.
    `timeout` (Megatron's --distributed-timeout-minutes) becomes the operation timeout of the
    world and of every group built afterwards (`collectives.set_timeout`); the start-up
    rendezvous waits at least `collectives.STARTUP_TIMEOUT` so that late ranks can join.
    Returns the device this process computes on.
    """
    global _OWNS_WORLD
    if timeout is not None:
        collectives.set_timeout(timeout)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        if timeout is not None:
            collectives.apply_timeout(None)
        return device
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        _OWNS_WORLD = True
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    store = _restart_safe_store()
    kw = dict(backend=backend, device_id=device_id, timeout=collectives.startup_timeout())
    if store is None:
        dist.init_process_group(**kw)
    else:
        dist.init_process_group(**kw, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    collectives.apply_timeout(None)
    return device


def say_error(line: str, rank: int, wait_s: float = 30.0) -> None:
    """Print `line` to stderr once (rank 0) and make it every worker's elastic error file
    (`report_error`), for an error every rank raised alike.

    Under torchrun the first worker to exit makes the agent SIGTERM the others, so a rank
    other than 0 that exits first could kill rank 0 before it prints, and the line would be
    missing from the top of the output. Ranks other than 0 therefore wait (at most `wait_s`
    seconds) for rank 0's mark in torchrun's agent store before they return; outside
    torchrun, or if the store cannot be reached, nobody waits."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    report_error(line)
    store, key = _agent_store(wait_s), _said_key()
    if store is None:
        return
    try:
        if rank == 0:
            store.set(key, "1")
        else:
            store.wait([key], timedelta(seconds=wait_s))
    except (RuntimeError, dist.DistStoreError):  # rank 0 died or the agent left: go on
        pass


def _said_key() -> str:
    return (f"shardzoo/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/error_said/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def _agent_store(timeout_s: float):
    """A client of torchrun's agent store (None outside torchrun or when it cannot be
    reached within `timeout_s` seconds)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, KeyError, ValueError, dist.DistStoreError):
        return None


def report_error(line: str) -> None:
    """Make `line` this worker's elastic error file (torch.distributed.elastic's JSON format;
    the file torchrun names in TORCHELASTIC_ERROR_FILE), so torchrun's failure summary shows
    it in place of "To enable traceback see ..."; a no-op outside torchrun."""
    import json
    import time

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:  # the format torch's ErrorHandler writes
            json.dump({"message": {"message": line, "extraInfo": {
                "py_callstack": line, "timestamp": str(int(time.time()))}}}, f)


def _restart_safe_store():
    """Under torchrun, a store namespace of this restart generation only.

    torchrun's workers share the agent's TCPStore across restarts, and torch's own per-attempt
    prefix uses each agent's restart count, which differs between nodes (the node that failed
    counts a restart, the others only re-join). A restarted gloo/NCCL group can then read peer
    addresses left by the previous attempt and fail ("Gloo connectFullMesh ... Connection
    refused"). Here every worker counts its arrival in the shared store; arrivals
    `[k * world, (k + 1) * world)` form generation k, whose keys live under their own prefix.
    This assumes every worker of an attempt reaches this point (a worker that dies while
    importing would shift later generations; the group then times out with a clear error).
    Returns None outside torchrun (plain env:// init).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    world = int(os.environ["WORLD_SIZE"])
    run = f"shardzoo/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timedelta(minutes=10))
    generation = (store.add(f"{run}/arrivals", 1) - 1) // world
    return dist.PrefixStore(f"{run}/generation_{generation}", store)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    device: torch.device | str | None = None,
    embedding_stages: list[int] | None = None,
    stage_groups: dict[str, list[int]] | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    pipeline_v_shape: bool = False,
) -> Grid:
    """Build the (pp, dp, cp, tp) grid over the running world and make it current.

    `embedding_stages`: the pipeline stages holding a copy of the word embedding (default the
    first and the last; T5 also the first decoder stage, Megatron's split rank).
    `stage_groups`: `{name: stages}` of other parameters replicated over stages; each gets a
    group per (dp, tp) coordinate (`get_stage_group(name)`), like the embedding group.
    `expert_model_parallel_size` (ep) and `expert_tensor_parallel_size` (etp, None: tp) lay
    out the expert layers over each stage's dp * cp * tp ranks as etp x ep x edp (module
    docstring); edp = dp * cp * tp / (ep * etp). `context_parallel_size` (cp): ranks splitting
    each sequence (Megatron's --context-parallel-size); dp = world / (tp * cp * pp).
    `pipeline_v_shape`: the model chunks sit in a V (ZBV, vpp 2: chunk 1 of stage s is virtual
    stage 2 pp - 1 - s); the chunk-1 activations and gradients get a second group over the
    pipeline's ranks, so that on NCCL (which pairs a pair's messages in posting order, tags
    ignored) they never pair with chunk 0's, whose order between two ranks differs.

    Raises `GridError` when the world size is not divisible by tp * cp * pp, when etp does not
    divide dp * cp * tp or ep does not divide dp * cp * tp / etp, when a size is not positive, when the
    default process group is not started, or when a grid already exists (call
    `destroy_model_parallel()` first). Sizes are checked before any group is made.
    """
    global _GRID
    if _GRID is not None:
        raise GridError("initialize_model_parallel() was called twice; call "
                        "destroy_model_parallel() before building another grid")
    if not dist.is_initialized():
        raise GridError("torch.distributed is not initialized; call "
                        "parallel_state.initialize_distributed() first (or run under torchrun)")
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    vpp = virtual_pipeline_model_parallel_size
    world = dist.get_world_size()
    cp = context_parallel_size
    dp = _data_parallel_size(world, tp, pp, vpp, cp)
    dpc = dp * cp  # the ranks of a stage holding the same shards: cp ranks beside dp ones
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    edp = _expert_data_parallel_size(world, tp, dp, pp, ep, etp, cp)
    device = torch.device(device) if device is not None else default_device()
    mesh = _device_mesh(device, pp, dp, cp, tp)
    rank = dist.get_rank()
    pp_rank, rest = divmod(rank, dpc * tp)
    dpc_rank, tp_rank = divmod(rest, tp)
    dp_rank, cp_rank = divmod(dpc_rank, cp)
    # groups spanning stages, like the expert layout, see dp x cp as one dimension of dpc
    model_parallel_group, embedding_group, groups = _cross_stage_groups(
        tp, dpc, pp, rank, embedding_stages, stage_groups)
    pp_ranks = [(p * dpc + dpc_rank) * tp + tp_rank for p in range(pp)]
    pp_v_group = None
    if pipeline_v_shape:
        if vpp != 2 or pp < 2:
            raise GridError(f"a V placement runs 2 model chunks on each of pp >= 2 stages "
                            f"(got vpp {vpp}, pp {pp})")
        for d in range(dpc):
            for t in range(tp):
                ranks = [(p * dpc + d) * tp + t for p in range(pp)]
                g = collectives.new_group(ranks, label="pp-v")
                if rank in ranks:
                    pp_v_group = g
    dp_cp_group = _dp_cp_group(mesh, tp, dp, cp, pp, rank, device)
    expert = _expert_groups(tp, dpc, pp, ep, etp, rank, mesh.get_group("tp"),
                            dp_cp_group, device)
    _GRID = Grid(
        mesh=mesh,
        tensor_model_parallel_size=tp,
        data_parallel_size=dp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        device=device,
        tp_group=mesh.get_group("tp"),
        dp_group=mesh.get_group("dp"),
        pp_group=mesh.get_group("pp"),
        model_parallel_group=model_parallel_group,
        embedding_group=embedding_group,
        stage_groups=groups,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        pp_ranks=pp_ranks,
        pipeline_v_shape=pipeline_v_shape,
        pp_v_group=pp_v_group,
        context_parallel_size=cp,
        cp_rank=cp_rank,
        cp_group=mesh.get_group("cp"),
        dp_cp_group=dp_cp_group,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        expert_data_parallel_size=edp,
        **expert,
    )
    return _GRID


def _data_parallel_size(world: int, tp: int, pp: int, vpp: int | None, cp: int = 1) -> int:
    """dp = world / (tp * cp * pp); raises GridError for a size below 1 or a world that
    tp * cp * pp does not divide, naming the flags to change."""
    if tp < 1 or pp < 1 or cp < 1 or (vpp is not None and vpp < 1):
        raise GridError(f"parallel sizes must be >= 1, got tp={tp} cp={cp} pp={pp} vpp={vpp}")
    if world % (tp * cp * pp):
        cp_part = f"context-parallel-size ({cp}) x " if cp > 1 else ""
        raise GridError(
            f"world size {world} is not divisible by tensor-model-parallel-size ({tp}) x "
            f"{cp_part}pipeline-model-parallel-size ({pp}); launch a multiple of "
            f"{tp * cp * pp} processes or change --tp/{'--context-parallel-size/' if cp > 1 else ''}--pp")
    return world // (tp * cp * pp)


def _device_mesh(device: torch.device, pp: int, dp: int, cp: int, tp: int):
    """The (pp, dp, cp, tp) DeviceMesh, its groups named and given the timeout; on CPU the tp,
    cp and dp groups get a shared-memory channel (TP's many small collectives, DP's large
    ones, CP's all-gathers: transport/shm.py)."""
    dims = ("pp", "dp", "cp", "tp")
    mesh = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=dims)
    for dim in dims:
        collectives.apply_timeout(mesh.get_group(dim))
        collectives.name_group(mesh.get_group(dim), dim)
    if device.type == "cpu":
        for dim, size in (("tp", tp), ("dp", dp), ("cp", cp)):
            if size > 1:
                shm_setup.attach(mesh.get_group(dim), collectives.get_timeout())
    return mesh


def _dp_cp_group(mesh, tp: int, dp: int, cp: int, pp: int, rank: int, device: torch.device):
    """The dp x cp ranks of this rank's stage and TP coordinate (Megatron's data-parallel group
    with context parallel): the dp group at cp 1, the cp group at dp 1, else a group of its
    own labelled "dp-cp" (every rank makes every one, in the same order), with a shared-memory
    channel on CPU (the gradient reductions and ZeRO's gathers)."""
    if cp == 1:
        return mesh.get_group("dp")
    if dp == 1:
        return mesh.get_group("cp")
    mine = None
    for p in range(pp):
        for t in range(tp):
            ranks = [(p * dp * cp + c) * tp + t for c in range(dp * cp)]
            g = collectives.new_group(ranks, label="dp-cp")
            if rank in ranks:
                mine = g
    if device.type == "cpu":
        shm_setup.attach(mine, collectives.get_timeout())
    return mine


def _cross_stage_groups(tp: int, dp: int, pp: int, rank: int, embedding_stages, stage_groups):
    """(model-parallel group, embedding group or None, {name: stage group}) of this rank: the
    groups spanning two mesh dims. Every rank takes part in every new_group call, in the same
    order (a torch.distributed requirement)."""
    dp_rank = rank // tp % dp
    model_parallel_group = None
    for d in range(dp):
        ranks = [(p * dp + d) * tp + t for p in range(pp) for t in range(tp)]
        g = collectives.new_group(ranks, label="mp")
        if d == dp_rank:
            model_parallel_group = g

    def stage_group(stages, label):
        mine = None
        for d in range(dp):
            for t in range(tp):
                ranks = [(p * dp + d) * tp + t for p in stages]
                g = collectives.new_group(ranks, label=label)
                if rank in ranks:
                    mine = g
        return mine

    embedding_group = None
    if pp > 1:
        embedding_group = stage_group(sorted(set(embedding_stages or [0, pp - 1])), "embedding")
    groups = {}
    for name, stages in sorted((stage_groups or {}).items()):
        stages = sorted(set(stages))
        if any(not 0 <= p < pp for p in stages):
            raise GridError(f"stage group {name!r}: stages {stages} outside 0..{pp - 1}")
        if len(stages) > 1:
            groups[name] = stage_group(stages, name)
    return model_parallel_group, embedding_group, groups


def _expert_data_parallel_size(world: int, tp: int, dp: int, pp: int, ep: int, etp: int,
                               cp: int = 1) -> int:
    """edp of the expert layout etp x ep x edp over a stage's dp * cp * tp ranks; raises
    GridError naming the flag to change when the sizes do not fit."""
    if ep < 1 or etp < 1:
        raise GridError(f"expert parallel sizes must be >= 1, got --expert-model-parallel-size "
                        f"{ep} --expert-tensor-parallel-size {etp}; 1 turns either off")
    stage = dp * cp * tp
    ranks = (f"data-parallel size {dp} x context-parallel-size {cp} x "
             f"tensor-model-parallel-size {tp}" if cp > 1 else
             f"data-parallel size {dp} x tensor-model-parallel-size {tp}")
    if stage % etp:
        raise GridError(
            f"--expert-tensor-parallel-size {etp} must divide the {stage} ranks of a pipeline "
            f"stage ({ranks}); use a divisor of {stage}, e.g. {tp} (the default: the same as "
            f"--tp)")
    if (stage // etp) % ep:
        n = stage // etp
        dpc = f"the data-parallel size ({dp} = world {world} / (tp {tp} x pp {pp}))" \
            if cp == 1 else (f"data-parallel size x context-parallel-size ({dp * cp} = world "
                             f"{world} / (tp {tp} x pp {pp}))")
        where = dpc
        if etp != tp:
            where += f" x tensor-model-parallel-size {tp} / expert-tensor-parallel-size {etp} = {n}"
        fits = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise GridError(
            f"--expert-model-parallel-size {ep} must divide {where}: the expert-parallel "
            f"ranks are carved out of the data-parallel{' x context-parallel' if cp > 1 else ''} "
            f"ranks of each pipeline stage; use one of {fits}, or launch a multiple of "
            f"{math.lcm(tp * cp, etp * ep) * pp} processes")
    return stage // (etp * ep)


def _expert_groups(tp: int, dp: int, pp: int, ep: int, etp: int, rank: int, tp_group,
                   dp_group, device: torch.device) -> dict:
    """This rank's coordinates and groups in the expert layout (module docstring), as `Grid`
    fields; `dp` is a stage's dp x cp ranks and `dp_group` their group (the dp-cp group).
    Every rank makes every group, in the same order. An expert group with the ranks of
    another is that group (etp == tp: the tp group; ep * etp == tp: the dp(-cp) group; etp x ep:
    the etp group when ep == 1, the ep group when etp == 1), with its label and shared-memory
    channel; the others are labelled "ep", "etp", "edp", "etp-ep". On CPU, new etp and edp
    groups (reductions) get a shared-memory channel; the ep group's all-to-all is not one the
    channel runs, so it stays on gloo."""
    stage, edp = dp * tp, dp * tp // (ep * etp)
    pp_rank, rest = divmod(rank, stage)
    edp_rank, rest = divmod(rest, ep * etp)
    ep_rank, etp_rank = divmod(rest, etp)

    def build(label, lists):
        mine = None
        for ranks in lists:
            g = collectives.new_group(ranks, label=label)
            if rank in ranks:
                mine = g
        return mine

    def at(p, d, e, t):
        return p * stage + (d * ep + e) * etp + t

    P, D, E, T = range(pp), range(edp), range(ep), range(etp)
    etp_group = tp_group if etp == tp else build(
        "etp", [[at(p, d, e, t) for t in T] for p in P for d in D for e in E])
    ep_group = build("ep", [[at(p, d, e, t) for e in E] for p in P for d in D for t in T])
    edp_group = dp_group if ep * etp == tp else build(
        "edp", [[at(p, d, e, t) for d in D] for p in P for e in E for t in T])
    etp_ep_group = etp_group if ep == 1 else ep_group if etp == 1 else build(
        "etp-ep", [[at(p, d, e, t) for e in E for t in T] for p in P for d in D])
    if device.type == "cpu":
        for g, size, dense in ((etp_group, etp, tp_group), (edp_group, edp, dp_group)):
            if size > 1 and g is not dense:
                shm_setup.attach(g, collectives.get_timeout())
    return dict(ep_rank=ep_rank, etp_rank=etp_rank, edp_rank=edp_rank, ep_group=ep_group,
                etp_group=etp_group, edp_group=edp_group, etp_ep_group=etp_ep_group)


def destroy_model_parallel(destroy_world: bool = False) -> None:
    """Forget the current grid; with destroy_world (or if we started it) end the world too."""
    global _GRID, _OWNS_WORLD
    _GRID = None
    shm.detach_all()
    collectives.forget_world_label()
    if (destroy_world or _OWNS_WORLD) and dist.is_initialized():
        dist.destroy_process_group()
        collectives.forget_groups()
        if _OWNS_WORLD:
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
                os.environ.pop(k, None)
        _OWNS_WORLD = False


def model_parallel_is_initialized() -> bool:
    return _GRID is not None


def get_grid() -> Grid:
    if _GRID is None:
        raise GridError("the process grid is not initialized; call "
                        "parallel_state.initialize_model_parallel(...) first")
    return _GRID


# ---------------------------------------------------------------------- Megatron-style getters
# Without a grid, layers behave as on one process (tp = pp = dp = 1): that keeps the dense
# single-process reference and unit tests free of process-group setup.

def get_tensor_model_parallel_group():
    return get_grid().tp_group


def get_data_parallel_group(with_context_parallel: bool = False):
    """The dp group (the data loader's replicas); `with_context_parallel`: the dp x cp ranks
    holding the same weights, over which weight gradients reduce and ZeRO shards (Megatron's
    argument; the dp group itself at cp 1)."""
    g = get_grid()
    return g.dp_cp_group if with_context_parallel else g.dp_group


def get_context_parallel_group():
    """The cp group: the ranks holding the parts of the same sequences (ring attention)."""
    return get_grid().cp_group


def get_context_parallel_world_size() -> int:
    return _GRID.context_parallel_size if _GRID else 1


def get_context_parallel_rank() -> int:
    return _GRID.cp_rank if _GRID else 0


def get_context_parallel_global_ranks() -> list[int]:
    """Global ranks of this rank's cp group, by cp rank (Megatron's getter)."""
    g = get_grid()
    first = g.tp_rank + ((g.pp_rank * g.data_parallel_size + g.dp_rank) *
                         g.context_parallel_size) * g.tensor_model_parallel_size
    return [first + c * g.tensor_model_parallel_size for c in range(g.context_parallel_size)]


def get_pipeline_model_parallel_group(chunk: int = 0):
    """The pipeline's group; in a V placement chunk 1's messages use a second one."""
    g = get_grid()
    return g.pp_v_group if chunk == 1 and g.pipeline_v_shape else g.pp_group


def is_pipeline_v_shape() -> bool:
    """True when the model chunks sit in a V (ZBV): stage 0 holds embedding and loss."""
    return bool(_GRID and _GRID.pipeline_v_shape)


def get_model_parallel_group():
    return get_grid().model_parallel_group


def get_embedding_group():
    return get_grid().embedding_group


def get_stage_group(name: str):
    """This rank's group of the stages replicating parameter group `name` (see
    `initialize_model_parallel`), or None when this stage holds no copy or there is one."""
    return get_grid().stage_groups.get(name)


def get_expert_model_parallel_group():
    """The ep group: ranks holding different experts of an MoE layer (the token all-to-all)."""
    return get_grid().ep_group


def get_expert_tensor_parallel_group():
    """The etp group: ranks holding shards of the same experts (the tp group when etp == tp)."""
    return get_grid().etp_group


def get_expert_data_parallel_group():
    """The edp group: replicas of the same expert shards; expert gradients reduce over it."""
    return get_grid().edp_group


def get_expert_tensor_and_model_parallel_group():
    """The etp x ep ranks of one expert replica (Megatron's tp-ep group)."""
    return get_grid().etp_ep_group


def get_expert_model_parallel_world_size() -> int:
    return _GRID.expert_model_parallel_size if _GRID else 1


def get_expert_model_parallel_rank() -> int:
    return _GRID.ep_rank if _GRID else 0


def get_expert_tensor_parallel_world_size() -> int:
    return _GRID.expert_tensor_parallel_size if _GRID else 1


def get_expert_tensor_parallel_rank() -> int:
    return _GRID.etp_rank if _GRID else 0


def get_expert_data_parallel_world_size() -> int:
    return _GRID.expert_data_parallel_size if _GRID else 1


def get_expert_data_parallel_rank() -> int:
    return _GRID.edp_rank if _GRID else 0


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return get_expert_model_parallel_world_size() * get_expert_tensor_parallel_world_size()


def get_expert_tensor_and_model_parallel_rank() -> int:
    return get_expert_model_parallel_rank() * get_expert_tensor_parallel_world_size() + \
        get_expert_tensor_parallel_rank()


def get_tensor_model_parallel_world_size() -> int:
    return _GRID.tensor_model_parallel_size if _GRID else 1


def get_tensor_model_parallel_rank() -> int:
    return _GRID.tp_rank if _GRID else 0


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    if _GRID is None:
        return 1
    cp = _GRID.context_parallel_size if with_context_parallel else 1
    return _GRID.data_parallel_size * cp


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    if _GRID is None:
        return 0
    if with_context_parallel:
        return _GRID.dp_rank * _GRID.context_parallel_size + _GRID.cp_rank
    return _GRID.dp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return _GRID.pipeline_model_parallel_size if _GRID else 1


def get_pipeline_model_parallel_rank() -> int:
    return _GRID.pp_rank if _GRID else 0


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _GRID.virtual_pipeline_model_parallel_size if _GRID else None


def get_virtual_pipeline_model_parallel_rank() -> int:
    return _GRID.virtual_pipeline_rank if _GRID else 0


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    get_grid().virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the stage holding the embedding (with vpp: chunk 0 of pipeline rank 0)."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size():
        if get_virtual_pipeline_model_parallel_rank() != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the stage holding the output layer and loss (with vpp: the last chunk; in a
    V placement chunk 1 of pipeline rank 0)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if is_pipeline_v_shape():
        return get_pipeline_model_parallel_rank() == 0 and (
            ignore_virtual or get_virtual_pipeline_model_parallel_rank() == 1)
    if not ignore_virtual and vpp:
        if get_virtual_pipeline_model_parallel_rank() != vpp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wrapping around, as the interleaved schedule needs)."""
    g = get_grid()
    return g.pp_ranks[(g.pp_rank + 1) % g.pipeline_model_parallel_size]


def get_pipeline_model_parallel_prev_rank() -> int:
    g = get_grid()
    return g.pp_ranks[(g.pp_rank - 1) % g.pipeline_model_parallel_size]


def get_device() -> torch.device:
    return _GRID.device if _GRID else torch.device("cpu")
