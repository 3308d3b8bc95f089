"""The LoRA serving hook (layers/multi_lora.py) against a per-token reference `B_s (A_s x)`:
rows of several adapters, base rows, uneven groups (pads), a gap slot, several positions,
fused parts whose rows interleave (QKV), an adapter not targeting the layer; at tp 1 and tp 2
(column-parallel: B's rows sharded; row-parallel: A's columns sharded, the partial products
summed); the thread count put back; part rows that do not split the output refused. The
SGMV kernels (layers/lora_kernels.py) that serve float32 rows: against the reference at tile
edges (ranks and widths that are not multiples of the 8-float vectors), a row's delta the
same bits alone as in any batch, and bad arguments refused by name."""
from __future__ import annotations

import pytest
import torch

from distributed import WorkerError, run_distributed
from tolerances import assert_fp32_close

SLOTS = [0, 0, 2, -1, 0]  # row i's slot (-1: base); slot 1 is a gap, slot 0 has 3 rows
SEQ, IN, OUT, R = 3, 8, 12, 2
QKV_ROWS = [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5], [6, 7]]  # q, k, v rows, interleaved


def _adapters(parts: int, out_f: int, in_f: int):
    g = torch.Generator().manual_seed(parts * 100 + out_f)
    return [(torch.randn(parts * R, in_f, generator=g), torch.randn(out_f, parts * R,
                                                                  generator=g))
            for _ in range(3)]


def _reference(x, adapters, rows):
    """Per token: the full delta `[s, b, out]` of each row's adapter (parts: own rows)."""
    y = torch.zeros(x.shape[0], x.shape[1], adapters[0][1].shape[0])
    for i, s in enumerate(SLOTS):
        if s < 0:
            continue
        a, b = adapters[s]
        for p, r in enumerate(rows):
            y[:, i, r] += x[:, i] @ a[p * R:(p + 1) * R].t() @ b[r, p * R:(p + 1) * R].t()
    return y


def _deltas(layer, lora, batch, x):
    """(delta the hook adds with `SLOTS` bound, no grad; the same with grad on)."""
    batch.bind([-1] * len(SLOTS), "cpu")
    with torch.no_grad():
        base = layer(x)
    batch.bind(SLOTS, "cpu")
    with torch.no_grad():
        served = layer(x) - base
    with torch.enable_grad():
        trained = layer(x).detach() - base
    return served, trained


