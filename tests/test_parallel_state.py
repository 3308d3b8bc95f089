"""The process grid (ranks, groups, stages, errors), the TP-aware RNG tracker, and the model
config's TP checks. One world of 8 processes answers every multi-process question."""
from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

import parallel_state as ps
from distributed import run_distributed
from models import ConfigError, GPTModel, ModelConfig
from parallel_state.random import MODEL_PARALLEL_RNG, RNGStatesTracker

WORLD = 8


# ----------------------------------------------------------------------------- worker side

def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _describe() -> dict:
    return dict(
        tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        dp=(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        pp=(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        tp_group=_ranks(ps.get_tensor_model_parallel_group()),
        dp_group=_ranks(ps.get_data_parallel_group()),
        pp_group=_ranks(ps.get_pipeline_model_parallel_group()),
        mp_group=_ranks(ps.get_model_parallel_group()),
        embedding_group=_ranks(ps.get_embedding_group()),
        first=ps.is_pipeline_first_stage(), last=ps.is_pipeline_last_stage(),
        next=ps.get_pipeline_model_parallel_next_rank(),
        prev=ps.get_pipeline_model_parallel_prev_rank(),
    )


def _error(fn, *args) -> str | None:
    try:
        fn(*args)
    except (ps.GridError, ConfigError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _raised(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _rng_draws() -> dict:
    """Megatron's scheme (dropout without sample ids): masks from the tracker's default and TP
    streams, the process's own generator untouched by both, and an exact replay."""
    from layers.dropout import hidden_dropout

    ps.model_parallel_seed(1234, ps.get_tensor_model_parallel_rank(),
                           ps.get_pipeline_model_parallel_rank())
    tracker, x = ps.get_rng_tracker(), torch.ones(8, 1, 32)
    before = torch.get_rng_state()
    default_mask = hidden_dropout(x, 0.5, True, site=0, sequence_parallel=False) != 0
    states = tracker.get_states()
    tp_mask = hidden_dropout(x, 0.5, True, site=0, sequence_parallel=True) != 0
    default_untouched = torch.equal(torch.get_rng_state(), before)
    advanced = not torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], states[MODEL_PARALLEL_RNG])
    tracker.set_states(states)  # recompute: replay the region exactly
    replay = hidden_dropout(x, 0.5, True, site=0, sequence_parallel=True) != 0
    return dict(default=default_mask, tp=tp_mask, replay_equal=torch.equal(replay, tp_mask),
                default_untouched=default_untouched, tp_stream_advanced=advanced)


def _shm_collectives() -> dict:
    """Each collective on the tp4 group's shared-memory channel against gloo (dist.* on the
    same group), with the default slots and with 256-byte slots (many pieces), contiguous and
    strided tensors, four dtypes."""
    from parallel_state import collectives
    from parallel_state.transport import shm, shm_setup

    group = ps.get_tensor_model_parallel_group()
    ch = shm.channel(group)
    out = {"channel": ch is not None,
           "dp_channel": shm.channel(ps.get_data_parallel_group()) is not None,  # dp 2
           "pp_channel": shm.channel(ps.get_pipeline_model_parallel_group()) is not None,
           "peers_known": ch is not None and len(ch._pids) == 4 and None not in ch._pids}
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    cases = {}
    for slots in ("default", "small"):
        if slots == "small":
            shm_setup.attach(group, slot_bytes=256)
        for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
            x = (torch.randn(33, 17, generator=gen) * 100).to(dtype)
            strided = x.t()  # not contiguous
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                mine, ref = strided.clone().t().t(), strided.clone()  # both strided
                handle = collectives.all_reduce(mine, op=op, group=group, async_op=True)
                handle.wait()
                dist.all_reduce(ref, op=op, group=group)
                cases[f"{slots} all_reduce {dtype} {op}"] = (mine, ref)
            parts = [torch.empty(17, 33, dtype=dtype).t() for _ in range(4)]  # strided outputs
            collectives.all_gather(parts, x, group=group)
            ref = [torch.empty_like(x) for _ in range(4)]
            dist.all_gather(ref, x, group=group)
            cases[f"{slots} all_gather {dtype}"] = (torch.stack(parts), torch.stack(ref))
            full = torch.empty(4 * 33, 17, dtype=dtype)
            collectives.all_gather_single(full, x, group=group)
            cases[f"{slots} all_gather_single {dtype}"] = (full, torch.stack(ref).flatten(0, 1))
            big = (torch.randn(4 * 12, 5, generator=gen) * 100).to(dtype)
            mine, ref = torch.empty(12, 5, dtype=dtype), torch.empty(12, 5, dtype=dtype)
            collectives.reduce_scatter_single(mine, big, group=group)
            dist.reduce_scatter_tensor(ref, big, group=group)
            cases[f"{slots} reduce_scatter {dtype}"] = (mine, ref)
    # a rank with its own /dev/shm (containers on one host): no channel for anyone
    tp_rank = dist.get_rank(group)
    if tp_rank == 1:
        own = tempfile.mkdtemp(prefix="own-dev-shm-")
        shm.SHM_DIR, saved = own, shm.SHM_DIR
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["private_dev_shm"] = shm_setup.attach(group) is None
    if tp_rank == 1:
        shm.SHM_DIR = saved
        out["private_dev_shm"] = (out["private_dev_shm"], os.listdir(own))
        os.rmdir(own)
    shm_setup.attach(group)  # back to the default slots
    # autograd: tensors that require grad, with grad mode on (torch's collectives accept
    # them); an all_gather of one must not leave the slots requiring grad either
    leaf = torch.randn(3, 4, generator=gen, requires_grad=True)
    mine, ref = leaf * 2, (leaf * 2).detach()
    collectives.all_reduce(mine, group=group)
    dist.all_reduce(ref, group=group)
    cases["grad all_reduce"] = (mine.detach(), ref)
    parts = [torch.empty(3, 4) for _ in range(4)]
    collectives.all_gather(parts, leaf * 2, group=group)
    ref_parts = [torch.empty(3, 4) for _ in range(4)]
    dist.all_gather(ref_parts, (leaf * 2).detach(), group=group)
    cases["grad all_gather"] = (torch.stack(parts), torch.stack(ref_parts))
    plain, ref = torch.ones(5), torch.ones(5)
    collectives.all_reduce(plain, group=group)  # after the grad-requiring all_gather
    dist.all_reduce(ref, group=group)
    cases["grad after all_gather all_reduce"] = (plain, ref)
    # ranks that disagree on the payload all raise (gloo aborts), and the channel goes on
    errors = {"mismatch": _raised(collectives.all_reduce, torch.ones(4 + (tp_rank == 1)),
                                 group=group),
              "short_list": _raised(collectives.all_gather, [torch.empty(2)] * 3,
                                   torch.ones(2), group=group)}
    after = torch.ones(2)
    collectives.all_reduce(after, group=group)
    errors["after"] = after.tolist()
    # a group this rank is not in (torch's NON_GROUP_MEMBER): a no-op, as in torch
    pair = dist.new_group([0, 1])
    x = torch.ones(2)
    errors["non_member"] = (_raised(collectives.all_reduce, x, group=pair)
                            if dist.get_rank() > 1 else "member")
    if dist.get_rank() <= 1:
        collectives.all_reduce(x, group=pair)
    out["errors"] = errors
    out["cases"] = cases
    return out


def _describe_cp() -> dict:
    """The context-parallel view of the grid: sizes, ranks, groups and their labels."""
    from parallel_state import collectives

    cp_group, dp_cp = ps.get_context_parallel_group(), ps.get_data_parallel_group(True)
    return dict(
        _describe(),
        cp=(ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        dp_cp=(ps.get_data_parallel_rank(with_context_parallel=True),
               ps.get_data_parallel_world_size(with_context_parallel=True)),
        cp_group=_ranks(cp_group), dp_cp_group=_ranks(dp_cp),
        cp_global_ranks=ps.get_context_parallel_global_ranks(),
        labels=(collectives.group_label(cp_group), collectives.group_label(dp_cp)),
        ep_group=_ranks(ps.get_expert_model_parallel_group()),
        edp_group=_ranks(ps.get_expert_data_parallel_group()),
        edp_is_dp_cp=ps.get_expert_data_parallel_group() is dp_cp,
        cp_sum=_cp_sum(cp_group, dp_cp),
    )


def _cp_sum(cp_group, dp_cp) -> list[float]:
    """All-reduces of the global rank over the cp and the dp-cp group (their channels)."""
    out = []
    for group in (cp_group, dp_cp):
        x = torch.tensor([float(dist.get_rank())])
        from parallel_state import collectives
        collectives.all_reduce(x, group=group)
        out.append(float(x))
    return out


def _cp_grid_cases(out: dict) -> None:
    """Context-parallel layouts of the 8-rank world (and their errors)."""
    ps.destroy_model_parallel()
    out["cp_errors"] = [_raised(ps.initialize_model_parallel, 2, 1, context_parallel_size=3),
                        _raised(ps.initialize_model_parallel, 1, 1, context_parallel_size=0)]
    ps.initialize_model_parallel(2, 1, device="cpu", context_parallel_size=2)
    out["tp2cp2"] = _describe_cp()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2, device="cpu", context_parallel_size=2,
                                 expert_model_parallel_size=2)
    out["cp2pp2ep2"] = _describe_cp()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, device="cpu", context_parallel_size=8)
    out["cp8"] = _describe_cp()
    ps.destroy_model_parallel()


def _grid_suite() -> dict:
    out = {"tp2pp2": _describe()}
    out["tp2pp2_cp"] = (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                        _ranks(ps.get_data_parallel_group(with_context_parallel=True)))
    out["twice"] = _error(ps.initialize_model_parallel, 2, 2)
    ps.destroy_model_parallel()  # the grid only; the world stays up
    out["no_grid_getter"] = _error(ps.get_tensor_model_parallel_group)
    out["not_divisible"] = _error(ps.initialize_model_parallel, 3, 1)
    out["not_divisible_pp"] = _error(ps.initialize_model_parallel, 2, 3)
    out["non_positive"] = _error(ps.initialize_model_parallel, 0, 1)
    ps.initialize_model_parallel(4, 1, device="cpu")
    out["tp4pp1"] = _describe()
    out["shm"] = _shm_collectives()
    out["rng"] = _rng_draws()
    out["bad_model"] = _error(GPTModel, ModelConfig(hidden_size=48, num_attention_heads=6,
                                                    num_layers=1))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 2, 2, device="cpu")  # vpp = 2 chunks per stage
    vpp = []
    for chunk in range(2):
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        vpp.append((ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                    ps.is_pipeline_first_stage(ignore_virtual=True),
                    ps.is_pipeline_last_stage(ignore_virtual=True)))
    out["vpp"] = vpp
    _cp_grid_cases(out)
    return out


