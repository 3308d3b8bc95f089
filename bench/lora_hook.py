"""Microseconds of the LoRA forward hook per targeted linear at one decode step (the cost
bench/lora_throughput.py sees as mixed-batch decode against the base alone).

    python bench/lora_hook.py [--hf PATH] [--batch 8] [--rank 16] [--adapters 3]
        [--steps 50] [--repeats 5]

The model, adapters and row mix of bench/lora_throughput.py (SmolLM2-135M-Instruct, random
rank-16 adapters on every linear, rows round-robin over the adapters and the base): each
step binds the rows (`LoRAManager.bind`, as the engine does once per step) and runs every
targeted linear's hook on a decode input `[1, batch, in]`, adding into a `[1, batch, out]`
output. Both forms of the hook, alternated: the SGMV kernels (layers/lora_kernels.py) and the
`torch.bmm` form they fall back to. Prints the mean per hook (us) and per step (ms) of each,
best of `--repeats` rounds of `--steps` steps, their largest difference, with the load
average before and after (the machine may be shared).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from generate_throughput import default_model  # noqa: E402
from lora_throughput import write_adapter  # noqa: E402


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import parallel_state as ps
    from inference.loading import load
    from inference.lora import LoRAManager
    from layers import lora_kernels

    torch.set_num_threads(os.cpu_count())
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    path = args.hf or default_model()
    model, _, _ = load(hf=path)
    lora = LoRAManager(model, args.adapters, args.rank)
    with tempfile.TemporaryDirectory(prefix="lora-hook-") as tmp:
        for i in range(args.adapters):
            lora.load(f"lora{i}", write_adapter(model.config, os.path.join(tmp, f"l{i}"),
                                                args.rank, i))
    slots = [(i % (args.adapters + 1) + 1) % (args.adapters + 1) for i in range(args.batch)]
    hooks = []
    for m in lora.layers.values():
        in_f = m.a.shape[1]
        out_f = m.layer.output_size if m.row else m.layer.output_size_per_partition
        hooks.append((m, torch.randn(1, args.batch, in_f), torch.zeros(1, args.batch, out_f)))
    print(f"load average before {os.getloadavg()[0]:.2f}", flush=True)
    ext = lora_kernels.extension()
    forms = {"sgmv": ext, "bmm": None} if ext is not None else {"bmm": None}
    best = {form: float("inf") for form in forms}
    deltas = {}
    for _ in range(args.repeats):
        for form, module in forms.items():  # alternated
            lora_kernels._LAZY.module = module
            t0 = time.perf_counter()
            for _ in range(args.steps):
                lora.bind(slots, "cpu")
                for m, x, out in hooks:
                    m._hook(m.layer, (x,), out)
            best[form] = min(best[form], (time.perf_counter() - t0) / args.steps)
            deltas[form] = []
            for m, x, out in hooks:  # one step's deltas, from zero outputs
                y = torch.zeros_like(out)
                m._hook(m.layer, (x,), y)
                deltas[form].append(y)
    lora_kernels._LAZY.module = ext
    print(f"{len(hooks)} hooks, batch {args.batch} (slots {slots}), {args.adapters} adapters "
          f"of rank {args.rank}, {os.cpu_count()} cores, best of {args.repeats} x "
          f"{args.steps} steps; load average after {os.getloadavg()[0]:.2f}")
    for form, t in best.items():
        print(f"  {form}: {t * 1e3:.2f} ms a step, {t / len(hooks) * 1e6:.1f} us a hook")
    if len(deltas) == 2:
        diff = max((a - b).abs().max().item() for a, b in zip(deltas["sgmv"], deltas["bmm"]))
        size = max(b.abs().max().item() for b in deltas["bmm"])
        print(f"  sgmv / bmm: {best['bmm'] / best['sgmv']:.2f}x faster; deltas differ by at "
              f"most {diff:.2e} (largest delta {size:.2e})")


if __name__ == "__main__":
    main()
