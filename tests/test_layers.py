"""Every parallel layer, forward and backward, against dense single-process torch at tp = 2, 4.

Two kinds of reference, both float32 with dropout off:

- in-worker checks (linear layers, mappings, embedding, cross entropy, norms under SP): the
  worker builds the full tensors from a seeded generator (identical on every rank), shards
  them with `layers.sharding.shard_tensor`, and compares against `torch.nn.functional` on the
  full tensors; shard gradients are all-gathered over TP and put back together with
  `unshard_tensors`. Mismatches are recorded, not raised, so the collectives stay in step and
  one world reports every failing check.
- module cases (attention, MLP, transformer layer, GPTModel): each worker builds the module
  at its TP size, runs `initialize_parameters` with a seed, forward + backward, and returns
  its shards; the parent builds the same module with no grid (tp = 1, the dense model) from
  the same seed and compares outputs, input grads, every parameter (init is
  layout-independent) and every parameter gradient (after the SP all-reduce), real vocab rows
  only for padded vocab tensors.

One spawned world per TP size runs everything (`world` fixture, module scope).

Tolerances: tests/tolerances.py, `ULPS x u x sqrt(k) x max|expected|` with `k` the number of
terms each compared value accumulates (passed at every comparison; `chain_terms` for modules).
"""
from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallel_state as ps
from distributed import run_distributed
from layers import (
    MLP,
    ColumnParallelLinear,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SelfAttention,
    TransformerBlock,
    TransformerLayer,
    VocabParallelEmbedding,
    apply_rotary_pos_emb,
    initialize_parameters,
    shard_tensor,
    unshard_tensors,
    vocab_parallel_cross_entropy,
)
from models import GPTModel, ModelConfig
from tolerances import assert_fp32_close, decoder_chain_terms, fp32_mismatch

TPS = (2, 4)
S, B, H = 8, 2, 32  # sequence, micro batch, hidden: divisible by every TP size tested


# ----------------------------------------------------------------------------- shared pieces

class Expect:
    """Collects mismatches instead of raising (keeps every rank's collectives in step)."""

    def __init__(self, prefix: str = ""):
        self.prefix, self.failures = prefix, []

    def close(self, actual, expected, what, k: int) -> None:
        """`actual` equals `expected` up to the rounding of `k`-term float32 sums."""
        problem = fp32_mismatch(actual, expected, k)
        if problem:
            self.failures.append(f"{self.prefix}{what}: {problem}")

    def differs(self, actual, expected, what, k: int) -> None:
        """`actual` is farther from `expected` than `k`-term rounding could explain."""
        if fp32_mismatch(actual, expected, k) is None:
            self.failures.append(f"{self.prefix}{what}")

    def true(self, cond, what) -> None:
        if not cond:
            self.failures.append(f"{self.prefix}{what}")


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _split(dim, parts=1):
    """A stand-in 'parameter' telling shard_tensor/unshard_tensors how an activation is split."""
    return types.SimpleNamespace(tensor_model_parallel=True, partition_dim=dim,
                                 num_fused_parts=parts)


