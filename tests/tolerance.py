"""How far a kernel's output may be from the exact result: bounds from rounding-error analysis,
computed per element from the inputs, against references computed in float64.

Every kernel test (the C kernels and the Triton ones) compares with `assert_within(got, ref,
bound)`, where `ref` is the float64 result on the very inputs the kernel saw (its bf16 or fp8
values converted exactly) and `bound` what floating point of unit roundoff u can promise for
those inputs. Never a tolerance tuned to one machine: the bound depends on the input only, so
it holds on any CPU, any vector width, any summation order, with or without fused multiply-add.
Standard model (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., ch. 2-3):
each operation's result is the exact one times (1 + e), |e| <= u, and a sum of n terms in any
order, or a dot product of length n, is off by at most gamma_n = n u / (1 - n u) times the sum
of the terms' magnitudes (Higham eq. 3.5; it holds for blocked, pairwise, FMA and vector sums).
Each bound below is that worst case; `tests/test_tolerance.py` shows each one failing a
deliberately broken kernel, so none is loose enough to hide a real bug.
"""
from __future__ import annotations

import math

import torch

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# half the spacing of each dtype's subnormals: the absolute error of rounding a value too small
# for the relative bound u (fp16's subnormals start at 6e-5; bf16 has fp32's exponent range)
ETA = {torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}
FP8 = getattr(torch, "float8_e4m3fn", None)
TINY = 2.0 ** -126       # fp32's least normal: products below it lose more than u (underflow)
EXP_ULPS = 4             # exp's own relative error in units of u: libm's expf, torch's (SLEEF),
#                          the C kernel's polynomial (under 1e-8 + its roundings), Triton's exp2
#                          on a GPU (ex2.approx: 2 ulp) and in the interpreter (numpy's)
MIN_TILE = 16            # the fewest rows between two updates of a running max: the C kernel's
#                          TILE, Triton's BLOCK_N (16 at least), torch's flash kernel's blocks


def gamma(n: float, u: float = U[torch.float32]) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n roundings in a row."""
    if n * u >= 1:
        raise ValueError(f"gamma_{n} undefined for u = {u}: the bound does not exist")
    return n * u / (1 - n * u)


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """|got - ref| <= bound elementwise (got converted to float64 exactly); NaN or inf in got
    fails. The message names the worst element and its error as a fraction of its bound."""
    g = got.double()
    if g.shape != ref.shape:
        raise AssertionError(f"{what}: shape {tuple(g.shape)}, expected {tuple(ref.shape)}")
    err = (g - ref).abs()
    bad = ~(err <= bound)               # NaN compares False: it fails
    if bool(bad.any()):
        ratio = torch.where(bound > 0, err / bound, torch.full_like(err, math.inf)).nan_to_num(math.inf)
        i = int(ratio.flatten().argmax())
        at = tuple(int(c) for c in torch.unravel_index(torch.tensor(i), g.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {g.numel()} elements past the error bound; worst at {at}: "
            f"got {g.flatten()[i].item():.9g}, float64 {ref.flatten()[i].item():.9g}, "
            f"|diff| {err.flatten()[i].item():.3g} = {ratio.flatten()[i].item():.3g} x the bound "
            f"{bound.flatten()[i].item():.3g}")


def slack(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest |got - ref| / bound: below 1 passes; how close a result came."""
    return float(((got.double() - ref).abs() / bound).nan_to_num(math.inf).max())


