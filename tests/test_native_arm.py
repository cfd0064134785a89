"""The C kernels on ARM, from this x86 machine: the sources compile for aarch64 with the flags
engine/native_build.py gives that architecture (no x86 intrinsics reach them), and, where
qemu-user is installed, a static aarch64 program calling every kernel (tests/csrc/driver.c)
runs under emulation with results within the float64 bounds of tests/tolerance.py.

The cross compiler is zig's clang (`pip install ziglang`); without it these tests skip and
say so. Their builds go to a folder of their own under the kvchat cache, keyed by the sources.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_native_batch import BS, CACHES, paged_batch
from tolerance import assert_within, gemv_reference, paged_decode_reference, rms_norm_reference, silu_mul_reference
from kvchat.engine import attention as A
from kvchat.engine import native_build as nb

pytestmark = [pytest.mark.slow,    # a cross compile: about 15 s the first time, cached after
              pytest.mark.xdist_group("aarch64")]    # one worker builds the driver, once

DRIVER = Path(__file__).with_name("csrc") / "driver.c"
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


def zig(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ziglang", "cc", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=900)


@pytest.fixture(scope="module")
def out_dir() -> Path:
    try:
        import ziglang  # noqa: F401, PLC0415
    except ImportError:
        pytest.skip("no cross compiler: pip install ziglang")
    from kvchat.engine.sources import cache_dir
    h = hashlib.sha256(b"".join(p.read_bytes() for p in (*nb.SOURCES, *nb.HEADERS, DRIVER))).hexdigest()[:16]
    folder = cache_dir() / "tests" / f"aarch64-{h}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_kernels_compile_for_aarch64_with_its_flags(out_dir):
    """The library as a user's aarch64 machine builds it: its flags minus -mcpu=native (this
    compiler targets another CPU), with OpenMP, warnings as errors."""
    flags = [f for f in (*nb.BASE_FLAGS, *nb.arch_flags("native", "aarch64")[0], "-fopenmp") if "native" not in f]
    lib = out_dir / f"kvchat_cpu-{os.getpid()}.so"     # its own name: workers share out_dir
    done = zig("-target", "aarch64-linux-gnu", *flags, "-Werror", *map(str, nb.SOURCES), "-o", str(lib), "-lm",
               cwd=out_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    head = lib.read_bytes()[:20]
    lib.unlink()
    assert head[:4] == b"\x7fELF" and head[18] == 183, "an aarch64 ELF (e_machine 183)"


@pytest.fixture(scope="module")
def driver(out_dir) -> Path:
    if QEMU is None:
        pytest.skip("no qemu-aarch64 to run aarch64 code (apt-get install qemu-user)")
    exe = out_dir / "driver"
    if not exe.exists():
        # pytest-xdist workers may build it at once into the same folder: each writes its own
        # file and renames it into place (the same bytes either way)
        part = out_dir / f"driver.{os.getpid()}.part"
        done = zig("-target", "aarch64-linux-musl", "-static", "-O2", "-std=c11", "-ffp-contract=fast",
                   f"-I{nb.CSRC}", str(DRIVER), *map(str, nb.SOURCES), "-o", str(part), "-lm", cwd=out_dir)
        assert done.returncode == 0, done.stderr[-3000:]
        part.replace(exe)
    return exe


def run(exe: Path, commands: bytes) -> bytes:
    done = subprocess.run([QEMU, str(exe)], input=commands + struct.pack("<q", 0), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return done.stdout


def f32(t: torch.Tensor) -> bytes:
    return t.float().contiguous().numpy().tobytes()


def test_the_products_and_norm_run_on_aarch64(driver):
    gen = torch.Generator().manual_seed(5)
    cases, cmds = [], b""
    for n, k, b in ((960, 576, 1), (13, 33, 5), (576, 1536, 16), (9, 17, 3)):
        x, w = torch.randn(b, k, generator=gen), torch.randn(n, k, generator=gen)
        cmds += struct.pack("<4q", 1, b, n, k) + f32(x) + f32(w)
        cases.append(("gemv", x, w))
    x, w = torch.randn(4, 100, generator=gen) * 3, torch.randn(100, generator=gen)
    cmds += struct.pack("<3qf", 2, 4, 100, 1e-5) + f32(x) + f32(w)
    cases.append(("rms", x, w))
    out, at = run(driver, cmds), 0
    for kind, x, w in cases:
        n = x.shape[0] * (w.shape[0] if kind == "gemv" else x.shape[1])
        got = torch.frombuffer(bytearray(out[at:at + 4 * n]), dtype=torch.float32).view(x.shape[0], -1)
        at += 4 * n
        ref = gemv_reference(x, w) if kind == "gemv" else rms_norm_reference(x, w, 1e-5)
        assert_within(got, *ref, what=f"aarch64 {kind} {tuple(x.shape)} x {tuple(w.shape)}")
    assert at == len(out)


DRIVER_CACHES = ["fp32", "fp8", "bf16", "fp16"]     # tests/csrc/driver.c's cache kinds, in its order


@pytest.mark.parametrize("kv", DRIVER_CACHES)
def test_decode_and_write_run_on_aarch64(driver, kv):
    fp8, kind = kv == "fp8", DRIVER_CACHES.index(kv)
    gen = torch.Generator().manual_seed(6 + kind)
    hk, g, d, lens = 3, 3, 64, [1, BS, BS + 1, 200]
    k, v, ks, vs, tables = paged_batch(lens, hk, d, gen, kv, head_major=False)   # the driver's layout
    nblocks = k.shape[0]
    q = torch.randn(len(lens), hk * g, d, generator=gen)
    cache = (lambda t: t.view(torch.uint8).numpy().tobytes()) if kv != "fp32" else f32
    cmds = (struct.pack("<9qf", 3, len(lens), hk, g, d, BS, nblocks, tables.shape[1], kind, d ** -0.5)
            + tables.numpy().tobytes() + torch.tensor(lens, dtype=torch.int32).numpy().tobytes() + f32(q)
            + cache(k) + cache(v) + (f32(ks) + f32(vs) if fp8 else b""))
    rows = torch.randn(37, hk, d, generator=gen) * torch.exp(2 * torch.randn(37, hk, 1, generator=gen))
    slots = torch.randperm(nblocks * BS, generator=gen)[:37]
    cmds += struct.pack("<7q", 4, 37, hk, d, nblocks, BS, kind) + f32(rows) + f32(rows * 0.5) + slots.numpy().tobytes()
    out = run(driver, cmds)
    rc, = struct.unpack_from("<i", out, 0)
    n = q.numel()
    got = torch.frombuffer(bytearray(out[4:4 + 4 * n]), dtype=torch.float32).view(q.shape)
    assert rc == 0
    assert_within(got, *paged_decode_reference(q, k, v, tables, lens, d ** -0.5, ks, vs), what="aarch64 decode")
    rest = out[4 + 4 * n:]
    assert struct.unpack_from("<i", rest, 0) == (0,)
    dtype = CACHES[kv]
    want = [torch.zeros(nblocks, BS, hk, d, dtype=dtype) for _ in range(2)]
    scales = [torch.zeros(nblocks, BS, hk) for _ in range(2)] if fp8 else [None, None]
    A.write_kv_ref(want[0], want[1], rows, rows * 0.5, slots, scales[0], scales[1])
    expected = b"".join(t.view(torch.uint8).numpy().tobytes() for t in want)
    expected += b"".join(f32(s) for s in scales if s is not None)
    assert rest[4:] == expected, "aarch64 write: bytes differ from torch's"


def test_the_fused_add_norm_and_silu_run_on_aarch64(driver):
    """engine/csrc/step.c's residual add + RMSNorm and SiLU(gate) * up (its exp built from the
    vector extensions alone) on aarch64, within their float64 bounds."""
    gen = torch.Generator().manual_seed(7)
    b, k, n = 3, 100, 1536 + 5
    x, r, w = torch.randn(b, k, generator=gen) * 3, torch.randn(b, k, generator=gen), torch.randn(k, generator=gen)
    gu = torch.randn(2, 2 * n, generator=gen) * 20
    cmds = struct.pack("<3qf", 5, b, k, 1e-5) + f32(x) + f32(r) + f32(w) + struct.pack("<3q", 6, 2, n) + f32(gu)
    out = run(driver, cmds)
    vals = torch.frombuffer(bytearray(out), dtype=torch.float32)
    assert vals.numel() == 2 * b * k + 2 * n
    assert torch.equal(vals[:b * k].view(b, k), x + r)
    assert_within(vals[b * k:2 * b * k].view(b, k), *rms_norm_reference(x + r, w, 1e-5), what="aarch64 add+norm")
    assert_within(vals[2 * b * k:].view(2, n), *silu_mul_reference(gu), what="aarch64 silu*up")
