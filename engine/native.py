"""The CPU's own kernels (engine/csrc/kvchat_cpu.c), compiled on first use and called through ctypes.

A batch-1 decode step on the CPU reads every weight once and the whole cache once; torch's
one-row product and its per-piece attention calls left a step at 2.7x the memory floor
(docs/bench.md). Two C kernels take those reads:
- `gemv(x, w)`: x @ w.T for one fp32 row, and `rms_norm` for one row;
- `decode(q, ...)`: one query per head against a sequence's cache through its block table,
  fp32 or fp8, read in place, split-K, merged by log-sum-exp;
- `write(...)`: a step's new K/V rows into their slots, quantized for an fp8 cache with the
  bytes torch's own conversion gives.

The source is compiled with the system's C compiler (`cc`, or $CC) with -O3 -march=native
-fopenmp into the kvchat cache folder, keyed by the source, flags, compiler and CPU, so that a
machine compiles it once (about a second). Where there is no compiler, the compile fails, or
KVCHAT_NATIVE=0 is set, `lib()` is None and every caller keeps its torch path; `status()` says
which and why. No C++ or torch headers: torch's C++ ABI differs between versions, plain C does not.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "kvchat_cpu.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_lock = threading.Lock()
_state: dict = {}          # "lib": CDLL | None, "why": str
_disabled = False          # tests: see disabled()


class DecodeArgs(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("ks", ctypes.c_void_p), ("vs", ctypes.c_void_p),
                ("table", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in
        ("block_stride", "row_stride", "head_stride", "sblock_stride", "srow_stride", "shead_stride", "length", "block_size", "kv_heads", "group", "dim")] + [("scale", ctypes.c_float)]


class WriteArgs(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("ks", ctypes.c_void_p), ("vs", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in
        ("block_stride", "row_stride", "head_stride", "sblock_stride", "srow_stride", "shead_stride",
         "block_size", "kv_heads", "dim")] + [
        ("src_k", ctypes.c_void_p), ("src_v", ctypes.c_void_p), ("k_row_stride", ctypes.c_int64),
        ("v_row_stride", ctypes.c_int64), ("src_head_stride", ctypes.c_int64)]


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return cc if cc and shutil.which(cc) else None


def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's flags, so that a cache folder shared by
    machines with other CPUs (a network home) never hands one a library it cannot run."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine() + platform.processor()


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + repr(FLAGS).encode() + version.encode()
                         + _cpu_features().encode()).hexdigest()[:16]
    from .sources import cache_dir  # noqa: PLC0415  (platformdirs, only when compiling)
    out = cache_dir() / "native" / f"kvchat_cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(part), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise OSError(f"{Path(cc).name} failed on {SOURCE.name}: {first}")
        os.replace(part, out)     # atomic: a second process sees the whole library or none
    return out


def _load():
    if os.environ.get("KVCHAT_NATIVE", "1") == "0":
        return None, "off: KVCHAT_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "off: no C compiler (cc, gcc or clang; or set CC)"
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"off: {e}"
    lib.kv_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.kv_gemv.restype = None
    lib.kv_decode.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.kv_decode.restype = ctypes.c_int
    lib.kv_write.argtypes = [ctypes.POINTER(WriteArgs), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.kv_write.restype = None
    lib.kv_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_float]
    lib.kv_rms_norm.restype = None
    return lib, f"on: {Path(cc).name} -march=native, {torch.get_num_threads()} threads"


def lib():
    """The loaded library, or None (then status() says why)."""
    if _disabled:
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["why"] = _load()
    return _state["lib"]


def status() -> str:
    """One line: whether the C kernels serve this process, and if not, why."""
    if _disabled:
        return "off: disabled"
    lib()
    return _state["why"]


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
def gemv_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gemv (w: (n, k)) or rms_norm (w: (k,)) takes these: one fp32 CPU row x, fp32
    contiguous CPU weights, and the kernels loaded."""
    return (x.shape[0] == 1 and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.device.type == "cpu" and w.device.type == "cpu" and w.is_contiguous()
            and x.is_contiguous() and lib() is not None)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: (1, k) fp32; w: (n, k) fp32 contiguous -> (1, n) = x @ w.T."""
    n, k = w.shape
    y = torch.empty(1, n)
    lib().kv_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
    return y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (1, k) fp32 contiguous; w: (k,) fp32 -> (1, k). Callers check gemv_serves(x, w)."""
    y = torch.empty_like(x)
    lib().kv_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[1], eps)
    return y


