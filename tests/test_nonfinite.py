"""Non-finite steps and replica checks (training/nonfinite.py, training/replicas.py).

- a NaN gradient (injected in the backward of the last rank, before the DP reduction) or a
  NaN loss skips the step on every rank: logged with the reason, the weights after a skipped
  step are bitwise those before it, and the run goes on;
- `--max-skipped-iters` consecutive skipped steps stop the run with NonFiniteError (train.py:
  exit 3, one line) without saving: the checkpoint before the streak stays current and whole;
- with `--no-check-for-nan-in-loss-and-grad` the step is applied, and a NaN loss or gradient
  norm stops the run before anything is saved from it;
- the replica check passes on a healthy model and names the parameter and the ranks when one
  rank's copy of a TP-replicated or a DP-replicated parameter is perturbed.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from launch import REPO

BASE = ["--config", "configs/tiny-gpt.yaml", "--eval-interval", "0", "--log-interval", "1",
        "--no-tensorboard", "--peak-tflops", "1", "--lr-decay-style", "constant",
        "--lr-warmup-iters", "0", "--hidden-dropout", "0.1"]


def _weights_digest(chunks) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        for name, p in sorted(chunk.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().clone().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _runs(runs: list[tuple[list[str], str | None]], log_dir: str, cache: str) -> list[dict]:
    """pretrain() per (args, SHARDZOO_TEST_NONFINITE); records, final weights' digest per
    rank, or the NonFiniteError message."""
    import parallel_state as ps
    from training.arguments import parse_config
    from training.nonfinite import TEST_ENV, NonFiniteError
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, (args, inject) in enumerate(runs):
        ps.destroy_model_parallel()
        os.environ.pop(TEST_ENV, None)
        if inject:
            os.environ[TEST_ENV] = inject
        try:
            records = pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]),
                               on_end=_weights_digest)
            out.append({"records": records})
        except NonFiniteError as e:
            out.append({"error": str(e)})
        finally:
            os.environ.pop(TEST_ENV, None)
    return out


def test_nonfinite_steps_are_skipped_and_stop_the_run(tmp_path, corpus_env):
    ckpt = tmp_path / "ckpt"
    runs = [
        (BASE + ["--train-iters", "2", "--tp", "2"], None),  # what the weights are after 2
        (BASE + ["--train-iters", "3", "--tp", "2"], "grad:3"),  # ... and after a skipped 3rd
        (BASE + ["--train-iters", "6", "--tp", "2"], "grad:2 loss:4"),  # two alone: goes on
        (BASE + ["--train-iters", "8", "--use-distributed-optimizer", "--save", str(ckpt),
                 "--save-interval", "2"], "loss:3 grad:4,5"),  # 3 in a row: stops
        (BASE + ["--train-iters", "3", "--no-check-for-nan-in-loss-and-grad"], "loss:2"),
        # unchecked, a NaN gradient at a save interval: applied, then the run stops unsaved
        (BASE + ["--train-iters", "4", "--no-check-for-nan-in-loss-and-grad", "--save",
                 str(tmp_path / "unchecked"), "--save-interval", "2"], "grad:2"),
    ]
    two, skipped_third, goes_on, stops, unchecked, unchecked_grad = run_distributed(
        _runs, 2, runs, str(tmp_path), corpus_env["SHARDZOO_CACHE"], timeout=600)[0]

    def digest(result):
        return [r["on_end"] for r in result["records"] if "on_end" in r]

    assert digest(skipped_third) == digest(two), "a skipped step changed the weights"
    skips = [r for r in skipped_third["records"] if r.get("event") == "skipped"]
    assert [(s["iteration"], s["reason"]) for s in skips] == \
        [(3, "a gradient on rank(s) [1] is not finite")]

    events = {r["iteration"]: r for r in goes_on["records"] if "iteration" in r}
    assert events[2]["event"] == "skipped" and events[4]["event"] == "skipped"
    assert "loss not finite on rank(s) [1]" in events[4]["reason"]
    losses = [r["loss"] for r in goes_on["records"] if "loss" in r and "event" not in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))

    assert "3 consecutive steps skipped (iterations 3..5" in stops["error"]
    assert "stopping without saving" in stops["error"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002",
                                                      "latest_checkpointed_iteration.txt"]
    from checkpoint.format import read_metadata, verify_files

    assert verify_files(str(ckpt / "iter_0000002"), read_metadata(str(ckpt / "iter_0000002"))) == []
    logged = [json.loads(line) for line in open(tmp_path / "3" / "metrics.jsonl")]
    assert [r["iteration"] for r in logged if r.get("event") == "skipped"] == [3, 4, 5]

    assert "loss is NaN at iteration 2 and the step was applied" in unchecked["error"]
    assert "grad norm is NaN at iteration 2 and the step was applied" in unchecked_grad["error"]
    assert not (tmp_path / "unchecked").exists() or not any((tmp_path / "unchecked").iterdir())


def test_train_py_stops_with_one_line_and_exit_3(tmp_path, corpus_env):
    env = dict(os.environ, **corpus_env, SHARDZOO_TEST_NONFINITE="grad:1,2")
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *BASE, "--train-iters", "4",
                           "--max-skipped-iters", "2", "--save", str(tmp_path / "ckpt"),
                           "--log-dir", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "train.py: training error: 2 consecutive steps skipped" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def _replica_check(perturb: str | None):
    """A tiny GPT on this grid; perturb one rank's copy of a parameter; the check's verdict."""
    import parallel_state as ps
    from models import GPTModel
    from models.config import ModelConfig
    from training.replicas import ReplicaMismatchError, check_replicas

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=16, vocab_size=128)
    model = GPTModel(cfg)
    model.init_weights(5)
    check_replicas([model], 1)  # healthy
    if perturb and torch.distributed.get_rank() == 3:
        with torch.no_grad():
            dict(model.named_parameters())[perturb].view(-1)[0] += 1e-6
    try:
        check_replicas([model], 2)
    except ReplicaMismatchError as e:
        return str(e)
    return None


DP_MISMATCH = "differs across data-parallel replicas: ranks [1] vs [3]"
TP_MISMATCH = "differs across tensor-parallel ranks (a TP-replicated parameter): ranks [2] vs [3]"


@pytest.mark.parametrize("param,found", [
    # a norm: rank 3's copy differs from its TP peer (2) and its DP replica (1)
    ("decoder.layers.1.pre_mlp_layernorm.weight", [TP_MISMATCH, DP_MISMATCH]),
    ("decoder.layers.0.mlp.linear_fc1.weight", [DP_MISMATCH]),  # TP-sharded: DP only
])
def test_replica_check_names_parameter_and_ranks(param, found):
    verdicts = run_distributed(_replica_check, 4, param, tp=2)  # tp 2 x dp 2
    assert len(set(verdicts)) == 1, "every rank stops with the same message"
    for where in found:
        assert f"{param} {where}" in verdicts[0], verdicts[0]
    assert f"after iteration 2, weights differ between ranks that must hold the same values " \
           f"({len(found)} difference(s))" in verdicts[0]


def test_replica_check_passes_when_healthy():
    assert run_distributed(_replica_check, 4, None, tp=2) == [None] * 4


def test_flags_are_validated():
    from models.config import ConfigError
    from training.arguments import parse_config

    for args, msg in ((["--max-skipped-iters", "-1"], "--max-skipped-iters must be >= 0"),
                      (["--check-weight-hash-across-dp-replicas-interval", "0"], "must be >= 1"),
                      (["--dropout-masks", "per-rank"], "--dropout-masks must be one of")):
        with pytest.raises(ConfigError, match=msg):
            parse_config(BASE + args).validate(1)



def _diloco_runs(runs: list[tuple[list[str], str]], log_dir: str, cache: str) -> list[dict]:
    """`_runs`, each rank returning its own records (or error) and its skipped iterations."""
    out = _runs(runs, log_dir, cache)
    return [{"skips": [(r["iteration"], r["reason"]) for r in res.get("records", [])
                       if r.get("event") == "skipped"],
             "losses": [r["loss"] for r in res.get("records", [])
                        if "loss" in r and "event" not in r],
             "error": res.get("error")} for res in out]


def test_diloco_nan_gradient_on_one_replica_is_skipped_everywhere(tmp_path, corpus_env):
    """Without the per-step gradient all-reduce only the replica holding a NaN gradient sees a
    NaN norm; every rank must still agree to skip the step (and, unchecked, to stop)."""
    diloco = ["--config", "configs/tiny-llama.yaml", "--eval-interval", "0", "--log-interval",
              "1", "--no-tensorboard", "--peak-tflops", "1", "--diloco-sync-every", "2"]
    ckpt = tmp_path / "ckpt"
    runs = [(diloco + ["--train-iters", "4", "--save", str(ckpt), "--save-interval", "2"],
             "grad:3"),
            (diloco + ["--train-iters", "3", "--no-check-for-nan-in-loss-and-grad"], "grad:2")]
    ranks = run_distributed(_diloco_runs, 2, runs, str(tmp_path), corpus_env["SHARDZOO_CACHE"],
                            timeout=600)
    checked = [r[0] for r in ranks]
    assert [c["error"] for c in checked] == [None, None]
    # the NaN is in replica 1's backward (the last rank): its norm alone is NaN
    assert [c["skips"] for c in checked] == \
        [[(3, "grad norm not finite on rank(s) [1]")]] * 2, checked
    assert all(len(c["losses"]) == 3 and all(map(math.isfinite, c["losses"])) for c in checked)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    from checkpoint.format import read_metadata, verify_files

    assert verify_files(str(ckpt / "iter_0000004"), read_metadata(str(ckpt / "iter_0000004"))) == []
    unchecked = [r[1]["error"] for r in ranks]
    assert unchecked[0] == unchecked[1] and unchecked[0] is not None, unchecked
    assert "grad norm not finite on rank(s) [1] at iteration 2 and the step was applied" \
        in unchecked[0]
