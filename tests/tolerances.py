"""Float32 tolerances derived from the computation, not picked by hand.

Two float32 results of the same mathematics that differ only in the order of their
additions (a TP shard's partial sums added by an all-reduce, another BLAS blocking or thread
count, another CPU's vector width) differ by rounding. Summing `k` terms in floating point
makes an error of at most about `sqrt(k) * u * sum|terms|` with high probability (the
probabilistic bound of Higham & Mary 2019, "A new approach to probabilistic rounding error
analysis", SIAM J. Sci. Comput. 41(5), Theorem 3.1; the worst case is `k * u * sum|terms|`,
Higham 2002, "Accuracy and Stability of Numerical Algorithms", eq. 3.5), where `u = 2**-24`
is the unit roundoff of float32. So the comparisons here use

    |actual - expected| <= ULPS * u * sqrt(k) * scale          (every element)

- `k`: the number of terms an output element accumulates along its whole computation, i.e.
  the sum of the reduction lengths on its path (a matmul over `h` adds `h`, a softmax over
  `s` adds `s`, a weight gradient summed over `s*b` tokens adds `s*b`, every layer adds its
  own). First-order rounding errors of a chain of well-conditioned steps add up, so they
  behave like one long sum.
- `scale`: the largest magnitude of the compared tensor (`max|expected|`): the size of the
  terms being summed, norm-wise, so an element that ends up small through cancellation is
  not held to a relative accuracy float32 cannot give it.
- `ULPS` (8) absorbs the constant of the bound (about 1-2 at the usual confidence), the
  rounding of both sides, and the mild amplification of norms and softmax.

Where the code promises bit-exactness (resume on the same layout, recompute, layout-free
initialization, tied copies) the tests use `torch.equal`, never these tolerances.

Multi-step training comparisons (`assert_losses_close`, `weights_mismatch`): the value after
`t` optimizer steps carries the rounding of all `t` steps' forward + backward chains, so
`k = t * k_step`. Adam turns a gradient's rounding into an update difference of at most
`lr * |dg| / eps` per element, so those tests pass `--adam-eps 1e-4` to keep it bounded.

bf16 against float32 (`bf16_loss_atol`) is not a summation-order question: every bf16 weight
and activation is rounded once, to a relative `u_bf16 = 2**-8`, while sums stay float32. The
loss, a mean over many tokens, then moves by about `u_bf16 * |loss|`, and training tracks it
there instead of compounding it (both runs descend the same loss), so the bound is
`BF16_ULPS * u_bf16 * |loss|`.

`SHARDZOO_TOLERANCE_LOG=FILE` appends every float32 comparison's largest difference in units
of `u * sqrt(k) * scale` (with its `k` and scale) to FILE: the headroom is ULPS over the
largest value, e.g. to check the bound on another CPU or BLAS.
"""
from __future__ import annotations

import math
import os

import torch

U32 = 2.0 ** -24  # unit roundoff of float32: half the spacing of floats in [1, 2)
ULPS = 8
U_BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significand bits)
BF16_ULPS = 4


def bf16_loss_atol(loss: float) -> float:
    """How far a bf16 run's loss may sit from the float32 run's (module docstring)."""
    return BF16_ULPS * U_BF16 * abs(loss)


def fp32_atol(k: int, scale: float, ulps: float = ULPS) -> float:
    """Absolute tolerance for float32 results of `k`-term accumulations of size `scale`."""
    return ulps * U32 * math.sqrt(max(k, 1)) * scale


