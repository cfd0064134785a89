"""Building the C kernels (engine/csrc/) on the user's machine: the flags for its CPU, where
the library is kept, and the checks it passes before a process maps it.

- **Levels.** `native` (the default: -march=native, or -mcpu=native where the compiler
  refuses -march=native, as on many ARM toolchains), `portable` (the same without the x86
  intrinsics: the code an ARM or other compiler sees), and on x86-64 the levels a
  distribution would ship, `x86-64` (SSE2), `-v2` (SSE4.2), `-v3` (AVX2, FMA), `-v4`
  (AVX-512). KVCHAT_NATIVE_LEVEL picks one; the tests build every level this CPU can run, so
  the AVX2 laptop's code is tested on an AVX-512 machine.
- **Keyed by everything that changes the code**: the sources, the flags, the level, the
  compiler (its path and version) and the CPU (its flags, for -march=native), so a test's
  build, another level or another machine sharing the folder never replaces the user's.
- **Never a damaged library.** A new library is compiled under a temporary name, checked in a
  child process (native_abi.check: it must load and compute; a crash kills only the child),
  and only then renamed into place, with its SHA-256 beside it. Every load first checks the
  file against that hash: a truncated file (a full disk, a killed compile, a bad copy) is
  rebuilt instead of mapped, which would kill the process with SIGBUS.
- **Always an answer.** When a compile fails, the next flags are tried (no -march, then no
  OpenMP: one thread); when none builds, the torch paths serve and `status` says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .native_abi import bind

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("gemv.c", "gemv_bf16.c", "gemv_amx.c", "decode.c", "merge.c", "write.c", "step.c"))
HEADERS = (CSRC / "kvchat.h", CSRC / "vec.h")
# -ffp-contract=fast: a * b + c as one fused multiply-add wherever the target has one (GCC's
# default in GNU C but not in ISO C; clang's `on` would not contract across statements)
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast")
X86_LEVELS = {   # /proc/cpuinfo flags each level needs beyond the one below (x86-64 psABI)
    "x86-64": set(),
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
LEVELS = ("native", "portable", *X86_LEVELS)
CHECK_SECONDS = 120


class BuildError(Exception):
    """One line: why no library could be built or loaded."""


def machine(name: str | None = None) -> str:
    """x86_64 or aarch64 for the spellings of each (amd64, arm64), else the name as given."""
    m = (name or platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def computes_bf16(flags: set[str] | None = None) -> bool:
    """Whether the CPU has bf16 arithmetic (AVX512-BF16 or AMX): where it does not, bf16
    products are emulated (vLLM's and torch's alike) and far slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & (cpu_flags() if flags is None else flags))


def runnable_levels(arch: str | None = None, flags: set[str] | None = None) -> list[str]:
    """The levels whose code this CPU can run: native and portable everywhere, and each
    x86-64 level whose instructions the CPU has (each level includes the ones below)."""
    arch = machine(arch)
    flags = cpu_flags() if flags is None else flags
    out = ["native", "portable"]
    if arch == "x86_64":
        need: set[str] = set()
        for level, extra in X86_LEVELS.items():
            need |= extra
            if not need <= flags:
                break
            out.append(level)
    return out


def arch_flags(level: str, arch: str | None = None) -> list[tuple[str, ...]]:
    """The architecture flags to try for a level, best first; the last is the compiler's
    default target, which every compiler accepts."""
    arch = machine(arch)
    if level in X86_LEVELS:
        return [(f"-march={level}",)]
    if arch == "aarch64":      # GCC and clang on ARM: -mcpu=native tunes for and targets this core
        native = [("-mcpu=native",), ("-march=native",), ()]
    elif arch == "x86_64":
        native = [("-march=native",), ()]
    else:                      # POWER takes -mcpu, RISC-V -march
        native = [("-march=native",), ("-mcpu=native",), ()]
    if level == "portable":
        return [(*f, "-DKVCHAT_PORTABLE") for f in native]
    return native


def check_level(level: str) -> None:
    """Raise BuildError unless level names a level and this CPU can run its code."""
    if level not in LEVELS:
        raise BuildError(f"KVCHAT_NATIVE_LEVEL={level!r} is not a level ({', '.join(LEVELS)})")
    if level in X86_LEVELS:
        if machine() != "x86_64":
            raise BuildError(f"{level} is an x86-64 level; this CPU is {machine()}")
        if level not in runnable_levels():
            raise BuildError(f"this CPU cannot run {level} code")


def compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return shutil.which(cc) if cc else None


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{Path(cc).name} --version failed: {e}") from None


def key(cc: str, flags: tuple[str, ...], level: str, version: str) -> str:
    """16 hex digits over everything that changes the compiled code."""
    h = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), repr(flags).encode(), level.encode(),
                 os.path.realpath(cc).encode(), version.encode(), machine().encode(),
                 " ".join(sorted(cpu_flags())).encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verified(lib: Path) -> bool:
    """Whether lib is a regular file whose bytes are those its check passed (the .sha256 beside it)."""
    stamp = lib.with_suffix(".sha256")
    try:
        return lib.is_file() and not lib.is_symlink() and stamp.is_file() and stamp.read_text().strip() == _digest(lib)
    except OSError:
        return False


@contextmanager
def _locked(folder: Path):
    """One builder at a time per folder (two kvchat processes starting together)."""
    try:
        import fcntl  # noqa: PLC0415  (POSIX only; elsewhere the atomic renames suffice)
    except ImportError:
        yield
        return
    with open(folder / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _first_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if "error" in x.lower()] or text.strip().splitlines()
    return lines[0].strip() if lines else "no output"


def _compile(cc: str, flags: tuple[str, ...], out: Path) -> None:
    try:
        done = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{Path(cc).name} did not run: {e}") from None
    if done.returncode != 0:
        raise BuildError(f"{Path(cc).name} {' '.join(f for f in flags if f not in BASE_FLAGS)} failed: "
                         f"{_first_line(done.stderr + done.stdout)}")
    if not out.is_file():
        raise BuildError(f"{Path(cc).name} reported success but wrote no library")


def _check(path: Path) -> None:
    """native_abi.check in a child process: a library that crashes kills only the child."""
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("native_abi.py")), str(path)],
                              capture_output=True, text=True, timeout=CHECK_SECONDS)
    except subprocess.TimeoutExpired:
        raise BuildError(f"the compiled library's check did not finish in {CHECK_SECONDS} s") from None
    if done.returncode < 0:
        raise BuildError(f"the compiled library crashed its check (signal {-done.returncode})")
    if done.returncode != 0:
        raise BuildError(f"the compiled library failed its check: {_first_line(done.stdout + done.stderr)}")


def build(folder: Path, cc: str, flags: tuple[str, ...], level: str) -> tuple[Path, bool]:
    """The checked library for these flags in folder, compiled first when there is none or
    the one there is damaged. Returns (path, whether a damaged one was replaced)."""
    version = _version(cc)
    path = folder / f"kvchat_cpu-{level}-{key(cc, flags, level, version)}{'.dylib' if sys.platform == 'darwin' else '.so'}"
    if verified(path):
        return path, False
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create {folder}: {e.strerror or e}") from None
    with _locked(folder):
        if verified(path):                       # another process built it meanwhile
            return path, False
        damaged = path.exists() or path.with_suffix(".sha256").exists()
        try:
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                part = Path(tmp) / path.name
                _compile(cc, flags, part)
                _check(part)
                stamp = Path(tmp) / "stamp"
                stamp.write_text(_digest(part) + "\n")
                os.replace(part, path)           # atomic: a reader sees the whole library or none
                os.replace(stamp, path.with_suffix(".sha256"))
        except OSError as e:                     # a full disk, a read-only folder
            raise BuildError(f"cannot write the library in {folder}: {e.strerror or e}") from None
    return path, damaged


def load(folder: Path, level: str = "native", cc: str | None = None) -> tuple[ctypes.CDLL | None, str, int | None]:
    """Build (or find) and load the library. Returns (library or None, one status line, the
    thread cap: 1 when built without OpenMP, else None)."""
    try:
        check_level(level)
    except BuildError as e:
        return None, f"off: {e}", None
    cc = cc or compiler()
    if cc is None:
        return None, "off: no C compiler (cc, gcc or clang; or set CC)", None
    errors = []
    for arch in arch_flags(level):
        for openmp in (("-fopenmp",), ()):
            flags = (*BASE_FLAGS, *arch, *openmp)
            try:
                path, damaged = build(folder, cc, flags, level)
                lib = bind(ctypes.CDLL(str(path)))
            except (BuildError, OSError, AttributeError) as e:
                errors.append(str(e))
                continue
            shown = " ".join(arch + openmp) or "the compiler's default target"
            note = "; a damaged library in the cache was rebuilt" if damaged else ""
            return lib, f"on: {Path(cc).name} {shown} (level {level}){note}", None if openmp else 1
    return None, f"off: {errors[0]}", None
