"""The machine a bench ran on, as the bench's JSON and notes record it: the load average (a
busy machine skews every figure) and the checkout's commit."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def busy_note(notes: list[str]) -> float | None:
    """Other work on the CPUs skews every figure; say so where the numbers are read."""
    load, cpus = load_average(), os.cpu_count() or 1
    if load is not None and load > 0.5 * cpus:
        why = f"the machine was busy when the run began (1-minute load {load:.1f} on {cpus} CPUs): figures are noisy"
        notes.append(why)
        print(f"kvchat bench: {why}", file=sys.stderr, flush=True)
    return load


def checkout_commit() -> str | None:
    """The checkout's commit (with "+changes" when the tree differs from it), or None."""
    import subprocess
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def gpu_name(device) -> dict[str, str]:
    """{"gpu": the device's name} for a CUDA run (what `kvchat plan --calibrate` checks --gpu
    against), else nothing."""
    import torch
    return {"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
