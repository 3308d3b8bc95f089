"""Crafted model files that used to import as garbage or silently as another model, each
refused with one line before any weight is built: a GGUF tensor whose declared type was
changed (F32 -> F16), GGUF tensors whose data overlap or run past the file, a GGUF tensor
of an unknown name (transformers' reader drops it: a renamed `output.weight` made the untied
output layer the tied embedding), a GGUF `context_length` of 2**63 (and config.json's
`max_position_embeddings`), a safetensors weight stored as I32, and a tokenizer folder whose
`tokenizer_config.json` names its own code (`auto_map`: transformers asked "run the custom
code? [y/N]" on stdin, and ran it on "y").

The files are written here; all cases run in one spawned process (`python
tests/test_untrusted_model_files.py ROOT`), the refusals first, which reports each one's
message and the process's peak memory (VmHWM) after it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEAK_MB = 400  # every refusal, imports included (torch + transformers: ~310 MB)


def peak_mb() -> float:
    """This process's peak resident memory in MB (VmHWM: unlike ru_maxrss, not carried over
    from the parent through fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _tensor_entry(data: bytes, name: str) -> int:
    """Byte position of tensor `name`'s entry in a GGUF tensor table: its name's length."""
    return data.index(len(name).to_bytes(8, "little") + name.encode())


def _entry_fields(data: bytes, name: str) -> tuple[int, int]:
    """(position of the ggml type, position of the offset) of tensor `name`."""
    at = _tensor_entry(data, name) + 8 + len(name)
    dims = int.from_bytes(data[at:at + 4], "little")
    kind = at + 4 + 8 * dims
    return kind, kind + 4


