"""Start-up checks of ZeRO-Infinity's NVMe offload (--optimizer-offload-device nvme,
--param-offload-device nvme): before any process group or model is built, every rank removes
the scratch folders that killed runs left under --offload-path on its host
(data_parallel/offload_files.py `remove_stale_scratch`: only folders whose owning process is
gone) and refuses a folder that is missing and cannot be made, read-only, or without room
for the scratch files of this host's ranks (the planner's NVMe bytes per rank x the local
ranks), naming the path and its free space."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from data_parallel.offload_files import OffloadPathError, check_offload_path, remove_stale_scratch
from models.config import ConfigError
from planner.parameters import model_state_prediction


def offload_scratch_bytes(config) -> int:
    """NVMe bytes one rank writes: the largest over pipeline stages of the planner's
    `nvme_total` (optimizer main copy + moments, ZeRO-3 weight shards)."""
    return max(model_state_prediction(config, r)["nvme_total"]
               for r in range(config.train.pipeline_model_parallel_size))


def prepare_offload_path(config, disk_usage=None) -> str | None:
    """Clean and check --offload-path (module docstring); returns the line to print, or None
    without NVMe offload.

    Raises:
        ConfigError: the folder cannot take this host's scratch files (path, free space and
            the fix in the message).
    """
    t = config.train
    if "nvme" not in (t.optimizer_offload_device, t.param_offload_device):
        return None
    path = os.path.abspath(t.offload_path)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    per_rank = offload_scratch_bytes(config)
    try:
        removed = remove_stale_scratch(path)
        kw = {} if disk_usage is None else {"disk_usage": disk_usage}
        free = check_offload_path(path, local * per_rank,
                                  what=f"the scratch files of {local} rank(s) on this host "
                                       f"({per_rank:,} B each)", **kw)
    except OffloadPathError as e:
        raise ConfigError(str(e)) from None
    gone = f"; removed {len(removed)} scratch folder(s) of dead runs" if removed else ""
    return (f"offload: scratch files under {path}: {per_rank / 2**30:,.3f} GiB per rank x "
            f"{local} rank(s) on this host, {free / 2**30:,.1f} GiB free{gone}")


def release_freed_host_memory() -> bool:
    """Give the process's freed heap memory back to the kernel (glibc's `malloc_trim(0)`);
    True if some was. Train.py keeps large freed blocks in the process
    (parallel_state/host_memory.py), so the full copy of the model a ZeRO-3 build frees would
    stay resident; an offload run, which exists to save that memory, trims once after the
    model and optimizer are built. No-op (False) outside glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc.malloc_trim(0) == 1
