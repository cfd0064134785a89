"""How the C kernels are built on a user's machine (engine/native_build.py): the flags for its
CPU and architecture, the key that keeps every build apart, and what happens when the build
goes wrong: a compiler that fails, one that refuses a flag, one that produces a broken
library, and a damaged library left in the cache (issue 21; issue 27, item 7).

Compilers that fail or misbehave are small shell scripts standing in for `cc` (the real
compiler cannot be made to fail on demand); where a test needs a library that builds, it
uses the machine's real compiler at -O0 (the build's steps, not its speed, are under test),
into a cache folder of the test's own.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.engine import native, native_build as nb

ROOT = Path(__file__).resolve().parents[1]
REAL_CC = nb.compiler()
needs_cc = pytest.mark.skipif(REAL_CC is None, reason="no C compiler on this machine")


def fake_cc(tmp_path: Path, body: str, name: str = "fakecc") -> str:
    """A `cc` that is a shell script: body runs with the compiler's arguments in "$@"."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def quick(monkeypatch):
    """Builds at -O0: seconds instead of tens of seconds, the same steps."""
    monkeypatch.setattr(nb, "BASE_FLAGS", ("-O0", *nb.BASE_FLAGS[1:]))


# ---- flags per CPU and architecture ---------------------------------------------------------
AVX2_LAPTOP = {"sse2", "cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2",
               "f16c", "fma", "abm", "movbe", "xsave"}


def test_the_levels_a_cpu_can_run_follow_its_flags():
    assert nb.runnable_levels("x86_64", AVX2_LAPTOP) == ["native", "portable", "x86-64", "x86-64-v2", "x86-64-v3"]
    assert nb.runnable_levels("x86_64", AVX2_LAPTOP | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})[-1] \
        == "x86-64-v4"
    assert nb.runnable_levels("x86_64", AVX2_LAPTOP - {"fma"})[-1] == "x86-64-v2"
    assert nb.runnable_levels("arm64", {"fp", "asimd"}) == ["native", "portable"]


def test_each_architecture_gets_the_flags_its_compilers_take():
    assert nb.arch_flags("native", "x86_64") == [("-march=native",), ()]
    assert nb.arch_flags("native", "aarch64")[0] == ("-mcpu=native",)       # -march=native: refused by many
    assert nb.arch_flags("native", "arm64") == nb.arch_flags("native", "aarch64")
    assert nb.arch_flags("native", "ppc64le")[:2] == [("-march=native",), ("-mcpu=native",)]
    assert all("-DKVCHAT_PORTABLE" in f for f in nb.arch_flags("portable", "x86_64"))
    assert nb.arch_flags("x86-64-v3") == [("-march=x86-64-v3",)]


def test_a_level_that_is_not_one_or_that_the_cpu_cannot_run_is_refused_in_one_line(monkeypatch, tmp_path):
    lib, why, _ = nb.load(tmp_path, "x86-64-v9")
    assert lib is None and why.startswith("off: KVCHAT_NATIVE_LEVEL='x86-64-v9' is not a level (native, ")
    monkeypatch.setattr(nb, "cpu_flags", lambda: AVX2_LAPTOP)
    monkeypatch.setattr(nb, "machine", lambda name=None: "x86_64")
    lib, why, _ = nb.load(tmp_path, "x86-64-v4")
    assert lib is None and why == "off: this CPU cannot run x86-64-v4 code"
    assert not any(tmp_path.iterdir()), "nothing built"


def test_the_key_changes_with_everything_that_changes_the_code(monkeypatch):
    cc = REAL_CC or "/bin/sh"
    base = nb.key(cc, nb.BASE_FLAGS, "native", "cc 12.2")
    assert base == nb.key(cc, nb.BASE_FLAGS, "native", "cc 12.2")
    others = {nb.key(cc, nb.BASE_FLAGS, "x86-64-v3", "cc 12.2"), nb.key(cc, nb.BASE_FLAGS + ("-march=native",), "native", "cc 12.2"),
              nb.key(cc, nb.BASE_FLAGS, "native", "cc 13.1"), nb.key("/usr/bin/env", nb.BASE_FLAGS, "native", "cc 12.2")}
    monkeypatch.setattr(nb, "cpu_flags", lambda: {"sse2"})
    others.add(nb.key(cc, nb.BASE_FLAGS, "native", "cc 12.2"))
    assert base not in others and len(others) == 5


# ---- a compiler that fails -------------------------------------------------------------------
def test_a_failing_compiler_leaves_the_torch_paths_and_says_why(tmp_path):
    cc = fake_cc(tmp_path, 'echo "kvchat.c:1: error: this compiler is broken" >&2; exit 1')
    lib, why, _ = nb.load(tmp_path / "cache", "native", cc)
    assert lib is None
    assert why == "off: fakecc -march=native -fopenmp failed: kvchat.c:1: error: this compiler is broken"


def test_a_compiler_that_writes_garbage_is_caught_by_the_check(tmp_path):
    """It reports success but the library is not one: the check in a child process refuses
    it before this process maps it."""
    cc = fake_cc(tmp_path, 'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then head -c 4096 /dev/urandom > "$2"; fi; '
                           'shift; done; exit 0')
    lib, why, _ = nb.load(tmp_path / "cache", "native", cc)
    assert lib is None and why.startswith("off: the compiled library failed its check: it does not load:"), why
    assert not list((tmp_path / "cache").glob("*.so")), "nothing kept"


