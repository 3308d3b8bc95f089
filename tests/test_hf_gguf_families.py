"""Import from GGUF (transformers' `gguf_file=` reader, models/hf/files.py) of the 2025
families, from tiny float32 files written here as llama.cpp writes them (tests/gguf_files.py):

- Qwen3, Qwen3-MoE, Qwen2-MoE, Phi-3, Gemma 2 and Gemma 3 (the families transformers reads
  from GGUF): `open_checked(x.gguf)` gives the ModelConfig the safetensors folder gives;
  transformers' tensors are the original model's bitwise (its expert stacking, Gemma's
  `1 + w` norms, Qwen2-MoE's squeezed shared-expert gate undone); the import's logits on a
  [2, 16] batch equal the original model's and transformers' own GGUF model's at tp 1
  (float32 tolerance); the import exported back equals the original safetensors bitwise and
  transformers loads it with no missing, unexpected or mismatched tensor;
- what transformers' reader drops for these files (`LOST`: Qwen3's head_dim, the expert
  widths, Phi-3's sliding window, Gemma 2's soft-caps, Gemma 3's linear RoPE scaling; it
  takes its config classes' defaults, the released models' values) is read from the header
  (models/hf/gguf_header.py); transformers alone builds another model (or none) from these
  files, which this checks too;
- refused with one line naming the architecture and the fix, nothing written: OLMo 2 and
  OLMoE GGUF files (transformers does not read them), a Mixtral one (llama.cpp's
  architecture "llama" with experts, read by transformers as a dense Llama), an architecture
  transformers lacks, RoPE scaling transformers drops, tensors that do not fit the metadata,
  and headers that are not GGUF (truncated, wrong magic, counts past the file).

Qwen3-MoE from GGUF at tp 2 and ep 2 x tp 2: tests/test_hf_moe_families.py's 4-rank world.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from gguf_files import VOCAB, gguf_configs, tiny_gguf, write_gguf
from tolerances import assert_fp32_close, forward_chain_terms

pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install gguf")
B, S = 2, 16
# config fields transformers' GGUF reader (5.x) leaves at its config class's default for
# these files, the value it takes; models/hf/gguf_header.py reads them from the header
LOST = {"qwen3": {"head_dim": 128},
        "qwen3_moe": {"moe_intermediate_size": 768},
        "qwen2_moe": {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
        "phi3": {"sliding_window": None},
        "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        "gemma3": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (HF folder, GGUF file in a folder of its own, the original model)."""
    from test_finetune import _tokenizer

    root = tmp_path_factory.mktemp("gguf")
    tok = str(root / "tokenizer")
    _tokenizer(tok, open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read())
    return {name: tiny_gguf(name, root, tok) for name in gguf_configs()}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))


def _terms(c) -> int:
    """forward_chain_terms plus the sandwich and q/k norms' sums (test_hf_gemma's `_terms`)."""
    return forward_chain_terms(c, S, "logits") + c.num_layers * (2 * c.hidden_size +
                                                                 c.kv_channels)


