"""The Triton kernels against float64 on fresh random inputs. Without a GPU they run in
triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1 before the engine is imported.

Every run starts from poison: caches are NaN outside the rows a sequence owns (so a read past
the context shows), and every buffer the decode wrapper allocates is NaN-filled (so an
element left unwritten shows). Decode attention, RMSNorm and silu are held to the error
bounds of tests/tolerance.py, for the dtype they compute in: the decode kernel rounds the
probabilities to q's dtype for the second matmul (as FlashAttention does) and its output to
q's dtype, and the bound counts both. Cache writes must match torch's bit for bit, RoPE too
(it rounds where torch rounds).
"""
from __future__ import annotations

import math

import pytest
import torch

from tolerance import assert_within, paged_decode_reference, rms_norm_reference, silu_mul_reference
from kvchat.engine import attention as A
from kvchat.engine.cuda_graph import TorchOps
from kvchat.engine.kernels import DecodeConfig, add_rms_norm, paged_decode, rope_write, silu_mul, write_kv
from kvchat.engine.kernels import checks
from kvchat.engine.kernels import decode as pd

pytestmark = pytest.mark.slow  # interpreted kernels: a couple of minutes on two cores

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn


def q_dtype_for(cache_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if cache_dtype == FP8 else cache_dtype


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every buffer paged_decode allocates starts as NaN."""
    def nan_empty(*shape, dtype=None, device=None):
        return torch.full(*shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(pd, "_empty", nan_empty)


def random_cache(nb: int, bs: int, hk: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """(k_cache, v_cache, k_scale, v_scale) of N(0, 1) rows; fp8 through the reference quantizer."""
    act = q_dtype_for(dtype)
    k = torch.randn(nb * bs, hk, d, generator=gen).to(act)
    v = torch.randn(nb * bs, hk, d, generator=gen).to(act)
    if dtype != FP8:
        return k.view(nb, bs, hk, d).to(DEVICE), v.view(nb, bs, hk, d).to(DEVICE), None, None
    (kq, ks), (vq, vs) = A.quantize_fp8(k), A.quantize_fp8(v)
    return (kq.view(nb, bs, hk, d).to(DEVICE), vq.view(nb, bs, hk, d).to(DEVICE),
            ks.view(nb, bs, hk).to(DEVICE), vs.view(nb, bs, hk).to(DEVICE))


def paged_batch(lens: list[int], bs: int, gen: torch.Generator):
    """Shuffled, disjoint block tables for sequences of `lens` tokens, ragged: a row's unused
    tail points at block 0, which no sequence owns. Returns (tables (B, max_blocks) int32,
    num_blocks, owned rows mask (num_blocks * bs,) bool)."""
    need = [-(-n // bs) for n in lens]
    nb = 1 + sum(need)
    ids = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    width = max(need) + 1
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    owned = torch.zeros(nb * bs, dtype=torch.bool)
    for i, (n, k) in enumerate(zip(lens, need)):
        row, ids = ids[:k], ids[k:]
        tables[i, :k] = torch.tensor(row, dtype=torch.int32)
        slots = torch.tensor(row)[:, None] * bs + torch.arange(bs)
        owned[slots.flatten()[:n]] = True
    return tables, nb, owned


def poisoned(cache: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """A copy of cache with every row outside `owned` set to NaN."""
    flat = cache.clone().view(owned.shape[0], -1)
    outside = ~owned.to(cache.device)
    if cache.dtype == FP8:
        flat.view(torch.uint8)[outside] = 0x7F  # e4m3fn's NaN (CPU torch cannot fill fp8)
    else:
        flat[outside] = float("nan")
    return flat.view(cache.shape)


def check_decode(group: int, d: int, bs: int, dtype: torch.dtype, lens: list[int], hk: int = 2,
                 config: DecodeConfig | None = None, seed: int = 0, strided_q: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    tables, nb, owned = paged_batch(lens, bs, gen)
    k_cache, v_cache, k_scale, v_scale = random_cache(nb, bs, hk, d, dtype, gen)
    hq = hk * group
    q = torch.randn(len(lens), hq + 3, d, generator=gen).to(q_dtype_for(dtype))
    q = q[:, :hq] if strided_q else q[:, :hq].contiguous()                    # (B, hq, d)
    q, tables = q.to(DEVICE), tables.to(DEVICE)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d ** -0.5
    ref = paged_decode_reference(q, k_cache, v_cache, tables, lens, scale, k_scale, v_scale, q.dtype, q.dtype)
    out = paged_decode(q, poisoned(k_cache, owned), poisoned(v_cache, owned), tables, context_lens, scale,
                       None if k_scale is None else poisoned(k_scale, owned),
                       None if v_scale is None else poisoned(v_scale, owned), config=config)
    assert out.shape == ref[0].shape and out.dtype == q.dtype
    assert_within(out.cpu(), *ref, what=f"{dtype} lens {lens}")


# Context lengths per case: 1, an exact block multiple, one past a multiple, and one long
# enough that the 4 splits below each get more than one 64-row tile.
def lens_for(bs: int) -> list[int]:
    return [1, 2 * bs, 3 * bs + 1, max(300, 2 * bs + 5)]


SPLIT4 = DecodeConfig(num_splits=4)


@pytest.mark.parametrize("group,d,bs,dtype", [
    (1, 64, 16, torch.float32),
    (3, 64, 8, torch.bfloat16),
    (4, 128, 16, torch.bfloat16),
    (8, 128, 32, torch.bfloat16),
    (4, 64, 128, torch.bfloat16),
    (8, 64, 64, torch.float16),
    (3, 128, 16, torch.float16),
    (4, 128, 8, torch.float32),
    (1, 128, 16, FP8),
    (4, 64, 32, FP8),
    (8, 128, 128, FP8),
    (3, 64, 16, FP8),
], ids=lambda p: str(p).replace("torch.", ""))
def test_paged_decode_matches_reference(nan_buffers, group, d, bs, dtype):
    check_decode(group, d, bs, dtype, lens_for(bs), config=SPLIT4)


@pytest.mark.parametrize("block_n,splits,bs", [(16, 7, 8), (32, 1, 64), (128, 3, 16)])
def test_paged_decode_any_tile_size_and_split_count(nan_buffers, block_n, splits, bs):
    check_decode(4, 64, bs, torch.bfloat16, lens_for(bs), config=DecodeConfig(num_splits=splits, block_n=block_n))


def test_paged_decode_default_config_with_eight_kv_heads(nan_buffers):
    """Llama 3.1 8B's head layout (8 KV heads of 4 queries), splits picked by the wrapper."""
    check_decode(4, 128, 16, torch.bfloat16, [1, 129, 300], hk=8)


def test_paged_decode_reads_strided_queries(nan_buffers):
    check_decode(4, 64, 16, torch.float32, [17, 64], strided_q=True, config=SPLIT4)


def test_paged_decode_more_splits_than_tiles_leaves_empty_splits_harmless(nan_buffers):
    check_decode(4, 64, 16, torch.float32, [1, 5, 65], config=DecodeConfig(num_splits=8, block_n=16))  # 5 tiles at most


# ---- cache write ---------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view, so NaN == NaN and -0 != +0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("hk,d,bs,tokens,dtype,act", [
    (2, 64, 16, 1, torch.bfloat16, torch.bfloat16),
    (8, 128, 16, 37, torch.bfloat16, torch.bfloat16),
    (3, 64, 8, 60, torch.float16, torch.float16),
    (1, 128, 128, 130, torch.float32, torch.float32),
    (2, 64, 32, 50, torch.float32, torch.bfloat16),
    (8, 128, 16, 1, FP8, torch.bfloat16),
    (3, 64, 8, 41, FP8, torch.float32),
    (1, 128, 64, 70, FP8, torch.float16),
], ids=lambda p: str(p).replace("torch.", ""))
def test_write_kv_matches_reference_and_touches_nothing_else(hk, d, bs, tokens, dtype, act):
    gen = torch.Generator().manual_seed(hk * 1000 + tokens)
    nb = -(-tokens // bs) + 3
    # K and V as the model hands them over: strided views of one fused projection, with a
    # spread of magnitudes so fp8 scales vary per (token, head)
    fused = torch.randn(tokens, 3 * hk * d, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen) * 2)
    fused = fused.to(act).to(DEVICE)
    k = fused[:, :hk * d].view(tokens, hk, d)
    v = fused[:, 2 * hk * d:].view(tokens, hk, d)
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEVICE)

    def fresh():
        caches = [torch.full((nb, bs, hk, d), float("nan"), device=DEVICE).to(dtype) for _ in range(2)]
        scales = [None, None]
        if dtype == FP8:
            scales = [torch.full((nb, bs, hk), float("nan"), device=DEVICE) for _ in range(2)]
        return caches + scales

    got, want = fresh(), fresh()
    write_kv(got[0], got[1], k, v, slots, got[2], got[3])
    A.write_kv_ref(want[0], want[1], k, v, slots, want[2], want[3])
    for g, w in zip(got, want):
        if w is not None:
            assert torch.equal(bits(g), bits(w))


