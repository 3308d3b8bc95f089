"""Peak memory while loading a float Hugging Face model with `--quantization int8 | int4`
(inference/loading.py): the weights are quantized one at a time as they load, so the process
should peak near the quantized model plus one float weight, never near the float model.

Writes a random Llama (`--hidden`, `--layers`, `--vocab`; float32 safetensors) to a temporary
folder, then loads it in a fresh process per mode (none = float, int8, int4), each sampling its
own anonymous resident memory (RssAnon: the safetensors file's mapped pages are not counted)
every 2 ms while `load` runs, and prints the peak beside the weight bytes the model ends with.

    python bench/quantized_load_memory.py [--hidden 1024 --layers 8 --vocab 32000]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(folder: str, mode: str) -> dict:
    """In the child: load `folder` with `mode`; peak and start RssAnon, weight bytes."""
    sys.path.insert(0, ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", "29561")
    import torch

    torch.set_num_threads(1)
    import parallel_state as ps
    from inference.loading import load
    from layers.quantized import Quantization, weight_bytes

    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    peak, done = [_rss_anon()], threading.Event()
    start = peak[0]

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.002)
    t = threading.Thread(target=sample)
    t.start()
    model = load(hf=folder, quantization=Quantization(None if mode == "none" else mode))[0]
    done.set()
    t.join()
    low, floats, f32 = weight_bytes(model)
    return {"start": start, "peak": max(peak[0], _rss_anon()), "low_bit": low,
            "float": floats, "float32": f32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(*args.child)))
        return 0
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                          intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.hidden // 64, tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(tmp)
        print(f"llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, float32 "
              f"safetensors; RssAnon while loading (MiB)")
        for mode in ("none", "int8", "int4"):
            out = subprocess.run([sys.executable, __file__, "--child", tmp, mode],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            weights = r["low_bit"] + r["float"]
            grown = r["peak"] - r["start"]
            print(f"{mode:5s} peak {r['peak'] / mib:8.1f} (+{grown / mib:7.1f} over the "
                  f"start); weights held {weights / mib:7.1f} ({r['low_bit'] / mib:.1f} "
                  f"low-bit + {r['float'] / mib:.1f} float; float32 {r['float32'] / mib:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
