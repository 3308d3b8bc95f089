"""DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", Algorithm 1): data-parallel replicas that communicate every H steps instead of every
step (`--diloco-sync-every H`).

Each data-parallel replica (its tensor x pipeline ranks: TP and PP inside a replica, and the
gradient reductions within TP/SP and between tied pipeline copies, are unchanged) trains with
its own inner AdamW on its own share of each global batch, with no gradient all-reduce over
dp: the replica's loss is the mean over its own tokens. Every H steps (and after the last
step, so a run always ends on one model) the outer step runs on every rank:

    delta   = mean over dp of (global - local)            # the pseudo-gradient, one all-reduce
    m       = mu m + delta                                # Nesterov momentum (torch SGD's form)
    global -= outer_lr (delta + mu m)
    local   = global                                      # every replica restarts from it

`global` is the float32 copy every replica agrees on (its TP/PP shard on each rank), `m` the
outer momentum. With H 1, outer lr 1 and momentum 0, `global` becomes the mean of the replicas'
weights after one inner step each: for an inner step linear in the gradient (SGD) that is
synchronous data parallelism exactly, up to rounding (tests/test_diloco.py uses AdamW with
beta1 = beta2 = 0 and eps far above |g|, which is SGD with step lr / eps).

Communication over dp: one all-reduce of the local parameters' float32 bytes per H steps
instead of the gradient buckets' every step (what --report-comm counts over an H-step window).
The non-finite guard's per-step exchange over the world (2 floats per rank:
training/nonfinite.py) stays, also with --no-check-for-nan-in-loss-and-grad: each replica's
loss and gradient norm are its own, and the exchange keeps every replica's skip decision, and
so the run's stop, the same.

Checkpoints (training/checkpointing.py): `model.*` holds the global copy (so a DiLoCo checkpoint
is an ordinary, layout-free model), `optim.*` the dp mean of the inner moments,
`diloco.outer_momentum.*` the outer momentum (layout-free like the weights), and per rank
`diloco.rank<R>.{local,exp_avg,exp_avg_sq}.*` the replica's own weights and moments, restored on
the same layout (exact resume mid-period); on another layout every replica starts from the
global copy and the mean moments.
"""
from __future__ import annotations

import torch

import parallel_state as ps
from parallel_state import collectives

LOCAL_KINDS = ("local", "exp_avg", "exp_avg_sq")  # per-rank keys of a checkpoint
MOMENTUM = "diloco.outer_momentum"  # the layout-free key kind of the outer momentum


class DiLoCo:
    """The outer optimizer of one rank: the global copy and outer momentum of `params`.

    Args:
        params: this rank's trainable parameters (float32; TP/PP shards), initialised alike on
            every data-parallel replica.
        sync_every: H, inner steps between outer steps (>= 1).
        outer_lr, outer_momentum: the outer SGD's step and Nesterov momentum (paper: 0.7, 0.9).
        group: the data-parallel group the pseudo-gradient is averaged over.
    """

    def __init__(self, params: list[torch.nn.Parameter], sync_every: int, outer_lr: float,
                 outer_momentum: float, group=None):
        self.params = params
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, outer_lr, outer_momentum
        self.group = group if group is not None else ps.get_data_parallel_group()
        self.dp = ps.get_data_parallel_world_size()
        with torch.no_grad():
            self.global_params = [p.detach().float().clone() for p in params]
        self.momentum = [torch.zeros_like(g) for g in self.global_params]
        self.syncs = 0  # outer steps taken in this run (not checkpointed: a count for logs)
        self.skipped_syncs = 0

    @torch.no_grad()
    def reset_global(self) -> None:
        """Take the parameters' current values as the global copy (after a load)."""
        for g, p in zip(self.global_params, self.params):
            g.copy_(p.detach().float())

    def due(self, it: int, last: int) -> bool:
        """An outer step follows iteration `it` (1-based): every H steps and after `last`."""
        return it % self.sync_every == 0 or it == last

    @torch.no_grad()
    def sync(self) -> bool:
        """The outer step (module docstring), collective over the dp group. A non-finite
        pseudo-gradient (a replica diverged) is not applied: every replica restarts from the
        unchanged global copy. Returns whether the step was applied."""
        flat = torch.cat([(g - p.detach().float()).reshape(-1)
                          for g, p in zip(self.global_params, self.params)])
        if self.dp > 1:
            collectives.all_reduce(flat, group=self.group)
            flat /= self.dp
        applied = bool(torch.isfinite(flat).all())  # the same sum on every replica
        if applied:
            mu, lr, offset = self.outer_momentum, self.outer_lr, 0
            for g, m in zip(self.global_params, self.momentum):
                delta = flat[offset: offset + g.numel()].view_as(g)
                offset += g.numel()
                if mu:
                    m.mul_(mu).add_(delta)
                    g.sub_(delta.add(m, alpha=mu), alpha=lr)
                else:
                    g.sub_(delta, alpha=lr)
            self.syncs += 1
        else:
            self.skipped_syncs += 1
        for g, p in zip(self.global_params, self.params):
            p.copy_(g)
        return applied

    def describe(self) -> str:
        return (f"DiLoCo: inner AdamW per data-parallel replica, outer Nesterov SGD (lr "
                f"{self.outer_lr:g}, momentum {self.outer_momentum:g}) on the dp-averaged "
                f"pseudo-gradient every {self.sync_every} step(s) over dp {self.dp}")



