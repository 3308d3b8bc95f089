"""Dropout with masks keyed by (seed, global sample, site, position) (layers/dropout.py).

- the masks: keep rate 1 - p, scaling, a sequence-parallel shard or a TP head shard is the
  slice of the full mask, different samples / sites / positions draw independent masks, a
  mask does not depend on which microbatch or rank holds the sample;
- training with hidden and attention dropout 0.1 gives the single process's losses and
  gradient norms at every layout (tp 2 without and with SP, pp with vpp, dp with ZeRO-1/2/3,
  recompute full and selective, compiled layers), to the float32 tolerance of
  tests/tolerances.py, and the replica check finds TP and DP replicas identical;
- a start-up or logging measurement that draws from the process's generator (more draws on
  a slower machine, and not the same on every rank) leaves the losses bitwise unchanged, in
  both schemes (`--dropout-masks sample` and Megatron's `rank-streams`).
"""
from __future__ import annotations

import pytest
import torch

import parallel_state as ps
from distributed import run_distributed
from layers.dropout import attention_dropout, hidden_dropout
from tolerances import assert_losses_close, training_chain_terms

P = 0.1


def _hidden(x, ids, site=7, sp=False):
    with ps.dropout_sample_ids(ids):
        return hidden_dropout(x, P, True, site, sequence_parallel=sp)


def test_masks_rate_scale_and_independence(no_grid):
    ps.model_parallel_seed(1234, 0)
    x = torch.ones(64, 8, 256)
    ids = torch.arange(100, 108)
    y = _hidden(x, ids)
    kept = y != 0
    # 131,072 draws of a Bernoulli(0.9): the rate's standard deviation is 8.3e-4
    assert abs(kept.float().mean().item() - (1 - P)) < 5e-3
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / (1 - P)))
    # bf16: x / (1 - p) rounded once (a bf16 scale, 1.109375, would shrink every kept value)
    xb = torch.randn(64, 8, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    yb = _hidden(xb, ids)
    assert torch.equal(yb[kept], (xb.float()[kept] * (1 / (1 - P))).bfloat16())
    assert torch.equal(_hidden(x, ids), y), "a mask is a function of its key"
    # each sample's mask depends on its id, not on its row in the microbatch
    swapped = _hidden(x, ids.flip(0))
    assert torch.equal(swapped, y.flip(1))
    # another sample, site, seed: an independent mask (agreement ~ 0.9^2 + 0.1^2 = 0.82)
    other = [_hidden(x, ids + 8), _hidden(x, ids, site=8)]
    ps.model_parallel_seed(1235, 0)
    other.append(_hidden(x, ids))
    for o in other:
        agree = ((o != 0) == kept).float().mean().item()
        assert abs(agree - 0.82) < 5e-3, agree
    # positions and features are not correlated along rows or columns
    k = kept.float() - kept.float().mean()
    for a, b in ((k[1:], k[:-1]), (k[:, :, 1:], k[:, :, :-1]), (k[:, 1:], k[:, :-1])):
        corr = (a * b).mean() / k.var()
        assert abs(corr.item()) < 0.02, corr


def test_no_sample_ids_or_rank_streams_use_the_tracker_streams(no_grid):
    """A model run outside the training schedules, or --dropout-masks rank-streams: Megatron's
    streams, owned by the tracker, never the process's generator."""
    x = torch.ones(16, 2, 32)
    for scheme, ids in (("sample", None), ("rank-streams", torch.arange(2))):
        ps.model_parallel_seed(1234, 0, dropout_masks=scheme)
        before = torch.get_rng_state()
        with ps.dropout_sample_ids(ids):
            a = hidden_dropout(x, P, True, 7)
            b = hidden_dropout(x, P, True, 7)
        assert not torch.equal(a, b), "a stream advances"
        assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(ValueError, match="dropout_masks"):
        ps.model_parallel_seed(1, 0, dropout_masks="per-rank")


def _shards(ids):
    """On each TP rank: its SP shard of a hidden mask and its heads of an attention mask."""
    ps.model_parallel_seed(99, ps.get_tensor_model_parallel_rank())
    s = 16 // ps.get_tensor_model_parallel_world_size()
    heads = 4 // ps.get_tensor_model_parallel_world_size()
    with ps.dropout_sample_ids(ids):
        hidden = hidden_dropout(torch.ones(s, 3, 8), P, True, 5, sequence_parallel=True)
        full = hidden_dropout(torch.ones(16, 3, 8), P, True, 5, sequence_parallel=False)
        probs = attention_dropout(torch.ones(3, heads, 6, 10), P, 11)
    return hidden, full, probs


def test_shards_are_slices_of_the_full_mask(no_grid):
    ids = torch.tensor([3, 70000, 2 ** 40 + 5])  # ids past 32 bits keep their high part
    (ref_hidden, _, ref_probs), = run_distributed(_shards, 1, ids)
    ranks = run_distributed(_shards, 2, ids, tp=2)
    assert torch.equal(torch.cat([r[0] for r in ranks]), ref_hidden)  # sequence shards
    assert all(torch.equal(r[1], ref_hidden) for r in ranks)  # replicated: the same everywhere
    assert torch.equal(torch.cat([r[2] for r in ranks], dim=1), ref_probs)  # head shards
    assert not torch.equal(ref_probs[0], ref_probs[2])


# --- training: layouts with dropout on --------------------------------------------------

DROPOUT = ["--train-iters", "4", "--log-interval", "1", "--eval-interval", "0",
           "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--no-tensorboard"]
MEASURED_LLAMA = ["--config", "configs/tiny-llama.yaml"] + DROPOUT  # the peak measured
GPT = ["--config", "configs/tiny-gpt.yaml", "--num-layers", "4", "--peak-tflops", "1"] + DROPOUT
LLAMA = MEASURED_LLAMA + ["--peak-tflops", "1"]
LAYOUTS = {  # world -> [(reference, flags)], run one after the other in one world
    1: [("gpt", ["--recompute-granularity", "full"]),
        ("llama", ["--recompute-granularity", "selective"]),
        # compiled layers: one graph shared by every layer (counted in the test; at tp 1 the
        # layer has no graph break, so its frame holds all of it)
        ("llama", ["--compile"])],
    2: [("gpt", ["--tp", "2", "--no-sequence-parallel"]),
        ("llama", ["--tp", "2", "--no-sequence-parallel"]),
        ("llama", ["--tp", "2", "--sequence-parallel", "--recompute-granularity", "selective"]),
        ("gpt", ["--pp", "2", "--vpp", "2"]),
        ("llama", ["--data-parallel-sharding-strategy", "optim_grads_params",
                   "--recompute-granularity", "full"])],
    4: [("gpt", ["--tp", "2", "--pp", "2", "--sequence-parallel", "--use-distributed-optimizer"]),
        # the replicas (DP, and TP for norms and row-parallel biases) checked after every step
        ("llama", ["--tp", "2", "--no-sequence-parallel", "--data-parallel-sharding-strategy",
                   "optim_grads", "--check-weight-hash-across-dp-replicas-interval", "1"])],
}
FAMILY = {"gpt": GPT, "llama": LLAMA}


def _train(runs: list[list[str]], log_dir: str, cache: str, busy: list[bool] | None = None):
    """pretrain() once per argument list; its (losses, grad norms). `busy[i]`: run i's
    start-up peak measurement first draws from the process's generator, a
    different number of values on each rank (a slower machine times more matmuls)."""
    import os

    import training.mfu as flops
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    measure, out = flops.measured_matmul_peak, []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        if busy and busy[i]:
            def measured(*a, **kw):
                torch.randn(1000 * (1 + torch.distributed.get_rank()))
                return measure(*a, **kw)
            flops.measured_matmul_peak = measured
        try:
            records = pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))
        finally:
            flops.measured_matmul_peak = measure
        steps = [r for r in records if "loss" in r]
        out.append(([r["loss"] for r in steps], [r["grad_norm"] for r in steps]))
    return out + [_compiled_layer_graphs()]


