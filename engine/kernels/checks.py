"""Host-side checks shared by the kernel wrappers: every bad argument is a ValueError that
names the argument, what it got and what would be accepted. The checks read shapes, dtypes,
strides and devices only, never tensor values, so a wrapper never synchronises with the
device and can run inside a CUDA graph capture."""
from __future__ import annotations

import os

import torch
import triton

FP8 = getattr(torch, "float8_e4m3fn", None)
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CACHE_DTYPES = ACT_DTYPES + ((FP8,) if FP8 is not None else ())
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1: kernels run on CPU tensors through triton's interpreter."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_dim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; accepted: {_names(allowed)}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_last_dim_dense(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, want: tuple[int, ...], layout: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)} {layout}, got {tuple(t.shape)}")


def check_pow2(name: str, n: int, lo: int, hi: int) -> None:
    if n < lo or n > hi or n & (n - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {n}")


def check_devices(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device, and that device runs Triton (CUDA, or any device
    under TRITON_INTERPRET=1)."""
    present = {k: t for k, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) != 1:
        where = ", ".join(f"{k} on {t.device}" for k, t in present.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    return device


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """fp8 caches need both float32 scale tensors (num_blocks, block_size, n_kv_heads);
    other caches take none. Returns whether the cache is fp8."""
    fp8 = FP8 is not None and k_cache.dtype == FP8
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are only for float8_e4m3fn caches; this cache is {k_cache.dtype}")
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("a float8_e4m3fn cache needs k_scale and v_scale (num_blocks, block_size, n_kv_heads) float32")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_dim(name, s, 3, "(num_blocks, block_size, n_kv_heads)")
        check_shape(name, s, k_cache.shape[:3], "(num_blocks, block_size, n_kv_heads)")
        check_dtype(name, s, (torch.float32,))
        check_contiguous(name, s)
    if k_cache.is_cuda and torch.cuda.get_device_capability(k_cache.device) < (8, 9):
        raise ValueError("float8_e4m3fn caches need a GPU of compute capability 8.9 or newer (Ada, Hopper)")
    return True


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    layout = "(num_blocks, block_size, n_kv_heads, head_dim)"
    check_dim("k_cache", k_cache, 4, layout)
    check_dim("v_cache", v_cache, 4, layout)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    check_dtype("k_cache", k_cache, CACHE_DTYPES)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    check_pow2("block_size (k_cache.shape[1])", k_cache.shape[1], 1, 1024)
    check_pow2("head_dim (k_cache.shape[3])", k_cache.shape[3], 16, 256)
