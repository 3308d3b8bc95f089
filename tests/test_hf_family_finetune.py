"""Fine-tuning an imported DeepSeek-V3 and gpt-oss: transformers' tiny random
DeepseekV3ForCausalLM (MLA with low-rank query, YaRN, group-limited routing) and
GptOssForCausalLM (sinks, alternating windows, clamped biased experts), each with a small
trained tokenizer, imported, trained one `train.py --finetune` step at tp 2 with sequence
parallelism (lr 1e-2), exported; transformers loads the export with nothing missing,
unexpected or mismatched, the weights moved, and its float32 logits equal ours from the
trained checkpoint to tests/tolerances.py's bound.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from launch import REPO, train_in_one_world
from test_hf_dense_families import export_and_load
from tolerances import assert_fp32_close, forward_chain_terms

VOCAB, S = 512, 16  # the trained tokenizer has 400 tokens


def _hf_models(root) -> dict:
    """name -> folder of a tiny random transformers model of each family."""
    from test_hf_gpt_oss import _hf_config
    from test_mla import _hf_configs
    from transformers import AutoModelForCausalLM

    deepseek = _hf_configs()["yarn"]
    deepseek.vocab_size = VOCAB
    out = {}
    for i, (name, cfg) in enumerate((("deepseek-v3", deepseek),
                                     ("gpt-oss", _hf_config(vocab_size=VOCAB)))):
        torch.manual_seed(70 + i)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # random norms, biases and sinks, so a swapped one shows
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if "norm" in pname else 0.0, 0.1)
        out[name] = str(root / name)
        model.save_pretrained(out[name])
    return out


def _native_logits(ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    from checkpoint.format import read_metadata
    from checkpoint.model_io import load_model_weights
    from models import GPTModel, ModelConfig

    import parallel_state as ps

    ps.destroy_model_parallel()
    config = ModelConfig.from_dict(read_metadata(ckpt)["model"])
    model = GPTModel(config).eval()
    load_model_weights(ckpt, [model])
    with torch.no_grad():
        return model(ids)[..., :VOCAB], config


def test_finetune_at_tp2_exports_to_transformers_logits(tmp_path):
    from safetensors.torch import load_file
    from test_finetune import _tokenizer

    from checkpoint.hf import import_hf

    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()
    (tmp_path / "corpus.txt").write_text(text)
    folders, argvs = _hf_models(tmp_path), []
    for name, hf_dir in folders.items():
        _tokenizer(hf_dir, text)
        import_hf(hf_dir, str(tmp_path / f"{name}-ckpt"), log=lambda *a: None)
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input",
                    str(tmp_path / "corpus.txt"), "--output-prefix", str(tmp_path / "data"),
                    "--tokenizer-dir", str(tmp_path / "gpt-oss-ckpt" / "tokenizer"),
                    "--text-unit", "line"], cwd=REPO, check=True, capture_output=True)
    for name in folders:
        argvs.append(["--load", str(tmp_path / f"{name}-ckpt"), "--finetune", "--tp", "2",
                      "--sequence-parallel", "--train-iters", "1", "--lr", "1e-2",
                      "--min-lr", "1e-2", "--lr-warmup-iters", "0", "--seq-length", "32",
                      "--micro-batch-size", "2", "--global-batch-size", "2",
                      "--eval-interval", "0", "--data-path", str(tmp_path / "data_text_document"),
                      "--save", str(tmp_path / f"{name}-save"),
                      "--log-dir", str(tmp_path / f"{name}-log")])
    train_in_one_world(2, argvs)
    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(0))
    for name, hf_dir in folders.items():
        save, out = str(tmp_path / f"{name}-save"), str(tmp_path / f"{name}-hf")
        hf = export_and_load(save, out, name)
        before = load_file(os.path.join(hf_dir, "model.safetensors"))
        after = load_file(os.path.join(out, "model.safetensors"))
        assert set(before) == set(after), name
        moved = sum(not torch.equal(before[k], after[k]) for k in before)
        assert moved > len(before) // 2, f"{name}: {moved} of {len(before)} tensors moved"
        with torch.no_grad():
            ref = hf.eval()(ids).logits
        ours, config = _native_logits(os.path.join(save, "iter_0000001"), ids)
        print(f"{name} fine-tuned at tp 2 (SP), exported: max |logit - transformers| "
              f"{(ours - ref).abs().max():.2e}; {moved} of {len(before)} tensors moved")
        assert_fp32_close(ours, ref, forward_chain_terms(config, S, "logits"),
                          f"{name} fine-tuned at tp 2, exported")