def _files(root: str) -> dict:
    """case -> (path, what refusing it must say): the crafted files, written under root."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, HERE)
    from gguf_files import tiny_gguf, write_gguf
    from test_detokenize import llama2_style_tokenizer
    from test_finetune import _tokenizer

    tok = os.path.join(root, "tokenizer")
    _tokenizer(tok, open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read())
    _, good, _ = tiny_gguf("qwen3", root, tok)  # untied output layer, F32 tensors
    data = open(good, "rb").read()
    cases = {"good gguf": (good, None)}

    def craft(case: str, content: bytes, expected: str) -> None:
        path = os.path.join(root, case.replace(" ", "_") + ".gguf")
        open(path, "wb").write(content)
        cases[case] = (path, expected)

    kind, _ = _entry_fields(data, "token_embd.weight")
    assert data[kind:kind + 4] == (0).to_bytes(4, "little")  # F32
    craft("type F32 to F16", data[:kind] + (1).to_bytes(4, "little") + data[kind + 4:],
          "tensor 'token_embd.weight' (F16 [64, 400]) ends at byte")
    _, first = _entry_fields(data, "token_embd.weight")
    _, second = _entry_fields(data, "blk.0.attn_k.weight")
    craft("overlapping offsets", data[:second] + data[first:first + 8] + data[second + 8:],
          "tensors overlap")
    craft("cut data", data[:-4096], "runs past the end of the file")
    at = _tensor_entry(data, "output.weight")
    craft("unknown name", data[:at] + data[at:at + 40].replace(b"output.weight",
                                                               b"outpux.weight") + data[at + 40:],
          "tensor 'outpux.weight' is not a tensor of a qwen3 model (gguf's name map)")
    long_dir = os.path.join(root, "qwen3_long")
    shutil.copytree(os.path.dirname(os.path.dirname(good)) + "/qwen3", long_dir)
    cfg = json.load(open(os.path.join(long_dir, "config.json")))
    json.dump({**cfg, "max_position_embeddings": 2**63},
              open(os.path.join(long_dir, "config.json"), "w"))
    cases["context_length 2**63"] = (
        write_gguf(long_dir, long_dir + ".gguf", tok), "qwen3.context_length is "
        "9223372036854775808, not a count of positions in [1, 16,777,216]")

    torch.manual_seed(0)
    folder = os.path.join(root, "llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=False)
                     ).save_pretrained(folder)
    cases["good safetensors"] = (folder, None)
    int_folder = os.path.join(root, "llama_i32")
    os.makedirs(int_folder)
    state = load_file(os.path.join(folder, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    state[name] = state[name].view(torch.int32)  # the same bytes, declared I32
    save_file(state, os.path.join(int_folder, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(folder, "config.json")))
    json.dump(cfg, open(os.path.join(int_folder, "config.json"), "w"))
    cases["safetensors I32 weight"] = (int_folder, f"tensor '{name}' has dtype I32, but a "
                                       f"weight is a floating type")
    long_folder = os.path.join(root, "llama_long")
    os.makedirs(long_folder)
    os.link(os.path.join(folder, "model.safetensors"),
            os.path.join(long_folder, "model.safetensors"))
    json.dump({**cfg, "max_position_embeddings": 2**63},
              open(os.path.join(long_folder, "config.json"), "w"))
    cases["max_position_embeddings 2**63"] = (
        long_folder, "max_position_embeddings is 9223372036854775808 (int), not at most "
        "16,777,216 positions")

    remote = os.path.join(root, "auto_map")
    llama2_style_tokenizer().save_pretrained(remote)
    cfg_path = os.path.join(remote, "tokenizer_config.json")
    tok_cfg = json.load(open(cfg_path))
    tok_cfg.pop("tokenizer_class", None)  # no class of transformers' own: it asks
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    json.dump(tok_cfg, open(cfg_path, "w"))
    open(os.path.join(remote, "evil.py"), "w").write(
        "import sys\nprint('CUSTOM CODE RAN', file=sys.stderr)\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    cases["tokenizer auto_map"] = (remote, "names its own Python code (auto_map in "
                                   "tokenizer_config.json); code shipped with model files is "
                                   "never run")
    return cases


def _refusals(root: str) -> dict:
    """case -> {"expected", "error" (one line, or None when it loaded), "peak_mb"} of the
    cases in root/cases.json (`_files`), the refusals first (the peak is the process's)."""
    from checkpoint.hf import import_hf
    from models.tokenizer import Tokenizer

    out = {}
    cases = json.load(open(os.path.join(root, "cases.json")))
    for case, (path, expected) in sorted(cases.items(), key=lambda c: c[1][1] is None):
        error = None
        try:
            if case.startswith("tokenizer"):
                Tokenizer(path)
            else:
                import_hf(path, os.path.join(root, "out", case.replace(" ", "_")),
                          log=lambda *a: None)
        except (ValueError, FileNotFoundError) as e:  # HFConversionError is a ValueError
            error = f"{type(e).__name__}: {e}"
        out[case] = {"expected": expected, "error": error, "peak_mb": peak_mb()}
    return out


def test_crafted_files_are_refused_in_one_line(tmp_path):
    pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install gguf")
    json.dump(_files(str(tmp_path)), open(tmp_path / "cases.json", "w"))
    # "y" on stdin: were transformers to ask whether to run the tokenizer's code, it would
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)],
                          input="y\n", capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[y/N]" not in proc.stdout and "CUSTOM CODE RAN" not in proc.stderr, proc.stdout
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, r in got.items():
        print(f"{case}: {r['error']} (peak {r['peak_mb']:.0f} MB)")
        if r["expected"] is None:  # the untouched files import
            assert r["error"] is None, (case, r)
            continue
        assert r["error"] is not None, f"{case}: imported without a word"
        assert r["expected"] in r["error"] and "\n" not in r["error"], (case, r["error"])
        assert r["peak_mb"] < PEAK_MB, (case, r["peak_mb"])
    assert not os.path.exists(tmp_path / "out" / "type_F32_to_F16")


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    print(json.dumps(_refusals(sys.argv[1])))
