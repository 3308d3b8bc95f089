"""Low-bit weight matmuls on CPU: us per call of `QuantizedWeight.linear` per format against
oneDNN's float32 GEMM on the packed weight (layers/gemm.py) and, where they apply, aten's
weight-only kernels (`_weight_int8pack_mm` with bf16 activations and scales,
`_weight_int4pack_mm_for_cpu` with bf16 activations, group 32/128); "i8act" rows are the same
format with 8-bit activations (SHARDZOO_QUANT_ACTIVATIONS=int8), "i8act avx2" those on the
AVX2 tiles where the CPU also has AVX-512 VNNI.

    python bench/quant_matmul.py [--rows 1 8] [--rounds 7] [--calls 10] [--threads 2]
        [--shapes 960x576 576x576 3072x576 576x1536 49152x576] [--dtype float32|bfloat16]
        [--warm]

Shapes are SmolLM2-135M's linears as `out x in` (fused QKV, attention output, fused
gate/up, down, and the tied 49152-row output layer). Every method runs once per round, the
rounds alternate methods (the machine may be shared) and the best round counts; each
round's figure is the mean of `--calls` calls. By default each call reads another copy of
the weight (copies totalling >= 64 MiB, more than the CPU's last-level cache), as decode
does (a model's weights are read once a token, from memory); `--warm` reuses one copy. The
machine's load average is printed with the table. First use builds the kernels (minutes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # q4_k / q6_k: tests/test_quant_formats.py
from layers import gemm  # noqa: E402
from layers.quant import QuantizedWeight, kernels  # noqa: E402

FORMATS = ["int8", "int4/32", "int4/64", "int4/128", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]
COLD_BYTES = 64 << 20


def methods(out: int, inp: int, dtype: torch.dtype):
    """name -> (a function making one weight copy's callable, or None when n/a)."""
    found = {}

    def onednn():
        w = torch.randn(out, inp)
        gemm.pack(w)
        p = gemm.packed(w)
        return (lambda x: gemm.linear_nt(x.float(), p)), w.numel() * 4
    found["onednn f32"] = onednn

    def ours(fmt):
        name, _, group = fmt.partition("/")
        block = {"q4_k": 256, "q6_k": 256}.get(name, int(group or 32))
        if inp % block:
            return None

        def make():
            if name in ("q4_k", "q6_k"):  # random blocks with small half-float scales
                from test_quant_formats import random_blocks
                qw = QuantizedWeight.from_gguf(name.upper(), random_blocks(name, out, inp),
                                               (out, inp))
            else:
                qw = QuantizedWeight.quantize(torch.randn(out, inp), name,
                                              group_size=int(group or 128))
            return (lambda x: qw.linear(x)), qw.nbytes
        return make
    for fmt in FORMATS:
        found[fmt] = ours(fmt)
    for fmt in ("int8", "int4/32", "q8_0", "q4_0", "q4_1"):  # llama.cpp's 8-bit activations
        make = found.get(fmt)
        if make is not None:
            found[fmt + " i8act"] = int8_activations(make)
            if kernels.Q8_ISA == 2 and getattr(kernels.extension(), "q8_isa", lambda: 1)() == 2:
                found[fmt + " i8act avx2"] = int8_activations(make, isa=1)

    def aten_int8():
        q = torch.randint(-127, 128, (out, inp), dtype=torch.int8)
        s = torch.rand(out, dtype=torch.bfloat16)
        return (lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, s)), q.numel()
    found["aten int8 (bf16)"] = aten_int8

    def aten_int4(g):
        if inp % g:
            return None

        def make():
            q = torch.randint(0, 16, (out, inp), dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            sz = torch.rand(inp // g, out, 2, dtype=torch.bfloat16)
            return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.bfloat16(), packed, g, sz)), out * inp // 2
        return make
    for g in (32, 128):
        found[f"aten int4/{g} (bf16)"] = aten_int4(g)
    return {k: v for k, v in found.items() if v is not None}


def int8_activations(make, isa=None):
    """`make` with its calls under SHARDZOO_QUANT_ACTIVATIONS=int8 (and `kernels.Q8_ISA =
    isa`: 1 the AVX2 tiles where the CPU has AVX-512 VNNI)."""
    def made():
        fn, nbytes = make()

        def call(x):
            kernels.ACTIVATIONS = "int8"
            kept = kernels.Q8_ISA
            kernels.Q8_ISA = isa or kept
            try:
                return fn(x)
            finally:
                kernels.ACTIVATIONS, kernels.Q8_ISA = "float", kept
        return call, nbytes
    return made


def bench_shape(out, inp, rows, dtype, rounds, calls, warm):
    ms = methods(out, inp, dtype)
    copies = {}
    for name, make in ms.items():
        fn, nbytes = make()
        n = 1 if warm else max(1, min(32, -(-COLD_BYTES // nbytes)))
        copies[name] = [fn] + [make()[0] for _ in range(n - 1)]
    best = {(name, r): float("inf") for name in ms for r in rows}
    for _ in range(rounds):
        for r in rows:
            x = torch.randn(r, inp).to(dtype)
            for name, fns in copies.items():
                fns[0](x)
                t0 = time.perf_counter()
                for i in range(calls):
                    fns[i % len(fns)](x)
                best[name, r] = min(best[name, r], (time.perf_counter() - t0) / calls)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", nargs="+",
                   default=["960x576", "576x576", "3072x576", "576x1536", "49152x576"])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--warm", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if kernels.extension() is None:
        print("the kernels could not be built: timing the de-quantizing fallback")
    dtype = getattr(torch, a.dtype)
    print(f"torch {torch.__version__}, {a.threads} threads, {torch.get_num_threads()} in use, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, x {a.dtype}, "
          f"{'warm' if a.warm else 'cold'} weights, load before {os.getloadavg()[0]:.1f}")
    for shape in a.shapes:
        out, inp = (int(s) for s in shape.split("x"))
        best = bench_shape(out, inp, a.rows, dtype, a.rounds, a.calls, a.warm)
        names = list(dict.fromkeys(n for n, _ in best))
        print(f"\n[{out} x {inp}]  us per call (best of {a.rounds})  " +
              f"load {os.getloadavg()[0]:.1f}")
        print(f"{'':22s}" + "".join(f"{'rows ' + str(r):>10s}" for r in a.rows)
              + "".join(f"{'vs f32@' + str(r):>10s}" for r in a.rows))
        for n in names:
            print(f"{n:22s}" + "".join(f"{best[n, r] * 1e6:10.0f}" for r in a.rows)
                  + "".join(f"{best['onednn f32', r] / best[n, r]:9.2f}x" for r in a.rows))


if __name__ == "__main__":
    main()
