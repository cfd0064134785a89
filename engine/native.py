"""The CPU's own kernels (engine/csrc/), compiled on first use and called through ctypes.

A decode step on the CPU reads every weight once and each sequence's cache once; torch's
one-row product and its per-piece attention calls left a step at 2.7x the memory floor
(docs/bench.md). C kernels take those reads, for one sequence or a batch of B:
- `gemv(x, w)`: x @ w.T for B fp32 rows (gemv.c), each weight row read once for all of them,
  and `rms_norm` of B rows;
- `decode(q, ...)` for one sequence, `decode_batch(q, ...)` for B (decode.c): one query per
  head against each sequence's cache through its own block table, fp32, bf16, fp16 or fp8, read in place,
  split-K over (sequence, KV head, stretch of blocks), merged by log-sum-exp;
- `write(...)`: a step's new K/V rows into their slots, rounded for a 16-bit cache, quantized for
  an fp8 one, with the bits torch's own conversion gives (write.c).
A row or sequence of a batch gets the bits it gets alone.
What surrounds them in a decode step (the residual adds and norms, RoPE, SiLU), and the
whole step as one C call: engine/native_step.py.

The sources are compiled with the system's C compiler (`cc`, or $CC) with -O3 -march=native
-fopenmp into the kvchat cache folder, once per machine and version (about 4 s), checked, and
loaded; engine/native_build.py says how (levels, flags per architecture, the key, the checks).
Where there is no compiler, nothing builds, or KVCHAT_NATIVE=0 is set, `lib()` is None and
every caller keeps its torch path; `status()` says which and why, in one line.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from . import native_build, threads
from .native_abi import DecodeArgs, WriteArgs

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict = {}          # "lib": CDLL | None, "why": str
_disabled = False          # tests: see disabled()


def _load(level: str | None = None, cc: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("KVCHAT_NATIVE", "1") == "0":
        return None, "off: KVCHAT_NATIVE=0"
    from .sources import cache_dir  # noqa: PLC0415  (platformdirs, only when loading)
    level = level or os.environ.get("KVCHAT_NATIVE_LEVEL") or "native"
    lib, why, cap = native_build.load(cache_dir() / "native", level, cc)
    if lib is None:
        return None, why
    if os.environ.get("KVCHAT_AMX", "1") == "0":
        lib.kv_amx_use(0)
    return lib, f"{why}, {'1 thread' if cap else 'threads ' + threads.describe()}"


def lib():
    """The loaded library, or None (then status() says why). The first call builds or finds
    it; when that fails, one line on the `kvchat.engine.native` logger (stderr by default)
    says why and that the torch paths serve."""
    if _disabled:
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                loaded, why = _load()
                _state["rows"], _state["why"] = _rows(loaded), why
                _state["lib"] = loaded        # last: another thread seeing "lib" finds the rest set
                if _state["lib"] is None and _state["why"] != "off: KVCHAT_NATIVE=0":
                    log.warning("kvchat: C kernels %s; the torch paths serve", _state["why"])
    return _state["lib"]


def status() -> str:
    """One line: whether the C kernels serve this process, and if not, why."""
    if _disabled:
        return "off: disabled"
    lib()
    return _state["why"]


@contextmanager
def using(level: str, cc: str | None = None) -> Iterator[str]:
    """Tests: the library built for another level (or compiler) serves inside the block;
    yields its status line (lib() is None there when it did not build). Not thread-safe."""
    global _state
    previous = _state
    loaded, why = _load(level, cc)
    _state = {"lib": loaded, "why": why, "rows": _rows(loaded)}
    try:
        yield why
    finally:
        _state = previous


@contextmanager
def disabled():
    """Tests: the torch paths, with the C kernels set aside."""
    global _disabled
    previous, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = previous


def _scale_strides(s: torch.Tensor | None) -> tuple[int, int, int]:
    return (s.stride(0), s.stride(1), s.stride(2)) if s is not None else (0, 0, 0)


# ---- the calls -----------------------------------------------------------------------------
GEMV_MAX_ROWS = 32   # rows up to which the C product beat MKL's GEMM (AVX-512: 4-row tiles on a Xeon, one thread;
                     # benchmarks/cpu_gemv_ab.py)
NARROW_MAX_ROWS = 16  # the same with 2-row tiles (AVX2, SSE, aarch64): on an AVX2 AMD EPYC, 2 cores, the
                      # bundled model's products with weights from memory (benchmarks/cpu_gemv_ab.py), C
                      # over torch: 1.15-1.61x at 16 rows on every shape, 0.86-1.18x at 32; the SSE build
                      # (-march=x86-64) against torch's AVX2 MKL: 1.09-1.90x at 8 rows, 0.56-0.72x at 32


def _rows(loaded: ctypes.CDLL | None) -> int:
    return 0 if loaded is None else GEMV_MAX_ROWS if loaded.kv_gemv_tile() >= 4 else NARROW_MAX_ROWS


def max_rows() -> int:
    """The most rows the C kernels take in one call in this build (a decode step's sequences,
    a prompt chunk's tokens); more go to torch. 0 when the kernels are not loaded, so the
    callers' row checks also say whether the kernels serve."""
    return 0 if lib() is None else _state["rows"]


def gemv_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gemv (w: (n, k)) or rms_norm (w: (k,)) takes these: 1 to max_rows() fp32 CPU
    rows x (a decode step's B sequences; a prefill's many rows go to MKL's GEMM), fp32
    contiguous CPU weights (bf16 for gemv), and the kernels loaded."""
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and w.dim() == 2))
            and w.is_contiguous() and x.is_contiguous() and 0 < x.shape[0] <= max_rows())   # last: loads the kernels


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: (B, k) fp32 contiguous; w: (n, k) fp32 or bf16 contiguous -> (B, n) fp32 = x @ w.T,
    each weight row read once for all B rows; row b's bits do not depend on B. With bf16
    weights on a CPU with AVX512-BF16, x is rounded to bf16 for the products (bf16_native()),
    on AMX tiles where those serve (amx())."""
    n, k = w.shape
    b = x.shape[0]
    y = torch.empty(b, n)
    if w.dtype == torch.bfloat16:
        if lib().kv_gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), b, n, k, threads.count()) != 0:
            raise MemoryError("no memory for x in bf16")
        return y
    lib().kv_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), b, n, k, threads.count())
    return y


