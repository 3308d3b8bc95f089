"""The random numbers of model code: dropout's key and Megatron's RNG tracker.

Dropout masks are, by default, keyed and not drawn (layers/dropout.py): a mask element is a
hash of (seed, global sample index, site, position), so this module holds only the seed, the
scheme (`--dropout-masks`) and the global sample ids of the microbatch being run
(`dropout_sample_ids`, set by the training schedules and replayed by activation recompute).

Megatron's scheme (`--dropout-masks rank-streams`, and any forward without sample ids) draws
from named streams that the tracker owns: the default stream (replicated regions, e.g. hidden
dropout without sequence parallelism: the same numbers on every TP rank) and the TP stream
(sharded regions: attention heads, sequence shards: different numbers per TP rank). The
tracker swaps a stream in around a region, `with get_rng_tracker().fork(DEFAULT_RNG): ...`,
so no other code that draws from the process's generator (a start-up measurement, logging,
a user's code) can shift a training mask. Activation recompute replays a region exactly by
saving and restoring the tracker's states (`get_states`/`set_states`) and the sample ids.

Works on CPU and CUDA: it swaps the default generator of the tensor's device.
"""
from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
DEFAULT_RNG = "default-rng"
DROPOUT_MASKS = ("sample", "rank-streams")


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
        """Replace the states of the streams in `states`; other streams keep theirs (a
        checkpoint written before a stream existed)."""
        self.states.update({k: v.clone() for k, v in states.items()})

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


class _DropoutKey:
    seed = 0
    scheme = "sample"
    sample_ids: torch.Tensor | None = None


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0,
                        device: torch.device | None = None,
                        dropout_masks: str = "sample") -> None:
    """Set the dropout seed and scheme and seed the tracker's streams.

    `dropout_masks`: "sample" (layout-independent masks keyed by `seed` and the global sample,
    layers/dropout.py) or "rank-streams" (Megatron's). The streams' seeds follow Megatron:
    default = seed + 100 * pp_rank; tensor-parallel = default + 2718 + tp_rank (data-parallel
    replicas use the same seeds, so their masks agree). The process's own generator is seeded
    with the default seed too, for code outside the model; the model never draws from it.
    Raises ValueError for an unknown scheme.
    """
    if dropout_masks not in DROPOUT_MASKS:
        raise ValueError(f"dropout_masks must be one of {DROPOUT_MASKS}, got {dropout_masks!r}")
    _DropoutKey.seed, _DropoutKey.scheme, _DropoutKey.sample_ids = seed, dropout_masks, None
    device = torch.device(device) if device is not None else torch.device("cpu")
    default_seed = seed + 100 * pp_rank
    torch.manual_seed(default_seed)
    _TRACKER.reset(device)
    _TRACKER.add(DEFAULT_RNG, default_seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, default_seed + 2718 + tp_rank)


def get_dropout_seed() -> int:
    return _DropoutKey.seed


def get_dropout_sample_ids() -> torch.Tensor | None:
    """`[b]` int64 global sample indices of the microbatch being run, when dropout masks are
    keyed by sample; None under "rank-streams" or outside `dropout_sample_ids`."""
    return _DropoutKey.sample_ids if _DropoutKey.scheme == "sample" else None


@contextlib.contextmanager
def dropout_sample_ids(sample_ids: torch.Tensor | None):
    """Run the block with `sample_ids` (`[b]` int64, the global indices of the microbatch's
    samples in the run's data order) keying dropout masks; None: no key (stream dropout)."""
    saved = _DropoutKey.sample_ids
    _DropoutKey.sample_ids = sample_ids
    try:
        yield
    finally:
        _DropoutKey.sample_ids = saved