FP8 = getattr(torch, "float8_e4m3fn", None)
SPLITS_PER_THREAD = 4   # work items per thread: KV heads x splits, enough to balance


def decode_serves(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode() takes these tensors: CPU, fp32 queries, an fp32 or e4m3 cache whose
    rows are unit-stride, head_dim a multiple of 16 up to 256, at most 16 queries per KV head."""
    hq, d = q.shape[-2:]
    hk = k_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype in (torch.float32, FP8)
            and k_cache.stride(-1) == 1 and d % 16 == 0 and d <= 256 and hq % hk == 0 and hq // hk <= 16
            and lib() is not None)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           length: int, scale: float, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """q: (n_heads, head_dim) fp32; caches: (num_blocks, block_size, n_kv_heads, head_dim) views
    in either pool layout, the same strides for K and V; block_table: int32, contiguous;
    scales: (num_blocks, block_size, n_kv_heads) for fp8. Returns (n_heads, head_dim), or None
    when the kernel declines the geometry (the caller then takes the torch path)."""
    hq, d = q.shape
    nb, bs, hk, _ = k_cache.shape
    assert v_cache.stride() == k_cache.stride() and block_table.dtype == torch.int32
    q = q.contiguous()
    table = block_table.contiguous()
    a = DecodeArgs(k_cache.data_ptr(), v_cache.data_ptr(),
                   k_scale.data_ptr() if k_scale is not None else None,
                   v_scale.data_ptr() if v_scale is not None else None, table.data_ptr(),
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   *_scale_strides(k_scale),
                   length, bs, hk, hq // hk, d, scale)
    threads = torch.get_num_threads()
    splits = max(1, -(-SPLITS_PER_THREAD * threads // hk))
    out = torch.empty(hq, d)
    if lib().kv_decode(ctypes.byref(a), q.data_ptr(), out.data_ptr(), splits, threads) != 0:
        return None
    return out


def write_serves(k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether write() takes these: CPU, fp32 rows with unit stride in head_dim (the same
    head stride for K and V; row strides may differ: K comes out of RoPE, V out of the projection), an fp32 or e4m3 cache with unit-stride rows, int64 slots."""
    return (k.device.type == "cpu" and k_cache.device.type == "cpu" and k.dtype == torch.float32
            and v.dtype == torch.float32 and k.stride(1) == v.stride(1) and k.stride(-1) == v.stride(-1) == 1
            and k_cache.dtype in (torch.float32, FP8) and k_cache.stride(-1) == 1
            and slots.dtype == torch.int64 and lib() is not None)


def write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v: (T, n_kv_heads, head_dim) fp32 into flat slots (T,): copied, or for an fp8 cache
    quantized per (row, head) with the bytes and scales attention.quantize_fp8 gives."""
    nb, bs, hk, d = k_cache.shape
    assert v_cache.stride() == k_cache.stride()
    slots = slots.contiguous()
    a = WriteArgs(k_cache.data_ptr(), v_cache.data_ptr(),
                  k_scale.data_ptr() if k_scale is not None else None,
                  v_scale.data_ptr() if v_scale is not None else None,
                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *_scale_strides(k_scale),
                  bs, hk, d, k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k.stride(1))
    lib().kv_write(ctypes.byref(a), slots.data_ptr(), slots.shape[0], torch.get_num_threads())