@needs_cc
@pytest.mark.parametrize("sabotage, message", [
    ("s/acc\\[b\\]\\[r\\]\\[s\\] += wv\\[r\\] \\* xv/acc[b][r][s] -= wv[r] * xv/", "failed its check: kv_gemv gave"),
    ("s/^void kv_gemv(\\(.*\\)) {$/void kv_gemv(\\1) { __builtin_trap();/", "crashed its check (signal"),
], ids=["wrong sums", "crashes"])
def test_a_compiler_that_produces_a_wrong_library_is_caught_by_the_check(tmp_path, quick, monkeypatch, sabotage,
                                                                         message):
    """The sources edited on their way through the compiler: the library builds and loads,
    but computes wrong products, or dies on the first call. (One target flag set: each
    fallback would be built and refused the same way.)"""
    monkeypatch.setattr(nb, "arch_flags", lambda level, arch=None: [()])
    body = (f'out=$(mktemp -d); cp {nb.CSRC}/* "$out"; sed -i "{sabotage}" "$out/gemv.c"; '
            f'args=""; for a in "$@"; do case "$a" in *.c) a="$out/$(basename "$a")";; esac; args="$args $a"; done; '
            f'exec {REAL_CC} $args')
    lib, why, _ = nb.load(tmp_path / "cache", "native", fake_cc(tmp_path, body))
    assert lib is None and message in why, why


@needs_cc
def test_a_compiler_without_openmp_builds_a_one_thread_library(tmp_path, quick):
    body = (f'for a in "$@"; do if [ "$a" = "-fopenmp" ]; then echo "clang: error: unsupported option \'-fopenmp\'" >&2; '
            f'exit 1; fi; done; exec {REAL_CC} "$@"')
    lib, why, threads = nb.load(tmp_path / "cache", "native", fake_cc(tmp_path, body))
    assert lib is not None and threads == 1
    assert why.startswith("on: fakecc -march=native (level native)"), why


@needs_cc
def test_a_compiler_that_refuses_march_native_builds_for_its_default_target(tmp_path, quick):
    body = (f'for a in "$@"; do case "$a" in -march=*) echo "error: the clang compiler does not support \'$a\'" >&2; '
            f'exit 1;; esac; done; exec {REAL_CC} "$@"')
    lib, why, _ = nb.load(tmp_path / "cache", "native", fake_cc(tmp_path, body))
    assert lib is not None
    assert why.startswith("on: fakecc -fopenmp (level native)") or why.startswith("on: fakecc -mcpu=native"), why


# ---- a damaged library in the cache ----------------------------------------------------------
def run_status(cache: Path, cc: str | None = None) -> subprocess.CompletedProcess:
    """A fresh process that loads the kernels from `cache` and runs one attention call."""
    code = ("import torch\nfrom kvchat.engine import native, attention as A\n"
            "q = torch.randn(1, 2, 16); k = torch.randn(2, 4, 1, 16)\n"
            "out = A.paged_decode(q, k, k, torch.tensor([[1, 0]], dtype=torch.int32),"
            " torch.tensor([5], dtype=torch.int32), 0.25)\n"
            "print(native.status()); print(bool(out.isfinite().all()))\n")
    env = dict(os.environ, KVCHAT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    env.pop("KVCHAT_NATIVE_LEVEL", None)
    if cc:
        env["CC"] = cc
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def build_native(cache: Path) -> Path:
    """The user's default library, built into cache without this process mapping it."""
    path, _ = nb.build(cache, REAL_CC, (*nb.BASE_FLAGS, *nb.arch_flags("native")[0], "-fopenmp"), "native")
    return path


@needs_cc
def test_a_truncated_library_in_the_cache_is_rebuilt_not_mapped(tmp_path, quick):
    """A library cut short (a full disk, an interrupted copy) used to kill every later run
    with SIGBUS. Its bytes no longer match the hash its check left beside it: rebuilt."""
    cache = tmp_path / "cache"
    so = build_native(cache)
    so.write_bytes(so.read_bytes()[:5000])
    assert not nb.verified(so)
    lib, why, _ = nb.load(cache, "native")
    assert lib is not None and why.endswith("a damaged library in the cache was rebuilt"), why
    assert nb.verified(so)


@needs_cc
def test_a_damaged_library_and_a_failing_compiler_give_the_torch_paths_and_one_line(tmp_path, quick):
    cache = tmp_path / "cache"
    so = build_native(cache)
    so.write_bytes(so.read_bytes()[:3000])
    done = run_status(cache, fake_cc(tmp_path, 'echo "error: no space left on device" >&2; exit 1'))
    assert done.returncode == 0, done.stderr[-2000:]
    status, finite = done.stdout.splitlines()[-2:]
    assert finite == "True" and status == "off: fakecc -march=native -fopenmp failed: error: no space left on device"
    assert [x for x in done.stderr.splitlines() if x.strip()] == [f"kvchat: C kernels {status}; the torch paths serve"]


def test_no_compiler_at_all_gives_the_torch_paths_and_one_line(tmp_path):
    done = run_status(tmp_path / "cache", str(tmp_path / "no-such-cc"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-2:] == ["off: no C compiler (cc, gcc or clang; or set CC)", "True"]
    assert [x for x in done.stderr.splitlines() if x.strip()] == [
        "kvchat: C kernels off: no C compiler (cc, gcc or clang; or set CC); the torch paths serve"]


@needs_cc
def test_another_levels_build_never_replaces_the_users():
    """The tests build every level (tests/test_native_levels.py) into the user's cache folder:
    each under its own key, beside the user's library, which stays as it was."""
    assert native.status().startswith("on:"), native.status()
    users = Path(native.lib()._name)
    before = users.read_bytes()
    with native.using("x86-64") as why:
        assert why.startswith("on:") and Path(native.lib()._name) != users
    assert users.read_bytes() == before and nb.verified(users)
    assert Path(native.lib()._name) == users
