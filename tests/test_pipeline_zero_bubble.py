"""Zero-bubble pipeline schedules (Qi et al. 2024): the split backward (B now, the linears'
weight gradients W later, once, with the joint backward's numbers), the schedule tables and
their checker, ZB-H1 training runs that give 1F1B's bits on the same layout (so the
single process's curve, which 1F1B reproduces: tests/test_pipeline.py) and the single
process's losses and weights up to rounding, and ZBV runs (two chunks per stage in a V, the
embedding and the loss on stage 0) that give the single process's curve."""
from __future__ import annotations

import pytest
import torch

from distributed import batched_by_world, run_distributed
from parallel_state import schedule_tables as st
from parallel_state import weight_grads
from tolerances import assert_losses_close, training_chain_terms, weights_mismatch


# ------------------------------------------------------------------------- split backward
def _tiny_block():
    from layers.linear import ColumnParallelLinear, RowParallelLinear
    from layers.moe.experts import GroupedLinear

    torch.manual_seed(0)
    mods = torch.nn.ModuleDict({
        "norm": torch.nn.LayerNorm(8),
        "fc1": ColumnParallelLinear(8, 16, bias=True),
        "fc2": RowParallelLinear(16, 8, bias=True),
        "experts": GroupedLinear(3, 8, 8, partition_dim=1, init="normal"),
    })
    for p in mods.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return mods


def _loss(mods, x):
    h = mods["fc2"](torch.nn.functional.gelu(mods["fc1"](mods["norm"](x))))
    return (mods["experts"](h.reshape(-1, 8), [5, 0, 7]) ** 2).sum()


def test_split_backward_matches_joint_backward_exactly_once():
    """B computes the input gradient and the non-linear parameters' gradients, leaves the
    linears' and experts' weights untouched and fires no usable hook for them; W adds the
    same bits as the joint backward, through the parameters' post-accumulate-grad hooks, and
    refuses to run twice or inside a B."""
    mods = _tiny_block()
    x = torch.randn(4, 3, 8)
    deferred = {id(mods[n].weight) for n in ("fc1", "fc2", "experts")} | {id(mods["fc1"].bias)}

    xj = x.clone().requires_grad_()
    with weight_grads.split_backward():
        _loss(mods, xj).backward()
    joint = {n: p.grad.clone() for n, p in mods.named_parameters()}
    for p in mods.parameters():
        p.grad = None

    hooks = []
    for p in mods.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: hooks.append((id(p), weight_grads.is_deferred(p), p.grad is not None)))
    xs = x.clone().requires_grad_()
    with weight_grads.split_backward():
        loss = _loss(mods, xs)
        with weight_grads.input_gradients_only() as w:
            loss.backward()
    assert torch.equal(xs.grad, xj.grad)
    for n, p in mods.named_parameters():
        if id(p) in deferred:
            assert p.grad is None, n
        else:
            assert torch.equal(p.grad, joint[n]), n
    # in B a deferred parameter's hook is told it carries nothing
    assert all(is_def == (pid in deferred) for pid, is_def, _ in hooks)
    assert len(w) == 3  # fc1 (weight + bias), fc2, experts
    hooks.clear()
    w.run()
    for n, p in mods.named_parameters():
        assert torch.equal(p.grad, joint[n]), n
    assert sorted(pid for pid, is_def, has in hooks if has and not is_def) == sorted(deferred)
    with pytest.raises(RuntimeError, match="already ran"):
        w.run()
    with pytest.raises(RuntimeError, match="does not nest"):
        with weight_grads.input_gradients_only(), weight_grads.input_gradients_only():
            pass
    # without split_backward() nothing changes: the joint backward computes everything
    for p in mods.parameters():
        p.grad = None
    _loss(mods, x.clone().requires_grad_()).backward()
    assert all(torch.equal(p.grad, joint[n]) for n, p in mods.named_parameters())


