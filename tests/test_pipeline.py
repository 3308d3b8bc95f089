"""Pipeline parallelism: losses of the first 5 iterations and the final parameters
equal the single-process run in float32 up to rounding (tests/tolerances.py: `k` = 5 training
steps' chains), for 1F1B, interleaved 1F1B and an uneven split, tied and untied embeddings,
also combined with TP, SP and DP; the tied embedding's two copies stay bit-identical."""
from __future__ import annotations

import pytest
import torch

from distributed import batched_by_world, run_distributed
from tolerances import assert_losses_close, training_chain_terms, weights_mismatch

# --adam-eps 1e-4: some gradients are exactly zero in exact arithmetic (the key bias: adding
# a constant to every key shifts all scores of a query equally) and float noise (~1e-10)
# there would be normalised by Adam into full lr-sized steps of random sign in *any* two
# implementations; an eps well above the noise keeps the final-weight comparison meaningful.
COMMON = ["--train-iters", "5", "--log-interval", "1", "--eval-interval", "0",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--no-tensorboard",
          "--adam-eps", "1e-4"]
GPT4 = ["--config", "configs/tiny-gpt.yaml", "--num-layers", "4"]  # tied embeddings
LLAMA = ["--config", "configs/tiny-llama.yaml"]  # untied, GQA, RoPE, SwiGLU (4 layers)


def _train_worker(runs: list[list[str]], log_dir: str, cache: str) -> list[dict]:
    """Run pretrain() once per argument list, one after the other, inside a run_distributed
    world; per run the losses, full weights and the tied-embedding copies of this rank."""
    return [_train_one(args, f"{log_dir}/{i}", cache) for i, args in enumerate(runs)]


def _train_one(args: list[str], log_dir: str, cache: str) -> dict:
    import os

    import parallel_state as ps
    from models.state_dict import gather_full_state_dict
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    ps.destroy_model_parallel()  # pretrain builds the grid from the config

    def on_end(chunks):
        tied = {}
        for c in chunks:
            if c.pre_process and c.share_embeddings_and_output_weights:
                tied["first"] = c.embedding.word_embeddings.weight.detach().clone()
            if c.post_process and c.share_embeddings_and_output_weights and not c.pre_process:
                tied["last"] = c.output_layer.weight.detach().clone()
        return {"state": gather_full_state_dict(chunks), "tied": tied}

    records = pretrain(parse_config(args + ["--log-dir", log_dir]), on_end=on_end)
    end = records[-1]["on_end"]
    return {"losses": [r["loss"] for r in records if "loss" in r], **end}


def _run(world, runs, tmp_path, corpus_env) -> list[list[dict]]:
    """`[rank][run]` results of the argument lists `runs` (+ COMMON) in one world."""
    return run_distributed(_train_worker, world, [args + COMMON for args in runs],
                           str(tmp_path), corpus_env["SHARDZOO_CACHE"], timeout=300 * len(runs))


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_env):
    out = _run(1, [GPT4, LLAMA], tmp_path_factory.mktemp("ref"), corpus_env)[0]
    return {"gpt": out[0], "llama": out[1]}


CASES = [
    # id, family, world, extra flags
    ("pp2-tied", "gpt", 2, ["--pp", "2"]),
    ("pp4-untied", "llama", 4, ["--pp", "4"]),
    ("pp2-vpp2-tied", "gpt", 4, ["--pp", "2", "--vpp", "2"]),
    ("pp2-vpp2-untied", "llama", 2, ["--pp", "2", "--vpp", "2"]),
    ("pp2-uneven-untied", "llama", 2, ["--pp", "2", "--decoder-first-pipeline-num-layers", "1"]),
    ("tp2-pp2-dp2-sp-untied", "llama", 8, ["--tp", "2", "--pp", "2", "--sequence-parallel"]),
    ("tp2-pp2-dp2-sp-vpp2-tied", "gpt", 8, ["--tp", "2", "--pp", "2", "--vpp", "2",
                                             "--sequence-parallel"]),
]


def _case_args(case) -> list[str]:
    return (GPT4 if case[1] == "gpt" else LLAMA) + case[3]