def _transformers_gguf(gguf_path: str, config: dict | None):
    """transformers' own model of `gguf_path`: from its config, or from `config` (a config
    dict: transformers' with the header's dropped fields set)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kw = {} if config is None else {"config": CONFIG_MAPPING[config["model_type"]].from_dict(
        {k: v for k, v in config.items() if k != "model_type"})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
            dtype=torch.float32, **kw).eval()


def test_gguf_import_equals_transformers_and_the_original(files, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from checkpoint.format import read_metadata
    from checkpoint.hf import export_hf, import_hf
    from checkpoint.model_io import load_model_weights
    from models import GPTModel, ModelConfig
    from models.hf import config_from_hf, open_checked

    for name, (hf_dir, gguf_path, original) in files.items():
        folder, fname = os.path.split(gguf_path)
        # what transformers alone reads from this file: the LOST fields at its defaults
        plain = AutoConfig.from_pretrained(folder, gguf_file=fname).to_dict()
        for field, value in LOST[name].items():
            got = plain[field]["full_attention"] if name == "gemma3" else plain[field]
            assert got == value, (name, field, got)
        src, c = open_checked(gguf_path)
        # the config the safetensors folder gives, but for the initialization's std (the
        # file does not hold it; it only matters to training from scratch)
        got = c.to_dict()
        want = config_from_hf(json.load(open(os.path.join(hf_dir, "config.json")))).to_dict()
        got["init_method_std"] = want["init_method_std"]
        assert got == want, (name, {k: (v, want[k]) for k, v in got.items() if v != want[k]})
        # the tensors of the original's safetensors file (a tied lm_head is only in memory)
        expected = load_file(os.path.join(hf_dir, "model.safetensors"))
        tied = {"lm_head.weight"} if original.config.tie_word_embeddings else set()
        assert set(src.names) - tied == set(expected), (name, set(src.names) ^ set(expected))
        bad = [n for n in expected if not torch.equal(src.get(n), expected[n])]
        assert not bad, f"{name}: transformers' GGUF tensors differ from the original: {bad}"

        ckpt, out = str(tmp_path / f"{name}-ckpt"), str(tmp_path / f"{name}-hf")
        import_hf(gguf_path, ckpt, log=lambda *a: None)
        config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
        model = GPTModel(config).eval()
        load_model_weights(ckpt, [model])
        with torch.no_grad():
            ours = model(_ids())[..., :VOCAB]
            ref = original(_ids()).logits
            theirs = _transformers_gguf(gguf_path, src.config)(_ids()).logits
        assert torch.equal(theirs, ref), name  # same weights, same code
        print(f"{name} from GGUF tp 1: max |logit - transformers'| "
              f"{float((ours - ref).abs().max()):.2e}")
        assert_fp32_close(ours, ref, _terms(config), f"{name} from GGUF at tp 1")

        export_hf(ckpt, out, log=lambda *a: None)
        assert os.path.exists(os.path.join(out, "tokenizer.json")), name  # carried from GGUF
        exported = load_file(os.path.join(out, "model.safetensors"))
        assert exported.keys() == expected.keys(), name
        assert all(torch.equal(exported[k], expected[k]) for k in expected), name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                           output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys",
                                         "mismatched_keys")), (name, info)


def test_transformers_alone_builds_another_model(files):
    """The losses `LOST` names are real: transformers' own model of the file, without the
    header's fields, cannot load the tensors (a shape from the lost field) or gives other
    logits (the lost field is behaviour). When a transformers release reads a field, this
    fails: drop it from models/hf/gguf_header.py's `_DROPPED` and from `LOST`."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()  # its load reports
    try:
        for name, (_, gguf_path, original) in files.items():
            try:
                model = _transformers_gguf(gguf_path, None)
            except RuntimeError as e:  # ignore_mismatched_sizes=False
                assert "mismatch" in str(e), (name, str(e)[:200])
                print(f"{name}: transformers alone cannot load its GGUF (size mismatch)")
                continue
            with torch.no_grad():
                diff = float((model(_ids()).logits - original(_ids()).logits).abs().max())
            print(f"{name}: transformers alone differs from the original by {diff:.2e}")
            assert diff > 1e-2, name
    finally:
        logging.set_verbosity(level)


# ------------------------------------------------------------------------------ refusals
def _refused(path: str, expected: str, out: str) -> str:
    """`import_hf(path)` raises one line holding `expected` and writes nothing at `out`."""
    from checkpoint.hf import import_hf
    from models.hf import HFConversionError

    with pytest.raises(HFConversionError) as info:
        import_hf(path, out, log=lambda *a: None)
    msg = str(info.value)
    assert expected in msg and "\n" not in msg, msg
    assert not os.path.exists(out)
    return msg