def bf16_native() -> bool:
    """Whether the loaded kernels multiply bf16 weights with AVX512-BF16 (vdpbf16ps) rather
    than widening them to fp32: the CPU has native bf16 arithmetic and this build uses it. Then
    decode attention over an fp8 cache takes its scores in bf16 too (its queries rounded:
    tests/tolerance.py's paged_decode_reference(dot_bf16=True))."""
    return lib() is not None and bool(lib().kv_bf16_native())


def amx() -> bool:
    """Whether the bf16 products of 1 to 32 rows run on AMX tiles (csrc/gemv_amx.c): the build
    has AMX, Linux granted the tile state, and KVCHAT_AMX=0 did not set them aside."""
    return lib() is not None and bool(lib().kv_amx())


def amx_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a short bf16 prefill chunk's rows x (1 to max_rows(), bf16) take the AMX tiles
    against bf16 w: gemv(x.float(), w), a read of w for all the rows, where torch's bf16 product
    copies w into its own layout at every call (24 rows of the bundled model's next turn: 25.6
    -> 17.6 ms a step of products)."""
    # the tensors' own tests first: a GPU's rows never reach max_rows(), which loads the C kernels
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == torch.bfloat16
            and w.dtype == torch.bfloat16 and x.dim() == 2 and w.dim() == 2 and w.shape[0] % 16 == 0
            and w.shape[1] % 32 == 0 and w.is_contiguous() and 0 < x.shape[0] <= max_rows() and amx())


def describe_bf16() -> str:
    """How the C kernels multiply bf16 weights, in words (the benches' notes)."""
    if lib() is None:
        return "torch's bf16 GEMM (the C kernels are off)"
    if amx():
        return "AMX tiles (tdpbf16ps, rows rounded to bf16; KVCHAT_AMX=0 sets them aside)"
    if bf16_native():
        return "AVX512-BF16 (vdpbf16ps, rows rounded to bf16)"
    return "widened to fp32 in the C kernel"


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (B, k) fp32 contiguous; w: (k,) fp32 -> (B, k). Callers check gemv_serves(x, w)."""
    y = torch.empty_like(x)
    lib().kv_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def read_sum(x: torch.Tensor) -> float | None:
    """The sum of a contiguous fp32 CPU tensor by the C kernels' streaming read (kv_read_sum),
    on the products' threads: the bench's read probe. None where the kernels do not serve."""
    if lib() is None or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        return None
    return lib().kv_read_sum(x.data_ptr(), x.numel(), threads.count())


FP8 = getattr(torch, "float8_e4m3fn", None)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8)    # the caches the C kernels read and write
HALF = {torch.bfloat16: 1, torch.float16: 2}            # kvchat.h's KV_BF16, KV_FP16
SPLITS_PER_THREAD = 4   # work items per thread for one sequence: KV heads x splits, enough to balance


def decode_serves(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode() and decode_batch() take these tensors: CPU, fp32 queries, an fp32, bf16,
    fp16 or e4m3 cache whose rows are unit-stride, head_dim a multiple of 16 up to 256, at most 16
    queries per KV head."""
    hq, d = q.shape[-2:]
    hk = k_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype in CACHE_DTYPES
            and k_cache.stride(-1) == 1 and d % 16 == 0 and d <= 256 and hq % hk == 0 and hq // hk <= 16
            and lib() is not None)