@pytest.fixture(scope="module")
def grid8():
    return run_distributed(_grid_suite, WORLD, tp=2, pp=2, timeout=180)


# ----------------------------------------------------------------------------- expectations

def _megatron_coords(rank, tp, pp, world=WORLD):
    dp = world // (tp * pp)
    pp_rank, rest = divmod(rank, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)
    return tp_rank, dp_rank, pp_rank, dp


def test_tp2_pp2_groups_follow_megatron_order(grid8):
    tp_groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    dp_groups = [[0, 2], [1, 3], [4, 6], [5, 7]]
    pp_groups = [[0, 4], [1, 5], [2, 6], [3, 7]]
    mp_groups = [[0, 1, 4, 5], [2, 3, 6, 7]]
    for rank, r in enumerate(g["tp2pp2"] for g in grid8):
        tp_rank, dp_rank, pp_rank, dp = _megatron_coords(rank, 2, 2)
        assert (r["tp"], r["dp"], r["pp"]) == ((tp_rank, 2), (dp_rank, 2), (pp_rank, 2)), rank
        assert r["tp_group"] in tp_groups and rank in r["tp_group"], (rank, r)
        assert r["dp_group"] in dp_groups and rank in r["dp_group"], (rank, r)
        assert r["pp_group"] in pp_groups and rank in r["pp_group"], (rank, r)
        assert r["mp_group"] in mp_groups and rank in r["mp_group"], (rank, r)
        assert r["embedding_group"] == r["pp_group"], (rank, r)  # first + last stage
        assert (r["first"], r["last"]) == (pp_rank == 0, pp_rank == 1), rank
        other = r["pp_group"][1 - pp_rank]
        assert r["next"] == other and r["prev"] == other, (rank, r)  # 2 stages: wraps around


