"""The process grid: one DeviceMesh with dims ("pp", "dp", "tp") and Megatron-style getters.

Rank order is Megatron's: tensor-parallel ranks are adjacent (fastest varying), then data
parallel, then pipeline, so global rank = (pp_rank * dp + dp_rank) * tp + tp_rank and a TP
group sits inside one node.

The grid is one object (`Grid`); the module keeps the current one so layers can ask for their
groups without threading it through every constructor, and the getters below read it.
"""
from __future__ import annotations

import os
import socket
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
    """Sizes, this process's coordinates and the process groups of the (pp, dp, tp) grid."""

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
) -> Grid:
    """Build the (pp, dp, tp) grid over the running world and make it current.

    `embedding_stages`: the pipeline stages holding a copy of the word embedding (default the
    first and the last; T5 also the first decoder stage, Megatron's split rank).
    `stage_groups`: `{name: stages}` of other parameters replicated over stages; each gets a
    group per (dp, tp) coordinate (`get_stage_group(name)`), like the embedding group.

    Raises `GridError` when the world size is not divisible by tp * pp, when a size is not
    positive, when the default process group is not started, or when a grid already exists
    (call `destroy_model_parallel()` first).
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
    if tp < 1 or pp < 1 or (vpp is not None and vpp < 1):
        raise GridError(f"parallel sizes must be >= 1, got tp={tp} pp={pp} vpp={vpp}")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise GridError(
            f"world size {world} is not divisible by tensor-model-parallel-size ({tp}) x "
            f"pipeline-model-parallel-size ({pp}); launch a multiple of {tp * pp} processes "
            f"or change --tp/--pp")
    dp = world // (tp * pp)
    device = torch.device(device) if device is not None else default_device()
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    for dim in ("pp", "dp", "tp"):
        collectives.apply_timeout(mesh.get_group(dim))
        collectives.name_group(mesh.get_group(dim), dim)
    if device.type == "cpu":  # TP's many small collectives, DP's large ones: transport/shm.py
        for dim, size in (("tp", tp), ("dp", dp)):
            if size > 1:
                shm_setup.attach(mesh.get_group(dim), collectives.get_timeout())
    rank = dist.get_rank()
    pp_rank, rest = divmod(rank, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)
    # Groups spanning two mesh dims and the embedding group: every rank takes part in
    # every new_group call, in the same order (a torch.distributed requirement).
    model_parallel_group = None
    for d in range(dp):
        ranks = [(p * dp + d) * tp + t for p in range(pp) for t in range(tp)]
        g = collectives.new_group(ranks, label="mp")
        if d == dp_rank:
            model_parallel_group = g
    embedding_group = None
    pp_ranks = [(p * dp + dp_rank) * tp + tp_rank for p in range(pp)]

    def stage_group(stages, label):
        mine = None
        for d in range(dp):
            for t in range(tp):
                ranks = [(p * dp + d) * tp + t for p in stages]
                g = collectives.new_group(ranks, label=label)
                if rank in ranks:
                    mine = g
        return mine

    if pp > 1:
        embedding_group = stage_group(sorted(set(embedding_stages or [0, pp - 1])), "embedding")
    groups = {}
    for name, stages in sorted((stage_groups or {}).items()):
        stages = sorted(set(stages))
        if any(not 0 <= p < pp for p in stages):
            raise GridError(f"stage group {name!r}: stages {stages} outside 0..{pp - 1}")
        if len(stages) > 1:
            groups[name] = stage_group(stages, name)
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
    )
    return _GRID


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


def get_data_parallel_group():
    return get_grid().dp_group


def get_pipeline_model_parallel_group():
    return get_grid().pp_group


def get_model_parallel_group():
    return get_grid().model_parallel_group


def get_embedding_group():
    return get_grid().embedding_group


def get_stage_group(name: str):
    """This rank's group of the stages replicating parameter group `name` (see
    `initialize_model_parallel`), or None when this stage holds no copy or there is one."""
    return get_grid().stage_groups.get(name)


def get_tensor_model_parallel_world_size() -> int:
    return _GRID.tensor_model_parallel_size if _GRID else 1


def get_tensor_model_parallel_rank() -> int:
    return _GRID.tp_rank if _GRID else 0


def get_data_parallel_world_size() -> int:
    return _GRID.data_parallel_size if _GRID else 1


def get_data_parallel_rank() -> int:
    return _GRID.dp_rank if _GRID else 0


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
    """True on the stage holding the output layer and loss (with vpp: the last chunk)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
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
