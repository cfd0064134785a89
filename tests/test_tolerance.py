"""The error bounds of tests/tolerance.py are tight enough to catch real bugs: for each bound,
deliberately broken kernels fail it on the very inputs where the working kernel passes.

The broken kernels are the real C kernels given what a bug would hand them (a table that
skips a block, the wrong scale, a reduction missing a stretch of k), or, where a bug cannot
be had by feeding the real kernel (a softmax without its running max, a running max that
forgets to rescale), the kernel's own algorithm written in fp32 torch with that one mistake.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_native_batch import BS, paged_batch
from tolerance import (assert_within, attention_reference, decode_reference, gemv_bf16_reference, gemv_reference,
                       lse_reference,
                       paged_decode_reference, paged_rows, rms_norm_reference, rope_reference, silu_mul_reference, slack)
from kvchat.engine import attention as A
from kvchat.engine import cpu_attention as C
from kvchat.engine import native

FP8 = torch.float8_e4m3fn


def fails(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    try:
        assert_within(got, ref, bound)
    except AssertionError:
        return True
    return False


# ---- the product ------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(576, 576), (960, 1536), (13, 33)])
def test_the_product_bound_catches_a_dropped_block_a_dropped_tail_and_bf16_weights(n, k):
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(4, k, generator=gen), torch.randn(n, k, generator=gen)
    ref = gemv_reference(x, w)
    assert_within(native.gemv(x, w), *ref)                          # the working kernel
    skipped = x.clone()
    skipped[:, 16:32] = 0                                           # one vector of k never summed
    assert fails(native.gemv(skipped, w), *ref), "a dropped block of k"
    assert fails(native.gemv(x[:, :-1].contiguous(), w[:, :-1].contiguous()), *ref), "k's last element dropped"
    assert fails(native.gemv(x, w.bfloat16().float()), *ref), "weights rounded to bf16"
    assert fails(native.gemv(x, w)[:, torch.arange(n).roll(1)], *ref), "rows written one place off"


@pytest.mark.parametrize("n, k", [(576, 576), (960, 1536), (13, 33)])
def test_the_bf16_product_bound_catches_swapped_pairs_a_dropped_block_and_x_rounded_twice(n, k):
    """The bound of the kernel this CPU builds (x rounded to bf16 where vdpbf16ps serves), and
    the same broken inputs the fp32 bound catches, plus the bf16 path's own likely bugs: the
    two halves of each bf16 pair swapped (an interleave done wrong) and x rounded to fp16-like
    precision (a wrong conversion: 5 bits fewer)."""
    gen = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(4, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
    ref = gemv_bf16_reference(x, w, native.bf16_native())
    assert_within(native.gemv(x, w), *ref)
    skipped = x.clone()
    skipped[:, 32:64] = 0
    assert fails(native.gemv(skipped, w), *ref), "a dropped block of k"
    kk = k // 2 * 2
    pairs = w.clone()
    pairs[:, :kk] = w[:, :kk].view(n, kk // 2, 2).flip(-1).reshape(n, kk)
    assert fails(native.gemv(x, pairs), *ref), "bf16 pairs swapped"
    coarse = (x * 8).round() / 8 if k > 100 else x.bfloat16().float().mul(1 + 2 ** -4)
    assert fails(native.gemv(coarse, w), *ref), "x rounded coarser than bf16"
    assert fails(native.gemv(x, w)[:, torch.arange(n).roll(1)], *ref), "rows written one place off"


def test_the_norm_bound_catches_a_short_mean_and_eps_outside_the_root():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    ref = rms_norm_reference(x, w, 1e-5)
    assert_within(native.rms_norm(x, w, 1e-5), *ref)
    ms = x.pow(2).mean(-1, keepdim=True)
    assert fails(x * torch.rsqrt(x[:, 16:].pow(2).mean(-1, keepdim=True) + 1e-5) * w, *ref), "a block left out"
    assert fails((x * torch.rsqrt(ms + 1e-5)).bfloat16().float() * w, *ref), "normalised rows rounded to bf16"
    small = x * 1e-3                                    # mean square 1e-5: where eps matters
    ref = rms_norm_reference(small, w, 1e-5)
    assert_within(native.rms_norm(small, w, 1e-5), *ref)
    assert fails(small / (small.pow(2).mean(-1, keepdim=True).sqrt() + 1e-5) * w, *ref), "eps outside the root"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_activation_bound_catches_swapped_halves_and_a_sigmoid_approximation(dtype):
    """silu(gate) * up, as the Triton kernel and torch compute it, against gate and up taken
    the wrong way round, and against GELU's sigmoid(1.702 x) stand-in."""
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(2, 2 * 300, generator=gen) * 4).to(dtype)
    ref = silu_mul_reference(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within(F.silu(gate) * up, *ref)                                # torch, rounding where it rounds
    assert fails(F.silu(up) * gate, *ref), "halves swapped"
    assert fails(gate * torch.sigmoid(1.702 * gate) * up, *ref), "an approximate sigmoid"


# ---- attention --------------------------------------------------------------------------------
def one_sequence(length: int, fp8: bool = False, seed: int = 0, q_scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    k, v, ks, vs, tables = paged_batch([length], 3, 64, gen, "fp8" if fp8 else "fp32", head_major=True)
    q = torch.randn(9, 64, generator=gen) * q_scale
    return q, k, v, ks, vs, tables[0]


def online_softmax(q, k, v, scale, running_max: bool = True, rescale: bool = True, tile: int = 16):
    """The C kernel's algorithm in fp32 torch, one KV head at a time: scores of `tile` rows,
    a running max, exp, a running sum and output rescaled when the max moves. q: (H, d);
    k, v: (T, Hk, d) float32 -> (H, d). The flags break it the way a kernel can be broken."""
    h, d = q.shape
    t, hk, _ = k.shape
    qg = q.view(hk, h // hk, d)                                            # (hk, g, d)
    m = torch.full((hk, h // hk, 1), float("-inf"))
    l = torch.zeros(hk, h // hk, 1)
    acc = torch.zeros(hk, h // hk, d)
    for r0 in range(0, t, tile):
        s = qg @ k[r0:r0 + tile].permute(1, 2, 0) * scale                  # (hk, g, tile)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True)) if running_max else torch.zeros_like(m)
        alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        p = torch.exp(s - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ v[r0:r0 + tile].transpose(0, 1)
        m = m_new
    return (acc / l).reshape(h, d)


def test_the_attention_bound_catches_a_dropped_block():
    """The real kernel reading a table that skips one of the sequence's blocks (a split's
    boundary off by a block, a loop that stops one early)."""
    q, k, v, _, _, table = one_sequence(700)
    ref = decode_reference(q, paged_rows(k, None, table, 700), paged_rows(v, None, table, 700), 0.125)
    assert_within(native.decode(q, k, v, table, 700, 0.125), *ref)
    for skipped in (0, 20, 43):                                            # the first, a middle, the last full one
        keep = torch.cat((table[:skipped], table[skipped + 1:]))
        assert fails(native.decode(q, k, v, keep, 700 - BS, 0.125), *ref), f"block {skipped} dropped"


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_the_attention_bound_catches_a_wrong_scale(fp8):
    q, k, v, ks, vs, table = one_sequence(500, fp8, seed=1)
    ref = [x[0] for x in paged_decode_reference(q[None], k, v, table[None], [500], 0.125, ks, vs,
                                                dot_bf16=native.bf16_native())]
    assert_within(native.decode(q, k, v, table, 500, 0.125, ks, vs), *ref)
    # p rounded to bf16 (fp8 on AVX512-BF16) widens the bound by 2^-8 of sum p |v|: 2% is seen there
    off = 1.02 if fp8 and native.bf16_native() else 1.01
    assert fails(native.decode(q, k, v, table, 500, 0.125 * off, ks, vs), *ref), f"the scale {off - 1:.0%} off"
    assert fails(native.decode(q, k, v, table, 500, 1 / 64, ks, vs), *ref), "1/d instead of 1/sqrt(d)"
    if fp8:
        ones = torch.ones_like(ks)
        assert fails(native.decode(q, k, v, table, 500, 0.125, ones, vs), *ref), "K's fp8 scales ignored"
        assert fails(native.decode(q, k, v, table, 500, 0.125, ks, ks), *ref), "K's scales used for V"


def test_the_fp8_bf16_score_bound_tells_the_rounded_queries_from_exact_ones():
    """decode.c's fp8 attention on AVX512-BF16 rounds the queries and p to bf16 and takes e4m3
    subnormals for zero (vdpbf16ps): that build's output is within dot_bf16's bound and past the
    exact one, and the portable build's (float32 widening) the other way round. A K row of
    subnormals with a large scale (not what our writes make: they scale each row's largest
    value to 448) moves the scores by far more than any bound, so the flush is modelled too."""
    if not native.bf16_native():
        pytest.skip("this build has no AVX512-BF16: its fp8 scores are float32's")
    q, k, v, ks, vs, table = one_sequence(500, True, seed=3)
    k.view(torch.uint8)[table[1], 5, 0] = 0x07                            # 7/8 x 2^-6 each, times 1000
    ks[table[1], 5, 0] = 1000.0
    args = (q[None], k, v, table[None], [500], 0.125, ks, vs)
    exact = [x[0] for x in paged_decode_reference(*args)]
    rounded = [x[0] for x in paged_decode_reference(*args, dot_bf16=True)]
    got = native.decode(q, k, v, table, 500, 0.125, ks, vs)
    assert_within(got, *rounded)
    assert fails(got, *exact)
    with native.using("portable"):
        widened = native.decode(q, k, v, table, 500, 0.125, ks, vs)
    assert_within(widened, *exact)
    assert fails(widened, *rounded)


def test_the_attention_bound_catches_a_softmax_without_the_running_max():
    """Scores up to about +-150 (e^150 is past fp32's range): subtracting the running max is
    what keeps exp finite. The same inputs as test_native's large-score test."""
    q, k, v, _, _, table = one_sequence(700, q_scale=40.0, seed=5)
    rows_k, rows_v = paged_rows(k, None, table, 700), paged_rows(v, None, table, 700)
    ref = decode_reference(q, rows_k, rows_v, 0.125)
    assert float((q.double().view(3, 3, 64) @ rows_k.permute(1, 2, 0)).abs().max()) * 0.125 > 89   # e^89 > fp32 max
    assert_within(native.decode(q, k, v, table, 700, 0.125), *ref)
    assert_within(online_softmax(q, rows_k.float(), rows_v.float(), 0.125), *ref)       # the algorithm, unbroken
    assert fails(online_softmax(q, rows_k.float(), rows_v.float(), 0.125, running_max=False), *ref)


def test_the_attention_bound_catches_a_running_max_that_forgets_to_rescale():
    q, k, v, _, _, table = one_sequence(300, seed=6)
    rows_k, rows_v = paged_rows(k, None, table, 300).float(), paged_rows(v, None, table, 300).float()
    ref = decode_reference(q, rows_k, rows_v, 0.125)
    assert fails(online_softmax(q, rows_k, rows_v, 0.125, rescale=False), *ref)


def test_the_old_fp32_reference_was_within_what_fp32_promises():
    """Issue 21's failure: at scores of +-150 the kernel and the fp32 reference differed by
    3.3e-5, past a fixed atol of 1e-5. Against float64 both are within the bound; the kernel
    is the closer of the two."""
    q, k, v, _, _, table = one_sequence(700, q_scale=40.0, seed=5)
    ref = paged_decode_reference(q[None], k, v, table[None], [700], 0.125)
    fp32_ref = A.paged_decode_ref(q[None], k.nan_to_num(0), v.nan_to_num(0), table[None, :-(-700 // BS)],
                                  torch.tensor([700], dtype=torch.int32), 0.125)
    kernel = native.decode(q, k, v, table, 700, 0.125)[None]
    assert_within(fp32_ref, *ref)
    assert_within(kernel, *ref)
    assert slack(kernel, *ref) < slack(fp32_ref, *ref)


def test_the_prefill_bound_catches_a_mask_one_key_off():
    """Causal attention after a cached prefix (the torch path's prefix_then_causal): a query
    that also sees the next key fails the bound."""
    gen = torch.Generator().manual_seed(8)
    t, prefix, h, hk, d = 40, 100, 9, 3, 64
    q = torch.randn(h, t, d, generator=gen)
    k, v = torch.randn(hk, prefix + t, d, generator=gen), torch.randn(hk, prefix + t, d, generator=gen)
    mask = torch.ones(t, prefix + t, dtype=torch.bool).tril(diagonal=prefix)
    ref = attention_reference(q, k, v, d ** -0.5, mask)
    assert_within(A.causal_attention(q, k, v, prefix, d ** -0.5), *ref)
    one_more = torch.ones(t, prefix + t, dtype=torch.bool).tril(diagonal=prefix + 1)
    leaky = F.scaled_dot_product_attention(q[None], k.repeat_interleave(3, 0)[None], v.repeat_interleave(3, 0)[None],
                                           attn_mask=one_more, scale=d ** -0.5)[0]
    assert fails(leaky, *ref)


def test_the_log_sum_exp_bound_catches_log2_units_and_a_missing_window():
    """The log-sum-exp a split keeps for the merge (torch's fused CPU op, cpu_attention), against
    one in log2 units (the Triton kernel's own, handed over unconverted) and one that misses
    the window's last 16 keys."""
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(1, 3, 3, 64, generator=gen)
    k, v = torch.randn(1, 3, 200, 64, generator=gen), torch.randn(1, 3, 200, 64, generator=gen)
    _, lse = C.partial_attention(q, k, v, 0.125)                          # (1, 3, 3)
    ref = lse_reference(q[0].reshape(9, 1, 64), k[0], 0.125)
    got = lse[0].reshape(9, 1)
    assert_within(got, *ref)
    assert fails(got * 1.4426950408889634, *ref), "log2 units"
    _, short = C.partial_attention(q, k[:, :, :-16], v[:, :, :-16], 0.125)
    assert fails(short[0].reshape(9, 1), *ref), "16 keys missing"


# ---- RoPE -----------------------------------------------------------------------------------------
def test_the_rope_bound_catches_a_wrong_sign_the_next_position_and_swapped_halves():
    """The C rotation (native_step.rope_write) within rope_reference's bound, and the same
    kernel fed what a bug would give it failing it: sin negated (rotating the wrong way),
    every position one on (an off-by-one in the table's index), halves swapped in its output."""
    from test_native_fused import pool_for, tables
    from kvchat.engine import native_step
    gen = torch.Generator().manual_seed(8)
    cos, sin = tables(64, 500)
    qkv = torch.randn(6, 15 * 64, generator=gen)
    pos, slots = torch.randint(1, 499, (6,), generator=gen), torch.arange(6)
    q_in = qkv[:, :9 * 64].reshape(6, 9, 64)
    ref = rope_reference(q_in, cos[pos], sin[pos])

    def rotate(c, s, p):
        k, v, _, _ = pool_for(3, 64, 1, "fp32", True)
        return native_step.rope_write(qkv, c, s, p, k, v, slots, None, None, 9)
    assert_within(rotate(cos, sin, pos), *ref)
    assert fails(rotate(cos, -sin, pos), *ref), "the wrong direction"
    assert fails(rotate(cos, sin, pos + 1), *ref), "the next position"
    assert fails(rotate(cos, sin, pos).roll(32, dims=-1), *ref), "halves swapped"