# ---- products -----------------------------------------------------------------------------
def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, K); w: (N, K) -> (x @ w.T in float64, its bound), both (B, N).

    Each output is a dot product of length K: K products and K - 1 additions, in whatever
    order and vector width the kernel chooses, so |y^ - y| <= gamma_K sum_j |x_j| |w_j|
    (Higham eq. 3.5; a fused multiply-add only removes roundings). Underflow adds at most
    K x TINY x u per output. The bound grows with the dot's length and the operands' sizes,
    not with |y|: where the terms cancel the absolute error stays that of the terms."""
    xd, wd = x.double(), w.double()
    k = x.shape[-1]
    return xd @ wd.T, gamma(k) * (xd.abs() @ wd.abs().T) + k * TINY


def gemv_bf16_reference(x: torch.Tensor, w: torch.Tensor, x_rounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, K) fp32; w: (N, K) bf16 -> (x @ w.T in float64 from the exact bf16 weights, its
    bound), both (B, N).

    The widening kernel is gemv_reference's case (bf16 -> fp32 is exact): gamma_K. Where x is
    rounded to bf16 first (AVX512-BF16's vdpbf16ps), each term carries that rounding, u of
    bf16 (2^-8), then the fp32 sum's gamma_K, compounded: u + gamma_K (1 + u). The
    instruction flushes subnormal inputs and products to zero: at most TINY a term, K of them.
    Both grow with sum |x_j| |w_j|, not |y|."""
    xd, wd = x.double(), w.double()
    k = x.shape[-1]
    u = U[torch.bfloat16] if x_rounded else 0.0
    rel = u + gamma(k) * (1 + u)
    return xd @ wd.T, rel * (xd.abs() @ wd.abs().T) + 2 * k * TINY


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, K); w: (K,) -> (x / sqrt(mean(x^2) + eps) * w in float64, its bound).

    The sum of squares is of K positive terms: relative error gamma_K (squares included); the
    division by K, the addition of eps, the square root, the reciprocal and the two products
    add at most six roundings, and the root halves the sum's error: relative error at most
    gamma_(K/2 + 6) of each output. In a 16-bit dtype the normalised row and its product with
    w are each rounded to it (as torch's rms_norm followed by * w, and the fused Triton
    kernel): gamma_2 of that dtype more, the two compounded."""
    xd, wd = x.double(), w.double()
    k = x.shape[-1]
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * wd
    rel = gamma(k / 2 + 6) + (gamma(2, U[out_dtype]) if out_dtype != torch.float32 else 0.0)
    return ref, rel * (1 + gamma(k / 2 + 6)) * ref.abs() + 2 * ETA[out_dtype] + TINY


def silu_mul_reference(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up: (T, 2 n), gate then up -> (silu(gate) * up in float64, its bound), (T, n).

    silu(g) = g / (1 + e^-g) in fp32: exp's EXP_ULPS u, the addition (whose result is at
    least 1 and at least e^-g, so it does not magnify the error), the division and the
    product with up: (EXP_ULPS + 3) u of fp32 relative. In a 16-bit dtype the activation and
    the product are each rounded to it, as torch rounds F.silu(gate) * up: 2 u of it more."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = gate * torch.sigmoid(gate) * up
    inner = gamma(EXP_ULPS + 3)
    rel = inner + (gamma(2, U[gate_up.dtype]) if gate_up.dtype != torch.float32 else 0.0)
    return ref, rel * (1 + inner) * ref.abs() + 2 * ETA[gate_up.dtype] + TINY


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, H, d); cos, sin: (T, 1, d), the table rows the kernel read -> (rotate-half RoPE
    x cos + (-x2, x1) sin in float64, its bound), both (T, H, d).

    Each output is a dot product of length 2, x_j c_j - x_(j+d/2) s_j (or the sum for the
    upper half), with or without a fused multiply-add: gamma_2 times the terms' magnitudes
    (Higham eq. 3.5), and 2 TINY for products below fp32's normal range."""
    xd, c, s = x.double(), cos.double(), sin.double()
    half = x.shape[-1] // 2
    rot = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)            # (-x2, x1)
    return xd * c + rot * s, gamma(2) * (xd.abs() * c.abs() + rot.abs() * s.abs()) + 2 * TINY


