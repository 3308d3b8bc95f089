"""Long real runs: extend, resize and preempt a job without repeating or skipping
data; the LR schedule and data config on resume; crash debris.

One 2-process world (dp=2, tiny-llama, float32, dropout 0) runs every pretrain() of the data
order checks in sequence; the SIGTERM preemption runs under real torchrun.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distributed import run_distributed
from launch import REPO, read_metrics

BASE = ["--config", "configs/tiny-llama.yaml", "--num-layers", "2", "--eval-interval", "0",
        "--log-interval", "1", "--peak-tflops", "1", "--no-tensorboard",
        "--lr-decay-iters", "12"]


# 4 samples per step until 16 are consumed, then 8: (4, 4, 4, 4, 8, 8, 8, 8) for 48 samples
RAMPUP = [a for a in BASE if a not in ("--lr-decay-iters", "12")] + [
    "--rampup-batch-size", "4", "4", "16", "--train-samples", "48", "--lr-warmup-iters", "0",
    "--lr-warmup-samples", "8"]


def _runs_worker(runs: list[list[str]], root: str, cache: str, digests=(), before=None):
    """pretrain() per argument list; per run its train records, rank 0's stdout (or the
    error text); then `_digests` per (args, batches) of `digests`. `before[i]`: file
    operations ("rm" a file, "mkdir" a folder) rank 0 does before run i (crash debris)."""
    import contextlib
    import io

    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        for op, path in (before or {}).get(i, []):
            if int(os.environ["RANK"]) == 0:
                os.remove(path) if op == "rm" else os.makedirs(path)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                records = pretrain(parse_config(args + ["--log-dir", f"{root}/log{i}"]))
        except Exception as e:  # noqa: BLE001 - the test checks the message
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        out.append({"steps": [r for r in records if "loss" in r], "printed": printed.getvalue(),
                    "exit": [r for r in records if r.get("event") == "exit"]})
    if digests:
        ps.initialize_model_parallel(device="cpu")
    return out + [_digests(args, batches) for args, batches in digests]


def _digests(args: list[str], batches: list[tuple[int, int]]) -> dict:
    """`batch_digest` of the train split for (start sample, count) pairs, and every sample id
    of [0, max end): what the trainer must have read."""
    import torch.distributed as dist

    from training.arguments import parse_config
    from data_pipeline import batch_digest
    from training.trainer import build_data

    config = parse_config(args).validate(dist.get_world_size())
    _, train_ds, _ = build_data(config)
    end = max(s + n for s, n in batches)
    return {"digests": [batch_digest(train_ds, s, n) for s, n in batches],
            "ids": [train_ds.sample_id(i) for i in range(end)],
            "epoch_samples": train_ds.epoch_samples}


def _meta(path) -> dict:
    return json.loads((path / "metadata.json").read_text())


@pytest.fixture(scope="module")
def world_runs(tmp_path_factory, corpus_env):
    """The runs of `test_extend_resize_and_data_config_on_resume` in one 2-rank world (its
    uninterrupted run is also the SIGTERM test's reference); returns (tmp, out, stdout)."""
    tmp_path = tmp_path_factory.mktemp("long_runs")
    s, sd, se = tmp_path / "s", tmp_path / "sd", tmp_path / "se"
    runs = [
        BASE + ["--train-iters", "12"],  # 0: uninterrupted
        BASE + ["--train-iters", "6", "--save", str(s), "--load", str(s)],  # 1
        BASE + ["--train-iters", "12", "--save", str(s), "--load", str(s)],  # 2: extended
        BASE + ["--train-iters", "9", "--load", str(s / "iter_0000006"), "--save", str(sd),
                "--global-batch-size", "16", "--lr", "2e-3"],  # 3: doubled batch
        BASE + ["--train-iters", "7", "--load", str(s / "iter_0000006"), "--seed", "7",
                "--split", "90,10,0"],  # 4: refused
        BASE + ["--train-iters", "7", "--load", str(s / "iter_0000006"), "--seed", "7",
                "--override-data-config"],  # 5: new data from its start
        BASE + ["--train-iters", "12", "--save", str(se), "--load", str(se),
                "--exit-interval", "3"],  # 6: stops after 3
        BASE + ["--train-iters", "12", "--save", str(se), "--load", str(se),
                "--exit-duration-in-mins", "1e-6"],  # 7: stops after 4
        RAMPUP + ["--save", str(tmp_path / "sr"), "--exit-interval", "3"],  # 8: ramp, stop
        RAMPUP + ["--load", str(tmp_path / "sr")],  # 9: the ramp continues on resume
    ]
    batches = [(8 * i, 8) for i in range(12)] + [(48, 16), (64, 16), (80, 16)]
    before = {2: [("rm", str(s / "latest_checkpointed_iteration.txt"))],  # crash before it
              7: [("mkdir", str(se / "iter_0000004.tmp-0badf00d"))]}  # a killed save's
    out = run_distributed(_runs_worker, 2, runs, str(tmp_path), corpus_env["SHARDZOO_CACHE"],
                          [(BASE, batches), (BASE + ["--seed", "7"], [(0, 8)])], before,
                          timeout=600)[0]
    return tmp_path, out[:len(runs)], out[len(runs):]


def test_extend_resize_and_data_config_on_resume(world_runs):
    """(a) 12 iterations == 6 iterations resumed with --train-iters 12: losses to 1e-6 and
    the same samples per step; (b) resuming with a doubled global batch (and another --lr,
    which is logged) reads each sample at most once and stores the exact consumed_samples;
    (c) a changed --seed is refused naming it, unless --override-data-config, which reads
    the new data from its start; (d) --exit-interval and --exit-duration-in-mins stop,
    save and resume to the uninterrupted losses; (e) crash debris: a missing marker
    resumes from the newest verified checkpoint, a killed save's staging folder is removed
    at start-up."""
    tmp_path, out, (want, seeded) = world_runs
    s, sd, se = tmp_path / "s", tmp_path / "sd", tmp_path / "se"
    ref, first, ext = out[0]["steps"], out[1]["steps"], out[2]["steps"]
    # (a) extension: the same samples (digest per step) and losses
    assert [r["iteration"] for r in first + ext] == list(range(1, 13))
    assert [r["samples_digest"] for r in first + ext] == [r["samples_digest"] for r in ref]
    assert [r["loss"] for r in first + ext] == pytest.approx([r["loss"] for r in ref],
                                                           abs=1e-6)
    print("\niter | uninterrupted digest, loss | 6 + extended resume digest, loss")
    for r, q in zip(ref, first + ext):
        print(f"{r['iteration']:4d} | {r['samples_digest']} {r['loss']:.6f} | "
              f"{q['samples_digest']} {q['loss']:.6f}")
    assert [r["consumed_samples"] for r in ref] == [8 * i for i in range(1, 13)]
    assert _meta(s / "iter_0000012")["consumed_samples"] == 96
    assert "is missing (a save completed but its marker was not written): resuming from " \
        f"the newest verified checkpoint {s / 'iter_0000006'}" in out[2]["printed"]
    # (b) doubled batch from iteration 6: 48 + 3 * 16 samples, each read once
    big = out[3]["steps"]
    assert [r["consumed_samples"] for r in big] == [64, 80, 96]
    assert _meta(sd / "iter_0000009")["consumed_samples"] == 96
    assert "LR schedule changed on resume (lr 0.001 -> 0.002)" in out[3]["printed"]
    assert want["digests"][:12] == [r["samples_digest"] for r in ref]
    assert want["digests"][12:] == [r["samples_digest"] for r in big]
    assert 96 < want["epoch_samples"]  # all in epoch 0, so "at most once" is "distinct"
    assert len(set(want["ids"][:96])) == 96
    # (c) data config
    err = out[4]["error"]
    assert err.startswith("CheckpointError") and "--seed: checkpoint 1234, this run 7" in err
    assert "--split: checkpoint '969,30,1', this run '90,10,0'" in err
    assert "--override-data-config" in err
    assert [r["samples_digest"] for r in out[5]["steps"]] == seeded["digests"]
    assert out[5]["steps"][0]["consumed_samples"] == 56
    # (d) --exit-interval / --exit-duration-in-mins: stop, save, resume exactly
    assert [r["iteration"] for r in out[6]["steps"]] == [1, 2, 3]
    assert "--exit-interval 3" in out[6]["exit"][0]["reason"]
    assert [r["iteration"] for r in out[7]["steps"]] == [4]
    assert "--exit-duration-in-mins" in out[7]["exit"][0]["reason"]
    assert (se / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert "removed 1 leftover(s) of interrupted saves at start-up: iter_0000004.tmp-0badf00d" \
        in out[7]["printed"]
    assert sorted(os.listdir(se)) == ["iter_0000003", "iter_0000004",
                                      "latest_checkpointed_iteration.txt"]
    assert [r["loss"] for r in out[6]["steps"] + out[7]["steps"]] == pytest.approx(
        [r["loss"] for r in ref[:4]], abs=1e-6)


def test_lr_schedule_choice_on_resume():
    """This command line's schedule wins and the change is one line with the LR before and
    after; --use-checkpoint-opt-param-scheduler keeps the checkpoint's."""
    from training.arguments import parse_config
    from training.optimizer import reconcile_schedule, schedule_lr

    saved = {"lr": 1e-3, "min_lr": 1e-4, "lr_warmup_iters": 2, "lr_decay_iters": 6,
             "lr_decay_style": "cosine"}
    t = parse_config(BASE + ["--train-iters", "12"]).validate(1).train
    note = reconcile_schedule(t, saved, 6)
    assert note.startswith("LR schedule changed on resume (lr_decay_iters 6 -> 12)")
    assert f"{schedule_lr(saved, 6):.4e} -> {schedule_lr(vars(t), 6):.4e}" in note
    assert t.lr_decay_iters == 12
    assert reconcile_schedule(t, {**saved, "lr_decay_iters": 12}, 6) is None
    t = parse_config(BASE + ["--train-iters", "12", "--use-checkpoint-opt-param-scheduler"]
                     ).validate(1).train
    note = reconcile_schedule(t, saved, 6)
    assert "keeping the checkpoint's" in note and t.lr_decay_iters == 6
    from models.config import ConfigError

    with pytest.raises(ConfigError, match="contradict"):
        parse_config(BASE + ["--use-checkpoint-opt-param-scheduler",
                             "--override-opt-param-scheduler"]).validate(1)


def test_sigterm_under_torchrun_saves_and_resumes(tmp_path, corpus_env, world_runs):
    """--exit-signal-handler under torchrun: SIGTERM reaches rank 1 inside step 3; both ranks
    finish the step, save iter 3 and exit 0 (the hang doctor dumps nothing); the same
    command then resumes at 4 and the losses equal an uninterrupted run's."""
    save = tmp_path / "save"
    args = BASE + ["--train-iters", "6", "--save", str(save), "--load", str(save),
                   "--exit-signal-handler"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "train.py", *args, "--log-dir", str(tmp_path / "log")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **corpus_env}
    first = subprocess.run(cmd, cwd=REPO, env={**env, "SHARDZOO_TEST_SIGTERM_AT": "1:3"},
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "rank 1: received SIGTERM" in first.stdout
    assert "--exit-signal-handler: SIGTERM received; stopping after iteration 3" in first.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not (tmp_path / "log" / "hang").exists()
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "loaded checkpoint" in second.stdout and "at iteration 3 (24 samples" in \
        second.stdout
    records = read_metrics(tmp_path / "log")
    curve = [(r["iteration"], r["loss"]) for r in records if "loss" in r]
    assert [i for i, _ in curve] == [1, 2, 3, 4, 5, 6]
    ref = world_runs[1][0]["steps"][:6]  # same schedule: --lr-decay-iters 12 is pinned
    assert [x for _, x in curve] == pytest.approx([r["loss"] for r in ref], abs=1e-6)
    print("sigterm stop/resume vs uninterrupted:",
          [(i, round(x, 6), round(r["loss"], 6)) for (i, x), r in zip(curve, ref)])


def test_keep_last_removes_debris_and_missing_marker_falls_back(tmp_path, capsys):
    """--keep-last pruning removes staging/old folders of interrupted saves with a line;
    resolve_checkpoint without a marker: the newest verified checkpoint only when asked
    (--load is --save), skipping one whose files do not match its metadata."""
    import torch
    import torch.distributed.checkpoint as dcp

    from checkpoint.format import CheckpointError, debris, describe_files, resolve_checkpoint
    from training.checkpoint_publish import prune

    root = tmp_path / "save"
    for it in (2, 4, 6):  # small real DCP checkpoints with their metadata.json
        folder = root / f"iter_{it:07d}"
        dcp.save({"w": torch.full((4,), float(it))}, checkpoint_id=str(folder), no_dist=True)
        files = describe_files(str(folder), os.listdir(folder))
        (folder / "metadata.json").write_text(json.dumps(
            {"iteration": it, "files": files, "layout": {}, "model": {}}))
    shard = next(p for p in (root / "iter_0000006").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-3])  # truncated: iter 6 does not verify
    (root / "iter_0000008.tmp-1a2b3c4d").mkdir()
    (root / "iter_0000004.old-00ff00ff").mkdir()
    with pytest.raises(CheckpointError, match="does not exist, but"):
        resolve_checkpoint(str(root))
    assert resolve_checkpoint(str(root), newest_if_no_marker=True) == \
        str(root / "iter_0000004")
    assert [os.path.basename(p) for p in debris(str(root))] == [
        "iter_0000004.old-00ff00ff", "iter_0000008.tmp-1a2b3c4d"]
    (root / "latest_checkpointed_iteration.txt").write_text("6\n")
    prune(str(root), keep_last=2)
    assert "removed 2 leftover(s) of interrupted saves (--keep-last)" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"]


def test_rampup_batch_size_and_train_samples(world_runs, tmp_path, corpus_env):
    """--rampup-batch-size 4 4 16 with --global-batch-size 8 and --train-samples 48:
    Megatron's sizes, exact consumed samples, a resume mid-ramp continues it, the LR counts
    samples, and the losses at dp=2 equal one process's."""
    from run_config.batch_schedule import BatchSchedule
    from tolerances import assert_losses_close, training_chain_terms

    # Megatron: start + floor(consumed / (ramp samples / increments)) * increment
    ramp = BatchSchedule(1024, (32, 32, 6000))
    # 31 increments, one per 6000 / 31 = 193.55 samples
    assert [ramp.size(c) for c in (0, 193, 194, 387, 388, 5999, 6001)] == \
        [32, 32, 64, 64, 96, 992, 1024]
    assert ramp.steps_to(0, 10_000) == sum(1 for _ in _ramp_steps(ramp, 10_000))
    out = world_runs[1]
    steps = out[8]["steps"] + out[9]["steps"]
    assert [r["global_batch_size"] for r in steps] == [4, 4, 4, 4, 8, 8, 8, 8]
    assert [r["consumed_samples"] for r in steps] == [4, 8, 12, 16, 24, 32, 40, 48]
    assert [r["iteration"] for r in steps] == list(range(1, 9))
    assert steps[0]["lr"] == pytest.approx(1e-3 * 4 / 8)  # warmup over 8 samples
    assert steps[1]["lr"] == pytest.approx(1e-3)
    one = run_distributed(_runs_worker, 1, [RAMPUP], str(tmp_path),
                          corpus_env["SHARDZOO_CACHE"], timeout=300)[0][0]["steps"]
    assert [r["samples_digest"] for r in one] == [r["samples_digest"] for r in steps]
    assert_losses_close([r["loss"] for r in steps], [r["loss"] for r in one],
                        training_chain_terms(RAMPUP))


def _ramp_steps(ramp, train_samples):
    consumed = 0
    while consumed + ramp.size(consumed) <= train_samples:
        consumed += ramp.size(consumed)
        yield consumed