# ---------------------------------------------------------------------- checkpoints
def _local_key(rank: int, kind: str, name: str) -> str:
    return f"diloco.rank{rank}.{kind}.{name}"


@torch.no_grad()
def save_state(diloco: DiLoCo, chunks, values: dict) -> dict:
    """Checkpoint entries of DiLoCo (module docstring), collective over dp. `values` is
    `{id(param): {kind: float32 TP-local tensor}}` (the replica's weights and inner moments),
    changed in place to what the layout-free keys hold: the global copy and the dp-mean
    moments. Returns the extra DCP entries: the outer momentum and this rank's own state."""
    from checkpoint.keys import as_saved, entries, stored_pieces

    rank = torch.distributed.get_rank()
    index = {id(p): i for i, p in enumerate(diloco.params)}
    extra = {}
    for name, p, key_name, tied_copy in entries(chunks):
        i, own = index[id(p)], values[id(p)]
        for kind, key in (("model", "local"), ("optim.exp_avg", "exp_avg"),
                          ("optim.exp_avg_sq", "exp_avg_sq")):
            extra[_local_key(rank, key, name)] = own[kind].detach().clone()
        moments = {k: own[k].detach().clone() for k in ("optim.exp_avg", "optim.exp_avg_sq")}
        if diloco.dp > 1:
            for m in moments.values():
                collectives.all_reduce(m, group=diloco.group)
                m /= diloco.dp
        values[id(p)] = {"model": diloco.global_params[i].clone(), **moments}
        if not tied_copy:
            for key, part in stored_pieces(MOMENTUM, key_name, p, diloco.momentum[i]):
                extra[key] = as_saved(part.clone(), p)
    return extra


@torch.no_grad()
def load_state(diloco: DiLoCo, path: str, md, chunks, optimizer, same_layout: bool) -> str:
    """After the weights (`model.*`: the global copy) and moments were loaded: set the global
    copy from them, read the outer momentum (zero when the checkpoint has none) and, on the
    same layout, this rank's own weights and inner moments. Collective (DCP). Returns what
    was restored, for the resume line."""
    from checkpoint import safe_dcp
    from checkpoint.keys import entries, read_plan, rebuild

    saved = md.state_dict_metadata
    diloco.reset_global()
    items = entries(chunks)
    has_momentum = any(k.startswith(MOMENTUM + ".") for k in saved)
    if has_momentum:
        sd, plan = read_plan(path, saved, items, (MOMENTUM,))
        safe_dcp.load(sd, path, md)
        values = rebuild(sd, plan)
        index = {id(p): i for i, p in enumerate(diloco.params)}
        for _, p, _, _ in items:
            diloco.momentum[index[id(p)]].copy_(values[id(p)][MOMENTUM])
    rank = torch.distributed.get_rank()
    mine = {_local_key(rank, k, name): p for name, p, _, _ in items for k in LOCAL_KINDS}
    local = same_layout and all(k in saved for k in mine)
    # every rank takes part in the load (collective) even when it reads nothing of its own
    sd = {k: torch.empty(tuple(saved[k].size)) for k in mine} if local else {}
    if any(_gather_flags(local)):
        safe_dcp.load(sd, path, md)
    if local:
        for name, p, _, _ in items:
            p.copy_(sd[_local_key(rank, "local", name)])
            state = optimizer.state.get(p)
            if state:
                state["exp_avg"].copy_(sd[_local_key(rank, "exp_avg", name)])
                state["exp_avg_sq"].copy_(sd[_local_key(rank, "exp_avg_sq", name)])
    return ("the global copy, the outer momentum" if has_momentum else
            "the global copy (no outer momentum saved: it starts at zero)") + (
        " and each replica's own weights and moments" if local else
        "; every replica starts from the global copy and the mean moments")


def _gather_flags(flag: bool) -> list[bool]:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [flag]
    out = [None] * torch.distributed.get_world_size()
    collectives.all_gather_object(out, flag)
    return out