# ------------------------------------------------------------------------- schedule tables
def test_schedule_tables_checked_over_a_grid():
    """Every table of pp 2..8 x microbatches 1..17 runs each action once without deadlock;
    with equal pass costs ZB-H1's bubble is a third of 1F1B's ((p-1)/(3m)) at 1F1B's peak of
    pp in-flight microbatches on every rank, and ZBV's is below ZB-H1's with the same
    activation memory (2 pp half-stage chunks)."""
    for pp in range(2, 9):
        for m in range(1, 18):
            one = st.check(st.build("1f1b", pp, m))
            zb = st.check(st.build("zb-h1", pp, m))
            v = st.check(st.build("zbv", pp, m, vpp=2))
            assert one.peak_activations[0] == min(pp, m)
            assert zb.peak_activations == [min(pp, m)] * pp
            assert max(v.peak_activations) <= 2 * pp
            if m >= pp:
                assert one.bubble == pytest.approx([(pp - 1) / m] * pp)
                assert zb.bubble == pytest.approx([(pp - 1) / (3 * m)] * pp)
            if m >= 2 * pp:
                assert max(v.bubble) < min(zb.bubble)
            if m % pp == 0:
                for vpp in (2, 3):
                    assert st.check(st.build("interleaved", pp, m, vpp)).bubble == \
                        pytest.approx([(pp - 1) / (vpp * m)] * pp)
    for pp in range(2, 7):  # the V: rank 0 holds the first and the last virtual stage
        s = st.build("zbv", pp, 2 * pp, vpp=2)
        assert s.virtual_stage(0, 0) == 0 and s.virtual_stage(0, 1) == 2 * pp - 1
        assert sorted(s.virtual_stage(r, c) for r in range(pp) for c in (0, 1)) == \
            list(range(2 * pp))
        assert all(st.stage_rank(pp, s.virtual_stage(r, c), True) == (r, c)
                   for r in range(pp) for c in (0, 1))
        for acts in s.actions:  # per chunk, F and B in microbatch order: on each chunk's
            for kind in "FB":     # group every direction carries one kind, first in first out
                for c in (0, 1):
                    mbs = [a.microbatch for a in acts if (a.kind, a.chunk) == (kind, c)]
                    assert mbs == sorted(mbs)
    assert st.simulate(st.build("zbv", 4, 8, vpp=2)).bubble == pytest.approx([1 / 16] * 4)
    table = st.build("zb-h1", 4, 8).table().splitlines()
    assert table[3].startswith("rank 3: F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 W0.0 F0.4")
    assert table[0].endswith("B0.7 W0.7")


def test_schedule_checker_rejects_broken_tables():
    s = st.build("zb-h1", 2, 4)
    s.actions[1] = [a for a in s.actions[1] if a != st.Action("W", 0, 2)]
    with pytest.raises(st.ScheduleError, match="rank 1 misses"):
        st.check(s)
    s = st.build("zb-h1", 2, 4)
    s.actions[0].append(st.Action("F", 0, 1))
    with pytest.raises(st.ScheduleError, match="rank 0 runs F0.1 twice"):
        st.check(s)
    s = st.build("1f1b", 2, 4)
    # rank 0 waits for B of microbatch 0 before its first forward: nobody can go on
    s.actions[0].insert(0, s.actions[0].pop(s.actions[0].index(st.Action("B", 0, 0))))
    with pytest.raises(st.ScheduleError, match="deadlock"):
        st.check(s)
    s = st.build("zb-h1", 2, 4)
    s.actions[1].insert(0, s.actions[1].pop(s.actions[1].index(st.Action("W", 0, 0))))
    with pytest.raises(st.ScheduleError, match="deadlock"):  # W before its own B
        st.check(s)
    for bad, match in ((("zb-h2", 4, 8), "unknown pipeline schedule"),
                       (("zb-h1", 1, 8), "pp >= 2"), (("zbv", 4, 8, 3), "exactly 2 chunks"),
                       (("interleaved", 4, 6, 2), "divisible"), (("zb-h1", 4, 8, 2), "one chunk")):
        with pytest.raises(st.ScheduleError, match=match):
            st.build(*bad)


