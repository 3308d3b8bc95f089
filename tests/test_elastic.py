"""Elastic data parallelism (training/elastic.py): a job under torchrun --nnodes 1:2
(c10d rendezvous) loses a node and continues on one; then a new torchrun agent joins and the
job grows back to two ranks; the loss curve is the uninterrupted one of the same global batch,
and each restart says in one line what changed."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from launch import REPO, read_metrics, read_until, train_in_one_world, train_losses
from tolerances import assert_losses_close, training_chain_terms

ARGS = ["--config", "configs/tiny-llama.yaml", "--num-query-groups", "4", "--eval-interval",
        "0", "--log-interval", "1", "--peak-tflops", "1", "--lr-decay-iters", "8"]


def test_lose_a_node_then_grow_back(tmp_path, corpus_env):
    """Two simulated nodes of one process each (two torchrun agents; the first hosts the c10d
    rendezvous store, which must outlive a lost node); after iteration 3 the second node's
    rank SIGKILLs its agent and itself (the node is gone). The other rank's collective fails,
    its agent restarts the group, which the rendezvous completes with the one node left
    (min 1): world 2 -> 1, dp 2 -> 1, 2 -> 4 microbatches at global batch 8, resumed from
    iteration 2. After saving iteration 6 it waits (test hook SHARDZOO_TEST_HOLD_AT) and a
    third agent starts: the running agent sees a node waiting and restarts the group at world
    2 from iteration 6 (the one-machine commands of docs/guide/clusters.md). Every agent has
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it both agents time out waiting for the new
    round's MASTER_ADDR: training/elastic.py). The curve 1-8 equals an uninterrupted dp-2 run
    to the derived float32 tolerance (another summation order only)."""
    from distributed import free_port
    from training.metrics import latest_curve

    save, log = tmp_path / "save", tmp_path / "log"
    nodes = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "--rdzv-id", "elastic-test"]
    args = ARGS + ["--train-iters", "8", "--save", str(save), "--load", str(save),
                   "--save-interval", "2", "--log-dir", str(log)]
    env = {**os.environ, **corpus_env, "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "SHARDZOO_TEST_HOLD_AT": "1:6"}

    def agent(node: int, node_env: dict, out) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *nodes, "--rdzv-conf",
             # the store's host; complete a rendezvous 2 s after the minimum joined (default 30 s)
             f"is_host={int(node == 0)},last_call_timeout=2", "train.py", *args], cwd=REPO,
            env=node_env, stdout=out, stderr=subprocess.STDOUT, text=True)

    files = [open(tmp_path / f"agent{node}.txt", "w+") for node in (1, 2)]
    procs = [agent(0, env, subprocess.PIPE),
             agent(1, {**env, "SHARDZOO_TEST_KILL_NODE_AT": "*:3"}, files[0])]
    lines: list[str] = []
    ref = tmp_path / "ref"
    try:
        # once the first rendezvous has formed the world of 2, the uninterrupted reference
        # trains in a world of its own meanwhile (the job's agents spend seconds waiting on
        # the restarts)
        read_until(procs[0], lines, f"saved checkpoint {save / 'iter_0000002'}")
        pool = ThreadPoolExecutor(1)
        reference_run = pool.submit(train_in_one_world, 2,
                                    [ARGS + ["--train-iters", "8", "--log-dir", str(ref)]],
                                    corpus_env["SHARDZOO_CACHE"])
        pool.shutdown(wait=False)
        read_until(procs[0], lines, f"saved checkpoint {save / 'iter_0000006'}")
        procs.append(agent(2, env, files[1]))  # a node joins the shrunk job
        lines.append(procs[0].communicate(timeout=300)[0])
        procs[2].wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
    outs = ["".join(lines)] + [f.seek(0) or f.read() for f in files]
    assert procs[0].returncode == 0, outs[0][-6000:]
    assert procs[1].returncode != 0  # the lost node
    assert procs[2].returncode == 0, outs[2][-6000:]
    notices = [x for out in outs for x in out.splitlines() if x.startswith("elastic restart")]
    assert notices == [
        "elastic restart: world size 2 -> 1 (torchrun restart 1): dp 2 -> 1, 2 -> 4 "
        "microbatches of 2 per step, keeping --global-batch-size 8; checkpoint iteration 2 "
        "resharded to tp 1 x pp 1 x dp 1; the data continues at sample 16",
        "elastic restart: world size 1 -> 2 (torchrun restart 1): dp 1 -> 2, 4 -> 2 "
        "microbatches of 2 per step, keeping --global-batch-size 8; checkpoint iteration 6 "
        "resharded to tp 1 x pp 1 x dp 2; the data continues at sample 48"], outs[0][-4000:]
    assert "WARNING: no node can re-join" not in outs[0]  # the store is not shared
    starts = [r for r in read_metrics(log) if r.get("event") == "run_start"]
    assert [(r["world_size"], r["resumed_from_iteration"]) for r in starts] == \
        [(2, None), (1, 2), (2, 6)]
    curve = [r["loss"] for r in latest_curve(read_metrics(log)) if "loss" in r]
    assert len(curve) == 8
    reference_run.result()
    reference = train_losses(ref)
    assert_losses_close(curve, reference, training_chain_terms(ARGS + ["--train-iters", "8"]))
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


def test_rejoin_warning_after_a_shrink_under_the_shared_store(monkeypatch):
    from training.arguments import parse_config
    from training.elastic import rejoin_warning

    config = parse_config(ARGS).validate(2)
    shrunk = {"layout": {"world_size": 4, "dp": 4}}
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    line = rejoin_warning(shrunk, config)
    assert line.startswith("WARNING: no node can re-join this job") and \
        line.endswith("start every agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to let nodes "
                      "join a running job"), line
    assert rejoin_warning({"layout": {"world_size": 1, "dp": 1}}, config) is None  # grown
    assert rejoin_warning({"layout": {"world_size": 2, "dp": 2}}, config) is None  # same
    assert rejoin_warning({}, config) is None  # an older checkpoint without a layout
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the variable is set
    assert rejoin_warning(shrunk, config) is None
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # not under torchrun
    assert rejoin_warning(shrunk, config) is None