# ---- the decode step's fused kernels ---------------------------------------------------------
@pytest.mark.parametrize("dtype,hidden,tokens,residual", [
    (torch.bfloat16, 256, 1, True), (torch.bfloat16, 576, 3, False), (torch.float32, 576, 2, True),
    (torch.float16, 128, 1, True),
], ids=lambda p: str(p).replace("torch.", ""))
def test_add_rms_norm_matches_torch_ops(dtype, hidden, tokens, residual):
    gen = torch.Generator().manual_seed(hidden + tokens)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    res = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE) if residual else None
    w = (1 + torch.randn(hidden, generator=gen) * 0.1).to(dtype).to(DEVICE)
    x_ref = x.clone()
    TorchOps.add_rms_norm(x_ref, res, w, 1e-5)
    got = add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(bits(x), bits(x_ref))        # the residual add, in place, bit for bit
    assert_within(got.cpu(), *rms_norm_reference(x.cpu(), w.cpu(), 1e-5, dtype))


@pytest.mark.parametrize("hq,hk,d,dtype,cache", [
    (8, 2, 64, torch.bfloat16, torch.bfloat16), (16, 8, 128, torch.bfloat16, torch.bfloat16),
    (9, 3, 64, torch.float32, torch.float32), (4, 4, 128, torch.float16, torch.float16),
    (8, 2, 128, torch.bfloat16, FP8), (6, 3, 64, torch.float32, FP8),
], ids=lambda p: str(p).replace("torch.", ""))
def test_rope_write_matches_torch_ops_bit_for_bit(hq, hk, d, dtype, cache):
    gen = torch.Generator().manual_seed(hq * d)
    tokens, nb, bs, max_pos = 3, 6, 16, 5000
    qkv = (torch.randn(tokens, (hq + 2 * hk) * d, generator=gen) * 2).to(dtype).to(DEVICE)
    angles = torch.rand(max_pos, 1, d // 2, generator=gen) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype).to(DEVICE)   # (max_pos, 1, d), as Llama's
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype).to(DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEVICE)

    def fresh():
        caches = [torch.full((nb, bs, hk, d), float("nan"), device=DEVICE).to(cache) for _ in range(2)]
        scales = [None, None]
        if cache == FP8:
            scales = [torch.full((nb, bs, hk), float("nan"), device=DEVICE) for _ in range(2)]
        return caches + scales

    got, want = fresh(), fresh()
    q_got = rope_write(qkv, cos, sin, positions, *got[:2], slots, *got[2:], hq)
    q_want = TorchOps.rope_write(qkv, cos, sin, positions, *want[:2], slots, *want[2:], hq)
    assert torch.equal(bits(q_got), bits(q_want.contiguous()))
    for g, w in zip(got, want):
        if w is not None:
            assert torch.equal(bits(g), bits(w))


