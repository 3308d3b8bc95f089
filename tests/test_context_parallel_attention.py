"""Context-parallel attention: layers/context_parallel/.

- layout: the 2*cp-chunk split and its global positions are a partition of the sequence
  whose inverse restores it, at cp 1, 2, 4; the errors for a length not divisible by 2*cp
  and a rank outside the group name the flag;
- attention dropout at global positions: a block draws the whole matrix's masks there;
- the block plan: every visible (query, key) pair computed exactly once, no block whose
  pairs are all masked, the documented halves of the causal ring steps;
- one 4-rank gloo world: outputs and the gradients of q, k, v at cp 2 (two groups of 2 with
  their own inputs and samples) and cp 4, ring ("p2p") and "all_gather", equal to one
  process's core_attention on the whole sequence to the float32 tolerance: MHA, GQA (g 2)
  and MQA (g 1), attention dropout 0.1 keyed by sample (the backward outside the sample ids'
  scope), a sliding window inside a chunk and one spanning chunks, soft-capping, a scale;
  attention sinks (gpt-oss) with dropout and with a window: output and the gradients of q,
  k, v and the sinks (summed over the group) against autograd of one process's float64
  core_attention, whose sink is checked against a written-out softmax([scores, sink]) in
  tests/test_hf_gpt_oss.py;
- the argument errors, before any communication.
"""
from __future__ import annotations

import pytest
import torch

import parallel_state as ps
from distributed import run_distributed
from layers.context_parallel import (context_parallel_attention, local_positions,
                                     split_for_context_parallel)
from layers.context_parallel.blocks import plan_blocks, visible
from layers.context_parallel.layout import chunk_ranges
from tolerances import fp32_mismatch

B, N, S, D = 2, 4, 32, 8  # chunks of 8 tokens at cp 2, of 4 at cp 4
CASES = {  # name -> (KV heads g, keyword arguments)
    "mha": (4, {}),
    "gqa-dropout": (2, dict(dropout_p=0.1, dropout_site=12345)),
    "mqa-window-in-chunk": (1, dict(window_size=(2, 0))),
    "gqa-window-spans-chunks-softcap": (2, dict(window_size=(11, 0), softcap=3.0)),
    "mha-all": (4, dict(window_size=(5, 0), softcap=2.0, dropout_p=0.1, scale=0.5)),
    "gqa-sinks-dropout": (2, dict(sinks=True, dropout_p=0.1, dropout_site=777)),
    "mha-sinks-window-softcap": (4, dict(sinks=True, window_size=(5, 0), softcap=3.0)),
}
SAMPLES = (torch.tensor([5, 9]), torch.tensor([11, 2]))  # the two cp-2 groups' batches


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