def _tp():
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _all_gather(t):
    """This tensor from every TP rank, in rank order."""
    parts = [torch.empty_like(t) for _ in range(_tp()[0])]
    dist.all_gather(parts, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return parts


def _dense_clone(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


# ----------------------------------------------------------------------------- in-worker checks

def check_mappings(ex: Expect) -> None:
    tp, rank = _tp()
    base = _randn(2 * tp, 3, 2 * tp, seed=5)
    mine = base * (rank + 1)  # a different tensor on every rank
    everyone = [base * (r + 1) for r in range(tp)]
    total = sum(everyone)
    close = lambda a, e, what: ex.close(a, e, what, k=tp)  # noqa: E731 (sums of tp terms)

    def run(fn, x, g):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(g.clone())  # a fresh buffer: the aliasing case is checked separately below
        return y.detach().clone(), x.grad

    y, dx = run(ps.copy_to_tensor_model_parallel_region, mine, mine)
    close(y, mine, "copy_to fwd = identity")
    close(dx, total, "copy_to bwd = all-reduce")
    y, dx = run(ps.reduce_from_tensor_model_parallel_region, mine, mine)
    close(y, total, "reduce_from fwd = all-reduce")
    close(dx, mine, "reduce_from bwd = identity")
    g = mine.chunk(tp, -1)[0]
    y, dx = run(ps.scatter_to_tensor_model_parallel_region, mine, g)
    close(y, mine.chunk(tp, -1)[rank], "scatter_to_tp fwd = own last-dim slice")
    close(dx, torch.cat([e.chunk(tp, -1)[0] for e in everyone], -1), "scatter_to_tp bwd")
    y, dx = run(ps.gather_from_tensor_model_parallel_region, mine, torch.cat(everyone, -1))
    close(y, torch.cat(everyone, -1), "gather_from_tp fwd = all-gather last dim")
    close(dx, mine, "gather_from_tp bwd = own slice")
    g = mine.chunk(tp, 0)[0]
    y, dx = run(ps.scatter_to_sequence_parallel_region, mine, g)
    close(y, mine.chunk(tp, 0)[rank], "scatter_to_sp fwd = own dim-0 slice")
    close(dx, torch.cat([e.chunk(tp, 0)[0] for e in everyone], 0), "scatter_to_sp bwd")
    full_g = torch.cat([base] * tp, 0) * (rank + 1)  # rank-dependent grad of the gathered seq
    y, dx = run(ps.gather_from_sequence_parallel_region, mine, full_g)
    close(y, torch.cat(everyone, 0), "gather_from_sp fwd = all-gather dim 0")
    close(dx, torch.cat([base] * tp, 0).chunk(tp, 0)[rank] * sum(range(1, tp + 1)),
             "gather_from_sp bwd = reduce-scatter")
    y, dx = run(lambda x: ps.gather_from_sequence_parallel_region(x, False), mine, full_g)
    close(dx, full_g.chunk(tp, 0)[rank], "gather_from_sp(tensor_parallel_output_grad=False) "
                                            "bwd = own slice")
    g = mine.chunk(tp, 0)[0]
    y, dx = run(ps.reduce_scatter_to_sequence_parallel_region, mine, g)
    close(y, total.chunk(tp, 0)[rank], "reduce_scatter_to_sp fwd")
    close(dx, torch.cat([e.chunk(tp, 0)[0] for e in everyone], 0), "reduce_scatter_to_sp bwd")
    # The backward all-reduce must not write into a gradient buffer autograd hands to another
    # branch too: z = copy_to(x) + w gives x and w the same incoming gradient tensor.
    x, w = mine.clone().requires_grad_(), mine.clone().requires_grad_()
    (ps.copy_to_tensor_model_parallel_region(x) + w).backward(mine.clone())
    close(w.grad, mine, "copy_to bwd leaves a sibling branch's gradient alone")
    close(x.grad, total, "copy_to bwd (sibling case) = all-reduce")
    # all_reduce_sequence_parallel_grads sums only tensors tagged sequence_parallel
    tagged, plain = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    tagged.sequence_parallel = True
    tagged.grad, plain.grad = torch.full((3,), rank + 1.0), torch.full((3,), rank + 1.0)
    ps.all_reduce_sequence_parallel_grads([tagged, plain])
    close(tagged.grad, torch.full((3,), float(sum(range(1, tp + 1)))), "SP grads summed")
    close(plain.grad, torch.full((3,), rank + 1.0), "untagged grads untouched")
    try:
        ps.scatter_to_sequence_parallel_region(torch.zeros(tp + 1, 2))
        ex.true(False, "scatter_to_sp of an indivisible sequence must raise")
    except ValueError as e:
        ex.true("--tp" in str(e), f"indivisible-sequence error names --tp: {e}")


def check_mappings_leave_caller_tensors_alone(ex: Expect) -> None:
    """copy_to's backward and reduce_from's forward all-reduce in place (as Megatron does):
    the caller's gradient / input tensor is overwritten. Harmless inside the layers (the
    buffers are fresh matmul outputs), a trap for anyone calling the mappings directly."""
    _, rank = _tp()
    g = torch.full((2, 3), rank + 1.0)
    g0 = g.clone()
    ps.copy_to_tensor_model_parallel_region(torch.zeros(2, 3, requires_grad=True)).backward(g)
    ex.true(torch.equal(g, g0), "copy_to backward overwrote the caller's gradient tensor")
    x = torch.full((2, 3), rank + 1.0)
    x0 = x.clone()
    ps.reduce_from_tensor_model_parallel_region(x)
    ex.true(torch.equal(x, x0), "reduce_from forward overwrote the caller's input tensor")


def check_column_linear(ex: Expect, combos=None) -> None:
    IN, OUT = 8, 16
    combos = combos or [(bias, gather, parts) for bias in (True, False) for gather in (True, False)
                        for parts in (1, 2) if not (gather and parts > 1)]
    for bias, gather, parts in combos:
        tag = f"column(bias={bias}, gather_output={gather}, num_fused_parts={parts}) "
        layer = ColumnParallelLinear(IN, OUT, bias=bias, gather_output=gather,
                                     num_fused_parts=parts)
        W, b = _randn(OUT, IN, seed=1), _randn(OUT, seed=2)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(W, layer.weight))
            if bias:
                layer.bias.copy_(shard_tensor(b, layer.bias))
        x = _randn(S, B, IN, seed=3).requires_grad_()
        gy = _randn(S, B, OUT, seed=4)
        out_split = _split(-1, parts)
        y = layer(x)
        (y * (gy if gather else shard_tensor(gy, out_split))).sum().backward()
        xr, Wr, br = _dense_clone(x, W, b)
        yr = F.linear(xr, Wr, br if bias else None)
        (yr * gy).sum().backward()
        ex.close(y if gather else unshard_tensors(_all_gather(y), out_split), yr,
                 tag + "output", k=IN)
        ex.close(x.grad, xr.grad, tag + "input grad", k=OUT)
        ex.close(unshard_tensors(_all_gather(layer.weight.grad), layer.weight), Wr.grad,
                 tag + "weight grad", k=S * B)
        if bias:
            ex.close(unshard_tensors(_all_gather(layer.bias.grad), layer.bias), br.grad,
                     tag + "bias grad", k=S * B)


def check_row_linear(ex: Expect) -> None:
    IN, OUT = 16, 8
    for bias in (True, False):
        tag = f"row(bias={bias}) "
        layer = RowParallelLinear(IN, OUT, bias=bias)
        W, b = _randn(OUT, IN, seed=1), _randn(OUT, seed=2)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(W, layer.weight))
            if bias:
                layer.bias.copy_(b)
        x_full, gy = _randn(S, B, IN, seed=3), _randn(S, B, OUT, seed=4)
        x = shard_tensor(x_full, _split(-1)).requires_grad_()
        y = layer(x)
        (y * gy).sum().backward()
        xr, Wr, br = _dense_clone(x_full, W, b)
        yr = F.linear(xr, Wr, br if bias else None)
        (yr * gy).sum().backward()
        ex.close(y, yr, tag + "output", k=IN)
        ex.close(unshard_tensors(_all_gather(x.grad), _split(-1)), xr.grad, tag + "input grad",
                 k=OUT)
        ex.close(unshard_tensors(_all_gather(layer.weight.grad), layer.weight), Wr.grad,
                 tag + "weight grad", k=S * B)
        if bias:
            ex.close(layer.bias.grad, br.grad, tag + "bias grad", k=S * B)


