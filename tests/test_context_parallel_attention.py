"""Context-parallel attention (issue 32): layers/context_parallel/.

- layout: the 2*cp-chunk split and its global positions are a partition of the sequence
  whose inverse restores it, at cp 1, 2, 4; the errors for a length not divisible by 2*cp
  and a rank outside the group name the flag.
"""
from __future__ import annotations

import pytest
import torch

from layers.context_parallel import local_positions, split_for_context_parallel


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_and_positions_invert(cp):
    s = 8 * cp
    x = torch.randn(3, s, 5)
    parts = [split_for_context_parallel(x, 1, cp, r) for r in range(cp)]
    positions = [local_positions(s, cp, r) for r in range(cp)]
    assert all(p.shape == (3, s // cp, 5) for p in parts)
    for r in range(cp):  # the positions are those of the rank's tokens, in its local order
        assert torch.equal(parts[r], x[:, positions[r]])
        assert torch.equal(positions[r], split_for_context_parallel(torch.arange(s), 0, cp, r))
    everything = torch.cat(positions)
    assert torch.equal(everything.sort().values, torch.arange(s))  # a partition
    restored = torch.empty_like(x)
    restored[:, everything] = torch.cat(parts, dim=1)
    assert torch.equal(restored, x)
    # causal load balance: every rank's queries see the same number of (query, key) pairs
    work = {int((positions[r] + 1).sum()) for r in range(cp)}
    assert len(work) == 1, work


def test_layout_errors_name_the_flag():
    with pytest.raises(ValueError, match="context-parallel-size = 8"):
        split_for_context_parallel(torch.zeros(2, 12), 1, 4, 0)
    with pytest.raises(ValueError, match="not divisible by 2 x --context-parallel-size"):
        local_positions(10, 2, 0)
    with pytest.raises(ValueError, match="outside 0..1"):
        local_positions(8, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        local_positions(8, 0, 0)
