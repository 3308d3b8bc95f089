"""The LoRA serving hook (layers/multi_lora.py) against a per-token reference `B_s (A_s x)`:
rows of several adapters, base rows, uneven groups (pads), a gap slot, several positions,
fused parts whose rows interleave (QKV), an adapter not targeting the layer; at tp 1 and tp 2
(column-parallel: B's rows sharded; row-parallel: A's columns sharded, the partial products
summed); the thread count put back; part rows that do not split the output refused."""
from __future__ import annotations

import pytest
import torch

from distributed import WorkerError, run_distributed

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
    return {"served": (served - want).abs().max().item(), "trained":
            (trained - want).abs().max().item(), "base rows": served[:, 3].abs().max().item(),
            "untouched": untouched, "threads": torch.get_num_threads(),
            "tp": tp}


@pytest.mark.parametrize("kind,tp", [("column", 1), ("qkv", 1), ("row", 1), ("column", 2),
                                     ("row", 2)])
def test_hook_equals_per_token_reference(kind, tp):
    for got in run_distributed(_check, tp, kind, tp=tp):
        assert got["tp"] == tp
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