def _shm_possible() -> bool:
    """Whether the tp4 groups of the 8-rank world can have channels here (x86-64 Linux with a
    /dev/shm of at least 256 MB free: Docker's default 64 MB is too small for them)."""
    from parallel_state.transport import shm

    if not shm.available():
        return False
    fs = os.statvfs(shm.SHM_DIR)
    return fs.f_bavail * fs.f_frsize >= 256 << 20


def test_shared_memory_collectives_match_gloo(grid8):
    for rank, g in enumerate(grid8):
        if _shm_possible():  # else the cases below ran on gloo, and must still match
            assert g["shm"]["channel"], rank  # 4 ranks on one host: the tp group has one
            assert g["shm"]["dp_channel"], rank  # and the dp group (gradient reductions)
            assert not g["shm"]["pp_channel"], rank  # p2p only: it stays on gloo
            assert g["shm"]["peers_known"], rank  # a waiter tells a dead peer from a late one
        for name, (mine, ref) in g["shm"]["cases"].items():
            assert mine.shape == ref.shape, (rank, name)
            if "reduce" in name and mine.is_floating_point():  # 4 ranks: another sum order
                # bf16 keeps 8 bits: one rounding of a sum near 300 moves it by 2
                rtol, atol = (2e-2, 4.0) if mine.dtype == torch.bfloat16 else (1e-5, 1e-4)
                torch.testing.assert_close(mine, ref, rtol=rtol, atol=atol,
                                           msg=f"{rank} {name}")
            else:
                assert torch.equal(mine, ref), (rank, name)
    for rank in range(WORLD):  # every rank of a group gets the same bits (rank-order sums)
        for name, (mine, _) in grid8[rank]["shm"]["cases"].items():
            if "all_reduce" in name:
                assert torch.equal(mine, grid8[rank - rank % 4]["shm"]["cases"][name][0]), name