def test_pipeline_schedule_flag_is_checked():
    from models.config import ConfigError
    from training.arguments import parse_config

    def validate(*flags, world=4):
        cfg = parse_config(["--config", "configs/tiny-llama.yaml", *flags])
        cfg.validate(world)
        return cfg.train.pipeline_schedule

    assert validate("--pp", "4") == "1f1b"
    assert validate("--pp", "2", "--vpp", "2", world=2) == "interleaved"
    assert validate("--pp", "4", "--pipeline-schedule", "zb-h1") == "zb-h1"
    assert validate("--pp", "2", "--pipeline-schedule", "zbv", world=2) == "zbv"
    cfg = parse_config(["--config", "configs/tiny-llama.yaml", "--pp", "2", "--vpp", "2",
                        "--pipeline-schedule", "zbv", "--global-batch-size", "2",
                        "--micro-batch-size", "1"])
    cfg.validate(2)  # vpp 2 may be given (zbv sets it otherwise)
    assert cfg.train.virtual_pipeline_model_parallel_size == 2
    cfg = parse_config(["--config", "configs/tiny-llama.yaml", "--pp", "2",
                        "--pipeline-schedule", "zbv", "--global-batch-size", "1",
                        "--micro-batch-size", "1"])
    assert cfg.validate(2).num_microbatches == 1  # m < pp runs (the interleaved one refuses)
    for flags, match in ((["--pp", "4", "--pipeline-schedule", "zbh1"], "pipeline.schedule"),
                         (["--pp", "2", "--vpp", "2", "--pipeline-schedule", "zb-h1"],
                          "one model chunk"),
                         (["--pp", "4", "--pipeline-schedule", "interleaved"], "add --virtual"),
                         (["--pipeline-schedule", "zb-h1"], "pipeline-model-parallel-size"),
                         (["--pp", "4", "--pipeline-schedule", "zb-h1", "--compile"],
                          "drop --compile"),
                         (["--pp", "2", "--vpp", "4", "--num-layers", "8",
                           "--pipeline-schedule", "zbv"], "exactly 2 model chunks"),
                         (["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                           "--pipeline-schedule", "zbv"], "exactly 2 model chunks"),
                         (["--pipeline-schedule", "zbv"], "pipeline-model-parallel-size"),
                         (["--pp", "4", "--pipeline-schedule", "zbv"], "make every stage"),
                         (["--pp", "2", "--pipeline-schedule", "zbv", "--compile"],
                          "drop --compile")):
        with pytest.raises(ConfigError, match=match):
            validate(*flags)


# ------------------------------------------------------------------------- training runs
COMMON = ["--train-iters", "5", "--log-interval", "1", "--eval-interval", "0",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--no-tensorboard",
          "--adam-eps", "1e-4", "--peak-tflops", "1"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
GPT = ["--config", "configs/tiny-gpt.yaml", "--num-layers", "4"] + DROPOUT  # tied
LLAMA = ["--config", "configs/tiny-llama.yaml"] + DROPOUT  # untied, 4 layers
MOE = ["--config", "configs/tiny-llama.yaml", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "2"]
LLAMA10 = LLAMA + ["--num-layers", "10"]
FAMILIES = {"gpt": GPT, "llama": LLAMA, "moe": MOE, "llama10": LLAMA10}
ZB = ["--pipeline-schedule", "zb-h1"]
ZBV = ["--pipeline-schedule", "zbv"]

CASES = [  # id, family, world, layout flags; each runs with ZB-H1 and with 1F1B
    ("pp2-tied", "gpt", 2, ["--pp", "2"]),
    ("pp2-uneven-recompute", "llama", 2, ["--pp", "2", "--decoder-first-pipeline-num-layers", "1",
                                          "--recompute-granularity", "full"]),
    ("pp4", "llama", 4, ["--pp", "4"]),
    ("pp2-tp2-sp", "llama", 4, ["--pp", "2", "--tp", "2", "--sequence-parallel"]),
    ("pp2-dp2-zero1", "gpt", 4, ["--pp", "2", "--use-distributed-optimizer"]),
    ("pp2-dp2-zero3", "llama", 4, ["--pp", "2", "--data-parallel-sharding-strategy",
                                   "optim_grads_params"]),
    ("pp2-ep2-moe", "moe", 4, ["--pp", "2", "--ep", "2"]),
    ("pp2-cp2", "llama", 4, ["--pp", "2", "--cp", "2"]),
]
UNEVEN4 = ["--pp", "4", "--decoder-first-pipeline-num-layers", "2",  # stages 2 2 2 4 layers
           "--decoder-last-pipeline-num-layers", "4"]
ZBV_CASES = [  # id, family, world, layout flags; each runs with ZBV
    ("pp2-tied", "gpt", 2, ["--pp", "2"]),
    ("pp4-uneven-recompute", "llama10", 4, UNEVEN4 + ["--recompute-granularity", "full"]),
    ("pp4-uneven-m2", "llama10", 4, UNEVEN4 + ["--micro-batch-size", "4"]),  # m 2 < pp 4
    ("pp2-tp2-sp", "llama", 4, ["--pp", "2", "--tp", "2", "--sequence-parallel"]),
    ("pp2-dp2-zero1-tied", "gpt", 4, ["--pp", "2", "--use-distributed-optimizer"]),
    ("pp2-dp2-zero3", "llama", 4, ["--pp", "2", "--data-parallel-sharding-strategy",
                                   "optim_grads_params"]),
    ("pp2-ep2-moe", "moe", 4, ["--pp", "2", "--ep", "2"]),
    ("pp2-cp2", "llama", 4, ["--pp", "2", "--cp", "2"]),
]
RUNS = [(c, "zb-h1") for c in CASES] + [(c, "zbv") for c in ZBV_CASES]


def _train_worker(runs: list[list[str]], log_dir: str, cache: str) -> list[dict]:
    import os

    import parallel_state as ps
    from models.state_dict import gather_full_state_dict
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        records = pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]),
                           on_end=gather_full_state_dict)
        out.append({"losses": [r["loss"] for r in records if "loss" in r],
                    "state": records[-1]["on_end"]})
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_env):
    out = run_distributed(_train_worker, 1, [f + COMMON for f in FAMILIES.values()],
                          str(tmp_path_factory.mktemp("ref")), corpus_env["SHARDZOO_CACHE"],
                          timeout=600)[0]
    return dict(zip(FAMILIES, out))


