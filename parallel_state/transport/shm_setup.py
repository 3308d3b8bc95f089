"""Giving a process group a shared-memory channel (shm.py): the set-up, itself a collective.

Every rank of the group agrees, over the group's gloo link, whether all of them share this
host and may use shared memory, then rank 0 creates the segment and the others map it (see
shm.py's module docstring). Those agreements are object collectives, so they go through
parallel_state.collectives like every other call; the channel they register is what that
layer then runs the group's CPU collectives on. The split is the import order: shm.py sits
below the collectives layer (which calls it), this module above it (it calls that layer).
"""
from __future__ import annotations

import os
import socket
import uuid
import warnings
from datetime import timedelta

import torch.distributed as dist

from .. import collectives
from . import shm


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def attach(group, timeout: timedelta | None = None, slot_bytes: int = shm.SLOT_BYTES):
    """Give `group` (a gloo group of CPU ranks) a shared-memory channel when all its ranks
    share this host; returns the `shm.Channel`, or None (the group stays on gloo). Collective:
    every member calls it, and all reach the same answer. `timeout`: how long a collective
    waits for a peer (None: 30 minutes, torch's default). The segment is made in
    `shm.SHM_DIR` (read at each call)."""
    n = dist.get_world_size(group)
    if n < 2:
        return None
    hosts = [None] * n
    collectives.all_gather_object(hosts, (_host_id(), shm.available()), group=group)
    if len(set(h for h, _ in hosts)) != 1 or not all(ok for _, ok in hosts):
        return None
    rank, ranks = dist.get_rank(group), [dist.get_global_rank(group, j) for j in range(n)]
    # The segment is named by rank 0 with a random token in it; a rank that cannot see the
    # file or the token (same host name and kernel, but its own /dev/shm: containers with
    # host networking) must not make its own, else every collective would wait for ranks
    # that write elsewhere: the group stays on gloo.
    name, token = f"shardzoo-{uuid.uuid4().hex}", uuid.uuid4().int >> 65
    path, channel = os.path.join(shm.SHM_DIR, name), None
    nbytes = shm.segment_bytes(n, slot_bytes)
    if rank == 0 and shm.create_segment(path, nbytes):
        channel = shm.Channel(path, n, rank, slot_bytes, timeout, ranks)
        channel.token = token
    shared = [(name, token) if channel is not None else None]
    collectives.broadcast_object_list(shared, src=ranks[0], group=group)
    if shared[0] is None:  # /dev/shm too small: rank 0 warned
        return None
    if rank != 0:
        name, token = shared[0]
        path = os.path.join(shm.SHM_DIR, name)
        if os.path.isfile(path) and os.path.getsize(path) == nbytes:
            channel = shm.Channel(path, n, rank, slot_bytes, timeout, ranks)
            if channel.token != token:
                channel = None
    seen = [None] * n
    collectives.all_gather_object(seen, channel is not None, group=group)  # then unlink
    if rank == 0:
        os.unlink(path)
    if not all(seen):
        if rank == 0:
            blind = [r for r, ok in zip(ranks, seen) if not ok]
            warnings.warn(f"no shared-memory channel: ranks {blind} do not see {path} "
                          f"(another /dev/shm); the group stays on gloo")
        return None
    channel.find_peers()  # every rank wrote its pid before the all-gather above
    shm.register(group, channel)
    return channel
