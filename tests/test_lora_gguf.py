"""QLoRA on a GGUF base kept in its stored block format (`train.py --load model.gguf
--lora-rank R --lora-base-quantization gguf`, training/lora_checkpoint.py `load_gguf_base`):
the frozen base's bytes are the file's tensors' bytes and its blocks the file's, unchanged by
training; the loss falls; tp 2 + SP reproduces one process; a saved run resumes from its
checkpoint; bad combinations and a changed base file are refused in one line."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from distributed import run_distributed

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install gguf")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(GGUF path of a tiny Llama in Q4_0 with Q8_0 attention output, tokenizer folder)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gguf_files import write_gguf
    from test_finetune import _tokenizer

    root = str(tmp_path_factory.mktemp("lora-gguf"))
    tok = os.path.join(root, "tok")
    _tokenizer(tok, open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read())
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, initializer_range=0.1))
    model.save_pretrained(os.path.join(root, "hf"))
    os.makedirs(os.path.join(root, "g"))
    kinds = {"token_embd.weight": "Q8_0"}
    for i in range(2):
        kinds.update({f"blk.{i}.{n}.weight": "Q4_0" for n in (
            "attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_down")})
        kinds[f"blk.{i}.attn_output.weight"] = "Q8_0"
    path = write_gguf(os.path.join(root, "hf"), os.path.join(root, "g", "m.gguf"), tok,
                      quant=kinds)
    return path, tok


def _args(path: str, tok: str, *extra: str) -> list[str]:
    return ["--load", path, "--tokenizer-model", tok, "--lora-rank", "4", "--lora-alpha", "8",
            "--lora-base-quantization", "gguf", "--seq-length", "32", "--train-iters", "6",
            "--eval-interval", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--no-tensorboard", "--peak-tflops", "1", "--lr", "2e-2", "--lr-warmup-iters", "0",
            *extra]


def _train(runs: list[list[str]], log_dir: str, cache: str) -> list:
    """pretrain() per argument list: (losses, the start-up record, {name: (format, blocks)}
    of this rank's low-bit weights after training), or the text of the exception."""
    import json

    import torch.distributed as dist

    import parallel_state as ps
    from layers.quantized import quantized_weights
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()

        def on_end(chunks):
            return {n: (w.format, {k: v.clone() for k, v in w.tensors.items()})
                    for c in chunks for n, w in quantized_weights(c)}
        try:
            records = pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]),
                               on_end=on_end)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out.append(f"{type(e).__name__}: {e}")
            continue
        start = {}
        if dist.get_rank() == 0:
            with open(f"{log_dir}/{i}/metrics.jsonl") as f:
                start = json.loads(f.readline())
        out.append(([r["loss"] for r in records if "loss" in r], start,
                    next(r["on_end"] for r in records if "on_end" in r)))
    return out


def _file_tensors(path: str) -> dict:
    """{GGUF name: (ggml type name, uint8 bytes)} of the file's tensors."""
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, torch.from_numpy(t.data.copy()).view(torch.uint8)
                     .reshape(-1)) for t in reader.tensors}