@pytest.fixture(scope="module")
def case_results(tmp_path_factory, corpus_env):
    """(case, "zb-h1") -> (ZB-H1 rank-0 result, 1F1B rank-0 result), (case, "zbv") -> (ZBV
    rank-0 result,); a world size's runs in one world."""
    schedules = {"zb-h1": (ZB, []), "zbv": (ZBV,)}

    def run_cases(world, runs):
        args = [FAMILIES[c[1]] + COMMON + c[3] + flags for c, name in runs
                for flags in schedules[name]]
        out = iter(run_distributed(_train_worker, world, args,
                                   str(tmp_path_factory.mktemp(f"world{world}")),
                                   corpus_env["SHARDZOO_CACHE"], timeout=300 * len(args))[0])
        return [tuple(next(out) for _ in schedules[name]) for _, name in runs]
    return batched_by_world(RUNS, lambda r: r[0][2], run_cases)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_zb_h1_matches_1f1b_and_single_process(case, references, case_results):
    """ZB-H1 and 1F1B on the same layout: the same bits (the split backward adds the same
    weight gradients in the same microbatch order); both the single process's curve."""
    zb, one = case_results((case, "zb-h1"))
    assert zb["losses"] == one["losses"]
    assert all(torch.equal(zb["state"][k], one["state"][k]) for k in one["state"])
    ref = references[case[1]]
    k_step = training_chain_terms(FAMILIES[case[1]] + COMMON + case[3])
    assert_losses_close(zb["losses"], ref["losses"], k_step)
    assert not weights_mismatch(zb["state"], ref["state"], 5 * k_step)


