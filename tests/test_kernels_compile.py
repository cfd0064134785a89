"""Every kernel, in the variants the engine launches, compiles for a Hopper GPU (sm_90), here
without one: triton's front end and its bundled ptxas, ahead of time. The interpreter runs
the kernels' arithmetic but not the compiler, which is where a kernel that is wrong only for
the GPU (mismatched branch types, a dot shape the hardware lacks) fails.

The compile runs in a child process: the interpreter, chosen for this one in tests/conftest.py,
replaces the compiler for every kernel a process imports.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def variants():
    """(name, kernel, argument types, constexprs, num_warps, num_stages[, other options]) for each launch."""
    from kvchat.engine.kernels import cache_write, decode, fused

    def ptr(t: str) -> str:
        return "*" + t

    out = []
    for q, cache, fp8, dot in (("bf16", "bf16", False, 0), ("fp16", "fp16", False, 0), ("fp32", "fp32", False, 1),
                               ("bf16", "fp8e4nv", True, 0)):
        types = dict(q_ptr=ptr(q), k_cache_ptr=ptr(cache), v_cache_ptr=ptr(cache),
                     k_scale_ptr=ptr("fp32" if fp8 else cache), v_scale_ptr=ptr("fp32" if fp8 else cache),
                     tables_ptr="*i32", lens_ptr="*i64", o_part_ptr="*fp32", lse_part_ptr="*fp32", qk_scale="fp32",
                     stride_qb="i32", stride_qh="i32", stride_tb="i32")
        consts = dict(HK=8, G=4, BLOCK_G=16, D=128, PAGE=16, BLOCK_N=64, NUM_SPLITS=66, FP8=fp8, DOT=dot)
        out.append((f"paged decode q {q}, cache {cache}", decode._decode_split_kernel, types, consts, 4, 2))
    for o in ("bf16", "fp32"):
        types = dict(o_part_ptr="*fp32", lse_part_ptr="*fp32", lens_ptr="*i64", out_ptr=ptr(o), stride_ob="i32",
                     stride_oh="i32")
        out.append((f"decode merge {o}", decode._merge_kernel, types,
                    dict(HQ=32, D=128, NUM_SPLITS=66, BLOCK_N=64, CHUNK=16), 2, 1))
    for act, cache, fp8 in (("bf16", "bf16", False), ("bf16", "fp8e4nv", True), ("fp32", "fp32", False)):
        types = dict(k_ptr=ptr(act), v_ptr=ptr(act), k_cache_ptr=ptr(cache), v_cache_ptr=ptr(cache),
                     k_scale_ptr=ptr("fp32" if fp8 else cache), v_scale_ptr=ptr("fp32" if fp8 else cache),
                     slots_ptr="*i64", stride_kt="i32", stride_kh="i32", stride_vt="i32", stride_vh="i32",
                     stride_slot="i32")
        out.append((f"write_kv {act} -> {cache}", cache_write._write_kv_kernel, types,
                    dict(HK=8, BLOCK_H=8, D=128, FP8=fp8), 4, 1))
    types = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", stride_x="i32", stride_res="i32",
                 stride_out="i32", n="i32", eps="fp32")
    for res in (True, False):
        out.append((f"add_rms_norm residual={res}", fused._add_rms_norm_kernel, types,
                    dict(HAS_RES=res, BLOCK=4096), 16, 1))
    types = dict(gu_ptr="*bf16", out_ptr="*bf16", stride_gu="i32", stride_out="i32", n="i32")
    out.append(("silu_mul bf16", fused._silu_mul_kernel, types, dict(BLOCK=2048), 4, 1))
    for cache, fp8 in (("bf16", False), ("fp8e4nv", True)):
        types = dict(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", pos_ptr="*i64", q_out_ptr="*bf16",
                     k_cache_ptr=ptr(cache), v_cache_ptr=ptr(cache), k_scale_ptr=ptr("fp32" if fp8 else cache),
                     v_scale_ptr=ptr("fp32" if fp8 else cache), slots_ptr="*i64", stride_qkv="i32",
                     stride_qo_t="i32", stride_pos="i32", stride_slot="i32")
        out.append((f"rope_write bf16 -> {cache}", fused._rope_write_kernel, types,
                    dict(HQ=32, HK=8, D=128, FP8=fp8), 1, 1, dict(enable_fp_fusion=False)))
    return out


def compile_all() -> int:
    """Compile every variant for sm_90; print one line each; the number that failed."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for name, kernel, types, consts, warps, stages, *more in variants():
        signature = {arg: types.get(arg, "constexpr") for arg in kernel.arg_names}
        # pointers and strides 16-aligned, as the JIT specialises them at a real launch
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
                 if types.get(arg, "").startswith("*") or arg.startswith("stride")}
        try:
            triton_compile(ASTSource(kernel, signature, consts, attrs), target=target,
                           options=dict(num_warps=warps, num_stages=stages, **(more[0] if more else {})))
            print(f"ok   {name}")
        except Exception as err:  # noqa: BLE001  (report every kernel, then fail)
            failed += 1
            print(f"FAIL {name}: {type(err).__name__}: {err}")
    return failed


def ptxas_available() -> bool:
    import triton
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


def test_every_kernel_compiles_for_sm90():
    if not ptxas_available():
        pytest.skip("triton's bundled ptxas is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(1 if compile_all() else 0)