def check_sequence_parallel_pair(ex: Expect) -> None:
    """column(SP: all-gather in) -> gelu -> row(SP: reduce-scatter out), fed a sequence shard."""
    tp, rank = _tp()
    FFN = 64
    k = 2 * (H + FFN) + S * B  # two matmuls forward, two backward, then the token sum
    col = ColumnParallelLinear(H, FFN, sequence_parallel=True)
    row = RowParallelLinear(FFN, H, sequence_parallel=True)
    W1, b1, W2, b2 = (_randn(FFN, H, seed=1) * 0.2, _randn(FFN, seed=2), _randn(H, FFN, seed=3) * 0.2,
                      _randn(H, seed=4))
    with torch.no_grad():
        col.weight.copy_(shard_tensor(W1, col.weight))
        col.bias.copy_(shard_tensor(b1, col.bias))
        row.weight.copy_(shard_tensor(W2, row.weight))
        row.bias.copy_(b2)
    ex.true(getattr(row.bias, "sequence_parallel", False), "row bias tagged sequence_parallel")
    ex.true(not getattr(col.weight, "sequence_parallel", False), "column weight not SP-tagged")
    x_full, gy = _randn(S, B, H, seed=5), _randn(S, B, H, seed=6)
    x = x_full.chunk(tp, 0)[rank].clone().requires_grad_()
    y = row(F.gelu(col(x)))
    ex.true(y.shape == (S // tp, B, H), f"SP pair output is a sequence shard, got {tuple(y.shape)}")
    (y * gy.chunk(tp, 0)[rank]).sum().backward()
    xr, W1r, b1r, W2r, b2r = _dense_clone(x_full, W1, b1, W2, b2)
    yr = F.linear(F.gelu(F.linear(xr, W1r, b1r)), W2r, b2r)
    (yr * gy).sum().backward()
    ex.close(torch.cat(_all_gather(y), 0), yr, "SP pair output", k)
    ex.close(torch.cat(_all_gather(x.grad), 0), xr.grad, "SP pair input grad", k)
    for p, ref, name in ((col.weight, W1r, "column weight"), (col.bias, b1r, "column bias"),
                         (row.weight, W2r, "row weight")):
        ex.close(unshard_tensors(_all_gather(p.grad), p), ref.grad, f"SP pair {name} grad", k)
    partial = row.bias.grad.clone()
    ps.all_reduce_sequence_parallel_grads(list(col.parameters()) + list(row.parameters()))
    ex.close(row.bias.grad, b2r.grad, "SP row bias grad after all_reduce_sequence_parallel_grads",
             k)
    ex.differs(partial, b2r.grad, "SP row bias grad before the all-reduce is partial", k)


def check_norms_under_sp(ex: Expect) -> None:
    tp, rank = _tp()
    k = 2 * H + S * B  # mean/variance over h forward and backward, weight grads over tokens
    for cls in (LayerNorm, RMSNorm):
        norm = cls(H, sequence_parallel=True)
        full = {n: _randn(*p.shape, seed=10 + i) for i, (n, p) in enumerate(norm.named_parameters())}
        with torch.no_grad():
            for n, p in norm.named_parameters():
                p.copy_(full[n])
        x_full, gy = _randn(S, B, H, seed=7), _randn(S, B, H, seed=8)
        x = x_full.chunk(tp, 0)[rank].clone().requires_grad_()
        (norm(x) * gy.chunk(tp, 0)[rank]).sum().backward()
        xr, wr = _dense_clone(x_full, full["weight"])
        br = _dense_clone(full["bias"])[0] if cls is LayerNorm else None
        yr = (F.layer_norm(xr, (H,), wr, br, 1e-5) if cls is LayerNorm
              else F.rms_norm(xr, (H,), wr, 1e-5))
        (yr * gy).sum().backward()
        ex.close(torch.cat(_all_gather(norm(x).detach()), 0), yr, f"{cls.__name__} SP output", k)
        ex.close(torch.cat(_all_gather(x.grad), 0), xr.grad, f"{cls.__name__} SP input grad", k)
        refs = {"weight": wr.grad, "bias": br.grad if br is not None else None}
        for n, p in norm.named_parameters():
            ex.differs(p.grad, refs[n],
                       f"{cls.__name__}.{n} grad without the SP all-reduce must be partial", k)
        ps.all_reduce_sequence_parallel_grads(norm.parameters())
        for n, p in norm.named_parameters():
            ex.close(p.grad, refs[n], f"{cls.__name__}.{n} grad after the SP all-reduce", k)


def check_vocab_parallel_embedding(ex: Expect) -> None:
    tp, rank = _tp()
    V, E = 50257, 8
    padded = ModelConfig(vocab_size=V, make_vocab_size_divisible_by=128).padded_vocab_size(tp)
    ex.true(padded % (128 * tp) == 0 and V <= padded < V + 128 * tp, f"padded vocab {padded}")
    per_rank = padded // tp
    ids = _randn(S, B, seed=1).abs().mul(10_000).long().clamp(max=V - 1)
    boundary = [0, V - 1] + [r * per_rank + d for r in range(1, tp) for d in (-1, 0)]
    ids.view(-1)[: len(boundary)] = torch.tensor(boundary)
    gy = _randn(S, B, E, seed=2)
    for sp in (False, True):
        tag = f"embedding(sp={sp}) "
        emb = VocabParallelEmbedding(padded, E, vocab_size=V, reduce_scatter_embeddings=sp)
        initialize_parameters(emb, seed=3, std=0.5, num_layers=1)
        W = unshard_tensors(_all_gather(emb.weight), emb.weight)
        ex.true(W.shape == (padded, E), tag + f"full weight shape {tuple(W.shape)}")
        ex.true(bool((W[V:] == 0).all()) and bool((W[:V] != 0).any()),
                tag + "padding rows are initialized to zero, real rows are not")
        y = emb(ids)
        (y * (gy.chunk(tp, 0)[rank] if sp else gy)).sum().backward()
        Wr = W.clone().requires_grad_()
        yr = F.embedding(ids, Wr)
        (yr * gy).sum().backward()
        ex.close(torch.cat(_all_gather(y), 0) if sp else y, yr, tag + "output", k=1)
        dW = unshard_tensors(_all_gather(emb.weight.grad), emb.weight)
        ex.close(dW, Wr.grad, tag + "weight grad", k=S * B)
        ex.true(bool((dW[V:] == 0).all()), tag + "padding rows get zero gradient")


def check_cross_entropy(ex: Expect) -> None:
    tp, rank = _tp()
    cases = [  # (name, real vocab, padded vocab, ignore some, label smoothing)
        ("plain", 64 * tp, 64 * tp, False, 0.0),
        ("ignore_index", 64 * tp, 64 * tp, True, 0.0),
        ("label_smoothing", 64 * tp, 64 * tp, False, 0.1),
        ("gpt2 vocab padded", 50257, ModelConfig(vocab_size=50257).padded_vocab_size(tp),
         False, 0.0),
        ("gpt2 vocab padded + ignore + smoothing", 50257,
         ModelConfig(vocab_size=50257).padded_vocab_size(tp), True, 0.1),
        ("whole partitions of padding", 100, 128 * tp, True, 0.1),
        # every logit + 1e4: the normalizer must be corrected from differences, not from
        # log Z itself (float32's step at 1e4 is 1e-3)
        ("large common offset", 64 * tp, 64 * tp, False, 0.1),
        # row 3's first half of the vocabulary -inf: at tp >= 2 whole ranks have nothing to
        # normalize (log_softmax alone gives NaN there)
        ("a rank's slice all -inf", 64 * tp, 64 * tp, True, 0.0),
    ]
    for i, (name, V, Vp, ignore, eps) in enumerate(cases):
        s, b = 4, 3
        logits_full = _randn(s, b, Vp, seed=20 + i) * 3
        logits_full[..., V:] += 20.0  # huge padding logits: wrong unless they are masked out
        target = (_randn(s, b, seed=40 + i).abs() * 1e6).long() % V
        target[0, 0], target[1, 0] = V - 1, 0
        if name == "large common offset":
            logits_full += 1e4
        if name == "a rank's slice all -inf":
            logits_full[3, :, :Vp // 2] = float("-inf")
            target[3] = V - 1
        if ignore:
            target[2, :2] = -100
        gl = _randn(s, b, seed=60 + i)
        logits = logits_full.chunk(tp, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, target, vocab_size=V if V != Vp else None,
                                            label_smoothing=eps)
        (loss * gl).sum().backward()
        # float64 reference: torch's own float32 label smoothing over 50k classes is off by
        # ~1e-5 in the grads, more than the parallel kernel (which is within 1e-7 of float64).
        lr = logits_full[..., :V].double().requires_grad_()
        ref = F.cross_entropy(lr.reshape(-1, V), target.reshape(-1), reduction="none",
                              ignore_index=-100, label_smoothing=eps).view(s, b)
        (ref * gl.double()).sum().backward()
        ex.close(loss, ref, f"cross entropy [{name}] loss", k=V)
        grad = torch.cat(_all_gather(logits.grad), -1)
        ex.close(grad[..., :V], lr.grad, f"cross entropy [{name}] logits grad", k=V)
        ex.true(bool((grad[..., V:] == 0).all()), f"cross entropy [{name}] padding grads are 0")
        if ignore:
            ex.true(bool((grad[2, :2] == 0).all()) and bool((loss[2, :2] == 0).all()),
                    f"cross entropy [{name}] ignored tokens: zero loss and zero grad")

    # bf16 logits (autocast's output layer): computed in float32 from the bf16 values, the
    # gradient handed back in bf16.
    V, Vp = 50257, ModelConfig(vocab_size=50257).padded_vocab_size(tp)
    logits_full = (_randn(4, 3, Vp, seed=80) * 3).bfloat16()
    target = (_randn(4, 3, seed=81).abs() * 1e6).long() % V
    logits = logits_full.chunk(tp, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=V, label_smoothing=0.1)
    loss.sum().backward()
    lr = logits_full[..., :V].double().requires_grad_()
    ref = F.cross_entropy(lr.reshape(-1, V), target.reshape(-1), reduction="none",
                          label_smoothing=0.1).view(4, 3)
    ref.sum().backward()
    ex.true(loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16,
            "cross entropy [bf16 logits] float32 loss, bf16 grad")
    ex.close(loss, ref, "cross entropy [bf16 logits] loss", k=V)
    grad = torch.cat(_all_gather(logits.grad), -1)[..., :V].double()
    ex.true(torch.allclose(grad, lr.grad, rtol=2 ** -7, atol=1e-9),
            f"cross entropy [bf16 logits] grad off by {(grad - lr.grad).abs().max():.2e}")


CHECKS = {
    "mappings": check_mappings,
    "mappings_leave_caller_tensors_alone": check_mappings_leave_caller_tensors_alone,
    "column_linear": check_column_linear,
    "column_linear_fused_gather_output": lambda ex: check_column_linear(
        ex, [(True, True, 2), (False, True, 2)]),
    "row_linear": check_row_linear,
    "sequence_parallel_pair": check_sequence_parallel_pair,
    "norms_under_sp": check_norms_under_sp,
    "vocab_parallel_embedding": check_vocab_parallel_embedding,
    "cross_entropy": check_cross_entropy,
}


# ----------------------------------------------------------------------------- module cases

def _attention_cfg(tp, gqa, rope):
    heads, groups = ((4, 2) if tp == 2 else (8, 4)) if gqa else (4, 4)
    return dict(hidden_size=H, num_attention_heads=heads, num_query_groups=groups, seq_length=S,
                position_embedding_type="rope" if rope else "learned_absolute",
                init_method_std=0.3)


GPT2 = dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S, vocab_size=300,
            make_vocab_size_divisible_by=64, init_method_std=0.1)
LLAMA = dict(GPT2, num_attention_heads=8, num_query_groups=4, position_embedding_type="rope",
             normalization="RMSNorm", activation="swiglu", ffn_hidden_size=64,
             add_bias_linear=False)


def case_spec(label: str, tp: int) -> dict:
    """`kind-variant-sp|nosp` -> what to build. Labels are the same for every TP size."""
    kind, variant, sp = label.split("-")
    sp = sp == "sp"
    if kind == "attention":
        cfg = _attention_cfg(tp, gqa=variant.startswith("gqa"), rope=variant.endswith("rope"))
    elif kind == "mlp":
        cfg = dict(hidden_size=H, num_attention_heads=4, activation=variant, ffn_hidden_size=64,
                   init_method_std=0.3)
    elif kind == "layer":
        cfg = dict(GPT2 if variant == "gpt2" else LLAMA, init_method_std=0.3)
    else:
        cfg = dict(GPT2) if variant == "gpt2" else dict(
            LLAMA, untie_embeddings_and_output_weights=variant == "llamauntied")
    return dict(kind=kind, cfg=cfg, sp=sp, seed=1234)


CASES = [f"{kind}-{v}-{sp}" for kind, variants in (
    ("attention", ("mha", "mharope", "gqa", "gqarope")), ("mlp", ("gelu", "swiglu")),
    ("layer", ("gpt2", "llama")), ("gpt", ("gpt2", "llamatied", "llamauntied")))
    for v in variants for sp in ("nosp", "sp")]


def chain_terms(spec: dict) -> int:
    """`k` of a module case (tests/tolerances.py): the forward chain of one token, twice for
    backward, plus the s*b tokens of a weight gradient."""
    return decoder_chain_terms(ModelConfig(**spec["cfg"]), S, S * B, spec["kind"])


def run_case(spec: dict) -> dict:
    """Build, init, forward, backward (+ SP grad all-reduce); return this rank's tensors.
    With no grid (the parent) this is the dense tp = 1 reference."""
    cfg = ModelConfig(**spec["cfg"])
    sp, kind = spec["sp"], spec["kind"]
    tp, rank = _tp()
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPTModel(cfg, sequence_parallel=sp)
        model.init_weights(spec["seed"])
        ids = (_randn(B, S, seed=1).abs() * 1e4).long() % cfg.vocab_size
        labels = (_randn(B, S, seed=2).abs() * 1e4).long() % cfg.vocab_size
        labels[0, :3] = -100
        loss = model(ids, labels=labels)
        (loss.sum() / (labels != -100).sum()).backward()  # the training loss: token mean
        out, dx = loss.detach(), None
        with torch.no_grad():
            logits = model(ids)
    else:
        build = {"attention": lambda: SelfAttention(cfg, 0, sequence_parallel=sp),
                 "mlp": lambda: MLP(cfg, sequence_parallel=sp),
                 "layer": lambda: TransformerLayer(cfg, 0, sequence_parallel=sp)}[kind]
        model = build()
        initialize_parameters(model, spec["seed"], cfg.init_method_std, cfg.num_layers)
        # gy / (S * B): the grads of a token-mean loss, the scale the tolerances are meant for
        x, gy = _randn(S, B, H, seed=3), _randn(S, B, H, seed=4) / (S * B)
        if sp and tp > 1:
            x, gy = x.chunk(tp, 0)[rank], gy.chunk(tp, 0)[rank]
        x = x.clone().requires_grad_()
        kwargs = {}
        if kind != "mlp" and cfg.position_embedding_type == "rope":
            kwargs["rotary"] = RotaryEmbedding(cfg.kv_channels, cfg.rotary_base)(S)
        y = model(x, **kwargs)
        (y * gy).sum().backward()
        out, dx, logits = y.detach(), x.grad, None
    ps.all_reduce_sequence_parallel_grads(model.parameters())
    return dict(out=out, dx=dx, logits=logits,
                params={n: p.detach().clone() for n, p in model.named_parameters()},
                grads={n: p.grad.clone() for n, p in model.named_parameters()})


# ----------------------------------------------------------------------------- the worlds

def _worker_suite(tp: int) -> dict:
    rank = dist.get_rank()
    checks = {}
    for name, check in CHECKS.items():
        ex = Expect(prefix=f"[rank {rank}] ")
        check(ex)
        checks[name] = ex.failures
    cases = {label: run_case(case_spec(label, tp)) for label in CASES}
    return dict(checks=checks, cases=cases)


@pytest.fixture(scope="module", params=TPS, ids=lambda tp: f"tp{tp}")
def world(request):
    """One spawned world of `tp` processes (grid tp x 1 x 1) running every check and case."""
    tp = request.param
    return tp, run_distributed(_worker_suite, tp, tp, tp=tp, timeout=300)


def _assert_check(world, name):
    _, results = world
    failures = [f for r in results for f in r["checks"][name]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", CHECKS)
def test_layer_against_dense(world, name):
    _assert_check(world, name)


_DENSE: dict[str, dict] = {}


def _dense(spec):
    key = repr({k: v for k, v in spec.items() if k != "sp"})
    if key not in _DENSE:
        assert not ps.model_parallel_is_initialized()
        _DENSE[key] = run_case(spec)
    return _DENSE[key]


@pytest.mark.parametrize("label", CASES)
def test_module_matches_tp1(world, label, no_grid):
    """Output, input grad, every parameter and every parameter grad equal the tp=1 model."""
    tp, results = world
    spec = case_spec(label, tp)
    ref = _dense(spec)
    cfg = ModelConfig(**spec["cfg"])
    dense_params = dict(_build_dense_params(spec))
    ex = Expect()
    sp, k = spec["sp"], chain_terms(spec)
    results = [r["cases"][label] for r in results]
    if sp and spec["kind"] != "gpt":
        ex.close(torch.cat([r["out"] for r in results], 0), ref["out"], "output (sequence shards)",
                 k)
        ex.close(torch.cat([r["dx"] for r in results], 0), ref["dx"], "input grad (shards)", k)
    else:
        for rank, r in enumerate(results):
            ex.close(r["out"], ref["out"], f"rank {rank} output/loss", k)
            if r["dx"] is not None:
                ex.close(r["dx"], ref["dx"], f"rank {rank} input grad", k)
    ex.true(set(ref["grads"]) == set(results[0]["grads"]),
            f"parameter names differ: {sorted(ref['grads'])} vs {sorted(results[0]['grads'])}")
    for name, p in dense_params.items():
        rows = getattr(p, "full_rows", None) or p.shape[0]
        for what in ("params", "grads"):
            full = unshard_tensors([r[what][name] for r in results], p)
            if what == "params":  # layout-independent init: bitwise equal on real rows
                ex.true(torch.equal(full[:rows], ref[what][name][:rows]),
                        f"{name}: tp={tp} init differs from tp=1 init")
            else:
                ex.close(full[:rows], ref[what][name][:rows], f"{name} grad", k)
            ex.true(bool((full[rows:] == 0).all()), f"{name} {what}: padded vocab rows not zero")
    if spec["kind"] == "gpt":
        for rank, r in enumerate(results):
            ex.true(r["logits"].shape == (B, S, ModelConfig(**spec["cfg"]).padded_vocab_size(tp)
                                          // tp),
                    f"rank {rank} logits shape {tuple(r['logits'].shape)} != [b, s, v_pad/tp]")
        logits = torch.cat([r["logits"] for r in results], -1)
        ex.close(logits[..., :cfg.vocab_size], ref["logits"][..., :cfg.vocab_size],
                 "vocab-parallel logits (gathered)", k)
    assert not ex.failures, f"{label} at tp={tp}:\n" + "\n".join(ex.failures)


def _build_dense_params(spec):
    """Parameters of the dense model (for their sharding attributes), without running it."""
    cfg = ModelConfig(**spec["cfg"])
    if spec["kind"] == "gpt":
        model = GPTModel(cfg)
    else:
        model = {"attention": lambda: SelfAttention(cfg, 0), "mlp": lambda: MLP(cfg),
                 "layer": lambda: TransformerLayer(cfg, 0)}[spec["kind"]]()
    return model.named_parameters()


# ----------------------------------------------------------------------------- single process

def _hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _hf_rope(q, positions, dim, base=10000.0):
    """HF Llama's RoPE, written independently: q `[b, n, s, d]`, float32 frequencies."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return q * emb.cos() + _hf_rotate_half(q) * emb.sin()


def test_rotary_position_ids_read_from_a_table_equal_the_computed_ones(no_grid):
    """Per-row positions on CPU (decode) come from a table of positions 0..P-1, grown as
    positions pass P: the same values, shapes and dtype as computing them, for plain, YaRN
    (attention factor) and llama3-scaled frequencies, at the table's edges."""
    scalings = (None, {"scaling_type": "yarn", "factor": 4.0, "original_max_position": 64,
                       "attention_factor": 1.3},
                {"scaling_type": "llama3", "factor": 8.0, "original_max_position": 128})
    for scaling in scalings:
        rope = RotaryEmbedding(16, 10000.0, scaling)
        for pos in ([[0]], [[5], [255]], [[256, 257]], list(map(list, zip(range(40)))),
                    [[1000], [3], [4095]], [[4096, 9000]]):
            ids = torch.tensor(pos)
            want = rope._compute(ids.shape[1], 0, None, ids)
            got = rope(ids.shape[1], 0, None, ids)
            for w, g in zip(want, got):
                assert g.shape == w.shape == (ids.shape[1], ids.shape[0], 1, 16)
                assert g.dtype == w.dtype and torch.equal(g, w), (scaling, pos)
        assert rope._rows[0].shape[0] == 16384  # grown to the next power of two


def test_rotary_matches_hf_llama(no_grid):
    s, b, n, d = 16, 2, 3, 8
    q = _randn(s, b, n, d, seed=1)
    cos, sin = RotaryEmbedding(d)(s)
    assert cos.shape == sin.shape == (s, 1, 1, d)
    ours = apply_rotary_pos_emb(q, cos, sin).permute(1, 2, 0, 3)
    hf = _hf_rope(q.permute(1, 2, 0, 3), torch.arange(s), d)
    # HF rounds the angles p * inv_freq in float32 (error up to u * (s - 1) radians): each of
    # the two terms q * cos and rotate(q) * sin moves by |q| times that
    assert_fp32_close(ours, hf, k=2, scale=float(q.abs().max()) * (s - 1), what="RoPE vs HF")
    # an offset gives the same angles as the tail of a longer table (decoding with a cache)
    cos2, sin2 = RotaryEmbedding(d)(4, offset=5)
    assert torch.equal(cos2, RotaryEmbedding(d)(9)[0][5:])  # the same float64 angles
    # relative: <rope(q, m), rope(k, n)> depends only on m - n
    k = _randn(1, 1, 1, d, seed=2)
    qq = q[:1, :1, :1]
    cos, sin = RotaryEmbedding(d)(12)
    rot = lambda t, m: apply_rotary_pos_emb(t, cos[m:m + 1], sin[m:m + 1])  # noqa: E731
    # d products of rotated values, whose angles (up to 7 rad) are rounded to float32
    assert_fp32_close((rot(qq, 7) * rot(k, 4)).sum(), (rot(qq, 3) * rot(k, 0)).sum(), k=d,
                      scale=float(qq.norm() * k.norm()) * 7, what="RoPE is relative")


def _naive_attention(attn, cfg, x, rope):
    """softmax(Q K^T / sqrt(d) + causal mask) V per head from the documented fused-QKV layout."""
    s, b, _ = x.shape
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    hpg = n // g
    W = attn.linear_qkv.weight.detach().view(g, hpg + 2, d, H)
    bias = attn.linear_qkv.bias.detach().view(g, hpg + 2, d)
    q = torch.einsum("sbh,gjdh->sbgjd", x, W[:, :hpg]) + bias[:, :hpg]
    k = torch.einsum("sbh,gdh->sbgd", x, W[:, hpg]) + bias[:, hpg]
    v = torch.einsum("sbh,gdh->sbgd", x, W[:, hpg + 1]) + bias[:, hpg + 1]
    q, k, v = q.reshape(s, b, n, d).permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    if rope:
        q, k = _hf_rope(q, torch.arange(s), d), _hf_rope(k, torch.arange(s), d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    heads = []
    for i in range(n):
        scores = q[:, i] @ k[:, i // hpg].transpose(-1, -2) / math.sqrt(d)
        heads.append(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v[:, i // hpg])
    out = torch.stack(heads, 2).permute(1, 0, 2, 3).reshape(s, b, n * d)  # [s, b, n*d]
    return F.linear(out, attn.linear_proj.weight.detach(), attn.linear_proj.bias.detach())


class _Cache:
    def __init__(self):
        self.k = self.v = None

    def update(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return self.k, self.v


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
def test_attention_matches_naive_softmax(gqa, rope, no_grid):
    cfg = ModelConfig(**_attention_cfg(4, gqa, rope))
    attn = SelfAttention(cfg, 0)
    initialize_parameters(attn, 7, 0.3, 1)
    with torch.no_grad():
        attn.linear_qkv.bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(8))
        attn.linear_proj.bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(9))
    x = _randn(S, B, H, seed=3)
    rotary = RotaryEmbedding(cfg.kv_channels)
    with torch.no_grad():
        full = attn(x, rotary=rotary(S) if rope else None)
        k = H + cfg.kv_channels + 2 * S + cfg.query_projection_size  # QKV, QK^T, softmax, AV, proj
        assert_fp32_close(full, _naive_attention(attn, cfg, x, rope), k, "SDPA vs naive softmax")
        # KV-cache decoding: prompt, then 2 tokens (sq < sk, masked), then 1 token
        cache, outs, pos = _Cache(), [], 0
        for n in (S - 3, 2, 1):
            outs.append(attn(x[pos:pos + n], rotary=rotary(n, pos) if rope else None,
                             kv_cache=cache))
            pos += n
        assert_fp32_close(torch.cat(outs, 0), full, k, "KV-cache decoding vs full sequence")


def test_cross_entropy_rejects_bad_label_smoothing(no_grid):
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long),
                                     label_smoothing=1.0)


def test_compile_without_cpp_compiler_names_the_fix(no_grid, no_cpp_compiler):
    """--compile on CPU with no C++ compiler stops before compiling with a message naming the
    fix (not inductor's error from inside the first step); train.py's config check says the
    same before any process starts (test_arguments)."""
    from layers import compile_transformer_layers

    layer = TransformerLayer(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                         vocab_size=16), 0)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler.*drop --compile"):
        compile_transformer_layers(layer)
    assert getattr(layer, "_compiled_call_impl", None) is None


@pytest.mark.parametrize("with_bias", [False, True], ids=["sdpa", "bias"])
def test_additive_mask_equals_bool_mask(with_bias, no_grid):
    """A float mask (0 / -inf, what inference builds once per forward) gives bitwise the
    attention of the bool mask it stands for, through SDPA and through the biased softmax."""
    from layers.attention import core_attention

    g = torch.Generator().manual_seed(5)
    b, n, kv, sq, sk, d = 3, 4, 2, 2, 7, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h, s in ((n, sq), (kv, sk), (kv, sk)))
    allowed = torch.rand(b, 1, sq, sk, generator=g) > 0.4
    allowed[..., 0] = True  # every query sees at least one key
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    bias = torch.randn(1, n, sq, sk, generator=g) if with_bias else None
    want = core_attention(q, k, v, allowed, bias, None, 0.0)
    got = core_attention(q, k, v, additive, bias, None, 0.0)
    assert torch.equal(got, want)
    assert not torch.allclose(got, core_attention(q, k, v, None, bias, None, 0.0))  # it masks


@pytest.mark.parametrize("kernel", [True, False], ids=["c++ kernel", "inductor loops"])
def test_compiled_decode_attention_matches_sdpa(no_grid, kernel, monkeypatch):
    """Under torch.compile on CPU without grad, one query per row (decode) takes
    `_decode_attention`, not SDPA (the recorded graph has no SDPA call), and gives eager
    `core_attention`'s result to float rounding: grouped-query heads, keys / values as
    strided views of a paged pool, additive and bool masks, softcap, a scale, bf16 (one bf16
    rounding of the float32 result). With the C++ kernel loaded, the cases it takes (no
    softcap, an additive mask or none) are one `shardzoo::decode_attention` call; without
    it (or for the others) inductor's loops."""
    from layers import attention_kernels
    from layers.attention import core_attention

    if kernel and not attention_kernels.prepare():
        pytest.skip("the C++ decode attention kernel cannot be built here (no g++ or ninja)")
    if not kernel:
        monkeypatch.setattr(attention_kernels, "supports", lambda *args: False)
    torch._dynamo.reset()  # `attend` below compiles 6 times per run: within dynamo's limit

    g = torch.Generator().manual_seed(11)
    b, sk, d = 3, 37, 16
    cases = [  # (query heads, kv heads, dtype, mask kind, scale, softcap)
        (6, 2, torch.float32, "additive", None, None),
        (2, 2, torch.bfloat16, "bool", None, 5.0),
        (4, 1, torch.float32, None, 0.3, None),
    ]
    for n, kv, dtype, kind, scale, softcap in cases:
        pool = torch.randn(2, 4 * b + 1, 16, kv, d, generator=g).to(dtype)  # [k|v, blocks, 16, g, d]
        k, v = (p.as_strided((b, kv, sk, d), (4 * 16 * kv * d, d, kv * d, 1), 16 * kv * d)
                for p in pool)
        q = torch.randn(b, n, 1, d, generator=g).to(dtype)
        allowed = torch.rand(b, 1, 1, sk, generator=g) > 0.3
        allowed[..., 0] = True
        mask = {None: None, "bool": allowed,
                "additive": torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))}[kind]
        seen = []

        def record(gm, inputs):
            seen.extend(str(node.target) for node in gm.graph.nodes)
            return gm.forward

        def attend(q, k, v, mask):
            return core_attention(q, k, v, mask, None, scale, 0.0, softcap=softcap)

        with torch.no_grad():
            want = attend(q, k, v, mask)
            got = torch.compile(attend, fullgraph=True)(q, k, v, mask)
            torch.compile(attend, backend=record, fullgraph=True)(q, k, v, mask)
        assert seen and not any("scaled_dot_product" in t for t in seen), seen
        takes = kernel and softcap is None and kind != "bool"
        assert any("decode_attention" in t for t in seen) == takes, seen
        assert got.dtype == dtype and got.shape == (b, n, 1, d)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        if kind is not None:  # the mask is applied: without it the result differs
            assert not torch.allclose(got.float(), attend(q, k, v, None).float(), atol=tol)


def test_compiled_short_prefill_attention_matches_sdpa(no_grid):
    """Under torch.compile on CPU without grad, several queries over at most
    SHORT_PREFILL_KEYS keys (a short prompt's prefill) take `_explicit_attention` in float32
    (no SDPA in the recorded graph) and give eager SDPA's result to float rounding: causal
    and a bool mask (a chunk after cached keys), grouped-query heads, bf16; one key more
    and the graph calls SDPA again."""
    from layers.attention import SHORT_PREFILL_KEYS, core_attention

    g = torch.Generator().manual_seed(12)

    def graph_targets(fn, *args):
        seen = []

        def record(gm, inputs):
            seen.extend(str(node.target) for node in gm.graph.nodes)
            return gm.forward
        torch.compile(fn, backend=record, fullgraph=True)(*args)
        return seen

    cases = [  # (rows, query heads, kv heads, queries, keys, dtype, causal)
        (2, 6, 2, 9, 9, torch.float32, True),
        (3, 4, 2, 5, 21, torch.bfloat16, False),  # a 5-token chunk after 16 cached keys
    ]
    for b, n, kv, sq, sk, dtype, causal in cases:
        q = torch.randn(b, n, sq, 16, generator=g).to(dtype)
        k, v = (torch.randn(b, kv, sk, 16, generator=g).to(dtype) for _ in range(2))
        mask = None if causal else \
            torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)[None, None].expand(b, 1, sq, sk)

        def attend(q, k, v, mask):
            return core_attention(q, k, v, mask, None, None, 0.0, causal=causal)

        with torch.no_grad():
            want = attend(q, k, v, mask)
            got = torch.compile(attend, fullgraph=True)(q, k, v, mask)
            seen = graph_targets(attend, q, k, v, mask)
        assert seen and not any("scaled_dot_product" in t for t in seen), seen
        assert not any("decode_attention" in t for t in seen), seen  # one query per row only
        assert got.dtype == dtype and got.shape == (b, n, sq, 16)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    long = SHORT_PREFILL_KEYS + 1
    q, k, v = (torch.randn(1, 2, long, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        seen = graph_targets(lambda q, k, v: core_attention(q, k, v, None, None, None, 0.0,
                                                            causal=True), q, k, v)
    assert any("scaled_dot_product" in t for t in seen), seen


def test_block_compiled_whole_matches_eager_and_falls_back_per_layer(no_grid):
    """compile_transformer_block (the engine's --compile): the block's layers run as one
    compiled call with each layer a nested region, layers with a sliding window and without
    in one block, equal to eager to float rounding and with no layer compiled on its own. A
    layer that breaks the graph (a nested region cannot hold a break) makes the block warn
    and compile per layer instead, with the same result; a block with a mixture-of-experts
    layer is compiled per layer from the start; compiling again changes nothing; a layer's
    forward hook runs as it does eagerly."""
    import warnings

    from layers import compile_transformer_block

    torch.manual_seed(0)
    config = ModelConfig(num_layers=3, hidden_size=16, num_attention_heads=2, vocab_size=32,
                         ffn_hidden_size=24, window_size=(2, 0),
                         window_attn_skip_freq=[1, 0, 1])
    x = torch.randn(6, 2, 16)

    def fresh(graph_break: bool = False) -> TransformerBlock:
        block = TransformerBlock(config, [0, 1, 2]).eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for w in block.parameters():
                w.copy_(torch.rand(w.shape, generator=g) + 0.5 if w.dim() == 1 else
                        torch.randn(w.shape, generator=g) * 0.3)
        if graph_break:
            mlp = block.layers["1"].mlp
            inner = mlp.forward

            def breaking(h):
                torch._dynamo.graph_break()
                return inner(h)
            mlp.forward = breaking
        return block

    with torch.no_grad():
        whole = fresh()
        want = whole(x)
        assert want.isfinite().all()
        assert compile_transformer_block(whole) == 3
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = whole(x)
        assert not [str(w.message) for w in seen if "compiled region" in str(w.message)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert whole.compiled_forward is not None
        assert not any(getattr(m, "_compiled_call_impl", None) for m in whole.layers.values())
        compiled = whole.compiled_forward
        assert compile_transformer_block(whole) == 3 and whole.compiled_forward is compiled
        # a layer's own forward hook runs (the layer is called as a module); dynamo keeps no
        # guard on hooks, so this needs graphs compiled with the hook in place: reset
        torch._dynamo.reset()
        hooked, calls = fresh(), []
        hooked.layers["1"].register_forward_hook(
            lambda module, args, out: calls.append(1) or out * 0.5)
        eager = hooked(x)
        compile_transformer_block(hooked)
        torch.testing.assert_close(hooked(x), eager, rtol=1e-5, atol=1e-5)
        assert len(calls) == 2 and not torch.allclose(eager, want)

        broken = fresh(graph_break=True)
        compile_transformer_block(broken)
        with pytest.warns(UserWarning, match="as one compiled region.*compiling each layer"):
            got = broken(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert broken.compiled_forward is None
        assert all(getattr(m, "_compiled_call_impl", None) for m in broken.layers.values())

    moe = TransformerBlock(ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                                       vocab_size=32, num_moe_experts=2, moe_router_topk=1),
                           [0, 1]).eval()
    assert compile_transformer_block(moe) == 2 and moe.compiled_forward is None
    assert all(getattr(m, "_compiled_call_impl", None) for m in moe.layers.values())


def test_compiled_blocks_keep_their_own_graphs_with_few_guards(no_grid):
    """compile_transformer_block keeps dynamo's guards on the inputs and `training` only: two
    blocks of other depths and widths of ffn compiled in one process, called with the same
    input, each give their own eager result (no block runs another's graph); weights
    changed in place are read (they are graph inputs); switching a block to training
    re-traces it (dropout applied), and back to eval gives the eval result again."""
    from layers import compile_transformer_block

    x = torch.randn(5, 2, 16)

    def block(layers: int, ffn: int, seed: int) -> TransformerBlock:
        config = ModelConfig(num_layers=layers, hidden_size=16, num_attention_heads=2,
                             vocab_size=32, ffn_hidden_size=ffn, hidden_dropout=0.5)
        b = TransformerBlock(config, list(range(layers))).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for w in b.parameters():
                w.copy_(torch.rand(w.shape, generator=g) + 0.5 if w.dim() == 1 else
                        torch.randn(w.shape, generator=g) * 0.3)
        return b

    with torch.no_grad():
        blocks = [block(2, 24, 1), block(3, 24, 2), block(3, 40, 3)]
        eager = [b(x) for b in blocks]
        for b in blocks:
            compile_transformer_block(b)
        for b, want in zip(blocks, eager):
            torch.testing.assert_close(b(x), want, rtol=1e-5, atol=1e-5)
        first = blocks[0]
        first.layers["1"].mlp.linear_fc2.weight.mul_(2.0)
        doubled = first._forward(x, None, None, None, None, None, None)  # eager
        assert not torch.allclose(doubled, eager[0])
        torch.testing.assert_close(first(x), doubled, rtol=1e-5, atol=1e-5)
        import parallel_state as ps
        ps.model_parallel_seed(1234, 0, dropout_masks="rank-streams")
        first.train()
        trained = first(x)
        assert not torch.allclose(trained, doubled, rtol=1e-3, atol=1e-3)
        first.eval()
        torch.testing.assert_close(first(x), doubled, rtol=1e-5, atol=1e-5)
