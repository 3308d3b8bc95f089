"""A Hugging Face tokenizer folder is untrusted input (models/hf/tokenizer_files.py): hostile
files (nested too deep, `{"model": 5}`, the wrong types, too large, too many added tokens)
are refused in one line naming the file, wherever a tokenizer is loaded (`Tokenizer`, an HF
import, a checkpoint's stored tokenizer at infer.py --load), in bounded memory; a good folder
still loads.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from launch import finish_measured, start_measured
from test_data import hf_tokenizer_dir

DEEP = "[" * 100_000 + "]" * 100_000


def _added(n: int):
    def edit(d: Path) -> None:
        t = json.loads((d / "tokenizer.json").read_text())
        t["added_tokens"] += [{"id": 1000 + i, "content": f"<a{i}>", "special": False}
                              for i in range(n)]
        (d / "tokenizer.json").write_text(json.dumps(t))
    return edit


def _write(name: str, text: str):
    return lambda d: (d / name).write_text(text)


def _drop_added(d: Path) -> None:
    t = json.loads((d / "tokenizer.json").read_text())
    del t["added_tokens"]
    (d / "tokenizer.json").write_text(json.dumps(t))


# case: (edit of a good folder, the file named, words of the problem); before these checks
# each raised RecursionError, KeyError, AttributeError or TypeError from transformers, or
# loaded (the oversized files)
HOSTILE = {
    "deep": (_write("tokenizer.json", '{"model": ' + DEEP + "}"), "tokenizer.json",
             "not valid JSON (RecursionError"),
    "model_5": (_write("tokenizer.json", '{"model": 5}'), "tokenizer.json",
                "not a tokenizers-format tokenizer.json"),
    "deep_200": (_write("tokenizer.json", '{"model": ' + "[" * 200 + "]" * 200 + "}"),
                 "tokenizer.json", "recursion limit exceeded"),
    "no_added_tokens": (_drop_added, "tokenizer.json", "added_tokens must be a list"),
    "config_deep": (_write("tokenizer_config.json", DEEP), "tokenizer_config.json",
                    "RecursionError"),
    "config_list": (_write("tokenizer_config.json", "[1]"), "tokenizer_config.json",
                    "not an object"),
    "decoder_5": (_write("tokenizer_config.json", '{"added_tokens_decoder": 5}'),
                  "tokenizer_config.json", "added_tokens_decoder must be a JSON object"),
    "added_large": (_write("added_tokens.json", '{"<x>": 400}' + " " * (4 * 2**20)),
                    "added_tokens.json", "more than the 4,194,304 accepted"),
    "added_many": (_added(2**16), "tokenizer.json", "adds 65,537 tokens"),  # +its eos
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return Path(hf_tokenizer_dir(tmp_path_factory.mktemp("tok") / "good",
                                 ["hello world, a small tokenizer " * 20]))


def _hostile(good: Path, root: Path, case: str) -> Path:
    folder = root / case
    shutil.copytree(good, folder)
    HOSTILE[case][0](folder)
    return folder


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_tokenizer_file_is_refused_by_name(good, tmp_path, case):
    from models.hf.tokenizer_files import TokenizerFileError
    from models.tokenizer import Tokenizer

    folder = _hostile(good, tmp_path, case)
    _, name, words = HOSTILE[case]
    with pytest.raises(TokenizerFileError) as e:
        Tokenizer(str(folder))
    msg = str(e.value)
    assert str(folder / name) in msg and words in msg and "\n" not in msg, msg
    assert Tokenizer(str(good)).vocab_size > 256  # the good folder still loads


def test_hostile_tokenizer_in_hf_import_and_checkpoint(good, tmp_path):
    """tools/convert_hf.py import of an HF folder whose tokenizer.json is `{"model": 5}`, and
    infer.py --load of a checkpoint whose stored tokenizer.json is nested 100,000 deep (its
    metadata.json rewritten to match, as an attacker would) or whose listed added_tokens.json
    is past its cap: one line naming the file, nothing written, under 400 MiB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from checkpoint.format import describe_files
    from checkpoint.hf import import_hf

    hf = tmp_path / "hf"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=32)
                     ).save_pretrained(hf)
    for name in os.listdir(good):
        shutil.copy(good / name, hf / name)
    ckpt = tmp_path / "ckpt"
    import_hf(str(hf), str(ckpt), log=lambda *a: None)  # the good tokenizer: imported
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()

    (hf / "tokenizer.json").write_text('{"model": 5}')
    runs = {"import": (start_measured(["tools/convert_hf.py", "import", "--hf", str(hf),
                                       "--out", str(tmp_path / "out")]),
                       hf / "tokenizer.json", "not a tokenizers-format")}
    for case, name, text, words in (
            ("deep", "tokenizer.json", '{"model": ' + DEEP + "}", "RecursionError"),
            ("large", "added_tokens.json", "{}" + " " * (4 * 2**20), "more than the")):
        folder = tmp_path / case
        shutil.copytree(ckpt, folder)
        (folder / "tokenizer" / name).write_text(text)
        meta = json.loads((folder / "metadata.json").read_text())
        rel = f"tokenizer/{name}"
        meta["files"] = [f for f in meta["files"] if f["name"] != rel] + \
            describe_files(str(folder), [rel])
        (folder / "metadata.json").write_text(json.dumps(meta))
        runs[case] = (start_measured(["infer.py", "--load", str(folder), "--prompt", "hi",
                                      "--max-new-tokens", "1"]),
                      folder / "tokenizer" / name, words)
    missed = []
    for case, (proc, path, words) in runs.items():
        code, out, peak = finish_measured(proc)
        lines = [x for x in out.splitlines() if str(path) in x]
        if code not in (1, 2) or "Traceback" in out or len(lines) != 1 or words not in lines[0]:
            missed.append(f"{case}: exit {code}: {out[-1500:]}")
        if peak >= 400:
            missed.append(f"{case}: peak {peak:.0f} MiB")
    assert not (tmp_path / "out").exists()
    assert not missed, "\n".join(missed)