def fp32_mismatch(actual: torch.Tensor, expected: torch.Tensor, k: int,
                  scale: float | None = None, ulps: float = ULPS) -> str | None:
    """None when `actual` equals `expected` to `fp32_atol(k, scale)`, else a message with the
    largest difference, the tolerance and what it was derived from. `scale` defaults to
    `max|expected|`; pass the size of the summed terms when it is known to be larger."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        return f"shape {tuple(a.shape)} != {tuple(e.shape)}"
    if scale is None:
        scale = float(e.abs().max()) if e.numel() else 0.0
    tol = fp32_atol(k, scale, ulps)
    err = float((a - e).abs().max()) if e.numel() else 0.0
    if os.environ.get("SHARDZOO_TOLERANCE_LOG"):
        with open(os.environ["SHARDZOO_TOLERANCE_LOG"], "a") as f:
            f.write(f"{err / fp32_atol(k, scale, 1) if scale else 0.0:.4f} {k} {scale:.4g}\n")
    if err <= tol and math.isfinite(err):
        return None
    return (f"max |diff| {err:.3g} > tolerance {tol:.3g} = {ulps} ulps x u x sqrt(k={k}) x "
            f"scale {scale:.3g}")


def assert_fp32_close(actual, expected, k: int, what: str = "", scale: float | None = None,
                      ulps: float = ULPS) -> None:
    """Assert `fp32_mismatch(...)` is None; the message starts with `what`."""
    problem = fp32_mismatch(torch.as_tensor(actual), torch.as_tensor(expected), k, scale, ulps)
    assert problem is None, f"{what}: {problem}" if what else problem


def forward_chain_terms(cfg, seq_length: int, kind: str = "gpt") -> int:
    """`k` of a forward pass: the reduction lengths on one token's path (norms over h; QKV
    over h; scores over d; softmax and AV over s; projection over q; fc1 over h; fc2 over
    ffn; for the whole model the final norm and the logits over h, and for "gpt" (the loss)
    the cross entropy over the vocab). A T5 config counts its encoder, then its decoder
    with cross-attention (`seq_length`: the longer of the two).

    `cfg` is a models.ModelConfig; `kind` is "attention", "mlp", "layer", "logits" or "gpt".
    """
    h, d, q = cfg.hidden_size, cfg.kv_channels, cfg.query_projection_size
    attention = h + d + 2 * seq_length + q
    mlp = h + cfg.ffn_hidden_size
    layer = 2 * h + attention + mlp
    logits = cfg.num_layers * layer + 2 * h
    if getattr(cfg, "is_encoder_decoder", False):  # T5: both stacks; cross-attention per
        # decoder layer (a norm and an attention more); two final norms
        logits = cfg.encoder_num_layers * layer + \
            cfg.decoder_num_layers * (layer + h + attention) + 3 * h
    return {"attention": attention, "mlp": mlp, "layer": layer, "logits": logits,
            "gpt": logits + cfg.vocab_size}[kind]


def decoder_chain_terms(cfg, seq_length: int, tokens: int, kind: str = "gpt") -> int:
    """`k` of a forward and backward pass: the forward chain twice, plus the `tokens` that a
    weight gradient sums over (arguments as `forward_chain_terms`)."""
    return 2 * forward_chain_terms(cfg, seq_length, kind) + tokens


def training_chain_terms(args: list[str]) -> int:
    """`k` of one training step of the run `args` (train.py flags): the model's chain with
    the weight gradients summed over every token of the global batch."""
    from training.arguments import parse_config

    c = parse_config(list(args))
    tokens = (c.train.global_batch_size or c.train.micro_batch_size) * c.model.seq_length
    return decoder_chain_terms(c.model, c.model.seq_length, tokens)


def assert_losses_close(losses, ref, k_step: int, what: str = "losses") -> None:
    """Loss `t` (1-based) of a run against the reference's: after `t - 1` updates its value
    carries the rounding of `t` steps' chains, so `k = t * k_step` (the module docstring)."""
    assert len(losses) == len(ref), (what, losses, ref)
    for t, (a, e) in enumerate(zip(losses, ref), 1):
        problem = fp32_mismatch(torch.tensor(float(a)), torch.tensor(float(e)), k=t * k_step)
        assert problem is None, f"{what} at step {t}: {problem} ({list(losses)} vs {list(ref)})"


def weights_mismatch(state: dict, ref: dict, k: int) -> list[str]:
    """Per tensor of a full state dict, the `fp32_mismatch` messages (tensor scale: its
    largest reference weight) of weights after training whose updates carry `k` terms."""
    out = []
    for name, full in ref.items():
        problem = fp32_mismatch(state[name], full, k)
        if problem:
            out.append(f"{name}: {problem}")
    return out