def test_shared_memory_errors(grid8):
    if not _shm_possible():
        pytest.skip("no shared-memory channels here (not x86-64 Linux, or /dev/shm < 256 MB)")
    for rank, g in enumerate(grid8):
        e = g["shm"]["errors"]
        assert "does not match across its ranks" in e["mismatch"], (rank, e)
        odd = rank - rank % 4 + 1  # tp rank 1 of this rank's group sent 5 elements
        assert f"rank {odd} calls all_reduce of 5 float32 elements" in e["mismatch"], (rank, e)
        assert "all_gather needs 4 output tensors" in e["short_list"], (rank, e)
        assert e["after"] == [4.0, 4.0], rank  # the channel still works
        # tp rank 1 looked in its own /dev/shm: no channel, and it made no file there
        assert g["shm"]["private_dev_shm"] == ((True, []) if rank % 4 == 1 else True), rank
        assert e["non_member"] in ("member", None), (rank, e)


def test_shared_memory_waits_fail_instead_of_hanging(tmp_path):
    """A peer that never arrives times out with the process-group timeout's message; a peer
    that exited is named at once. (The peer: a plain Python process holding rank 1 of a
    2-rank channel, which writes only its pid.)"""
    import subprocess
    import sys

    from parallel_state.transport.shm import Channel

    path = str(tmp_path / "segment")
    ch = Channel(path, 2, 0, 4096, None, [0, 1])
    peer = subprocess.Popen([sys.executable, "-c", (
        "import mmap, os, struct, sys\n"
        f"f = open({path!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0)\n"
        "struct.pack_into('<q', m, 72, os.getpid()); m.flush()\n"  # rank 1's pid word
        "print('ready', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "ready"
        ch.find_peers()
        ch.timeout = 0.2
        with pytest.raises(RuntimeError, match=r"Timed out after 0\.\d s .* waiting for rank 1 "
                                                r"to arrive at shared-memory collective 1"):
            ch.all_reduce(torch.ones(3))
        peer.stdin.close()
        peer.wait(timeout=30)
        ch.timeout = 600
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {peer.pid}\) exited while this "
                                                r"rank waited for it to arrive"):
            ch.all_reduce(torch.ones(3))
    finally:
        peer.kill()


def test_shared_memory_segment_larger_than_dev_shm():
    """A segment that does not fit /dev/shm is refused at creation (the group stays on gloo)
    instead of killing a rank with SIGBUS at its first touch of a page past the free space."""
    from parallel_state.transport import shm

    if not shm.available():
        pytest.skip("no /dev/shm channels on this machine")
    fs = os.statvfs("/dev/shm")
    path = f"/dev/shm/shardzoo-test-{os.getpid()}"
    with pytest.warns(UserWarning, match="the group stays on gloo"):
        assert not shm.create_segment(path, fs.f_blocks * fs.f_frsize + (1 << 20))
    assert not os.path.exists(path)
    assert shm.create_segment(path, 1 << 16)
    try:
        assert os.path.getsize(path) == 1 << 16
    finally:
        os.unlink(path)


def test_shared_memory_switch(monkeypatch):
    from parallel_state.transport import shm

    monkeypatch.setenv(shm.ENV_SWITCH, "0")
    assert not shm.available()
    monkeypatch.setenv(shm.ENV_SWITCH, "1")
    assert shm.available() == (os.path.isdir("/dev/shm") and os.uname().machine == "x86_64")


def test_context_parallel_groups_follow_megatron_order(grid8):
    """tp-cp-dp-pp (Megatron's order): rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp +
    tp_rank; the dp-cp group (weight gradients, ZeRO) is dp x cp of one stage and tp rank;
    the expert layout carves ep out of dp x cp; labels "cp" and "dp-cp" for traces and
    --report-comm. Hand-written group lists for world 8."""
    tp2cp2 = dict(tp_group=[[0, 1], [2, 3], [4, 5], [6, 7]], cp_group=[[0, 2], [1, 3], [4, 6], [5, 7]],
                  dp_group=[[0, 4], [1, 5], [2, 6], [3, 7]], dp_cp_group=[[0, 2, 4, 6], [1, 3, 5, 7]],
                  mp_group=[[0, 1], [2, 3], [4, 5], [6, 7]], pp_group=[[r] for r in range(8)])
    cp2pp2 = dict(tp_group=[[r] for r in range(8)], cp_group=[[0, 1], [2, 3], [4, 5], [6, 7]],
                  dp_group=[[0, 2], [1, 3], [4, 6], [5, 7]], dp_cp_group=[[0, 1, 2, 3], [4, 5, 6, 7]],
                  mp_group=[[0, 4], [1, 5], [2, 6], [3, 7]], pp_group=[[0, 4], [1, 5], [2, 6], [3, 7]],
                  # ep 2 over each stage's dp x cp = 4 ranks: etp 1, ep 2, edp 2
                  ep_group=[[0, 1], [2, 3], [4, 5], [6, 7]], edp_group=[[0, 2], [1, 3], [4, 6], [5, 7]])
    for rank in range(8):
        assert grid8[rank]["tp2pp2_cp"] == (1, 0, grid8[rank]["tp2pp2"]["dp_group"]), rank
        for name, want, (tp, cp, dp, pp) in (("tp2cp2", tp2cp2, (2, 2, 2, 1)),
                                             ("cp2pp2ep2", cp2pp2, (1, 2, 2, 2))):
            r = grid8[rank][name]
            pp_rank, rest = divmod(rank, dp * cp * tp)
            (dp_rank, cp_rank), tp_rank = divmod(rest // tp, cp), rest % tp
            assert (r["tp"], r["cp"], r["dp"], r["pp"]) == (
                (tp_rank, tp), (cp_rank, cp), (dp_rank, dp), (pp_rank, pp)), (name, rank)
            assert r["dp_cp"] == (dp_rank * cp + cp_rank, dp * cp), (name, rank)
            for group, lists in want.items():
                assert r[group] in lists and rank in r[group], (name, rank, group, r[group])
            assert r["cp_global_ranks"] == r["cp_group"], (name, rank)
            assert r["labels"] == ("cp", "dp-cp"), (name, rank, r["labels"])
            assert r["cp_sum"] == [float(sum(r["cp_group"])), float(sum(r["dp_cp_group"]))]
        assert not grid8[rank]["cp2pp2ep2"]["edp_is_dp_cp"], rank  # ep 2: a group of its own
        assert grid8[rank]["tp2cp2"]["edp_is_dp_cp"], rank  # ep 1: the experts' edp is dp x cp
        r = grid8[rank]["cp8"]  # dp 1: the dp-cp group is the cp group, labelled so
        assert r["cp"] == (rank, 8) and r["dp_group"] == [rank] and r["dp_cp_group"] == list(range(8))
        assert r["labels"] == ("world/cp", "world/cp"), r["labels"]
    errors = grid8[0]["cp_errors"]
    assert "context-parallel-size (3)" in errors[0] and "multiple of 6" in errors[0], errors
    assert "cp=0" in errors[1], errors


def test_context_parallel_grid_arithmetic():
    """The size checks, without processes: dp = world / (tp cp pp), the expert layout over
    dp x cp x tp, and the errors naming the flag."""
    from parallel_state.grid import _data_parallel_size, _expert_data_parallel_size

    assert _data_parallel_size(16, 2, 2, None, cp=2) == 2
    # a stage's dp 2 x cp 2 x tp 2 ranks over ep x etp 2
    assert [_expert_data_parallel_size(16, 2, 2, 2, ep, 2, cp=2) for ep in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ps.GridError, match=r"context-parallel-size \(4\) x pipeline.*multiple "
                                            r"of 8 processes or change --tp/--context-parallel"):
        _data_parallel_size(12, 1, 2, None, cp=4)
    with pytest.raises(ps.GridError, match=r"--expert-model-parallel-size 3 must divide data-"
                                            r"parallel size x context-parallel-size \(4"):
        _expert_data_parallel_size(8, 2, 2, 1, 3, 2, cp=2)


def test_tp4_pp1_groups(grid8):
    for rank, r in enumerate(g["tp4pp1"] for g in grid8):
        assert r["tp"] == (rank % 4, 4) and r["dp"] == (rank // 4, 2) and r["pp"] == (0, 1)
        assert r["tp_group"] == list(range(rank - rank % 4, rank - rank % 4 + 4))
        assert r["dp_group"] == [rank % 4, rank % 4 + 4]
        assert r["pp_group"] == [rank]
        assert r["mp_group"] == r["tp_group"]
        assert r["embedding_group"] is None
        assert r["first"] and r["last"] and r["next"] == rank and r["prev"] == rank


def test_virtual_pipeline_stages(grid8):
    for rank, g in enumerate(grid8):
        pp_rank = rank // 4
        (f0, l0, f0i, l0i), (f1, l1, f1i, l1i) = g["vpp"]
        assert (f0, l0) == (pp_rank == 0, False), rank  # chunk 0 of stage 0 is the first
        assert (f1, l1) == (False, pp_rank == 1), rank  # chunk 1 of the last stage is the last
        assert f0i == f1i == (pp_rank == 0) and l0i == l1i == (pp_rank == 1), rank


def test_grid_errors_name_the_fix(grid8):
    r = grid8[0]
    assert r["twice"] and "called twice" in r["twice"] and "destroy_model_parallel" in r["twice"]
    assert r["no_grid_getter"] and "initialize_model_parallel" in r["no_grid_getter"]
    for key, sizes in (("not_divisible", "(3)"), ("not_divisible_pp", "(3)")):
        msg = r[key]
        assert msg and msg.startswith("GridError") and "world size 8" in msg, msg
        assert "tensor-model-parallel-size" in msg and "--tp/--pp" in msg and sizes in msg, msg
    assert r["non_positive"] and "must be >= 1" in r["non_positive"]
    assert all(g["twice"] and g["not_divisible"] for g in grid8)  # every rank, not just rank 0


def test_model_rejects_heads_not_divisible_by_tp(grid8):
    msg = grid8[0]["bad_model"]
    assert msg and "ConfigError" in msg and "--num-attention-heads" in msg, msg


def test_rng_tracker_across_ranks(grid8):
    rng = [g["rng"] for g in grid8]  # tp4 x dp2 grid: rank = dp_rank * 4 + tp_rank
    for r in rng:
        assert r["replay_equal"] and r["default_untouched"] and r["tp_stream_advanced"]
        assert 0.3 < r["tp"].float().mean() < 0.7
    for rank in range(WORLD):
        assert torch.equal(rng[rank]["default"], rng[0]["default"]), "default stream must agree"
        assert torch.equal(rng[rank]["tp"], rng[rank % 4]["tp"]), "DP replicas must agree"
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(rng[a]["tp"], rng[b]["tp"]), f"TP ranks {a} and {b} share masks"
    assert not torch.equal(rng[0]["tp"], rng[0]["default"])


# ----------------------------------------------------------------------------- single process

def test_getters_without_a_grid(no_grid):
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_data_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    for getter in (ps.get_grid, ps.get_tensor_model_parallel_group, ps.get_data_parallel_group,
                   ps.get_pipeline_model_parallel_next_rank):
        with pytest.raises(ps.GridError, match="initialize_model_parallel"):
            getter()


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(),
                    reason="this process already runs a world")
def test_initialize_requires_a_world_then_single_process_world(no_grid):
    with pytest.raises(ps.GridError, match="initialize_distributed"):
        ps.initialize_model_parallel(1, 1)
    if "RANK" in os.environ:
        pytest.skip("RANK is set: initialize_distributed would join that world")
    try:
        ps.initialize_distributed("cpu")
        grid = ps.initialize_model_parallel(1, 1, device="cpu")
        assert grid.tensor_model_parallel_size == grid.data_parallel_size == 1
        assert ps.get_pipeline_model_parallel_next_rank() == 0
    finally:
        ps.destroy_model_parallel()  # we started the world, so this ends it too
    assert not dist.is_initialized() and "RANK" not in os.environ


def test_rng_tracker_single_process():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="model_parallel_seed"):
        with tracker.fork("missing"):
            pass
    from layers.dropout import hidden_dropout

    x = torch.ones(2, 1, 8)
    assert hidden_dropout(x, 0.0, True, site=0, sequence_parallel=True) is x
    assert hidden_dropout(x, 0.5, False, site=0, sequence_parallel=False) is x
    # the seeds model_parallel_seed documents: default = seed + 100 * pp, TP = default + 2718 + tp
    ps.model_parallel_seed(7, tp_rank=1, pp_rank=2)
    with ps.get_rng_tracker().fork(ps.DEFAULT_RNG):
        default = torch.rand(4)
    with ps.get_rng_tracker().fork():
        tp_draw = torch.rand(4)
    torch.manual_seed(7 + 200)
    assert torch.equal(default, torch.rand(4))
    torch.manual_seed(7 + 200 + 2718 + 1)
    assert torch.equal(tp_draw, torch.rand(4))


@pytest.mark.parametrize("kwargs,tp,flag", [
    (dict(hidden_size=48, num_attention_heads=6), 4, "--num-attention-heads"),
    (dict(hidden_size=64, num_attention_heads=8, num_query_groups=2), 4, "--num-query-groups"),
    (dict(hidden_size=64, num_attention_heads=8, num_query_groups=3), 1, "--num-query-groups"),
    (dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=66), 4, "--ffn-hidden-size"),
])
def test_model_config_validate_names_the_flag(kwargs, tp, flag):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**kwargs).validate(tp)
    assert flag in str(e.value), str(e.value)
    if tp > 1:
        assert "--tensor-model-parallel-size" in str(e.value), str(e.value)


def test_model_config_accepts_gqa_divisible_by_tp():
    ModelConfig(hidden_size=64, num_attention_heads=8, num_query_groups=4).validate(4)