def _check(kind: str):
    import parallel_state as ps
    from layers.linear import ColumnParallelLinear, RowParallelLinear
    from layers.multi_lora import LoRABatch, MultiLoRA
    from layers.sharding import shard_tensor

    torch.set_num_threads(2)
    torch.manual_seed(0)  # the same base weights and input on every rank
    row = kind == "row"
    layer = RowParallelLinear(OUT, IN, bias=False) if row else \
        ColumnParallelLinear(IN, OUT, bias=False)
    in_f, out_f = (OUT, IN) if row else (IN, OUT)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape) * 0.3)  # the base's output ~1
    rows = [torch.tensor(r) for r in QKV_ROWS] if kind == "qkv" else [torch.arange(out_f)]
    batch = LoRABatch()
    lora = MultiLoRA(layer, R, 3, batch, rows if kind == "qkv" else None)
    adapters = _adapters(len(rows), out_f, in_f)
    for s, (a, b) in enumerate(adapters):
        if s == 1:
            lora.set(s, None, None)  # a gap: loaded, targets other layers
        else:
            lora.set(s, shard_tensor(a, layer.weight) if row else a,
                     b if row else shard_tensor(b, layer.weight))
    x_full = torch.randn(SEQ, len(SLOTS), in_f)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    mine = slice(rank * OUT // tp, (rank + 1) * OUT // tp)  # this rank's OUT-sized shard
    x = x_full[..., mine].contiguous() if row else x_full
    served, trained = _deltas(layer, lora, batch, x)
    want = _reference(x_full, adapters, rows)
    if not row:
        want = want[..., mine]
    # rows naming only the gap slot: nothing added
    batch.bind([1, -1, 1, -1, -1], "cpu")
    with torch.no_grad():
        untouched = torch.equal(layer(x), layer.forward(x))
    from layers import lora_kernels
    return {"kernel": lora_kernels.extension() is not None,
            "served": (served - want).abs().max().item(), "trained":
            (trained - want).abs().max().item(), "base rows": served[:, 3].abs().max().item(),
            "untouched": untouched, "threads": torch.get_num_threads(),
            "tp": tp}


@pytest.mark.parametrize("kind,tp", [("column", 1), ("qkv", 1), ("row", 1), ("column", 2),
                                     ("row", 2)])
def test_hook_equals_per_token_reference(kind, tp):
    for got in run_distributed(_check, tp, kind, tp=tp):
        assert got["tp"] == tp
        assert got["kernel"], "the LoRA kernels do not build on this machine (g++, ninja)"
        assert got["served"] < 1e-5 and got["trained"] < 1e-5, got
        assert got["base rows"] == 0 and got["untouched"], got
        assert got["threads"] == 2, got


def _bad_parts():
    from layers.linear import ColumnParallelLinear
    from layers.multi_lora import LoRABatch, MultiLoRA

    layer = ColumnParallelLinear(IN, OUT, bias=False)
    MultiLoRA(layer, R, 2, LoRABatch(), [torch.arange(6), torch.arange(5, OUT)])


def test_part_rows_that_do_not_split_the_output_are_refused():
    with pytest.raises(WorkerError, match="part_rows must split the 12 output rows"):
        run_distributed(_bad_parts, 1)


def _kernel_case(seed: int, n: int, in_f: int, rank: int, widths: list[int], slots: list[int]):
    """A MultiLoRA of `widths` parts (rows interleaved in blocks of 3) over a column-parallel
    base, every slot filled; (lora, batch, x [1, n, in], reference delta [1, n, out])."""
    from layers.linear import ColumnParallelLinear
    from layers.multi_lora import LoRABatch, MultiLoRA

    g = torch.Generator().manual_seed(seed)
    out_f = sum(widths)
    ids = torch.cat([torch.full((w,), i) for i, w in enumerate(widths)])
    perm = torch.randperm(out_f, generator=g) if len(widths) > 1 else torch.arange(out_f)
    ids = ids[perm]  # parts' rows scattered over the output
    rows = [torch.nonzero(ids == i).flatten() for i in range(len(widths))]
    layer = ColumnParallelLinear(in_f, out_f, bias=False)
    batch = LoRABatch()
    lora = MultiLoRA(layer, rank, 4, batch, rows if len(widths) > 1 else None)
    adapters = [(torch.randn(len(widths) * rank, in_f, generator=g),
                 torch.randn(out_f, len(widths) * rank, generator=g)) for _ in range(4)]
    for s, (a, b) in enumerate(adapters):
        for i, r in enumerate(rows):  # part i's block of ranks touches only its rows
            mask = torch.ones(out_f, dtype=torch.bool)
            mask[r] = False
            b[mask, i * rank:(i + 1) * rank] = 0
        lora.set(s, a, b)
    x = torch.randn(1, n, in_f, generator=g)
    want = torch.zeros(1, n, out_f, dtype=torch.float64)
    terms = 0.0  # the largest sum of |terms| an output element accumulates
    for t, s in enumerate(slots):
        if s >= 0:
            a, b = (w.double() for w in adapters[s])
            want[0, t] = b @ (a @ x[0, t].double())
            terms = max(terms, (b.abs() @ (a.abs() @ x[0, t].double().abs())).max().item())
    return lora, batch, x, want, terms


@pytest.mark.parametrize("in_f,rank,widths", [(72, 16, [40, 13, 24]), (20, 3, [7]),
                                              (576, 16, [576, 192, 192]), (9, 8, [33, 31])])
def test_sgmv_kernels_at_tile_edges_and_batch_invariant(in_f, rank, widths):
    from layers import lora_kernels
    assert lora_kernels.extension() is not None, "the LoRA kernels do not build here"
    slots = [1, 2, -1, 1, 3, 1, 1, 2, 0, -1, 1]  # groups of 5, 2, 1, 1 tokens and base rows
    lora, batch, x, want, terms = _kernel_case(in_f + rank, len(slots), in_f, rank, widths,
                                               slots)
    batch.bind(slots, "cpu")
    with torch.no_grad():
        got = torch.zeros(1, len(slots), sum(widths))
        lora._hook(lora.layer, (x,), got)
    assert_fp32_close(got, want, k=in_f + rank, what="kernel delta", scale=terms)
    assert got[0, 2].abs().max() == 0 and got[0, 9].abs().max() == 0  # base rows
    for t, s in enumerate(slots):  # each row alone: the same bits
        if s < 0:
            continue
        batch.bind([s], "cpu")
        alone = torch.zeros(1, 1, sum(widths))
        with torch.no_grad():
            lora._hook(lora.layer, (x[:, t:t + 1],), alone)
        assert torch.equal(alone[0, 0], got[0, t]), (t, s)


def test_sgmv_kernels_refuse_bad_arguments():
    from layers import lora_kernels
    ext = lora_kernels.extension()
    assert ext is not None, "the LoRA kernels do not build here"
    x, at = torch.randn(4, 8), torch.zeros(3, 8, 4)
    tokens, seg = torch.tensor([0, 2]), torch.tensor([0, 1, 2])
    assert ext.shrink(x, at, 0, tokens, seg).shape == (2, 4)
    cases = [((x, at, 2, tokens, seg), "slots 2..4 out of 3"),
             ((x, at, 0, torch.tensor([0, 9]), seg), "token 9 out of 4"),
             ((x, at, 0, tokens, torch.tensor([0, 2, 1])), "seg"),
             ((x, at, 0, tokens, torch.tensor([0, 1, 3])), "seg must run 0..tokens"),
             ((x.double(), at, 0, tokens, seg), "x must be contiguous float32"),
             ((x, torch.zeros(3, 4, 8), 0, tokens, seg), "at must be contiguous float32"),
             ((x, at, 0, tokens.int(), seg), "tokens must be a contiguous int64")]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ext.shrink(*args)
    xa, bt, out = torch.zeros(2, 4), torch.zeros(3, 4, 6), torch.zeros(4, 6)
    ext.expand(xa, bt, torch.tensor([[0, 0, 0, 6]]), 0, tokens, seg, out)
    for runs, message in [([[0, 0, 1, 6]], "run 0 out of range"),
                          ([[1, 0, 0, 6]], "run 0 out of range"),
                          ([[0, 2, 0, 5]], "run 0 out of range")]:
        with pytest.raises(RuntimeError, match=message):
            ext.expand(xa, bt, torch.tensor(runs), 0, tokens, seg, out)