def _compiled_layer_graphs() -> int:
    """How many graphs torch.compile keeps for TransformerLayer.forward: one per layer if
    something in a layer (a Python int such as its dropout site) specializes the graph."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from layers.transformer import TransformerLayer

    return len(_debug_get_cache_entry_list(TransformerLayer.forward.__code__))


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory, corpus_env):
    """world -> results of LAYOUTS[world]; world 1 also runs the references first."""
    cache, out = corpus_env["SHARDZOO_CACHE"], {}
    for world, cases in LAYOUTS.items():
        runs = [FAMILY[ref] + flags for ref, flags in cases]
        if world == 1:
            runs = [GPT, LLAMA] + runs
        out[world] = run_distributed(_train, world, runs, str(tmp_path_factory.mktemp("d")),
                                     cache, timeout=900)[0]
    return out


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_dropout_on_every_layout_matches_single_process(world, dropout_runs):
    refs = dict(zip(("gpt", "llama"), dropout_runs[1][:2]))
    results = dropout_runs[world][2:-1] if world == 1 else dropout_runs[world][:-1]
    for (ref, flags), (losses, norms) in zip(LAYOUTS[world], results, strict=True):
        args = FAMILY[ref] + flags
        k_step = training_chain_terms(args)
        ref_losses, ref_norms = refs[ref]
        assert len(losses) == 4, (flags, losses)
        assert_losses_close(losses, ref_losses, k_step, f"losses of {ref} {flags}")
        assert_losses_close(norms, ref_norms, k_step, f"grad norms of {ref} {flags}")
    for ref_losses, _ in refs.values():
        assert ref_losses[-1] < ref_losses[0]
    if world == 1:  # the --compile run's 4 layers: one graph, not one per layer
        assert dropout_runs[1][-1] == 1, dropout_runs[1][-1]


def test_dropout_is_on_and_the_schemes_differ(dropout_runs, tmp_path, corpus_env):
    """Dropout changes the losses (so the matrix above tests masks), and rank-streams is
    another scheme; both unaffected by a busy start-up measurement (bitwise)."""
    no_dropout = MEASURED_LLAMA + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    streams = MEASURED_LLAMA + ["--tp", "2", "--no-sequence-parallel", "--dropout-masks",
                                "rank-streams"]
    sample = MEASURED_LLAMA + ["--tp", "2", "--no-sequence-parallel"]
    runs = [no_dropout, no_dropout, streams, streams, sample]
    (off, _), _, (quiet, _), (busy, _), (sample_busy, _), _ = run_distributed(
        _train, 2, runs, str(tmp_path), corpus_env["SHARDZOO_CACHE"],
        [False, True, False, True, True], timeout=600)[0]
    ref = dropout_runs[1][1][0]
    assert off != ref and quiet != ref
    assert busy == quiet, "a start-up measurement moved Megatron-scheme masks"
    assert sample_busy == dropout_runs[2][1][0], "a start-up measurement moved sample masks"