@pytest.mark.parametrize("case", ZBV_CASES, ids=[c[0] for c in ZBV_CASES])
def test_zbv_matches_single_process(case, references, case_results):
    """ZBV (two chunks per stage in a V: stage 0 holds the embedding, a tied output copy
    and the loss) gives the single process's losses and weights up to rounding, with dropout,
    uneven stages, recompute, fewer microbatches than stages, TP + SP, ZeRO-1 / ZeRO-3, ep 2
    and cp 2."""
    (v,) = case_results((case, "zbv"))
    ref = references[case[1]]
    k_step = training_chain_terms(FAMILIES[case[1]] + COMMON + case[3])
    assert len(v["losses"]) == 5
    assert_losses_close(v["losses"], ref["losses"], k_step)
    assert not weights_mismatch(v["state"], ref["state"], 5 * k_step)


PROFILED = [("zb-h1", 1, 3 / (3 * 8), 4), ("zbv", 2, 1 / 16, 8)]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, corpus_env):
    """schedule -> log folder of train.py --profile-pipeline at pp 4 (m 8, 2 iterations);
    both schedules in one spawned world of 4 (one start-up; train.py's torchrun launch is
    covered by the checkpointing and run-log tests)."""
    from launch import train_in_one_world

    root = tmp_path_factory.mktemp("profiled")
    args = ["--config", "configs/tiny-llama.yaml", "--pp", "4", "--num-layers", "8",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "2",
            "--eval-interval", "0", "--profile-pipeline", "--no-tensorboard"]
    schedules = [case[0] for case in PROFILED]
    train_in_one_world(4, [args + ["--pipeline-schedule", name, "--log-dir", str(root / name)]
                           for name in schedules], corpus_env["SHARDZOO_CACHE"])
    return {name: root / name for name in schedules}


@pytest.mark.parametrize("schedule,chunks,bubble,peak", PROFILED)
def test_profiled_timeline_has_w_blocks_and_the_table_s_bubble(schedule, chunks, bubble, peak,
                                                               profiled):
    """--profile-pipeline under ZB-H1 and ZBV (pp 4, m 8): every rank records 8 F, 8 B and
    8 W blocks per chunk; re-timed with equal costs the recorded order has the table's bubble
    on every rank ((p-1)/(3m) for ZB-H1, a third of 1F1B's; 1/16 for ZBV); the activations
    held at peak, counted from the timeline, equal the table's (pp chunk-microbatches of
    one chunk per rank for ZB-H1, 2 pp of half a stage each for ZBV)."""
    import json

    from launch import read_metrics
    from training.timeline import Span, replay

    log_dir = profiled[schedule]
    record = [r for r in read_metrics(log_dir) if "bubble_theory" in r][0]
    assert record["schedule"] == schedule
    assert record["bubble_theory"] == pytest.approx(bubble)
    assert record["in_flight_peak"] == record["in_flight_peak_predicted"] == [peak] * 4
    assert len(record["bubble_predicted"]) == 4 and record["pass_costs"][2] > 0
    trace = json.loads((log_dir / "pipeline_timeline.json").read_text())["traceEvents"]
    per_rank = [[] for _ in range(4)]
    for e in sorted(trace, key=lambda e: e["ts"]):
        if e["cat"] in "FBW":
            _, chunk, mb = e["name"].split()
            per_rank[e["tid"]].append(Span(e["cat"], int(chunk[1:]), int(mb[2:]), 0, 0, 1.0))
    assert all(sorted((s.kind, s.chunk) for s in spans) == sorted(
        (k, c) for k in "FBW" for c in range(chunks) for _ in range(8)) for spans in per_rank)
    assert replay(per_rank, 4, chunks, v_shape=schedule == "zbv") == \
        pytest.approx([bubble] * 4, abs=1e-9)


