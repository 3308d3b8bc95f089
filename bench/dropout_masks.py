"""What layout-independent dropout costs: masks keyed by (seed, sample, site, position)
(`--dropout-masks sample`, layers/dropout.py) against Megatron's per-rank streams
(`--dropout-masks rank-streams`: torch's own dropout and SDPA's dropout), measured in the same
run.

1. Operators, forward + backward, median of alternating rounds:
   - hidden dropout on `[s, b, h]`: `layers.dropout.hidden_dropout` keyed by sample against
     `F.dropout`;
   - core attention with dropout on `[b, n, s, d]`: `layers.attention.core_attention` with the
     keyed mask on the explicit softmax against `F.scaled_dot_product_attention(dropout_p=p)`.
2. A training step (forward, backward, AdamW) of a whole model with hidden and attention
   dropout `--dropout` under each scheme, and without dropout for scale; rounds alternate the
   schemes (ABC ABC ...) so drift on a shared machine cancels.

Run: `python bench/dropout_masks.py` (about 1-2 minutes on 2 CPU cores); `--model`,
`--seq-length`, `--micro-batch-size`, `--rounds`, `--steps` change the step part.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import parallel_state as ps  # noqa: E402
from layers.attention import core_attention  # noqa: E402
from layers.dropout import hidden_dropout  # noqa: E402
from models import GPTModel  # noqa: E402
from parallel_state.host_memory import tune_host_allocator  # noqa: E402
from training.arguments import load_model_config  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _alternate(fns: dict, rounds: int, repeats: int, device) -> dict:
    """name -> median seconds of one call of fns[name], rounds alternating the names."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / repeats)
    return {name: statistics.median(t) for name, t in times.items()}


def _spread(times: list[float]) -> float:
    return (max(times) - min(times)) / statistics.median(times)


def operators(args, device) -> None:
    p, s, b = args.dropout, args.seq_length, args.micro_batch_size
    h, n = args.op_hidden, args.op_heads
    d = h // n
    ids = torch.arange(b, device=device)
    x = torch.randn(s, b, h, device=device, requires_grad=True)
    q, k, v = (torch.randn(b, n, s, d, device=device, requires_grad=True) for _ in range(3))

    def keyed_hidden():
        with ps.dropout_sample_ids(ids):
            hidden_dropout(x, p, True, 1).sum().backward()

    def torch_hidden():
        F.dropout(x, p, True).sum().backward()

    def keyed_attention():
        with ps.dropout_sample_ids(ids):
            core_attention(q, k, v, None, None, None, p, causal=True, dropout_site=3).sum().backward()

    def sdpa_attention():
        F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).sum().backward()

    for what, fns in ((f"hidden dropout [{s}, {b}, {h}]", {"keyed": keyed_hidden,
                                                          "torch": torch_hidden}),
                      (f"attention [{b}, {n}, {s}, {d}] causal", {"keyed": keyed_attention,
                                                                  "sdpa": sdpa_attention})):
        t = _alternate(fns, args.rounds, 5, device)
        (a, ta), (bname, tb) = t.items()
        print(f"{what:40s} fwd+bwd: {a} {ta * 1e3:8.2f} ms | {bname} {tb * 1e3:8.2f} ms | "
              f"ratio {ta / tb:.2f}x")


def training_step(args, device) -> None:
    cfg = load_model_config(args.model)
    cfg.seq_length = cfg.max_position_embeddings = args.seq_length
    b, s = args.micro_batch_size, args.seq_length
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=gen).to(device)
    ids = torch.arange(b, device=device)
    runs = {}
    for scheme, p in (("sample", args.dropout), ("rank-streams", args.dropout), ("off", 0.0)):
        c = load_model_config(args.model)
        c.seq_length = c.max_position_embeddings = args.seq_length
        c.hidden_dropout = c.attention_dropout = p
        ps.model_parallel_seed(1234, 0, dropout_masks="rank-streams" if scheme == "off" else scheme)
        model = GPTModel(c).to(device)
        model.init_weights(1234)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt, scheme=scheme):
            ps.model_parallel_seed(1234, 0, dropout_masks="rank-streams" if scheme == "off"
                                   else scheme)
            with ps.dropout_sample_ids(ids):
                loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[scheme] = step
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in runs.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / args.steps)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"training step ({args.model}, s {s}, b {b}, dropout {args.dropout}, "
          f"{sum(x.numel() for x in GPTModel(cfg).parameters()) / 1e6:.1f}M parameters):")
    for name, t in med.items():
        flag = "  (spread {:.0%}: busy machine, rerun)".format(_spread(times[name])) \
            if _spread(times[name]) > 0.25 else ""
        print(f"  {name:13s} {t * 1e3:8.1f} ms/step  {b * s / t:9,.0f} tok/s{flag}")
    print(f"  cost of layout-independent masks: sample / rank-streams = "
          f"{med['sample'] / med['rank-streams']:.3f}x step time "
          f"(dropout itself: rank-streams / off = {med['rank-streams'] / med['off']:.3f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--op-hidden", type=int, default=768)
    ap.add_argument("--op-heads", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    tune_host_allocator()
    device = torch.device(args.device)
    print(f"device {device} ({torch.get_num_threads()} threads), torch {torch.__version__}")
    operators(args, device)
    training_step(args, device)


if __name__ == "__main__":
    main()