@pytest.mark.parametrize("dtype,inter,tokens", [(torch.bfloat16, 1536, 1), (torch.float32, 300, 2),
                                                 (torch.float16, 4096, 1)],
                         ids=lambda p: str(p).replace("torch.", ""))
def test_silu_mul_matches_torch_ops(dtype, inter, tokens):
    gate_up = (torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    gate_up = gate_up.to(DEVICE)
    assert_within(silu_mul(gate_up).cpu(), *silu_mul_reference(gate_up.cpu()))


@pytest.mark.parametrize("call,message", [
    (lambda: add_rms_norm(torch.randn(2, 8, 4), None, torch.ones(4), 1e-5), "x must be 2-D"),
    (lambda: add_rms_norm(torch.randn(2, 8), None, torch.ones(4), 1e-5), "weight must have shape"),
    (lambda: add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5), "residual must have shape"),
    (lambda: add_rms_norm(torch.randn(2, 8), None, torch.ones(8).half(), 1e-5), "must match"),
    (lambda: silu_mul(torch.randn(2, 7)), "even"),
    (lambda: silu_mul(torch.randn(2, 8).to(torch.int32)), "gate_up has dtype"),
    (lambda: rope_write(torch.randn(1, 11 * 64), torch.ones(9, 1, 64), torch.ones(9, 1, 64), torch.zeros(1).long(),
                        torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64), torch.zeros(1).long(), None, None, 8),
     "qkv must have shape"),
    (lambda: rope_write(torch.randn(1, 12 * 64), torch.ones(9, 1, 32), torch.ones(9, 1, 64), torch.zeros(1).long(),
                        torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64), torch.zeros(1).long(), None, None, 8),
     "cos must be"),
    (lambda: rope_write(torch.randn(1, 12 * 64), torch.ones(9, 1, 64), torch.ones(9, 1, 64), torch.zeros(1).long(),
                        torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64), torch.zeros(1).long(), None, None, 7),
     "n_heads must be"),
])
def test_fused_kernels_reject_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- wrapper validation -------------------------------------------------------------------
def decode_args(**change):
    nb, bs, hk, d, b, hq = 4, 16, 2, 64, 2, 8
    args = dict(q=torch.randn(b, hq, d), k_cache=torch.randn(nb, bs, hk, d), v_cache=torch.randn(nb, bs, hk, d),
                block_tables=torch.zeros(b, 3, dtype=torch.int32), context_lens=torch.ones(b, dtype=torch.int32),
                scale=0.125, k_scale=None, v_scale=None)
    args.update(change)
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def fp8_cache():
    return torch.zeros(4, 16, 2, 64).to(FP8)