def test_resume_across_schedules_gives_the_uninterrupted_curve(tmp_path, corpus_env):
    """pp 2 with dropout: 1F1B saves at iteration 2, ZB-H1 resumes to 5; and the reverse.
    Both continue the uninterrupted runs' losses bit for bit (a checkpoint does not depend on
    the schedule that wrote it)."""
    base = LLAMA + COMMON + ["--pp", "2"]
    save_a, save_b = str(tmp_path / "a"), str(tmp_path / "b")
    runs = [base, base + ZB,
            base + ["--save", save_a, "--save-interval", "2", "--exit-interval", "2"],
            base + ZB + ["--load", save_a],
            base + ZB + ["--save", save_b, "--save-interval", "2", "--exit-interval", "2"],
            base + ["--load", save_b]]
    out = run_distributed(_train_worker, 2, runs, str(tmp_path / "logs"),
                          corpus_env["SHARDZOO_CACHE"], timeout=900)[1]  # the loss stage
    whole_1f1b, whole_zb = out[0]["losses"], out[1]["losses"]
    assert whole_1f1b == whole_zb and len(whole_1f1b) == 5
    for first, resumed in ((out[2], out[3]), (out[4], out[5])):
        assert first["losses"] + resumed["losses"] == whole_1f1b


def test_zbv_resumes_across_schedules(tmp_path, corpus_env):
    """Tied GPT at pp 2 with dropout: 1F1B saves at iteration 2 and ZBV (other layers on
    each stage, the output copy on stage 0) resumes to 5; ZBV saves and 1F1B resumes. Each
    continues its uninterrupted run's curve (layer numbers are global, the tied copy reads
    the embedding), and the two uninterrupted runs agree. ZBV and 1F1B are equal to rounding
    only, not bit for bit: ZBV's chunks are other tensors, and oneDNN's float32 GEMM may sum
    in another order for another memory alignment (seen: 44 tensors off by <= 7.5e-9 after
    5 steps in some orders of runs in one process, none in others), so across the two
    schedules the check is the training-chain bound of tolerances.py and a 1e-5 relative
    band on the final weights."""
    base = GPT + COMMON + ["--pp", "2"]
    save_a, save_b = str(tmp_path / "a"), str(tmp_path / "b")
    runs = [base, base + ZBV,
            base + ["--save", save_a, "--save-interval", "2", "--exit-interval", "2"],
            base + ZBV + ["--load", save_a],
            base + ZBV + ["--save", save_b, "--save-interval", "2", "--exit-interval", "2"],
            base + ["--load", save_b]]
    out = run_distributed(_train_worker, 2, runs, str(tmp_path / "logs"),
                          corpus_env["SHARDZOO_CACHE"], timeout=900)[0]
    whole_1f1b, whole_zbv = out[0]["losses"], out[1]["losses"]
    assert len(whole_1f1b) == 5
    assert_losses_close(whole_zbv, whole_1f1b, training_chain_terms(base))
    k = training_chain_terms(base)
    assert_losses_close(out[2]["losses"] + out[3]["losses"], whole_zbv, k, "1f1b -> zbv resume")
    assert_losses_close(out[4]["losses"] + out[5]["losses"], whole_1f1b, k, "zbv -> 1f1b resume")
    for resumed, whole in ((out[3], out[1]), (out[5], out[0])):
        assert set(resumed["state"]) == set(whole["state"])
        for name, w in whole["state"].items():
            torch.testing.assert_close(resumed["state"][name], w, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name: f"{name}: {m}")
