"""The split backward of zero-bubble pipeline schedules: input gradients now, weight gradients
later (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 2).

A stage's backward for one microbatch is two passes: B computes the gradient of the stage's
input (the previous stage waits for it) and W the gradients of the weights (nobody waits for
them), so a schedule can run W later, in what would otherwise be a bubble. Here the split is
made where the weight gradient is computed: the linear layers (`layers.linear`'s
`_LinearWithGrad`, used by every column- and row-parallel linear while `split_backward()` is
on, and the experts' `_GroupedLinear`) check `defer()` in their backward; inside
`input_gradients_only()` they return no weight (or bias) gradient and queue a closure that
computes it from the saved input and output gradient. Everything else (norms, embeddings, the
router, attention's parameters outside linears) gets its gradient in B, as Megatron's
zero-bubble implementation does (its WeightGradStore holds the linears' GEMMs only).

`DeferredWeightGrads.run()` (the W) runs the queued closures, once, through autograd's engine:
one graph node per closure, whose backward computes the weight gradients, accumulates them
into `.grad` by the parameters' own AccumulateGrad nodes and fires their post-accumulate-grad
hooks. So gradient accumulation into DP buffers, ZeRO-2/3 reduce-scatters (and their
end-of-backward callbacks) and the collective trace see W where it runs, with the same
numbers as a joint backward: the same GEMMs on the same tensors, added into `.grad` the same
way. While B runs, `is_deferred(param)` tells a post-accumulate-grad hook that the call it
gets carries no gradient (autograd calls AccumulateGrad even for a None gradient).

Costs: the saved input and output gradient of each deferred linear live until its W (the
activation memory a schedule's W placement accounts for); with sequence parallelism the
input's all-gather moves from B to W.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch

_split = False  # forwards build graphs whose linear backward can be split
_collecting: "DeferredWeightGrads | None" = None  # the B pass running now


@contextlib.contextmanager
def split_backward(enabled: bool = True):
    """While on, linear layers run through the autograd functions that can defer their weight
    gradient (set by a zero-bubble schedule around its whole step)."""
    global _split
    previous, _split = _split, enabled
    try:
        yield
    finally:
        _split = previous


def splitting() -> bool:
    return _split


class DeferredWeightGrads:
    """The weight-gradient pass (W) of one backward: closures queued by `defer`."""

    def __init__(self) -> None:
        self._items: list[tuple[Callable[[], tuple], tuple[torch.Tensor, ...]]] = []
        self._param_ids: set[int] = set()
        self.done = False

    def __len__(self) -> int:
        return len(self._items)

    def add(self, compute: Callable[[], tuple], params: tuple[torch.Tensor, ...]) -> None:
        self._items.append((compute, params))
        self._param_ids.update(id(p) for p in params)

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._param_ids

    def run(self) -> None:
        """Compute and accumulate every queued weight gradient (in the order B queued them).

        Raises:
            RuntimeError: this W already ran, or runs inside another backward.
        """
        if self.done:
            raise RuntimeError("this weight-gradient pass (W) already ran; a schedule must run "
                               "each W exactly once")
        if _collecting is not None:
            raise RuntimeError("a weight-gradient pass (W) cannot run inside a B pass")
        self.done = True
        items, self._items = self._items, []
        if not items:
            return
        with torch.enable_grad():
            roots = [_WeightGradNode.apply(compute, *params) for compute, params in items]
        # the engine runs the node created last first: reverse, so W keeps B's order
        torch.autograd.backward(roots[::-1], [torch.ones_like(r) for r in roots[::-1]])


class _WeightGradNode(torch.autograd.Function):
    """A graph node whose backward computes the gradients of `params` (the closure's tuple,
    None entries allowed) and hands them to the parameters' AccumulateGrad nodes."""

    @staticmethod
    def forward(ctx, compute, *params):
        ctx.compute = compute
        return torch.zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _):
        grads = ctx.compute()
        ctx.compute = None  # the saved tensors go with it
        return (None, *grads)


@contextlib.contextmanager
def input_gradients_only():
    """Run the enclosed backward as B: deferrable weight gradients are queued, not computed.
    Yields the `DeferredWeightGrads` to run later (its W)."""
    global _collecting
    if _collecting is not None:
        raise RuntimeError("input_gradients_only() does not nest")
    _collecting = DeferredWeightGrads()
    try:
        yield _collecting
    finally:
        _collecting = None


def defer(compute: Callable[[], tuple], params: Iterable[torch.Tensor]) -> bool:
    """Called by a linear layer's backward: queue `compute` (returns one gradient per entry
    of `params`) when a B pass runs and return True, else return False (compute now)."""
    if _collecting is None:
        return False
    _collecting.add(compute, tuple(params))
    return True


def collecting() -> bool:
    """True while a B pass runs."""
    return _collecting is not None


def is_deferred(param: torch.Tensor) -> bool:
    """True while a B pass runs that deferred `param`'s gradient (its AccumulateGrad call in
    B carries nothing)."""
    return _collecting is not None and _collecting.holds(param)