@pytest.fixture(scope="module")
def case_results(tmp_path_factory, corpus_env):
    """case -> per-rank results; the cases of one world size run in one world."""
    def run_cases(world, cases):
        out = _run(world, [_case_args(c) for c in cases],
                   tmp_path_factory.mktemp(f"world{world}"), corpus_env)
        return [[rank_out[j] for rank_out in out] for j in range(len(cases))]
    return batched_by_world(CASES, lambda c: c[2], run_cases)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pipeline_matches_single_process(case, references, case_results):
    _, family, world, extra = case
    args = _case_args(case)
    out = case_results(case)
    ref = references[family]
    k_step = training_chain_terms(args + COMMON)
    for rank_out in out:
        assert_losses_close(rank_out["losses"], ref["losses"], k_step)
    state = out[0]["state"]
    assert sorted(state) == sorted(ref["state"])
    # each tensor to its largest weight's scale: Adam's g / sqrt(v) turns rounding noise in a
    # near-zero gradient into a larger step on that one element (bounded by --adam-eps)
    assert not weights_mismatch(state, ref["state"], 5 * k_step)
    if family == "gpt":  # tied: the two copies of the embedding are bit-identical
        pairs = 0
        firsts = [r["tied"]["first"] for r in out if "first" in r["tied"]]
        lasts = [r["tied"]["last"] for r in out if "last" in r["tied"]]
        assert lasts, "expected a separate last-stage copy of the tied embedding"
        # same (dp, tp) coordinates hold the same shard: compare as sets of tensors
        for last in lasts:
            assert any(torch.equal(last, first) for first in firsts)
            pairs += 1
        assert pairs == len(lasts)


PROFILED_VPP = [1, 2]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, corpus_env):
    """vpp -> log folder of train.py --profile-pipeline at pp 4 (m 8, 2 iterations); both
    runs in one spawned world of 4 (one start-up; train.py's torchrun launch is covered by
    the checkpointing and run-log tests)."""
    from launch import train_in_one_world

    root = tmp_path_factory.mktemp("profiled")
    args = LLAMA + ["--pp", "4", "--num-layers", "8", "--micro-batch-size", "1",
                    "--global-batch-size", "8", "--train-iters", "2", "--eval-interval", "0",
                    "--profile-pipeline", "--no-tensorboard"]
    train_in_one_world(4, [args + (["--vpp", str(vpp)] if vpp > 1 else [])
                           + ["--log-dir", str(root / f"vpp{vpp}")] for vpp in PROFILED_VPP],
                       corpus_env["SHARDZOO_CACHE"])
    return {vpp: root / f"vpp{vpp}" for vpp in PROFILED_VPP}


@pytest.mark.parametrize("vpp", PROFILED_VPP)
def test_profiled_schedule_has_theoretical_bubble(vpp, profiled):
    """--profile-pipeline records the executed schedule; re-timed with uniform costs (F = 1,
    B = 2) the recorded order of every stage has exactly the bubble (p-1)/(v*m) of Narayanan et
    al. 2021 sec. 2.2, for 1F1B and interleaved 1F1B (pp = 4, m = 8)."""
    import json

    from launch import read_metrics
    from training.timeline import Span, replay

    log_dir = profiled[vpp]
    record = [r for r in read_metrics(log_dir) if "bubble_theory" in r][0]
    assert record["bubble_theory"] == pytest.approx(3 / (vpp * 8))
    assert len(record["bubble_replay"]) == len(record["bubble_wall"]) == 4
    assert record["stage_layers"] == [2, 2, 2, 2] and sum(record["compute_share"]) == \
        pytest.approx(1.0) and min(record["compute_share"]) > 0
    trace = json.loads((log_dir / "pipeline_timeline.json").read_text())["traceEvents"]
    per_rank = [[] for _ in range(4)]
    for e in sorted(trace, key=lambda e: e["ts"]):
        if e["cat"] in "FB":
            _, chunk, mb = e["name"].split()
            per_rank[e["tid"]].append(Span(e["cat"], int(chunk[1:]), int(mb[2:]), 0, 0,
                                           1.0 if e["cat"] == "F" else 2.0))
    assert all(len(spans) == 2 * 8 * vpp for spans in per_rank)
    assert replay(per_rank, 4, vpp) == pytest.approx([3 / (vpp * 8)] * 4, abs=1e-9)
