"""`train.py --load <imported HF checkpoint> --finetune` at tp=2, and the trained checkpoint
exported back to HF: weights from the checkpoint, iteration and optimizer fresh, the
checkpoint's own tokenizer, and (at lr 0) a bitwise HF -> native -> tp=2 training save -> HF
round trip. Its log: the fine-tune defaults of what was not given (a global batch of 16, a
warm-up), and one MFU peak, said once at start-up, that every MFU of the run divides by."""
from __future__ import annotations

import json
import os

import pytest
import torch

from launch import read_metrics, run_main, train_in_one_world
from tools import preprocess_data


def _tokenizer(folder: str, text: str) -> None:
    """A small real BPE tokenizer (trained here, offline) saved as an HF tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def test_finetune_imported_model_at_tp2_and_export(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from checkpoint.hf import export_hf, import_hf

    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()
    (tmp_path / "corpus.txt").write_text(text)
    hf = str(tmp_path / "hf")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(hf)
    _tokenizer(hf, text)
    ckpt = str(tmp_path / "ckpt")
    import_hf(hf, ckpt, log=lambda *a: None)
    assert os.path.isfile(os.path.join(ckpt, "tokenizer", "tokenizer.json"))
    prep = run_main(preprocess_data.cli, ["--input", tmp_path / "corpus.txt", "--output-prefix",
                                          tmp_path / "data", "--tokenizer-dir",
                                          os.path.join(ckpt, "tokenizer"), "--text-unit", "line"])
    assert prep.returncode == 0, prep.stderr
    save = str(tmp_path / "save")
    # lr 0: the saved weights must be exactly the imported ones (AdamW moves nothing); in a
    # spawned world of 2 (rank 0's stdout: the log lines below are rank 0's)
    stdout, = train_in_one_world(2, [[
        "--load", ckpt, "--finetune", "--tp", "2", "--train-iters", "2", "--lr", "0",
        "--min-lr", "0", "--seq-length", "32", "--micro-batch-size", "2", "--eval-interval",
        "0", "--log-interval", "1", "--data-path", str(tmp_path / "data_text_document"),
        "--save", save, "--log-dir", str(tmp_path / "log")]])
    assert "iteration, optimizer and RNG start fresh" in stdout
    assert "finetune defaults (not given): global batch 16, warm-up 2 iterations" in stdout
    assert "batch   global 16 = micro 2 x 8 microbatches x dp 1" in stdout
    records = read_metrics(tmp_path / "log")
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and abs(losses[0] - losses[1]) < 0.5  # lr 0: no learning
    peak = records[0]["peak_tflops"]  # run_start: measured once, at start-up
    assert stdout.count("against a peak of") == 1 and "measured at start-up" in stdout
    steps = [r for r in records if "loss" in r]
    assert all(r["mfu"] is None or r["mfu"] == pytest.approx(r["tflops"] / peak) for r in steps)
    end = records[-1]
    assert end["event"] == "run_end" and end["peak_tflops"] == peak
    assert end["mean_mfu"] is None or end["mean_mfu"] == pytest.approx(end["mean_tflops"] / peak)
    assert f"of the peak {peak:.3g} TFLOP/s per device" in stdout
    saved = json.load(open(os.path.join(save, "iter_0000002", "metadata.json")))
    assert saved["layout"]["tp"] == 2 and saved["iteration"] == 2
    assert any(f["name"] == "tokenizer/tokenizer.json" for f in saved["files"])
    out = str(tmp_path / "back")
    export_hf(save, out, log=lambda *a: None)
    original, back = (load_file(os.path.join(d, "model.safetensors")) for d in (hf, out))
    assert set(original) == set(back)
    for key in original:
        assert torch.equal(original[key], back[key]), key
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen["eos_token_id"] == 2
