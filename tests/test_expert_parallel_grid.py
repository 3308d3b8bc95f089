"""Expert parallelism's grid and collectives: the etp x ep x edp groups of
Megatron-Core's expert layout at five layouts of 8 ranks (against hand-written group lists),
the all-to-all with autograd against a reference built from all_gather (uneven and zero
splits), what the comm counter, a trace-like consumer and --debug-collectives see of it, and
the grid's errors. One world of 8 processes answers every multi-process question."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parallel_state as ps
from distributed import run_distributed
from test_parallel_state import _shm_possible

WORLD = 8
H = 3  # hidden size of the exchanged rows
# rows ep rank i sends to ep rank j: rank 0 sends nothing, rank 1 receives nothing
COUNTS4 = [[0, 0, 0, 0],
           [2, 0, 1, 3],
           [1, 0, 2, 0],
           [3, 0, 0, 1]]
COUNTS2 = [[0, 3],
           [2, 0]]  # over a two-rank group: each rank keeps nothing of its own

# Megatron-Core's expert RankGenerator (order tp-ep-dp-pp) at world 8, written out by hand:
# rank = (pp_rank * edp + edp_rank) * ep * etp + ep_rank * etp + etp_rank
SINGLE = [[r] for r in range(WORLD)]
LAYOUTS = {
    "tp2_ep2": (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2), dict(
        sizes=(2, 2, 2), ep=[[0, 2], [1, 3], [4, 6], [5, 7]], etp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        edp=[[0, 4], [1, 5], [2, 6], [3, 7]], etp_ep=[[0, 1, 2, 3], [4, 5, 6, 7]],
        labels=dict(ep="ep", etp="tp", edp="edp", etp_ep="etp-ep"))),
    "tp1_ep4": (dict(tensor_model_parallel_size=1, expert_model_parallel_size=4), dict(
        sizes=(4, 1, 2), ep=[[0, 1, 2, 3], [4, 5, 6, 7]], etp=SINGLE,
        edp=[[0, 4], [1, 5], [2, 6], [3, 7]], etp_ep=[[0, 1, 2, 3], [4, 5, 6, 7]],
        labels=dict(ep="ep", etp="tp", edp="edp", etp_ep="ep"))),
    "tp2_pp2_ep2": (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                         expert_model_parallel_size=2), dict(
        sizes=(2, 2, 1), ep=[[0, 2], [1, 3], [4, 6], [5, 7]], etp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        edp=SINGLE, etp_ep=[[0, 1, 2, 3], [4, 5, 6, 7]],
        labels=dict(ep="ep", etp="tp", edp="edp", etp_ep="etp-ep"))),
    "tp2_ep2_etp1": (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                          expert_tensor_parallel_size=1), dict(
        sizes=(2, 1, 4), ep=[[0, 1], [2, 3], [4, 5], [6, 7]], etp=SINGLE,
        edp=[[0, 2, 4, 6], [1, 3, 5, 7]], etp_ep=[[0, 1], [2, 3], [4, 5], [6, 7]],
        labels=dict(ep="ep", etp="etp", edp="dp", etp_ep="ep"))),  # edp: the dp group's ranks
    "tp1_ep2_etp2": (dict(tensor_model_parallel_size=1, expert_model_parallel_size=2,
                          expert_tensor_parallel_size=2), dict(
        sizes=(2, 2, 2), ep=[[0, 2], [1, 3], [4, 6], [5, 7]], etp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        edp=[[0, 4], [1, 5], [2, 6], [3, 7]], etp_ep=[[0, 1, 2, 3], [4, 5, 6, 7]],
        labels=dict(ep="ep", etp="etp", edp="edp", etp_ep="etp-ep"))),
}
ERRORS = {  # name: initialize_model_parallel kwargs (a world of 8)
    "ep_not_dividing_dp": dict(tensor_model_parallel_size=2, expert_model_parallel_size=3),
    "ep_past_dp": dict(tensor_model_parallel_size=1, expert_model_parallel_size=16),
    "ep_with_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=3,
                         expert_tensor_parallel_size=1),
    "etp_not_dividing": dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=3),
    "ep_zero": dict(expert_model_parallel_size=0),
    "etp_zero": dict(expert_tensor_parallel_size=0),
}


# ----------------------------------------------------------------------------- worker side

def _describe() -> dict:
    from parallel_state import collectives
    from parallel_state.transport import shm

    groups = dict(ep=ps.get_expert_model_parallel_group(),
                  etp=ps.get_expert_tensor_parallel_group(),
                  edp=ps.get_expert_data_parallel_group(),
                  etp_ep=ps.get_expert_tensor_and_model_parallel_group())
    return dict(
        ranks={k: dist.get_process_group_ranks(g) for k, g in groups.items()},
        labels={k: collectives.group_label(g) for k, g in groups.items()},
        channels={k: shm.channel(g) is not None for k, g in groups.items()},
        ep=(ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
        etp=(ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
        edp=(ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()),
        etp_ep=(ps.get_expert_tensor_and_model_parallel_rank(),
                ps.get_expert_tensor_and_model_parallel_world_size()),
        dense=(ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size(),
               ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()),
        pp_group=dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        etp_is_tp=groups["etp"] is ps.get_tensor_model_parallel_group(),
    )


def _gather_rows(t: torch.Tensor, group, rows: list[int]) -> list[torch.Tensor]:
    """Every rank's `t` (rank j's with rows[j] rows), through torch's own all_gather of
    tensors padded to the longest: the reference does not use the code under test."""
    padded = torch.zeros(max(rows), *t.shape[1:], dtype=t.dtype)
    padded[:t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded, group=group)
    return [p[:n] for p, n in zip(parts, rows)]


def _exchange(group, counts, seed: int) -> dict:
    """ps.all_to_all of random rows with `counts[i][j]` rows from rank i to rank j, and a
    weighted sum's gradient, beside the reference from all_gather."""
    n, i = dist.get_world_size(group), dist.get_rank(group)
    send, recv = counts[i], [row[i] for row in counts]
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(sum(send), H, generator=gen, requires_grad=True)
    w = torch.randn(sum(recv), H, generator=gen)
    y = ps.all_to_all(x, recv, send, group)
    (y * w).sum().backward()
    xs = _gather_rows(x.detach(), group, [sum(row) for row in counts])
    ws = _gather_rows(w, group, [sum(counts[k][j] for k in range(n)) for j in range(n)])
    y_ref = torch.cat([xs[j][sum(counts[j][:i]):sum(counts[j][:i + 1])] for j in range(n)])
    grad_ref = torch.cat([ws[j][sum(counts[k][j] for k in range(i)):
                                sum(counts[k][j] for k in range(i + 1))] for j in range(n)])
    with torch.no_grad():
        y_no_grad = ps.all_to_all(x.detach(), recv, send, group)
    return dict(y=y.detach(), y_ref=y_ref, grad=x.grad, grad_ref=grad_ref,
                y_no_grad=y_no_grad, shapes=(tuple(x.shape), tuple(y.shape)))


