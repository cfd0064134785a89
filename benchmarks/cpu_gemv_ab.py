"""The batched C product (engine/native.py `gemv`) against B separate one-row calls and
torch's `x @ w.T`, on the bundled model's weight shapes, in one run.

    python benchmarks/cpu_gemv_ab.py [--batches 1,2,4,8,16] [--reps 15] [--threads 2]

A decode step reads every weight matrix from memory, since together they are far larger
than the last-level cache: each shape is timed over enough copies of its weights to fill
512 MB, every call taking the next copy, so that it streams its weights from memory as in a
real step. The three ways take turns within each round (their order rotating), so that a
changing load touches them alike. Prints, per shape and B, the fastest and the median ms per
call of each way over the rounds, the batched product's weight stream in GB/s (fastest), and
its speed-up over the other two (fastest over fastest: on a shared machine the minimum is the
least disturbed); and the 1-minute load before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvchat

from kvchat.engine import native  # noqa: E402

# (n, k) of w, as the brief of issue 22 lists them: o_proj, gate or up, down, lm_head;
# and the engine's fused qkv and gate_up
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (960, 576), (3072, 576)]
STREAM_BYTES = 512 << 20


def race(ways: dict, weights: list[torch.Tensor], reps: int) -> dict[str, list[float]]:
    """ms of each way's call per round, the ways in a rotating order, each call on the next copy."""
    times = {name: [] for name in ways}
    names = list(ways)
    i = 0
    for r in range(reps + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            w = weights[i % len(weights)]
            i += 1
            t0 = time.perf_counter()
            ways[name](w)
            if r:                      # round 0 warms up
                times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="", help="n x k pairs, e.g. 576x576,49152x576 (default: the model's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native.lib() is None:
        print(f"the C kernels are not loaded: {native.status()}")
        return 1
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    batches = [int(b) for b in args.batches.split(",")]
    load0 = os.getloadavg()[0]
    print(f"kernels: {native.status()}")
    print(f"{'w (n x k)':>12} {'B':>3} {'C batched':>14} {'B x C 1-row':>14} {'torch x@w.T':>14} "
          f"{'GB/s':>6} {'vs 1-row':>9} {'vs torch':>9}")
    print(f"{'':>16} {'(min / median ms)':>44}")
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        copies = max(1, STREAM_BYTES // (n * k * 4))
        weights = [torch.randn(n, k, generator=gen) for _ in range(copies)]
        for b in batches:
            x = torch.randn(b, k, generator=gen)
            rows = [x[i:i + 1].contiguous() for i in range(b)]
            t = race({"batched": lambda w: native.gemv(x, w),
                      "one_row": lambda w: [native.gemv(r, w) for r in rows],
                      "torch": lambda w: x @ w.T}, weights, args.reps)
            best = {name: min(v) for name, v in t.items()}
            cols = " ".join(f"{f'{min(v):.3f} / {statistics.median(v):.3f}':>14}" for v in t.values())
            gbs = n * k * 4 / best["batched"] / 1e6
            print(f"{f'{n}x{k}':>12} {b:>3} {cols} {gbs:>6.1f} {best['one_row'] / best['batched']:>8.2f}x "
                  f"{best['torch'] / best['batched']:>8.2f}x")
        del weights
    print(f"load (1 min) before {load0:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{args.threads} threads, {args.reps} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
