"""Random-number streams for tensor-parallel regions (Megatron's RNG tracker).

Replicated regions (hidden dropout without sequence parallelism) must draw the same numbers on
every TP rank; sharded regions (attention dropout on a head shard, dropout on a sequence
shard) must draw different ones. The tracker keeps named generator states and swaps one in
around a region: `with get_rng_tracker().fork(): dropout(x)`. Activation recompute replays a
region exactly by saving and restoring the tracker's states (`get_states`/`set_states`).

Works on CPU and CUDA: it swaps the default generator of the tensor's device.
"""
from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that can be forked into, one per region kind."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")

    def reset(self, device: torch.device | None = None) -> None:
        self.states = {}
        if device is not None:
            self.device = torch.device(device)

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` from `seed`; raises ValueError if the name already exists."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device)
        torch.manual_seed(seed) if self.device.type == "cpu" else torch.cuda.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with stream `name` as the device's default generator."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not added; call model_parallel_seed(seed)")
        saved = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0,
                        device: torch.device | None = None) -> None:
    """Seed the default stream (same on all TP ranks of a stage) and the TP stream (per rank).

    Offsets follow Megatron: default = seed + 100 * pp_rank; tensor-parallel = default + 2718 +
    tp_rank. Data-parallel replicas use the same seeds, so their dropout masks agree.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    default_seed = seed + 100 * pp_rank
    torch.manual_seed(default_seed)
    _TRACKER.reset(device)
    _TRACKER.add(MODEL_PARALLEL_RNG, default_seed + 2718 + tp_rank)


def dropout(x: torch.Tensor, p: float, training: bool, sharded: bool) -> torch.Tensor:
    """Dropout drawing from the TP stream when `x` is sharded across TP ranks (heads or sequence),
    else from the default stream (identical masks on all TP ranks of a replicated tensor)."""
    if p == 0.0 or not training:
        return x
    if sharded:
        with _TRACKER.fork():
            return torch.nn.functional.dropout(x, p, True)
    return torch.nn.functional.dropout(x, p, True)