class _Recorder:
    """What the hang doctor's trace keeps of each call: label, signature, bytes."""

    def __init__(self):
        self.calls = []

    def start(self, call):
        self.calls.append((call.label, call.signature(), call.nbytes))

    def end(self, call, error):
        pass


def _all_to_all_suite() -> dict:
    """At tp1 ep4: the exchanges, the comm counter, a recorder, --debug-collectives."""
    from parallel_state import collectives
    from parallel_state.comm_counter import CommCounter
    from parallel_state.hang_doctor import debug_collectives

    group, i = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_rank()
    send, recv = COUNTS4[i], [row[i] for row in COUNTS4]
    out = {"uneven": _exchange(group, COUNTS4, 0),
           "empty": _exchange(group, [[0] * 4] * 4, 1),  # nobody sends anything
           "even": _exchange(group, [[2] * 4] * 4, 2)}
    x = torch.arange(8 * H, dtype=torch.float32).view(8, H) + 100 * dist.get_rank()
    out["even_none"] = (ps.all_to_all(x, None, None, group),
                        ps.all_to_all(x, [2] * 4, [2] * 4, group))
    # observed: a counter and a recorder; forward + backward, and torch's async form
    counter, recorder = CommCounter().begin(), _Recorder()
    collectives.add_consumer(recorder)
    x = torch.ones(sum(send), H, requires_grad=True)
    ps.all_to_all(x, recv, send, group).sum().backward()
    y = torch.empty(sum(recv), H)
    collectives.all_to_all_single(y, torch.ones(sum(send), H), recv, send, group=group,
                                  async_op=True).wait()
    collectives.remove_consumer(recorder)
    out["counts"], out["calls"] = counter.stop(), recorder.calls
    out["async"] = y
    # --debug-collectives: uneven splits pass; a real disagreement (dtype) still raises
    debug_collectives.enable()
    try:
        out["debug"] = _exchange(group, COUNTS4, 3)
        bad = torch.ones(sum(send), H, dtype=torch.float64 if i == 0 else torch.float32)
        try:
            ps.all_to_all(bad, recv, send, group)
            out["debug_mismatch"] = None
        except debug_collectives.CollectiveMismatchError as e:
            out["debug_mismatch"] = str(e)
        out["debug_after"] = _exchange(group, COUNTS4, 4)  # the group still works
    finally:
        debug_collectives.disable()
    # bad split lists: every rank raises before any communication
    out["bad_splits"] = {
        "count": _raised(ps.all_to_all, torch.ones(3, H), [1, 1, 1], [1, 1, 1, 0], group),
        "sum": _raised(ps.all_to_all, torch.ones(3, H), [1, 1, 1, 0], [1, 1, 1, 1], group),
        "negative": _raised(ps.all_to_all, torch.ones(0, H), [0] * 4, [1, -1, 0, 0], group),
        "even": _raised(ps.all_to_all, torch.ones(3, H), None, None, group)}
    return out