def decode_args(q_shape: tuple[int, ...], q_stride: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                tables: torch.Tensor, table_stride: int, lens: int | None, length: int, batch: int, scale: float,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> DecodeArgs:
    """kv_decode's arguments. lens: the address of B int32 lengths, or None for one sequence
    of `length` rows; q_stride: elements between sequences in q (heads and dims contiguous)."""
    hq, d = q_shape[-2:]
    nb, bs, hk, _ = k_cache.shape
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"K and V caches differ in strides: {k_cache.stride()} vs {v_cache.stride()}")
    return DecodeArgs(k_cache.data_ptr(), v_cache.data_ptr(),
                      k_scale.data_ptr() if k_scale is not None else None,
                      v_scale.data_ptr() if v_scale is not None else None, tables.data_ptr(), lens,
                      table_stride, tables.shape[-1], nb,
                      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *_scale_strides(k_scale),
                      batch, bs, hk, hq // hk, d, q_stride, length, scale, HALF.get(k_cache.dtype, 0))


def splits(n_kv_heads: int) -> int:
    """Work items per (sequence, KV head), from the most threads, not the current count: the
    bits stay put while the load changes. A sequence's items (KV heads x splits) are a multiple
    of the threads, so that no thread waits on another's extra item: the bundled model's 3 KV
    heads on 2 threads took 3 splits, 9 items, 5 on one thread and 4 on the other; 4 splits
    gave 30 layers at 4,096 tokens 10-15% faster (17.0-17.7 -> 14.5-15.7 ms)."""
    most = threads.most()
    step = most // math.gcd(most, n_kv_heads)       # the fewest splits whose items fill every thread
    n = max(1, -(-SPLITS_PER_THREAD * most // n_kv_heads))
    return -(-n // step) * step


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            table_stride: int, lens: int | None, length: int, batch: int, scale: float,
            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor | None:
    d = q.shape[-1]
    if q.stride(-1) != 1 or q.stride(-2) != d:
        q = q.contiguous()
    a = decode_args(q.shape, q.stride(0) if q.dim() == 3 else 0, k_cache, v_cache, tables, table_stride, lens,
                    length, batch, scale, k_scale, v_scale)
    out = torch.empty(q.shape)                                              # ([B,] n_heads, head_dim)
    if lib().kv_decode(ctypes.byref(a), q.data_ptr(), out.data_ptr(), splits(k_cache.shape[2]), threads.count()) != 0:
        return None
    return out


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           length: int, scale: float, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """One sequence. q: (n_heads, head_dim) fp32; caches: (num_blocks, block_size, n_kv_heads,
    head_dim) views in either pool layout, the same strides for K and V; block_table: (max_blocks,)
    int32; scales: (num_blocks, block_size, n_kv_heads) for fp8. Returns (n_heads, head_dim), or
    None when the kernel declines (a geometry it does not serve, a length or block id out of
    range: the caller then takes the torch path)."""
    table = block_table if block_table.is_contiguous() else block_table.contiguous()
    return _decode(q, k_cache, v_cache, table, 0, None, length, 1, scale, k_scale, v_scale)


def decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """B sequences in one call, each read through its own row of block_tables in place.
    q: (B, n_heads, head_dim); block_tables: (B, max_blocks) int32; context_lens: (B,) int32.
    Returns (B, n_heads, head_dim), or None as decode() does. Sequence b's result has the bits
    decode() gives it alone (its splits depend on its own length and the threads only)."""
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    lens = context_lens if context_lens.is_contiguous() else context_lens.contiguous()
    if lens.dtype != torch.int32 or tables.dtype != torch.int32:
        raise ValueError(f"block tables and context lengths must be int32, got {tables.dtype}, {lens.dtype}")
    return _decode(q, k_cache, v_cache, tables, tables.stride(0), lens.data_ptr(), 0, q.shape[0], scale, k_scale,
                   v_scale)


def merge_two(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor | None:
    """A prompt chunk's attention to the cached prefix and to itself merged by log-sum-exp in
    one C pass (kv_merge_two): o1 (hk, g T, d) with l1 (hk, g T), each KV head's g query heads
    folded into its rows; o2 (H, T, d) with l2 (H, T); fp32 or bf16 outputs with unit stride
    in d, fp32 log-sum-exps, any other strides. Returns (T, H, d) contiguous in o1's dtype,
    or None where the kernels do not serve."""
    h, t, d = o2.shape
    hk = o1.shape[0]
    if (lib() is None or o1.dtype not in (torch.float32, torch.bfloat16) or o2.dtype != o1.dtype
            or l1.dtype != torch.float32 or l2.dtype != torch.float32 or o1.stride(-1) != 1 or o2.stride(-1) != 1
            or o1.device.type != "cpu" or h % hk or o1.shape != (hk, h // hk * t, d)
            or l1.shape != o1.shape[:2] or l2.shape != o2.shape[:2]):
        return None
    out = torch.empty(t, h, d, dtype=o1.dtype)
    st = (ctypes.c_int64 * 8)(o1.stride(0), o1.stride(1), l1.stride(0), l1.stride(1),
                              o2.stride(0), o2.stride(1), l2.stride(0), l2.stride(1))
    lib().kv_merge_two(o1.data_ptr(), l1.data_ptr(), o2.data_ptr(), l2.data_ptr(), st, out.data_ptr(),
                       t, h, h // hk, d, o1.dtype == torch.bfloat16, threads.count())
    return out


def write_serves(k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether write() takes these: CPU, fp32 rows with unit stride in head_dim (the same
    head stride for K and V; row strides may differ: K comes out of RoPE, V out of the
    projection), an fp32, bf16, fp16 or e4m3 cache with unit-stride rows, int64 slots."""
    return (k.device.type == "cpu" and k_cache.device.type == "cpu" and k.dtype == torch.float32
            and v.dtype == torch.float32 and k.stride(1) == v.stride(1) and k.stride(-1) == v.stride(-1) == 1
            and k_cache.dtype in CACHE_DTYPES and k_cache.stride(-1) == 1
            and slots.dtype == torch.int64 and lib() is not None)


def write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v: (T, n_kv_heads, head_dim) fp32 into flat slots (T,), rows of one sequence or of
    many (each row carries its slot): copied (bf16, fp16: rounded to nearest even, torch's rounding),
    or for an fp8 cache quantized per (row, head)
    with the bytes and scales attention.quantize_fp8 gives. A slot outside the pool raises
    IndexError before anything is written."""
    slots = slots.contiguous()
    a = write_args(k_cache, v_cache, k_scale, v_scale, k, v)
    if lib().kv_write(ctypes.byref(a), slots.data_ptr(), slots.shape[0], threads.count()) != 0:
        raise IndexError(f"a slot is outside the pool's {a.num_blocks * a.block_size} slots")


def write_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> WriteArgs:
    """kv_write's arguments; without k and v, the cache's alone (kv_rope_write, the step)."""
    nb, bs, hk, d = k_cache.shape
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"K and V caches differ in strides: {k_cache.stride()} vs {v_cache.stride()}")
    src = (k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k.stride(1)) if k is not None and v is not None \
        else (None, None, 0, 0, 0)
    return WriteArgs(k_cache.data_ptr(), v_cache.data_ptr(),
                     k_scale.data_ptr() if k_scale is not None else None,
                     v_scale.data_ptr() if v_scale is not None else None,
                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *_scale_strides(k_scale),
                     nb, bs, hk, d, *src, HALF.get(k_cache.dtype, 0))
