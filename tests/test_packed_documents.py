"""Packed documents: --reset-position-ids, --reset-attention-mask, --eod-mask-loss.

A sample holding two documents gives each document's tokens the losses they get alone, and a
training run with the three flags on short documents is layout-equivalent at tp 2 x pp 2 x
dp 2 (the loss stays the global token mean over unmasked tokens).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from distributed import run_distributed
from tolerances import assert_fp32_close, assert_losses_close, training_chain_terms

FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def _separate_vs_packed():
    """Per-token losses of [doc A, EOD, doc B] packed with the three options, and of each
    document run alone (tiny-llama, 2 layers, float32)."""
    from models import GPTModel
    from training.arguments import parse_config
    from data_pipeline.masks import ltor_masks_and_position_ids

    cfg = parse_config(["--config", "configs/tiny-llama.yaml", "--num-layers", "2"]).model
    cfg.vocab_size = 512
    model = GPTModel(cfg)
    model.init_weights(3)
    model.eval()
    eod = 2
    rng = np.random.RandomState(0)
    a, b = rng.randint(3, 512, size=9), rng.randint(3, 512, size=12)
    sample = torch.tensor(np.concatenate([a, [eod], b]))[None]  # [1, 22]
    tokens, labels = sample[:, :-1], sample[:, 1:]
    mask, loss_mask, positions = ltor_masks_and_position_ids(tokens, eod, True, True, True)
    with torch.no_grad():
        packed = model(tokens, labels=labels, position_ids=positions, attention_mask=mask)
        alone_a = model(sample[:, :10 - 1], labels=sample[:, 1:10])  # a -> a[1:], EOD
        alone_b = model(sample[:, 10:-1], labels=sample[:, 11:])
        causal = model(tokens, labels=labels)  # without the options: doc B sees doc A
    return {"packed": packed[0], "loss_mask": loss_mask[0], "a": alone_a[0], "b": alone_b[0],
            "causal": causal[0]}


def test_packed_sample_equals_separate_documents():
    out = run_distributed(_separate_vs_packed, 1, timeout=120)[0]
    p = out["packed"]
    assert out["loss_mask"].tolist() == [1.0] * 9 + [0.0] + [1.0] * 11  # EOD input masked
    assert_fp32_close(p[:9], out["a"], k=200, what="doc A packed vs alone")
    assert_fp32_close(p[10:], out["b"], k=200, what="doc B packed vs alone")
    assert (out["causal"][10:] - out["b"]).abs().max() > 1e-3  # the options matter


def _short_documents(prefix: str, vocab: int, eod: int) -> None:
    from data_pipeline import IndexedDatasetBuilder

    rng = np.random.RandomState(1)
    with IndexedDatasetBuilder(prefix, vocab_size=vocab) as builder:
        for _ in range(400):  # 5..40 tokens + EOD: several documents per 64-token sample
            builder.add_document(np.append(rng.randint(3, vocab, size=rng.randint(5, 40)),
                                           eod).tolist())
        builder.finalize()


def _train(runs: list[list[str]], log_dir: str):
    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        out.append([r["loss"] for r in pretrain(parse_config(args + ["--log-dir",
                                                                     f"{log_dir}/{i}"]))
                    if "loss" in r])
    return out


def test_packed_training_is_layout_equivalent(tmp_path, corpus_env):
    from models.tokenizer import build_tokenizer
    from data_pipeline import ensure_default_corpus

    _, sp = ensure_default_corpus(corpus_env["SHARDZOO_CACHE"], quiet=True)
    tok = build_tokenizer(sp)
    prefix = str(tmp_path / "short")
    _short_documents(prefix, tok.vocab_size, tok.eod)
    args = ["--config", "configs/tiny-llama.yaml", "--num-layers", "4", "--train-iters", "3",
            "--eval-interval", "0", "--log-interval", "1", "--peak-tflops", "1",
            "--no-tensorboard", "--data-path", prefix, "--tokenizer-model", sp, *FLAGS]
    os.environ["SHARDZOO_CACHE"] = corpus_env["SHARDZOO_CACHE"]
    ref, plain = run_distributed(_train, 1, [args, args[:-3]], str(tmp_path / "one"),
                                 timeout=300)[0]
    par = run_distributed(_train, 8, [args + ["--tp", "2", "--pp", "2", "--sequence-parallel"]],
                          str(tmp_path / "eight"), timeout=600)[0][0]
    assert_losses_close(par, ref, training_chain_terms(args))
    assert abs(plain[0] - ref[0]) > 1e-4  # the options change the loss
    print("packed losses, 1 process vs tp2 pp2 dp2 (sp):", ref, par)