# ---- attention ----------------------------------------------------------------------------
def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None, p_dtype: torch.dtype = torch.float32,
                        out_dtype: torch.dtype = torch.float32, score_abs: float = 0.0,
                        out_abs_per_key: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale q k^T) v in float64 and its bound. q: (H, Tq, d); k, v: (Hk, S, d), the
    values the kernel reads (fp8 already times its scale, exactly, in float64); mask: (Tq, S)
    bool, True where a query sees a key, or None. Returns (ref, bound), both (H, Tq, d).

    Why the bound has the shape it has. For one query let s_i be key i's exact score, m their
    maximum, p_i the exact softmax, o the exact output and T the keys it sees.
    - Scores: a dot product of length d, the scale, and where it applies the fp8 scale and
      Triton's log2(e): |s^_i - s_i| <= gamma_(d+3) a_i, with a_i = |scale| sum_c |q_c k_ic|.
      It grows with the score's magnitude: at scores of +-150 it is about 30 times what it is
      at +-5, the case the fixed atol of 1e-5 failed (issue 21).
    - The exponent: exp is taken of s^_i - m^ (any running max m^: a shift common to all rows
      cancels in the normalisation); the subtraction rounds with u |s_i - m|, exp adds
      EXP_ULPS u, and each later update of the running max multiplies the row's weight by a
      rounded exp(m_old - m_new): at most 2 T / MIN_TILE + 1 updates (per tile, then the
      merge of splits). So row i's weight is exp(s_i - m) e^(t_i) with |t_i| <= tau_i =
      gamma_(d+3) a_i + u |s_i - m| + (EXP_ULPS + 1) u (2 T / MIN_TILE + 1).
    - Perturbed weights: o^ - o = sum_i p_i (e^(t_i) - 1) (v_i - o) / sum_i p_i e^(t_i), so
      |o^ - o| <= e^(max tau) sum_i p_i (e^(tau_i) - 1) (|v_i| + |o|). Only the rows that
      carry weight count.
    - The sums: the weighted sum of T values and the sum of T weights are off by at most
      gamma_(T+2) (sum_i p_i |v_i| + |o|), the products and the final division included.
    - Probabilities rounded to q's dtype before the second product (the Triton kernel with
      bf16 or fp16 queries, as FlashAttention does): u_p sum_i p_i |v_i|, and where a weight
      (at most 1 before the division by their sum, itself at least 1) falls among fp16's
      subnormals, eta_p sum_i |v_i|; the output rounded to its dtype: u_out |o| + eta_out.
      Roundings that follow one another compound: the weights' error is taken (1 + u_p)
      times, and the whole error (1 + u_out) times before the output's own rounding is added.
    - score_abs: an absolute error a kernel's scores may have beyond gamma_(d+3) a_i (what its
      arithmetic flushes to zero: paged_decode_reference's dot_bf16), added to every tau_i;
      out_abs_per_key: the same for the output, per key seen (added before its rounding).
    So the bound grows with the largest scores (through a_i and |s_i - m|) and the length
    (through the updates and gamma_T); it is computed in float64 from the inputs alone."""
    h, tq, d = q.shape
    hk, _, _ = k.shape
    g = h // hk
    u = U[torch.float32]
    qd = q.double().reshape(hk, g * tq, d)                                # (hk, g*Tq, d): head = kv_head * g + j
    kd, vd = k.double(), v.double()                                       # (hk, S, d)
    s = scale * qd @ kd.transpose(1, 2)                                   # (hk, g*Tq, S)
    a = abs(scale) * qd.abs() @ kd.abs().transpose(1, 2)
    seen = torch.ones(tq, k.shape[1], dtype=torch.bool) if mask is None else mask.cpu()
    seen = seen.repeat(g, 1)                                              # (g*Tq, S)
    s = s.masked_fill(~seen, -math.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.softmax(s, -1)                                              # (hk, g*Tq, S)
    o = p @ vd                                                            # (hk, g*Tq, d)
    t = seen.sum(-1, keepdim=True).double()                               # (g*Tq, 1): keys seen
    updates = 2 * torch.ceil(t / MIN_TILE) + 1
    tau = gamma(d + 3) * a + u * (s - m).abs() + (EXP_ULPS + 1) * u * updates + score_abs
    tau = tau.masked_fill(~seen, 0.0)                                     # (hk, g*Tq, S)
    w = p * torch.expm1(tau)
    first = torch.exp(tau.amax(-1, keepdim=True)) * (w @ vd.abs() + w.sum(-1, keepdim=True) * o.abs())
    absv = p @ vd.abs()                                                   # (hk, g*Tq, d): sum p |v|
    u_p = U[p_dtype] if p_dtype != torch.float32 else 0.0
    u_out = U[out_dtype] if out_dtype != torch.float32 else 0.0
    sums = (t + 2) * u / (1 - (t + 2) * u)                                # gamma_(T+2), per query
    # the output's own rounding applies to the computed output: (its error)(1 + u_out) + u_out |o|
    inside = (first * (1 + u_p) + sums * (absv + o.abs()) + u_p * absv + ETA[p_dtype] * (seen.double() @ vd.abs())
              + out_abs_per_key * t)
    bound = inside * (1 + u_out) + u_out * o.abs() + ETA[out_dtype] + d * TINY
    return o.reshape(h, tq, d), bound.reshape(h, tq, d)


def lse_reference(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """log sum_i exp(s_i), the log-sum-exp a split-K kernel keeps beside its output, in float64
    and its bound. q: (H, Tq, d); k: (Hk, S, d); mask as attention_reference's -> both (H, Tq).

    Each weight is off by at most a factor e^(tau_i) (attention_reference), which moves the
    log of their sum by at most max tau; the sum adds gamma_(T+2); the log and the addition
    of the max round with (EXP_ULPS + 2) u of the magnitudes involved."""
    h, tq, d = q.shape
    hk = k.shape[0]
    g = h // hk
    u = U[torch.float32]
    qd, kd = q.double().reshape(hk, g * tq, d), k.double()
    seen = (torch.ones(tq, k.shape[1], dtype=torch.bool) if mask is None else mask.cpu()).repeat(g, 1)
    s = (scale * qd @ kd.transpose(1, 2)).masked_fill(~seen, -math.inf)   # (hk, g*Tq, S)
    a = abs(scale) * qd.abs() @ kd.abs().transpose(1, 2)
    m = s.amax(-1, keepdim=True)
    lse = torch.logsumexp(s, -1)                                          # (hk, g*Tq)
    t = seen.sum(-1).double()
    tau = gamma(d + 3) * a + u * (s - m).abs() + (EXP_ULPS + 1) * u * (2 * torch.ceil(t / MIN_TILE) + 1)[:, None]
    bound = (tau.masked_fill(~seen, 0.0).amax(-1) + (t + 2) * u / (1 - (t + 2) * u)
             + (EXP_ULPS + 2) * u * (lse.abs() + m[..., 0].abs()))
    return lse.reshape(h, tq), bound.reshape(h, tq)


def decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     p_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype = torch.float32,
                     score_abs: float = 0.0, out_abs_per_key: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per head. q: (H, d); k, v: (T, Hk, d) -> (ref, bound), both (H, d)."""
    ref, bound = attention_reference(q[:, None], k.transpose(0, 1), v.transpose(0, 1), scale, None, p_dtype,
                                     out_dtype, score_abs, out_abs_per_key)
    return ref[:, 0], bound[:, 0]