@pytest.mark.parametrize("change,message", [
    (dict(q=torch.randn(8, 64)), "q must be 3-D"),
    (dict(q=torch.randn(2, 8, 32)), "head_dim"),
    (dict(q=torch.randn(2, 7, 64)), "not a multiple"),
    (dict(q=torch.randn(2, 8, 64).to(torch.int32)), "q has dtype"),
    (dict(q=torch.randn(2, 8, 128)[..., ::2]), "unit stride"),
    (dict(k_cache=torch.randn(4, 16, 2, 64, 1)), "k_cache must be 4-D"),
    (dict(v_cache=torch.randn(4, 16, 1, 64)), "differ in shape"),
    (dict(v_cache=torch.randn(4, 16, 2, 64).half()), "differ in dtype"),
    (dict(k_cache=torch.randn(4, 2, 16, 64).transpose(1, 2), v_cache=torch.randn(4, 2, 16, 64).transpose(1, 2)),
     "contiguous"),
    (dict(k_cache=torch.randn(4, 12, 2, 64), v_cache=torch.randn(4, 12, 2, 64)), "power of two"),
    (dict(k_cache=torch.randn(4, 16, 2, 96), v_cache=torch.randn(4, 16, 2, 96), q=torch.randn(2, 8, 96)),
     "power of two"),
    (dict(k_cache=fp8_cache(), v_cache=fp8_cache()), "needs k_scale and v_scale"),
    (dict(k_cache=fp8_cache(), v_cache=fp8_cache(), k_scale=torch.ones(4, 16, 2), v_scale=torch.ones(4, 16, 2).half()),
     "v_scale has dtype"),
    (dict(k_cache=fp8_cache(), v_cache=fp8_cache(), k_scale=torch.ones(4, 16, 3), v_scale=torch.ones(4, 16, 3)),
     "k_scale must have shape"),
    (dict(k_scale=torch.ones(4, 16, 2), v_scale=torch.ones(4, 16, 2)), "only for float8"),
    (dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)), "rows for a batch"),
    (dict(block_tables=torch.zeros(2, 3)), "block_tables has dtype"),
    (dict(block_tables=torch.zeros(2, 3, 2, dtype=torch.int32)), "block_tables must be 2-D"),
    (dict(context_lens=torch.ones(3, dtype=torch.int32)), "context_lens must have shape"),
    (dict(context_lens=torch.ones(2)), "context_lens has dtype"),
    (dict(scale=float("nan")), "scale must be a finite"),
    (dict(scale=torch.tensor(0.1)), "scale must be a finite"),
])
def test_paged_decode_rejects_bad_arguments(change, message):
    with pytest.raises(ValueError, match=message):
        paged_decode(**decode_args(**change))