def test_gguf_base_kept_as_stored_trains_at_tp2_and_resumes(files, tmp_path, corpus_env,
                                                            no_grid):
    from tolerances import assert_losses_close, training_chain_terms

    path, tok = files
    cache = corpus_env["SHARDZOO_CACHE"]
    log = str(tmp_path / "logs")
    one = run_distributed(_train, 1, [_args(path, tok)], log + "1", cache, timeout=600)[0]
    assert isinstance(one[0], tuple), one
    losses, start, weights = one[0]
    assert losses[-1] < losses[0] - 0.02, losses
    # the frozen base: the file's bytes (every tensor: blocks and F32 norms), as predicted
    file = _file_tensors(path)
    frozen = start["model_state_frozen_params_bytes"] + start["model_state_frozen_low_bit_bytes"]
    assert frozen == sum(b.numel() for _, b in file.values())
    assert start["planner_frozen_base_bytes"] == frozen and \
        start["planner_model_state_ratio"] == 1.0
    # its blocks are the file's, after training (q/k rows: llama.cpp's per-head order undone)
    formats = {n: f for n, (f, _) in weights.items()}
    assert formats["embedding.word_embeddings.weight"] == "q8_0"
    assert formats["decoder.layers.1.self_attention.linear_proj.weight"] == "q8_0"
    assert formats["decoder.layers.0.mlp.linear_fc2.weight"] == "q4_0" and len(formats) == 9
    for ours, theirs in (("decoder.layers.1.mlp.linear_fc2.weight", "blk.1.ffn_down.weight"),
                         ("embedding.word_embeddings.weight", "token_embd.weight"),
                         ("decoder.layers.0.self_attention.linear_proj.weight",
                          "blk.0.attn_output.weight")):
        assert torch.equal(weights[ours][1]["blocks"].reshape(-1), file[theirs][1]), ours
    # tp 2 + SP: the same curve; then a resume from its checkpoint continues
    ck = str(tmp_path / "ck")
    two = run_distributed(_train, 2, [
        _args(path, tok, "--tp", "2", "--sequence-parallel", "--save", ck,
              "--save-interval", "3"),
        _args(path, tok, "--tp", "2", "--sequence-parallel", "--train-iters", "8")[2:4]
        + ["--load", ck] + _args(path, tok, "--tp", "2", "--sequence-parallel",
                                 "--train-iters", "8")[4:]], log + "2", cache, timeout=600)[0]
    assert all(isinstance(r, tuple) for r in two), two
    assert_losses_close(two[0][0], losses, training_chain_terms(_args(path, tok)),
                        "GGUF base at tp 2 + SP")
    assert two[0][1]["planner_frozen_base_ratio"] == 1.0
    assert len(two[1][0]) == 2 and two[1][0][-1] < losses[0]  # iterations 7, 8 resumed


def test_gguf_base_refusals(files, tmp_path, corpus_env, no_grid):
    from models.config import ConfigError
    from training.arguments import parse_config

    path, tok = files
    for argv, message in [
        (["--load", path, "--tokenizer-model", tok], "is a GGUF file: train LoRA adapters"),
        (["--load", path, "--tokenizer-model", tok, "--lora-rank", "4"],
         "--lora-base-quantization gguf"),
        (["--load", path, "--tokenizer-model", tok, "--lora-rank", "4",
          "--lora-base-quantization", "int4"], "import it first"),
        (_args(path, tok, "--hidden-size", "96"), "hidden_size: file 64, this run 96")]:
        try:
            config = parse_config(argv)
            config.validate(1)
        except ConfigError as e:
            assert message in str(e), (argv, e)
            continue
        got = run_distributed(_train, 1, [argv], str(tmp_path / "bad"),
                              corpus_env["SHARDZOO_CACHE"], timeout=300)[0][0]
        assert isinstance(got, str) and message in got, (argv, got)
    # a checkpoint trained on a GGUF base refuses to resume on a changed file
    copy = str(tmp_path / "copy.gguf")
    shutil.copy(path, copy)
    ck = str(tmp_path / "ck")
    first = run_distributed(_train, 1, [_args(copy, tok, "--train-iters", "1", "--save", ck)],
                            str(tmp_path / "l1"), corpus_env["SHARDZOO_CACHE"], timeout=300)[0]
    assert isinstance(first[0], tuple), first
    with open(copy, "ab") as f:
        f.write(b"\0")
    got = run_distributed(_train, 1, [["--load", ck] + _args(copy, tok, "--train-iters", "2")[2:]],
                          str(tmp_path / "l2"), corpus_env["SHARDZOO_CACHE"], timeout=300)[0][0]
    assert isinstance(got, str) and "now has sha256" in got, got