def paged_rows(cache: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` rows from a paged cache (num_blocks, block_size, Hk, d), in
    float64, fp8 values times their scale exactly: (length, Hk, d)."""
    blocks = seq_blocks(table, length, cache.shape[1])
    raw = cache.cpu()
    if raw.dtype == FP8:           # CPU torch gathers float8 as bytes only
        raw = raw.view(torch.uint8)[blocks].view(FP8)
    else:
        raw = raw[blocks]
    rows = raw.flatten(0, 1)[:length].double()                            # (length, Hk, d)
    if scale is not None:
        rows = rows * paged_scales(scale, table, length, cache.shape[1]).double()[..., None]
    return rows


def seq_blocks(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The ids of the blocks a sequence of `length` rows occupies, from its table."""
    return table.long().cpu()[:-(-length // block_size)]


def paged_scales(scale: torch.Tensor, table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """A sequence's first `length` rows of fp8 scales (num_blocks, block_size, Hk): (length, Hk)."""
    return scale.cpu()[seq_blocks(table, length, block_size)].flatten(0, 1)[:length]


def bf16_queries(q: torch.Tensor) -> torch.Tensor:
    """The queries the C kernel's fp8 attention on AVX512-BF16 (decode.c's K_DOT) multiplies:
    rounded to bf16 (nearest even), as vdpbf16ps sees them, which takes an input under 2^-126
    for zero: the kernel's queries are times 2^60, so a query under 2^-186 is one."""
    qb = q.bfloat16().float()
    return torch.where(qb.abs() < 2.0 ** -186, torch.zeros_like(qb), qb)


def e4m3_normal(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as that kernel's vdpbf16ps sees it: its bytes hold each value times 2^-120,
    so a subnormal (exponent bits 0, mantissa not) is under 2^-126, taken for zero."""
    raw = cache.view(torch.uint8)
    subnormal = ((raw & 0x78) == 0) & ((raw & 0x07) != 0)
    return torch.where(subnormal, torch.zeros_like(raw), raw).view(cache.dtype)


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lens, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, p_dtype: torch.dtype = torch.float32,
                           out_dtype: torch.dtype = torch.float32, dot_bf16: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_reference for each of B sequences read through its block table.
    q: (B, H, d); tables: (B, max_blocks); lens: B ints -> (ref, bound), both (B, H, d).
    dot_bf16: an fp8 cache's attention as the C kernel computes it with AVX512-BF16
    (native.bf16_native()): scores of bf16_queries() and e4m3_normal() K, each off by what
    vdpbf16ps flushes to zero besides: each of a lane's products and sums under 2^-126, 4 a pair
    of dims in 16 lanes, so 2 d 2^-126 in the kernel's units, which its K scale (times 2^60)
    and the softmax scale carry to the score: 2 d 2^-66 |scale| times the row's K scale (their
    largest). Then p (times its V scale and 2^60) rounded to bf16 (p_dtype), e4m3_normal() V,
    and in p V two products and two sums a pair of keys, each under 2^-126 flushed, the 2^60
    taken off at the end: 2 T 2^-66; a p flushed as an input (p V under 2^-186 x 448 a key)
    adds less: 4 T 2^-66 in all."""
    fp8 = dot_bf16 and k_scale is not None
    if fp8:
        q, k_cache, v_cache = bf16_queries(q), e4m3_normal(k_cache), e4m3_normal(v_cache)
    refs, bounds = [], []
    for b, n in enumerate(int(x) for x in lens):
        k = paged_rows(k_cache, k_scale, tables[b], n)
        v = paged_rows(v_cache, v_scale, tables[b], n)
        flushed = 0.0
        if fp8:
            ks = paged_scales(k_scale, tables[b], n, k_cache.shape[1])
            flushed = 2 * q.shape[-1] * 2.0 ** -66 * abs(scale) * float(ks.abs().max())
        r, e = decode_reference(q[b].cpu(), k, v, scale, torch.bfloat16 if fp8 else p_dtype, out_dtype, flushed,
                                4 * 2.0 ** -66 if fp8 else 0.0)
        refs.append(r)
        bounds.append(e)
    return torch.stack(refs), torch.stack(bounds)
