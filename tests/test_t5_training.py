"""T5 pretraining: span corruption over indexed .bin/.idx files, and loss equivalence of
train.py's T5 runs against one process (tp=2 with sequence parallel, dp=2 with the
distributed optimizer, full and selective recompute, a save + resume under the same command,
pp=2 split 1, pp=4 split 2, tp=2 x pp=2 x dp=2), in float32 with hidden and attention dropout
0.1 (layout-independent masks, layers/dropout.py; the resume draws the same masks)."""
from __future__ import annotations

import numpy as np
import pytest

from distributed import run_distributed
from tolerances import assert_losses_close, training_chain_terms

VOCAB, SENTINELS, EOS = 1000, 100, 1


def _span_dataset(tmp_path, seed=7, encoder_length=64, decoder_length=16):
    from data_pipeline import GPTDataset, IndexedDataset, IndexedDatasetBuilder
    from data_pipeline.t5_dataset import T5SpanCorruptionDataset, span_corruption_lengths

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(tmp_path / "docs"), dtype=np.uint16) as b:
        for _ in range(40):  # token ids below the sentinels, EOS-terminated documents
            b.add_document(np.append(rng.integers(2, VOCAB - SENTINELS, rng.integers(20, 200)),
                                     EOS).tolist())
        b.finalize()
    raw, _ = span_corruption_lengths(encoder_length)
    indexed = IndexedDataset(str(tmp_path / "docs"))
    windows = GPTDataset(indexed, np.arange(len(indexed)), 500, raw - 1, seed)
    return windows, T5SpanCorruptionDataset(
        windows, encoder_seq_length=encoder_length, decoder_seq_length=decoder_length,
        vocab_size=VOCAB, num_sentinels=SENTINELS, eos_id=EOS, pad_id=0, seed=seed)


def test_span_corruption_reconstructs_text_with_sentinels_in_order(tmp_path):
    from data_pipeline.t5_dataset import uncorrupt

    windows, ds = _span_dataset(tmp_path)
    noise, raw = 0, 0
    for i in range(300):
        item = ds[i]
        inputs = item["text_enc"][item["enc_mask"]]
        targets = item["labels"][item["loss_mask"] > 0]
        assert inputs[-1] == EOS and targets[-1] == EOS
        first = VOCAB - SENTINELS
        s_in, s_out = inputs[inputs >= first], targets[targets >= first]
        k = len(s_in)
        assert k >= 1 and list(s_in) == list(range(VOCAB - 1, VOCAB - 1 - k, -1))
        assert list(s_out) == list(s_in)  # the same sentinels, in the same order
        assert targets[0] == VOCAB - 1  # the target starts with the first sentinel
        original = windows[i]
        assert np.array_equal(uncorrupt(inputs, targets, VOCAB, SENTINELS), original)
        noise += len(targets) - k - 1
        raw += len(original)
        assert not item["enc_mask"][len(inputs):].any()
        assert (item["labels"][len(targets):] == -100).all()
    assert abs(noise / raw - 0.15) < 0.02, noise / raw
    # seeded and resumable: sample i depends only on (seed, i), not on what was read before
    _, again = _span_dataset(tmp_path)
    for i in (299, 3, 150):
        assert all(np.array_equal(again[i][k], ds[i][k]) for k in ds[i])
    assert not np.array_equal(ds[1]["text_enc"], ds[2]["text_enc"])


def test_span_corruption_lengths_and_errors(tmp_path):
    from data_pipeline.t5_dataset import span_corruption_lengths

    assert span_corruption_lengths(512) == (568, 114)  # the T5 paper's 512 -> 114 targets
    assert span_corruption_lengths(64) == (70, 14)
    with pytest.raises(ValueError, match="raise --decoder-seq-length to >= 14"):
        _span_dataset(tmp_path, decoder_length=12)