def _raised(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except (ps.GridError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _suite() -> dict:
    out = {"errors": {}}
    ps.destroy_model_parallel()
    for name, kwargs in ERRORS.items():
        out["errors"][name] = _raised(ps.initialize_model_parallel, device="cpu", **kwargs)
    out["grid_after_errors"] = ps.model_parallel_is_initialized()
    for name, (kwargs, _) in LAYOUTS.items():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(device="cpu", **kwargs)
        out[name] = _describe()
        if name == "tp1_ep4":
            out["all_to_all"] = _all_to_all_suite()
        if name == "tp2_ep2":  # the etp group is the tp group, with its shared-memory channel
            out["on_tp_group"] = _exchange(ps.get_expert_tensor_parallel_group(), COUNTS2, 5)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, device="cpu")  # no expert sizes: ep 1, etp = tp
    out["default"] = _describe()
    return out


@pytest.fixture(scope="module")
def expert8():
    return run_distributed(_suite, WORLD, timeout=240)


# ----------------------------------------------------------------------------- expectations

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_groups_follow_megatron_layout(expert8, layout):
    kwargs, want = LAYOUTS[layout]
    ep, etp, edp = want["sizes"]
    for rank, r in enumerate(g[layout] for g in expert8):
        tp, dp, pp, pp_rank = r["dense"]
        assert dp * tp == edp * ep * etp and pp == kwargs.get("pipeline_model_parallel_size", 1)
        for name in ("ep", "etp", "edp", "etp_ep"):
            ranks = r["ranks"][name]
            assert ranks in want[name] and rank in ranks, (layout, rank, name, ranks)
            assert r[name] == (ranks.index(rank), len(ranks)), (layout, rank, name, r[name])
            assert r["labels"][name] == want["labels"][name], (layout, rank, name, r["labels"])
        (ep_rank, _), (etp_rank, _), (edp_rank, _) = r["ep"], r["etp"], r["edp"]
        assert rank == (pp_rank * edp + edp_rank) * ep * etp + ep_rank * etp + etp_rank
        stage = set(range(pp_rank * dp * tp, (pp_rank + 1) * dp * tp))  # inside one stage
        assert all(set(r["ranks"][n]) <= stage for n in ("ep", "etp", "edp", "etp_ep")), rank
        assert r["etp_is_tp"] == (etp == tp), rank


def test_expert_groups_shared_memory_channels(expert8):
    """New reduction groups (etp, edp) of more than one rank get a channel; the ep group never
    (its all-to-all is not one the channel runs); a reused dense group keeps its own."""
    if not _shm_possible():
        pytest.skip("no shared-memory channels here (not x86-64 Linux, or /dev/shm < 256 MB)")
    for rank in range(WORLD):
        assert expert8[rank]["tp2_ep2"]["channels"] == dict(ep=False, etp=True, edp=True,
                                                            etp_ep=False), rank
        assert expert8[rank]["tp1_ep2_etp2"]["channels"] == dict(ep=False, etp=True, edp=True,
                                                                 etp_ep=False), rank
        assert expert8[rank]["tp2_ep2_etp1"]["channels"]["edp"], rank  # the dp group's


def test_default_expert_layout_is_the_dense_one(expert8):
    for rank, r in enumerate(g["default"] for g in expert8):
        assert r["ep"] == (0, 1) and r["ranks"]["ep"] == [rank], rank
        assert r["etp_is_tp"] and r["etp"] == (rank % 2, 2), rank
        assert r["ranks"]["edp"] == [rank % 2 + k for k in (0, 2, 4, 6)], rank  # the dp group
        assert r["labels"]["edp"] == "dp" and r["labels"]["etp_ep"] == "tp", rank


def _assert_exchange(case, where):
    assert torch.equal(case["y"], case["y_ref"]), where
    assert torch.equal(case["y_no_grad"], case["y_ref"]), where
    assert case["grad"] is not None and torch.equal(case["grad"], case["grad_ref"]), where


def test_all_to_all_matches_all_gather_reference(expert8):
    for rank, g in enumerate(expert8):
        a = g["all_to_all"]
        for name in ("uneven", "empty", "even", "debug", "debug_after"):
            _assert_exchange(a[name], (rank, name))
        i = rank % 4
        assert a["uneven"]["shapes"] == ((sum(COUNTS4[i]), H), (sum(r[i] for r in COUNTS4), H))
        assert a["empty"]["shapes"] == ((0, H), (0, H)), rank
        torch.testing.assert_close(*a["even_none"], rtol=0, atol=0)
        assert torch.equal(a["async"], torch.ones(sum(r[i] for r in COUNTS4), H)), rank
        _assert_exchange(g["on_tp_group"], (rank, "on the tp group"))
    assert expert8[0]["all_to_all"]["uneven"]["shapes"][0] == (0, H)  # sends nothing
    assert expert8[1]["all_to_all"]["uneven"]["shapes"][1] == (0, H)  # receives nothing


def test_all_to_all_is_observed_with_bytes_sent(expert8):
    for rank, g in enumerate(expert8):
        a, i = g["all_to_all"], rank % 4
        sent, received = sum(COUNTS4[i]) * H * 4, sum(r[i] for r in COUNTS4) * H * 4
        # forward sends x, backward sends y's gradient, then the async call sends x again
        assert a["counts"] == {("ep", "all_to_all_single"): (3, 2 * sent + received)}, rank
        assert a["calls"] == [("ep", "all_to_all_single float32[*, 3]", n)
                              for n in (sent, received, sent)], rank


def test_debug_collectives_allows_uneven_splits_but_not_dtypes(expert8):
    for rank, g in enumerate(expert8):
        msg = g["all_to_all"]["debug_mismatch"]
        assert msg and "disagree" in msg and "group ep" in msg, (rank, msg)
        assert "all_to_all_single float64[*, 3]" in msg and "float32[*, 3]" in msg, msg


def test_all_to_all_bad_splits(expert8):
    e = expert8[0]["all_to_all"]["bad_splits"]
    assert "output_split_sizes must be 4 non-negative ints" in e["count"], e
    assert "input_split_sizes [1, 1, 1, 1] sum to 4, but the input has 3 rows" in e["sum"], e
    assert "input_split_sizes must be 4 non-negative ints" in e["negative"], e
    assert "dim 0 (3) divisible by the group size 4" in e["even"], e
    assert all(g["all_to_all"]["bad_splits"] == e for g in expert8)


def test_expert_grid_errors_name_the_fix(expert8):
    e = expert8[0]["errors"]
    assert e["ep_not_dividing_dp"] == (
        "GridError: --expert-model-parallel-size 3 must divide the data-parallel size "
        "(4 = world 8 / (tp 2 x pp 1)): the expert-parallel ranks are carved out of the "
        "data-parallel ranks of each pipeline stage; use one of 1, 2, 4, or launch a multiple "
        "of 6 processes")
    assert "--expert-model-parallel-size 16 must divide the data-parallel size (8" in \
        e["ep_past_dp"] and "use one of 1, 2, 4, 8," in e["ep_past_dp"], e["ep_past_dp"]
    assert ("x tensor-model-parallel-size 2 / expert-tensor-parallel-size 1 = 8" in
            e["ep_with_etp1"] and "multiple of 6 processes" in e["ep_with_etp1"]), e
    assert "--expert-tensor-parallel-size 3 must divide the 8 ranks of a pipeline stage" in \
        e["etp_not_dividing"], e
    for key in ("ep_zero", "etp_zero"):
        assert "expert parallel sizes must be >= 1" in e[key] and "1 turns either off" in e[key]
    assert not expert8[0]["grid_after_errors"]  # checked before any group was made
    assert all(g["errors"] == e for g in expert8)


def test_expert_getters_without_a_grid(no_grid):
    assert ps.get_expert_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_rank() == 0
    assert ps.get_expert_tensor_parallel_world_size() == 1 and ps.get_expert_data_parallel_rank() == 0
    assert ps.get_expert_tensor_and_model_parallel_world_size() == 1
    for getter in (ps.get_expert_model_parallel_group, ps.get_expert_tensor_parallel_group,
                   ps.get_expert_data_parallel_group,
                   ps.get_expert_tensor_and_model_parallel_group):
        with pytest.raises(ps.GridError, match="initialize_model_parallel"):
            getter()
