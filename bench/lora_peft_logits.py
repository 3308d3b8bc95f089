"""Our logits against peft's for a LoRA checkpoint of a model imported from a GGUF file:
GPTModel with the checkpoint's adapters over its base (the imported float checkpoint, or the
GGUF file's blocks as stored: `--base gguf`) against `peft.PeftModel.from_pretrained` with the
exported adapter folder over transformers' model of the same GGUF file (de-quantized by its
reader, which equals our blocks' values exactly). Prints one JSON line: the largest absolute
logit difference, the largest logit, and how far the adapters move peft's logits.

    python bench/lora_peft_logits.py --gguf FILE.gguf --lora LORA_CKPT --adapter PEFT_DIR \\
        --tokenizer TOKENIZER_DIR --base BASE_CKPT|gguf
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["Question: What does textwrap.dedent do?\nAnswer:",
           "Question: What does json.dumps do?\nAnswer: Serialize"]


def main() -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoint.format import read_metadata, require_checkpoint
    from checkpoint.hf import load_hf_weights
    from checkpoint.model_io import load_model_weights
    from layers.lora import add_lora
    from layers.quantized import Quantization
    from models.config import ModelConfig
    from models.gpt import GPTModel
    from models.hf import open_checked

    p = argparse.ArgumentParser()
    for flag in ("--gguf", "--lora", "--adapter", "--tokenizer", "--base"):
        p.add_argument(flag, required=True)
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = torch.tensor([tok(t)["input_ids"][:12] for t in PROMPTS])
    path = require_checkpoint(args.lora)
    meta = read_metadata(path)
    config, lora = ModelConfig.from_dict(meta["model"]), meta["lora"]
    model = GPTModel(config)
    add_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["target_modules"],
             lora["use_rslora"])
    model.init_weights(0)
    if args.base == "gguf":
        src, _ = open_checked(args.gguf, quantization="keep")
        load_hf_weights(src, config, [model], quantization=Quantization(), part="base")
    else:
        load_model_weights(require_checkpoint(args.base), [model], part="base")
    load_model_weights(path, [model])
    with torch.no_grad():
        ours = model.eval()(ids)[..., :config.vocab_size]
        hf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(args.gguf)), gguf_file=os.path.basename(args.gguf),
            dtype=torch.float32).eval()
        base = hf(ids).logits
        theirs = PeftModel.from_pretrained(hf, args.adapter).eval()(ids).logits
    print(json.dumps({"base": args.base, "max_abs_diff": float((ours - theirs).abs().max()),
                      "max_abs_logit": float(theirs.abs().max()),
                      "adapters_move_logits_by": float((theirs - base).abs().max())}))


if __name__ == "__main__":
    main()