@pytest.mark.parametrize("window", [None, 0, 2, 11, 40])
def test_block_plan_covers_visible_pairs_once(window):
    for cp in (1, 2, 4):
        for r in range(cp):
            qpos = local_positions(S, cp, r)
            ring = [(local_positions(S, cp, j), chunk_ranges(S, cp, j)) for j in range(cp)]
            gathered = [(torch.arange(S), [range(S)])]  # all_gather's keys, global order
            for holders in (ring, gathered):
                covered = torch.zeros(S // cp, S, dtype=torch.int64)
                for kpos, chunks in holders:
                    for block in plan_blocks(chunk_ranges(S, cp, r), chunks, window):
                        vis = visible(qpos[block.rows], kpos[block.cols], window)
                        assert vis.any(), (cp, r, block)  # no fully masked block
                        assert not block.full or vis.all(), (cp, r, block)
                        covered[block.rows, kpos[block.cols]] += vis.long()
                assert torch.equal(covered, visible(qpos, torch.arange(S), window).long())
    # the halves of the causal ring steps (blocks.plan_blocks' docstring), cp 4, rank 2
    L, mine = S // 8, chunk_ranges(S, 4, 2)
    early, late = plan_blocks(mine, chunk_ranges(S, 4, 0), None), \
        plan_blocks(mine, chunk_ranges(S, 4, 3), None)
    assert [(b.rows, b.cols, b.full) for b in early] == [(slice(0, 2 * L), slice(0, L), True)]
    assert [(b.rows, b.cols, b.full) for b in late] == [(slice(L, 2 * L), slice(0, 2 * L), True)]
    diagonal = plan_blocks(mine, mine, None)
    assert [(b.rows, b.cols, b.full) for b in diagonal] == [
        (slice(0, L), slice(0, L), False), (slice(L, 2 * L), slice(0, 2 * L), False)]


def test_attention_dropout_at_global_positions(no_grid):
    """A block of scores at given global positions draws the full matrix's masks there."""
    from layers.dropout import attention_dropout

    full = torch.rand(2, 3, S, S)
    qpos, kpos = local_positions(S, 4, 1), torch.tensor([0, 5, 6, 30, 31])
    with ps.dropout_sample_ids(torch.tensor([7, 2 ** 40 + 1])):
        whole = attention_dropout(full, 0.3, 99)
        part = attention_dropout(full[:, :, qpos][:, :, :, kpos], 0.3, 99, qpos, kpos, S)
        assert torch.equal(part, whole[:, :, qpos][:, :, :, kpos])
        assert not torch.equal(part, attention_dropout(full[:, :, qpos][:, :, :, kpos], 0.3, 99))
    with pytest.raises(ValueError, match="--dropout-masks sample"):
        attention_dropout(full, 0.3, 99, qpos, kpos, S)  # no sample ids: stream masks


def test_argument_errors_before_communication(no_grid):
    q, kv = torch.zeros(2, 4, 8, 8), torch.zeros(2, 2, 8, 8)
    cases = [
        (dict(comm_type="ulysses"), "--cp-comm-type must be one of"),
        (dict(window_size=(4, 1)), "window_size must be"),
        (dict(dropout_p=1.0), r"\[0, 1\)"),
        (dict(softcap=0.0), "softcap must be positive"),
        (dict(dropout_p=0.1), "--dropout-masks sample"),  # no sample ids set
        (dict(sinks=torch.zeros(2)), r"one logit per query head, \[4\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            context_parallel_attention(q, kv, kv, group=None, **kwargs)
    with pytest.raises(ValueError, match="do not fit"):
        context_parallel_attention(torch.zeros(2, 3, 8, 8), kv, kv, group=None)
    with pytest.raises(ValueError, match="two equal chunks"):
        context_parallel_attention(torch.zeros(2, 4, 7, 8), torch.zeros(2, 2, 7, 8),
                                   torch.zeros(2, 2, 7, 8), group=None)
    with pytest.raises(ValueError, match="one shape"):
        context_parallel_attention(q, kv, torch.zeros(2, 2, 8, 4), group=None)
    with ps.dropout_sample_ids(torch.tensor([1, 2, 3])), \
            pytest.raises(ValueError, match="3 sample ids for a batch of 2"):
        context_parallel_attention(q, kv, kv, group=None, dropout_p=0.1)


def _inputs(g: int, seed: int):
    """q, k, v, dL/dout and the sinks `[N]` (logits around the scores' size, so the sink
    takes a real share of each row)."""
    gen = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(B, N, S, D, generator=gen)
    k, v = (1.5 * torch.randn(B, g, S, D, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(B, N, S, D, generator=gen), 2 * torch.randn(N, generator=gen)


def _dense(q, k, v, w, sinks, kwargs, ids):
    """One process: core_attention on the whole sequence, and the gradients of q, k, v (and
    of the sinks, when the case has them: then in float64, the reference of the sink's
    merge and gradient)."""
    from layers.attention import causal_window_mask, core_attention

    wide = torch.float64 if kwargs.get("sinks") else q.dtype
    q, k, v, w, sinks = (t.to(wide) for t in (q, k, v, w, sinks))
    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    window = kwargs.get("window_size")
    mask = causal_window_mask(torch.arange(S), S, window) if window else None
    with ps.dropout_sample_ids(ids):
        out = core_attention(q, k, v, mask, None, kwargs.get("scale"),
                             kwargs.get("dropout_p", 0.0), causal=mask is None,
                             dropout_site=kwargs.get("dropout_site", 0),
                             softcap=kwargs.get("softcap"),
                             sinks=sinks if kwargs.get("sinks") else None)
    out.backward(w)
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)] + \
        [sinks.grad.float() if kwargs.get("sinks") else None]


def _context_parallel_cases():
    """This rank's {case: (max |diff| per tensor, tolerance problems)}, every case at cp 2
    (groups [0, 1], [2, 3]) and cp 4, both comm types."""
    import torch.distributed as dist
    from parallel_state import collectives

    rank = dist.get_rank()
    pairs = [collectives.new_group([0, 1]), collectives.new_group([2, 3])]
    world = collectives.new_group([0, 1, 2, 3])
    results = {}
    for cp, group, cp_rank, half in ((2, pairs[rank // 2], rank % 2, rank // 2),
                                     (4, world, rank, 0)):
        ids = SAMPLES[half]
        for name, (g, kwargs) in CASES.items():
            q, k, v, w, z = _inputs(g, seed=100 * half + len(name))
            expected = _dense(q, k, v, w, z, kwargs, ids)
            part = [split_for_context_parallel(t, 2, cp, cp_rank) for t in (q, k, v, w)]
            for comm in ("p2p", "all_gather"):
                ql, kl, vl, zl = (t.clone().requires_grad_() for t in (*part[:3], z))
                with ps.dropout_sample_ids(ids):
                    out = context_parallel_attention(
                        ql, kl, vl, group=group, comm_type=comm,
                        **{**kwargs, "sinks": zl if kwargs.get("sinks") else None})
                out.backward(part[3])  # outside the ids' scope: the saved keys redraw masks
                k_forward = D + 2 * S  # scores over d, softmax and AV over s
                k_grad = 2 * k_forward + N // g * S  # + dK/dV sum over the group's queries
                names, actuals = ["out", "dq", "dk", "dv"], [out, ql.grad, kl.grad, vl.grad]
                if kwargs.get("sinks"):  # each rank's queries' part, summed over the group
                    dz = zl.grad.clone()
                    dist.all_reduce(dz, group=group)
                    names.append("dsinks")
                    actuals.append(dz)
                diffs, problems = {}, []
                for what, actual, full, terms in zip(
                        names, actuals, expected,
                        (k_forward, k_grad, k_grad, k_grad, k_grad + B * S)):
                    ref = full if what == "dsinks" else \
                        split_for_context_parallel(full, 2, cp, cp_rank)
                    diffs[what] = float((actual.detach() - ref).abs().max())
                    problem = fp32_mismatch(actual, ref, terms)
                    if problem:
                        problems.append(f"{what}: {problem}")
                results[f"cp{cp} {comm} {name}"] = (diffs, problems)
    return results


def test_context_parallel_attention_equals_one_process():
    per_rank = run_distributed(_context_parallel_cases, 4)
    failures = [f"rank {r} {case}: {p}" for r, res in enumerate(per_rank)
                for case, (_, problems) in res.items() for p in problems]
    measured = []  # the largest differences over the ranks, shown only with a failure
    for case in per_rank[0]:
        worst = {w: max(res[case][0][w] for res in per_rank) for w in per_rank[0][case][0]}
        measured.append(f"{case}: " + " ".join(f"{w} {d:.2e}" for w, d in worst.items()))
    assert not failures, "\n".join(failures + ["measured:"] + measured)
    assert len(per_rank[0]) == 2 * 2 * len(CASES)