# --adam-eps 1e-4 as tests/test_distributed_optimizer.py; --clip-grad 0.05 below every norm
COMMON = ["--model", "t5-tiny", "--train-iters", "3", "--log-interval", "1",
          "--eval-interval", "0", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--no-tensorboard", "--adam-eps", "1e-4", "--clip-grad", "0.05", "--peak-tflops", "1",
          "--lr", "1e-3", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
UNTIED = COMMON  # t5-tiny: v1.1 style, gated-GeLU, untied head
TIED = COMMON + ["--activation", "relu", "--no-untie-embeddings-and-output-weights"]  # v1.0


def _train_worker(runs: list[list[str]], log_dir: str, cache: str):
    """pretrain() once per argument list in this world; the losses and grad norms."""
    import os

    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        steps = [r for r in pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))
                 if "loss" in r]
        out.append({"losses": [r["loss"] for r in steps],
                    "grad_norms": [r["grad_norm"] for r in steps]})
    return out


def _run(world, runs, tmp_path, corpus_env):
    return run_distributed(_train_worker, world, runs, str(tmp_path),
                           corpus_env["SHARDZOO_CACHE"], timeout=600)[0]


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_env):
    untied, tied = _run(1, [UNTIED, TIED], tmp_path_factory.mktemp("ref"), corpus_env)
    return {"untied": untied, "tied": tied}


LAYOUTS = [  # (reference, flags) run one after the other in one world of 2
    ("tied", ["--tp", "2", "--sequence-parallel", "--recompute-granularity", "selective"]),
    ("untied", ["--use-distributed-optimizer", "--recompute-granularity", "full"]),  # dp 2
]


def _check(result, ref, args):
    k_step = training_chain_terms(args)
    assert_losses_close(result["losses"], ref["losses"], k_step)
    assert_losses_close(result["grad_norms"], ref["grad_norms"], k_step, "gradient norms")
    for a, e in zip(result["losses"], ref["losses"]):
        assert abs(a - e) <= 1e-5 * abs(e), (result["losses"], ref["losses"])


def _check_layouts(layouts, world, references, tmp_path, corpus_env, extra_runs=()):
    """Run every `(reference, flags)` of `layouts` (then `extra_runs`) one after the other in
    one world; returns the results of `extra_runs`."""
    runs = [(TIED if ref == "tied" else UNTIED) + flags for ref, flags in layouts]
    results = run_distributed(_train_worker, world, runs + list(extra_runs), str(tmp_path),
                              corpus_env["SHARDZOO_CACHE"], timeout=600)[0]
    for (ref, _), args, result in zip(layouts, runs, results):
        _check(result, references[ref], args)
    return results[len(runs):]


def test_t5_layouts_match_single_process(references, tmp_path, corpus_env):
    # and a resume: stop after step 2 with a checkpoint, then the same command continues
    resume = UNTIED + ["--use-distributed-optimizer", "--save", str(tmp_path / "ckpt"),
                       "--load", str(tmp_path / "ckpt"), "--exit-interval", "2"]
    first, second = _check_layouts(LAYOUTS, 2, references, tmp_path, corpus_env,
                                   [resume, resume])
    _check({k: first[k] + second[k] for k in first}, references["untied"], resume)
    assert len(first["losses"]) == 2 and len(second["losses"]) == 1
    for ref in references.values():
        assert ref["losses"][-1] < ref["losses"][0]  # it trains


PIPELINE_LAYOUTS = [  # one world of 8: encoder stages | decoder stages, 1F1B
    ("untied", ["--pp", "2", "--pipeline-model-parallel-split-rank", "1", "--micro-batch-size",
                "1"]),  # dp 4
    ("tied", ["--pp", "4", "--pipeline-model-parallel-split-rank", "2",
              "--use-distributed-optimizer"]),  # dp 2; the tied copy on the last stage
    ("untied", ["--tp", "2", "--pp", "2", "--pipeline-model-parallel-split-rank", "1",
                "--sequence-parallel", "--use-distributed-optimizer"]),  # dp 2
]


def test_t5_pipeline_layouts_match_single_process(references, tmp_path, corpus_env):
    _check_layouts(PIPELINE_LAYOUTS, 8, references, tmp_path, corpus_env)
