"""Elastic data parallelism (issue 34, training/elastic.py): a job under torchrun --nnodes 1:2
(c10d rendezvous) loses a node and continues on one; then the checkpoint grows back to two
ranks; the loss curve is the uninterrupted one of the same global batch, and each restart says
in one line what changed."""
from __future__ import annotations

import os
import subprocess
import sys

from launch import REPO, read_metrics, train_in_one_world, train_losses
from tolerances import assert_losses_close, training_chain_terms

ARGS = ["--config", "configs/tiny-llama.yaml", "--num-query-groups", "4", "--eval-interval",
        "0", "--log-interval", "1", "--peak-tflops", "1", "--lr-decay-iters", "8"]


def test_lose_a_node_then_grow(tmp_path, corpus_env):
    """Two simulated nodes of one process each (two torchrun agents; the first hosts the c10d
    rendezvous store, which must outlive a lost node); after iteration 3 the second node's
    rank SIGKILLs its agent and itself (the node is gone). The other rank's collective fails,
    its agent restarts the group, which the rendezvous completes with the one node left
    (min 1): world
    2 -> 1, dp 2 -> 1, 2 -> 4 microbatches at global batch 8, resumed from iteration 2. Then
    the final checkpoint grows to 2 ranks for iterations 7-8 (the trainer side of a joining
    node, in a spawned world). The curve 1-8 equals an uninterrupted dp-2 run to the derived
    float32 tolerance (another summation order only)."""
    from distributed import free_port
    from training.metrics import latest_curve

    save, log = tmp_path / "save", tmp_path / "log"
    nodes = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "--rdzv-id", "elastic-test"]
    args = ARGS + ["--train-iters", "6", "--save", str(save), "--load", str(save),
                   "--save-interval", "2", "--log-dir", str(log)]
    env = {**os.environ, **corpus_env, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *nodes, "--rdzv-conf",
         # the store's host; complete a rendezvous 2 s after the minimum joined (default 30 s)
         f"is_host={int(node == 0)},last_call_timeout=2", "train.py", *args], cwd=REPO,
        env=env if node == 0 else {**env, "SHARDZOO_TEST_KILL_NODE_AT": "*:3"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in range(2)]
    outs = []
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0, outs[0][-6000:]
    assert procs[1].returncode != 0  # the lost node
    line = next((x for x in outs[0].splitlines() if x.startswith("elastic restart")), None)
    assert line == ("elastic restart: world size 2 -> 1 (torchrun restart 1): dp 2 -> 1, "
                    "2 -> 4 microbatches of 2 per step, keeping --global-batch-size 8; "
                    "checkpoint iteration 2 resharded to tp 1 x pp 1 x dp 1; the data "
                    "continues at sample 16"), outs[0][-4000:]
    starts = [r for r in read_metrics(log) if r.get("event") == "run_start"]
    assert [(r["world_size"], r["resumed_from_iteration"]) for r in starts] == [(2, None), (1, 2)]
    shrunk = [r["loss"] for r in latest_curve(read_metrics(log)) if "loss" in r]
    assert len(shrunk) == 6
    grown, ref = tmp_path / "grown", tmp_path / "ref"
    out, _ = train_in_one_world(2, [
        ARGS + ["--train-iters", "8", "--load", str(save), "--log-dir", str(grown)],
        ARGS + ["--train-iters", "8", "--log-dir", str(ref)]], corpus_env["SHARDZOO_CACHE"])
    assert "elastic restart: world size 1 -> 2: dp 1 -> 2, 4 -> 2 microbatches" in out, out
    reference = train_losses(ref)
    assert_losses_close(shrunk + train_losses(grown), reference,
                        training_chain_terms(ARGS + ["--train-iters", "8"]))
    assert reference[-1] < reference[0]


def test_notice_only_when_the_world_changes():
    from training.arguments import parse_config
    from training.elastic import elastic_notice

    config = parse_config(ARGS).validate(4)  # dp 4, micro 2, global 8: 1 microbatch
    meta = {"layout": {"world_size": 4, "dp": 4, "micro_batch_size": 2}, "global_batch_size": 8}
    assert elastic_notice(meta, config, 10, 80) is None
    meta = {"layout": {"world_size": 2, "dp": 2}, "global_batch_size": 16}  # an older one
    line = elastic_notice(meta, config, 10, 160)
    assert line.startswith("elastic restart: world size 2 -> 4: dp 2 -> 4, ? -> 1 "
                           "microbatches of 2 per step, with --global-batch-size 16 -> 8"), line
