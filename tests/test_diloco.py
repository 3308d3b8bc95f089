"""DiLoCo (training/diloco.py): H 1 with outer lr 1 and momentum 0 is synchronous data
parallelism, H 4 resumes bitwise mid-period, the counted dp bytes per step fall by H, and the
combinations it cannot run with are refused before any work.

All runs in one spawned world of 4 processes: tensor parallel 2 with sequence parallelism inside
each of 2 data-parallel replicas (the TP/SP reductions stay, only dp's go), tiny-llama, float32,
dropout 0.
"""
from __future__ import annotations

import pytest

from launch import read_metrics, train_in_one_world, train_losses
from tolerances import assert_losses_close, training_chain_terms

COMMON = ["--config", "configs/tiny-llama.yaml", "--eval-interval", "0", "--log-interval", "1",
          "--peak-tflops", "1", "--report-comm", "--tp", "2", "--sequence-parallel"]
# AdamW with beta1 = beta2 = 0 and eps = 1e8 >> |g| updates by lr g / (|g| + eps) = 0.5 g to
# a relative 1e-8 (below float32's unit roundoff): SGD with step 0.5, which is linear in the
# gradient, so averaging the replicas' weights after one step each equals averaging their
# gradients (synchronous data parallelism) up to rounding. No decay, no clipping (a replica's
# norm is not the global one), constant lr.
SGD = ["--adam-beta1", "0", "--adam-beta2", "0", "--adam-eps", "1e8", "--lr", "5e7",
       "--min-lr", "5e7", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
       "--weight-decay", "0", "--clip-grad", "0", "--train-iters", "4"]
H1 = ["--diloco-sync-every", "1", "--diloco-outer-lr", "1", "--diloco-outer-momentum", "0"]
H4 = COMMON + ["--train-iters", "6", "--diloco-sync-every", "4"]  # syncs after 4 and 6


def _dp_bytes(log_dir) -> float:
    """--report-comm's per-step payload bytes of the dp group's all-reduces, summed over ranks
    (the record holds totals over its `steps` steps: whole calls)."""
    rec = next(r for r in read_metrics(log_dir) if r.get("event") == "comm")
    assert all(type(row["calls"]) is int and type(row["bytes"]) is int for row in rec["comm"])
    return sum(row["bytes"] for row in rec["comm"] if row["group"] == "dp") / rec["steps"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_env):
    root = tmp_path_factory.mktemp("diloco")
    save = root / "save"
    argvs = {"dp": COMMON + SGD, "h1": COMMON + SGD + H1,
             "h4": H4 + ["--save", str(save), "--save-interval", "2"],
             "h4-resumed": H4 + ["--load", str(save / "iter_0000002")]}
    outs = train_in_one_world(4, [a + ["--log-dir", str(root / n)] for n, a in argvs.items()],
                              corpus_env["SHARDZOO_CACHE"])
    return root, dict(zip(argvs, outs))


def test_h1_equals_data_parallel(runs):
    root, outs = runs
    assert "DiLoCo: inner AdamW per data-parallel replica" in outs["h1"]
    dp, h1 = train_losses(root / "dp"), train_losses(root / "h1")
    assert len(dp) == 4 and dp[-1] < dp[0]  # it trains
    assert_losses_close(h1, dp, training_chain_terms(COMMON + SGD))


def test_h4_resumes_bitwise_mid_period(runs):
    root, outs = runs
    assert "each replica's own weights and moments" in outs["h4-resumed"], outs["h4-resumed"]
    full, resumed = train_losses(root / "h4"), train_losses(root / "h4-resumed")
    assert resumed == full[2:]  # iterations 3..6: bitwise, the second outer step included
    assert full[-1] < full[0]


def test_counted_dp_bytes_fall_by_h(runs):
    root, _ = runs
    dp, h1, h4 = (_dp_bytes(root / n) for n in ("dp", "h1", "h4"))
    params = next(r for r in read_metrics(root / "h4")
                  if r.get("event") == "run_start")["model_state_psi"]
    # (each rank's psi: TP shards and TP-replicated weights are the same size on both ranks)
    assert h1 == 4 * 4 * params  # one float32 all-reduce of the weights per period and rank
    assert h4 * 4 == h1  # per step: 1/H
    assert 0 < dp - h1 <= 4 * 16  # synchronous DP: the gradients, the loss and token sums


@pytest.mark.parametrize("extra, match", [
    (["--use-distributed-optimizer"], "shards the optimizer over dp"),
    (["--data-parallel-sharding-strategy", "optim_grads_params"], "shards the optimizer"),
    (["--bf16"], "--bf16 / optimizer offload"),
    (["--eval-interval", "6"], "--eval-interval 6 must be a multiple of it"),
    (["--check-weight-hash-across-dp-replicas-interval", "3"], "must be a multiple"),
    (["--diloco-outer-momentum", "1"], "0 <= --diloco-outer-momentum < 1"),
    (["--diloco-outer-lr", "nan"], "finite --diloco-outer-lr > 0"),
    (["--diloco-sync-every", "0"], "must be a positive integer"),
    (["--straggler-threshold", "1"], "--straggler-threshold must be a finite ratio above 1"),
])
def test_refusals(extra, match):
    from models.config import ConfigError
    from training.arguments import parse_config

    with pytest.raises(ConfigError, match=match):
        parse_config(H4 + extra).validate(4)


def test_outer_step_is_torch_nesterov_sgd():
    """The outer step on one replica (dp 1: the pseudo-gradient is the replica's own) against
    torch.optim.SGD(nesterov=True) on the global copy with grad = global - local: the same
    weights after three outer steps; a non-finite pseudo-gradient is not applied."""
    import torch

    from training.diloco import DiLoCo

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    ref = torch.nn.Parameter(w.detach().clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    outer = DiLoCo([w], sync_every=4, outer_lr=0.7, outer_momentum=0.9, group=object())
    for _ in range(3):
        with torch.no_grad():
            w.add_(torch.randn(5, 3) * 0.1)  # what the inner steps did to the replica
        ref.grad = (ref - w).detach()
        sgd.step()
        assert outer.sync()
        # the same float32 operations in the same order: bitwise
        assert torch.equal(w.detach(), ref.detach())
        assert torch.equal(outer.global_params[0], ref.detach())
    before = outer.global_params[0].clone()
    with torch.no_grad():
        w[0, 0] = float("nan")
    assert not outer.sync() and outer.skipped_syncs == 1
    assert torch.equal(outer.global_params[0], before) and torch.equal(w.detach(), before)
    assert [outer.due(i, 10) for i in (3, 4, 8, 9, 10)] == [False, True, True, False, True]
