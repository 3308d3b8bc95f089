"""Steps whose loss or gradient norm is not finite are not applied (Megatron's
--check-for-nan-in-loss-and-grad, on by default).

After the backward and the gradient norm (a global all-reduce, so every rank sees the same
value) and the global loss (summed over the pipeline and data-parallel groups, likewise the
same everywhere), a step whose loss or norm is NaN or infinite skips the optimizer. The norm
counts a TP-replicated parameter's gradient on one TP rank only (and a pipeline copy on one
stage), so each rank also checks the few gradients it holds that the norm does not count, and
the world agrees on the verdict (one all-reduce of two floats per rank: whether its local
loss sum is finite, and bits of what else it saw not finite: its loss, its norm, a gradient
outside the norm): a value that is not finite on any rank skips the step everywhere. Under
DiLoCo (training/diloco.py) there is no per-step gradient all-reduce, so the loss and norm
are each replica's own: the same exchange makes a NaN gradient on one replica skip the step
on all of them (and, unchecked, stop them all), so the ranks never reach different
collectives. Skipping: weights,
Adam moments and the step count stay as they were; the data of the step is consumed (the
next step reads the next samples, as Megatron does after an fp16 overflow) and the learning
rate schedule follows the iteration. The log line of the step says what was not finite.
After `--max-skipped-iters` consecutive skipped steps the run stops with `NonFiniteError`:
nothing is saved (the last checkpoint written stays the newest and `latest`), so the same
command, or one with a lower --lr, resumes from good weights.

With `--no-check-for-nan-in-loss-and-grad` a step is applied whatever its norm, and a
non-finite loss or norm stops the run with `NonFiniteError` right after the step (weights may
be NaN; nothing is saved from it).

Test hook: `SHARDZOO_TEST_NONFINITE="grad:3,4 loss:7"` makes the gradient (of one parameter on
the last rank, in its backward: before the data-parallel reduction, as a bad sample would) or
the loss sum (on the last rank) NaN at those iterations (1-based).
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

import parallel_state as ps
from parallel_state import collectives

from data_parallel.grad_norm import counts_toward_norm

TEST_ENV = "SHARDZOO_TEST_NONFINITE"


class NonFiniteError(FloatingPointError):
    """Training cannot go on: too many consecutive non-finite steps (or one, unchecked)."""


class StepGuard:
    """Decides whether a step is applied, and stops the run after too many skipped ones.

    Every input of the verdict goes through one all-reduce over the world (`_exchange`), so
    every rank reaches the same verdict whatever it saw itself: under synchronous data
    parallelism the loss and norm are already the same everywhere, under DiLoCo
    (`replica_local`) each replica has its own, and a NaN gradient on one replica must skip
    the step on all of them (the ranks would otherwise reach different collectives).

    Args:
        enabled: --check-for-nan-in-loss-and-grad.
        max_skipped: --max-skipped-iters (consecutive skipped steps that stop the run; 0:
            never stop).
        replica_local: the loss and gradient norm are a data-parallel replica's own
            (DiLoCo), so even unchecked the world exchanges them to stop together.
    """

    def __init__(self, enabled: bool, max_skipped: int, replica_local: bool = False):
        self.enabled, self.max_skipped = enabled, max_skipped
        self.exchange = enabled or replica_local
        self.consecutive = 0

    def not_finite(self, loss: float, grad_norm: float, grads: list[torch.Tensor],
                   local_loss: torch.Tensor) -> str | None:
        """What was not finite in this step (e.g. "grad norm is NaN", "grad norm not
        finite on rank(s) [1]"), the same string on every rank, or None. `loss`: the loss as
        this rank sees it (global, or its replica's under DiLoCo); `local_loss`: this rank's
        loss sum before the reductions (so the text names the ranks where a loss went bad,
        not those it was summed into); `grad_norm`: the norm as this rank sees it; `grads`:
        the gradients this rank holds that the norm does not count (`grads_outside_norm`).
        Collective over the world (when checked, or `replica_local`); unchecked and
        synchronous, every value is already global and nothing is exchanged."""
        if not self.exchange:  # every value is global: this rank's view is everyone's
            return _verdicts([0], [_bits(loss, grad_norm)])
        return _verdicts(*_exchange(local_loss, loss, grad_norm, grads))

    def skip_reason(self, not_finite: str | None) -> str | None:
        """Why this step must not be applied (`not_finite`'s text), or None to apply it."""
        return not_finite if self.enabled else None

    def record(self, reason: str | None) -> int:
        """Count a step (`reason`: why it was skipped, None if applied); returns the skipped
        steps in a row, this one included."""
        self.consecutive = self.consecutive + 1 if reason is not None else 0
        return self.consecutive

    def stop_if_needed(self, iteration: int, reason: str | None,
                       not_finite: str | None) -> None:
        """After `record`: raises `NonFiniteError` when the run must stop at 1-based
        `iteration`: `max_skipped` consecutive skipped steps, or (unchecked) a step where
        something was `not_finite`, before anything is saved from it. The same on every
        rank (its inputs are)."""
        if not self.enabled:
            if not_finite is not None:
                raise NonFiniteError(
                    f"{not_finite} at iteration {iteration} and the step was applied "
                    f"(--no-check-for-nan-in-loss-and-grad), so the weights may be NaN; "
                    f"nothing was saved from it. Resume from the last checkpoint with a lower "
                    f"--lr, or drop that flag so that such steps are skipped")
            return
        if reason is not None and self.max_skipped and self.consecutive >= self.max_skipped:
            raise NonFiniteError(
                f"{self.consecutive} consecutive steps skipped (iterations "
                f"{iteration - self.consecutive + 1}..{iteration}; the last: {reason}); "
                f"stopping without saving, so the newest checkpoint holds the last good "
                f"weights. Resume from it with a lower --lr (or --clip-grad), look for bad "
                f"samples around these iterations, or raise --max-skipped-iters")


def grads_outside_norm(optimizer, params) -> list[torch.Tensor]:
    """The gradients this rank applies that the global norm does not count
    (`optimizer.counts_toward_norm`: TP-replicated ones off TP rank 0, pipeline copies): the
    distributed optimizer's owned ranges outside its norm ranges, else those parameters'
    `.grad`. Every other gradient makes the norm non-finite when it is."""
    shards = getattr(optimizer, "shards", None)
    if shards is not None:
        return [s.grad[a:b] for s in shards for a, b in s.outside_norm]
    return [p.grad for p in params if p.grad is not None and not counts_toward_norm(p)]


# what a rank saw not finite, as bits of one float (exact up to 2^24)
_LOSS_NAN, _LOSS_INF, _NORM_NAN, _NORM_INF, _OUTSIDE = 1, 2, 4, 8, 16


def _bits(loss: float, grad_norm: float) -> int:
    """The `_LOSS_*` and `_NORM_*` bits of this rank's view of the loss and gradient norm."""
    return sum(bit for v, bits in ((loss, (_LOSS_NAN, _LOSS_INF)),
                                   (grad_norm, (_NORM_NAN, _NORM_INF)))
               for bit, hit in zip(bits, (math.isnan(v), math.isinf(v))) if hit)


def _exchange(local_loss: torch.Tensor, loss: float, grad_norm: float,
              grads: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """(per global rank: 1 if its local loss sum is NaN or infinite, else 0; per rank: the
    bits of what else it saw not finite: its view of the loss and of the norm, `_OUTSIDE`
    for a gradient outside the norm), the same lists on every rank. One all-reduce (sum) of
    2 floats per rank, each rank writing only its own column."""
    grads = [g for g in grads if g.numel()]
    device = grads[0].device if grads else ps.get_device()
    flags = torch.zeros(2, dist.get_world_size(), dtype=torch.float32, device=device)
    rank = dist.get_rank()
    flags[0, rank] = (~torch.isfinite(local_loss.detach().float())).float()
    flags[1, rank] = _bits(loss, grad_norm)
    if grads:
        local = torch.stack(torch._foreach_norm(grads)).sum()
        flags[1, rank] += _OUTSIDE * (~torch.isfinite(local)).float()
    collectives.all_reduce(flags)
    flags = flags.cpu().int()
    return flags[0].tolist(), flags[1].tolist()


def _verdicts(loss_flags: list[int], bits: list[int]) -> str | None:
    """What was not finite, from `_exchange`'s lists (the same text on every rank), or None."""
    def ranks(mask: int) -> list[int]:
        return [r for r, b in enumerate(bits) if b & mask]

    bad = []
    loss_ranks = [r for r, f in enumerate(loss_flags) if f]
    if loss_ranks:
        bad.append(f"loss not finite on rank(s) {loss_ranks}")
    elif ranks(_LOSS_NAN | _LOSS_INF):  # finite on every rank, a sum that overflowed
        bad.append(_verdict("loss", [b & (_LOSS_NAN | _LOSS_INF) for b in bits], _LOSS_NAN))
    if ranks(_NORM_NAN | _NORM_INF):
        bad.append(_verdict("grad norm", [b & (_NORM_NAN | _NORM_INF) for b in bits],
                            _NORM_NAN))
    elif ranks(_OUTSIDE):
        bad.append(f"a gradient on rank(s) {ranks(_OUTSIDE)} is not finite")
    return " and ".join(bad) or None


def _verdict(what: str, seen: list[int], nan: int) -> str:
    """`what` is not finite somewhere; `seen`: per rank its NaN or inf bit (`nan`: the NaN
    one), 0 when finite. "grad norm is NaN" when every rank saw the same (a global value),
    else the ranks that saw one (DiLoCo: a replica's own)."""
    if len(set(seen)) == 1:
        return f"{what} is {'NaN' if seen[0] == nan else 'infinite'}"
    return f"{what} not finite on rank(s) {[r for r, b in enumerate(seen) if b]}"


def _test_iterations(kind: str) -> set[int]:
    spec = os.environ.get(TEST_ENV, "")
    out = set()
    for part in spec.split():
        name, _, its = part.partition(":")
        if name == kind:
            out.update(int(i) for i in its.split(",") if i)
    return out


def _last_rank_at(iteration: int, kind: str) -> bool:
    return os.environ.get(TEST_ENV) is not None and iteration in _test_iterations(kind) and \
        dist.get_rank() == dist.get_world_size() - 1


def inject_grad_for_test(iteration: int, params) -> list:
    """The test hook's gradient: a hook that makes the gradient of this rank's last parameter
    NaN in the coming backward. Returns the hook handles to remove after it."""
    if not _last_rank_at(iteration, "grad"):
        return []
    return [params[-1].register_hook(lambda g: g + float("nan"))]


def inject_loss_for_test(iteration: int, loss_sum: torch.Tensor) -> torch.Tensor:
    """The test hook's loss: NaN added to the last rank's loss sum at `iteration`."""
    return loss_sum + float("nan") if _last_rank_at(iteration, "loss") else loss_sum