@pytest.mark.parametrize("change,message", [
    (dict(k=torch.randn(3, 3, 64)), "k must have shape"),
    (dict(v=torch.randn(3, 2, 32)), "v must have shape"),
    (dict(k=torch.randn(3, 128)), "k must be 3-D"),
    (dict(k=torch.randn(3, 2, 128)[..., ::2]), "unit stride"),
    (dict(k=torch.randn(3, 2, 64).to(torch.int8)), "k has dtype"),
    (dict(slots=torch.zeros(3, 1, dtype=torch.int64)), "slots must be 1-D"),
    (dict(slots=torch.zeros(4, dtype=torch.int64)), "slots must have shape"),
    (dict(slots=torch.zeros(3)), "slots has dtype"),
    (dict(k_cache=torch.randn(4, 16, 2, 64).to(torch.int8), v_cache=torch.randn(4, 16, 2, 64).to(torch.int8)),
     "k_cache has dtype"),
    (dict(k_cache=fp8_cache(), v_cache=fp8_cache(), k_scale=torch.ones(4, 16, 2)), "needs k_scale and v_scale"),
])
def test_write_kv_rejects_bad_arguments(change, message):
    args = dict(k_cache=torch.randn(4, 16, 2, 64), v_cache=torch.randn(4, 16, 2, 64), k=torch.randn(3, 2, 64),
                v=torch.randn(3, 2, 64), slots=torch.zeros(3, dtype=torch.int64), k_scale=None, v_scale=None)
    args.update(change)
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with pytest.raises(ValueError, match=message):
        write_kv(**args)


def test_kernels_refuse_tensors_on_mixed_devices_or_cpu_without_the_interpreter(monkeypatch):
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="one device"):
            paged_decode(**{**decode_args(), "context_lens": torch.ones(2, dtype=torch.int32)})
    monkeypatch.setattr(checks, "interpreting", lambda: False)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in decode_args().items()}
    with pytest.raises(ValueError, match="need CUDA tensors"):
        paged_decode(**cpu)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_splits=0), "num_splits"), (dict(block_n=48), "block_n"), (dict(num_warps=3), "num_warps"),
    (dict(num_stages=0), "num_stages"), (dict(waves=0), "waves"),
])
def test_decode_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**kwargs)


def test_pick_splits_fills_the_gpu_but_never_exceeds_the_tiles():
    cpu = torch.device("cpu")
    assert pd.pick_splits(1, 8, 10**6, cpu, DecodeConfig(num_splits=5)) == 5
    assert pd.pick_splits(1, 1, 10**6, cpu) == math.ceil(DecodeConfig().waves * 2 / 1)
    assert pd.pick_splits(1, 1, 64, cpu) == 1  # one tile of context: one split