def _header_only(path: str, arch: str, **meta) -> str:
    """A GGUF file with `general.architecture` `arch`, metadata `meta` and no tensors."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_refusals(files, tmp_path, capsys):
    from test_hf_dense_families import _tiny_models
    from test_hf_moe_families import _hf_configs
    from transformers import AutoModelForCausalLM

    from tools import convert_hf

    out = str(tmp_path / "out")
    fix = "import the model's Hugging Face safetensors folder (config.json + model.safetensors)"
    made = {}
    for name, cfg in (("olmo2", _tiny_models()["olmo2"]), ("olmoe", _hf_configs()["olmoe"]),
                      ("mixtral", _hf_configs()["mixtral"])):
        hf_dir = str(tmp_path / name)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(hf_dir)
        made[name] = write_gguf(hf_dir, str(tmp_path / f"{name}.gguf"))
    for name, label in (("olmo2", "OLMo 2"), ("olmoe", "OLMoE")):
        msg = _refused(made[name], f"GGUF architecture '{name}' ({label}) is not one "
                       f"transformers' GGUF reader reads", out)
        assert fix in msg, msg
    _refused(made["mixtral"], "GGUF architecture 'llama' with llama.expert_count 4 is a "
             "mixture of experts (Mixtral): transformers' GGUF reader reads it as a dense Llama "
             "and drops the experts", out)
    # the command line: exit 1, the one line on stderr, nothing written
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf", made["olmo2"], "--out", out]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_hf.py import: ") and "'olmo2'" in err and fix in err, err
    assert "\n" not in err and not os.path.exists(out)

    _refused(_header_only(str(tmp_path / "rwkv.gguf"), "rwkv7"), "GGUF architecture 'rwkv7' "
             "is not one transformers' GGUF reader reads (it reads ", out)
    _refused(_header_only(str(tmp_path / "yarn.gguf"), "qwen3", **{
        "qwen3.rope.scaling.type": "yarn"}), "qwen3.rope.scaling.type 'yarn' is dropped by "
        "transformers' GGUF reader", out)
    noarch = tmp_path / "noarch.gguf"  # the key renamed in the bytes
    noarch.write_bytes(open(_header_only(str(noarch), "qwen3"), "rb").read().replace(
        b"general.architecture", b"general.architecturX"))
    _refused(str(noarch), "has no general.architecture", out)

    # a header whose key_length does not fit the tensors: refused before anything is written
    qwen3 = open(files["qwen3"][1], "rb").read()
    key = b"qwen3.attention.key_length"
    at = qwen3.index(key) + len(key) + 4  # past the value type: the uint32 value
    assert int.from_bytes(qwen3[at:at + 4], "little") == 32
    bad = tmp_path / "bad_key_length.gguf"
    bad.write_bytes(qwen3[:at] + (16).to_bytes(4, "little") + qwen3[at + 4:])
    _refused(str(bad), "transformers cannot load the tensors of", out)
    # hostile counts, refused from the header before transformers reads them: 2**31 blocks
    # (its config built a 2**31-entry layer_types list first: minutes and GBs), a bos id past
    # the 400 tokens (its tokenizer raised IndexError after the weights had loaded)
    for field, value, expected in (
            (b"qwen3.block_count", 2**31, "qwen3.block_count is 2147483648, but the file "
             "holds 25 tensors (at least one per block)"),
            (b"tokenizer.ggml.bos_token_id", 2**31, "tokenizer.ggml.bos_token_id is 2147483648, "
             "not a token id of its 400 tokens")):
        at = qwen3.index(field) + len(field) + 4
        assert qwen3[at - 4:at] == (4).to_bytes(4, "little")  # uint32
        hostile = tmp_path / "hostile.gguf"
        hostile.write_bytes(qwen3[:at] + value.to_bytes(4, "little") + qwen3[at + 4:])
        _refused(str(hostile), expected, out)
    # key_length typed float32: transformers' multi-line validation error, on one line
    at = qwen3.index(key) + len(key)
    hostile.write_bytes(qwen3[:at] + (6).to_bytes(4, "little") + qwen3[at + 4:])
    _refused(str(hostile), "Validation error for field 'head_dim': TypeError", out)
    # not GGUF: truncated, wrong magic, a tensor count past the file
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(qwen3[:200])
    _refused(str(cut), "the GGUF header runs past the end of the file (200 bytes)", out)
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGML" + qwen3[4:])
    _refused(str(magic), "does not start with the GGUF magic bytes", out)
    count = tmp_path / "count.gguf"
    count.write_bytes(qwen3[:8] + (2**62).to_bytes(8, "little") + qwen3[16:])
    _refused(str(count), "the GGUF header runs past the end of the file", out)
