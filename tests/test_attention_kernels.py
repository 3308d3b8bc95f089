"""The C++ decode attention (layers/attention_kernels.py) against a float64 reference:
grouped-query heads, strided and gathered cache reads, masks, stale non-finite entries, head
sizes off the vector width, bf16; and the compiled engine's greedy decode through it."""
from __future__ import annotations

import math

import pytest
import torch

from layers import attention_kernels


@pytest.fixture(scope="module")
def kernel():
    if not attention_kernels.prepare():
        pytest.skip("the C++ decode attention kernel cannot be built here (no g++ or ninja)")


def reference(q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v in float64: q [b, n, 1, d], k / v [b, g, sk, *]."""
    b, n, _, d = q.shape
    g = k.shape[1]
    kk = k.double().repeat_interleave(n // g, dim=1)
    vv = v.double().repeat_interleave(n // g, dim=1)
    scores = q.double() @ kk.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, dim=-1) @ vv


def paged(b, g, sk, d, dv, dtype, gen, block=16):
    """Keys / values `[b, g, sk, *]` as strided views of pools `[blocks, block, g, *]` (row i
    in region i of one block more than it needs, as the block manager places rows), and the
    pools."""
    region = -(-sk // block) + 1
    blocks = b * region + 1
    pools = [torch.randn(blocks, block, g, e, generator=gen).to(dtype) for e in (d, dv)]
    views = [p.as_strided((b, g, sk, e), (region * block * g * e, e, g * e, 1), block * g * e)
             for p, e in zip(pools, (d, dv))]
    return views, pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_decode_attention_matches_float64(kernel, dtype):
    """Heads x KV groups (9/3, 4/1, 8/8), head sizes 64, 20 (a tail past the vector width)
    and values of another size (multi-latent attention's v_head_dim), strided pool views and
    contiguous gathered copies, an additive mask per row or none, a scale, one row (split
    over its KV groups between the threads) and several: the result matches float64 to
    float32 rounding (bf16: one rounding of the output)."""
    gen = torch.Generator().manual_seed(3)
    for b, n, g, d, dv, sk, strided, masked in [(5, 9, 3, 64, 64, 37, True, True),
                                                (5, 4, 1, 20, 20, 50, True, False),
                                                (5, 8, 8, 32, 48, 19, False, True),
                                                (5, 6, 2, 64, 64, 64, False, False),
                                                (1, 9, 3, 64, 64, 90, True, True),
                                                (1, 6, 2, 16, 16, 33, False, False)]:
        (k, v), _ = paged(b, g, sk, d, dv, dtype, gen)
        if not strided:
            k, v = k.contiguous(), v.contiguous()
        q = torch.randn(b, n, 1, d, generator=gen).to(dtype)
        mask = None
        if masked:  # each row's own length, 1..sk
            lengths = torch.randint(1, sk + 1, (b,), generator=gen)
            mask = torch.zeros(b, 1, 1, sk).masked_fill_(
                torch.arange(sk) >= lengths[:, None, None, None], float("-inf")).to(dtype)
        scale = 0.7 / math.sqrt(d)
        got = attention_kernels.decode_attention(q, k, v, mask, scale)
        want = reference(q, k, v, mask, scale)
        assert got.dtype == dtype and got.shape == (b, n, 1, dv)
        tol = 2e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_masked_stale_entries_never_reach_the_result(kernel):
    """Keys masked with -inf are skipped, so NaN / inf left in the cache past a row's length
    change nothing (0 * NaN would be NaN in a softmax-then-sum); a row with every key masked
    (padding) gets zeros, not NaN."""
    gen = torch.Generator().manual_seed(4)
    b, n, g, d, sk = 3, 4, 2, 16, 20
    (k, v), (kp, vp) = paged(b, g, sk, d, d, torch.float32, gen)
    q = torch.randn(b, n, 1, d, generator=gen)
    lengths = torch.tensor([7, 20, 0])
    mask = torch.zeros(b, 1, 1, sk).masked_fill_(
        torch.arange(sk) >= lengths[:, None, None, None], float("-inf"))
    want = reference(q, k, v, mask, 0.25)[:2]
    clean = attention_kernels.decode_attention(q, k, v, mask, 0.25)
    k[0, :, 7:] = float("nan")  # writes through the views into the pools
    v[0, :, 7:] = float("inf")
    k[2] = float("nan")
    assert not torch.isfinite(kp).all() and not torch.isfinite(vp).all()
    got = attention_kernels.decode_attention(q, k, v, mask, 0.25)
    assert torch.equal(got[:2], clean[:2])
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    torch.testing.assert_close(got[:2].double(), want, rtol=2e-6, atol=2e-6)


def test_supports_and_refusals(kernel):
    """`supports` takes float32 / bf16 CPU tensors of one dtype with an additive or no mask;
    a bool mask, mixed dtypes or fp16 go to inductor's loops. The kernel itself refuses
    mismatched shapes with a RuntimeError naming them."""
    q = torch.randn(2, 4, 1, 8)
    k = v = torch.randn(2, 2, 5, 8)
    add = torch.zeros(2, 1, 1, 5)
    assert attention_kernels.supports(q, k, v, add) and attention_kernels.supports(q, k, v, None)
    assert not attention_kernels.supports(q, k, v, add.bool())
    assert not attention_kernels.supports(q, k.bfloat16(), v, None)
    assert not attention_kernels.supports(q.half(), k.half(), v.half(), None)
    with pytest.raises(RuntimeError, match="mismatched shapes"):
        attention_kernels.decode_attention(torch.randn(2, 3, 1, 8), k, v, None, 1.0)
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        columns = torch.randn(2, 2, 8, 5).transpose(-1, -2)  # [2, 2, 5, 8], stride 5 last
        attention_kernels.decode_attention(q, columns, v, None, 1.0)
