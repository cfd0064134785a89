"""The C decode attention alone (engine/csrc/decode.c, through native.decode_batch), beside the
read bandwidth measured in the same run.

    python benchmarks/cpu_attention.py [--kv fp32,bf16,fp8] [--batches 1,8] [--contexts 256,4096]
                                       [--geometry 3,3,64] [--reps 5] [--shuffled] [--hot]

A decode step reads each layer's cache once, and together the layers' caches are far larger
than the last-level cache. So each point builds enough layers' pools to fill POOL_BYTES, the
bundled model's geometry by default (3 KV heads, 3 queries each, head_dim 64). It times one
call per layer, round after round, so that every call reads its cache from memory. fp8 rows
are scaled to 448 as the engine's writes scale them. Unscaled values cast to e4m3 hold many
subnormals, and each multiply that meets one takes a microcode assist on x86 (decode.c's
widen_rows).

Prints, for each point:
- the median and fastest ms per layer over the rounds;
- the cache bytes one call reads (K, V and the fp8 scales) and the GB/s that makes at the
  median;
- the same beside the bandwidth of timed sums over a buffer of POOL_BYTES (the bench's probe,
  kvchat/bench/floor.py), taken before and after the points.

--hot times one layer's pool over and over (from cache where it fits): a kernel as fast hot as
cold is bound by its instructions, not by memory. --shuffled gives each sequence its blocks in
a random order (by default they are in order, as a fresh pool hands them out). Threads: the C
kernels' own count (KVCHAT_THREADS, else what the load leaves).
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

from kvchat.bench.floor import BandwidthProbe  # noqa: E402
from kvchat.engine import native, threads  # noqa: E402

POOL_BYTES = 1200 * 2**20
BLOCK = 16
KV = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": native.FP8}


def csv_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def csv_kv(text: str) -> list[str]:
    kinds = [v for v in text.split(",") if v]
    bad = [k for k in kinds if k not in KV]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"{text!r}: cache dtypes are {', '.join(KV)}")
    return kinds


def pool(kv: str, hk: int, blocks: int, d: int, gen: torch.Generator):
    """One layer's K and V (blocks, BLOCK, hk, d) in the CPU pool's head-major storage, and the
    fp8 scales (blocks, BLOCK, hk) or None, filled with N(0, 1) rows (fp8: scaled to 448)."""
    def side():
        x = torch.randn(hk, blocks, BLOCK, d, generator=gen)
        if kv != "fp8":
            return x.to(KV[kv]).permute(1, 2, 0, 3), None
        scale = x.abs().amax(-1) / 448
        return (x / scale[..., None]).to(KV[kv]).permute(1, 2, 0, 3), scale.permute(1, 2, 0)
    (k, ks), (v, vs) = side(), side()
    return k, v, ks, vs


def point(kv: str, b: int, ctx: int, geometry: tuple[int, int, int], reps: int, shuffled: bool, hot: bool,
          seed: int) -> dict:
    hk, g, d = geometry
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // BLOCK)
    blocks = b * per_seq
    elem = torch.empty(0, dtype=KV[kv]).element_size()
    read = 2 * b * ctx * hk * d * elem + (2 * b * ctx * hk * 4 if kv == "fp8" else 0)
    layer_bytes = 2 * blocks * BLOCK * hk * d * elem
    layers = 1 if hot else max(2, POOL_BYTES // layer_bytes)
    pools = [pool(kv, hk, blocks, d, gen) for _ in range(layers)]
    order = torch.randperm(blocks, generator=gen) if shuffled else torch.arange(blocks)
    tables = order.to(torch.int32).reshape(b, per_seq)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    q = torch.randn(b, hk * g, d, generator=gen)
    calls = max(layers, 64) if hot else layers
    ms = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        for i in range(calls):
            k, v, ks, vs = pools[i % layers]
            if native.decode_batch(q, k, v, tables, lens, d ** -0.5, ks, vs) is None:
                raise SystemExit("cpu_attention: the C kernels do not serve this geometry or dtype here")
        if r:                                   # the first round warms the threads and pages
            ms.append((time.perf_counter() - t0) / calls * 1000)
    med = statistics.median(ms)
    return {"kv": kv, "batch": b, "context": ctx, "layers": layers, "median_ms": med, "fastest_ms": min(ms),
            "read_bytes": read, "gb_s": read / (med / 1000) / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", type=csv_kv, default=["fp32", "bf16", "fp8"])
    ap.add_argument("--batches", type=csv_ints, default=[1, 8])
    ap.add_argument("--contexts", type=csv_ints, default=[256, 4096])
    ap.add_argument("--geometry", type=csv_ints, default=[3, 3, 64], help="KV heads, queries per KV head, head_dim")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shuffled", action="store_true")
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if len(args.geometry) != 3:
        ap.error(f"--geometry takes 3 integers (KV heads, queries per KV head, head_dim), got {len(args.geometry)}")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: at least 1")
    if native.lib() is None:
        print("cpu_attention: the C kernels are not built here (engine/native.py)", file=sys.stderr)
        return 2
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    probe = BandwidthProbe(POOL_BYTES)
    probe.sample()
    rows = [point(kv, b, ctx, tuple(args.geometry), args.reps, args.shuffled, args.hot, args.seed)
            for kv in args.kv for b in args.batches for ctx in args.contexts]
    probe.sample()
    bw = probe.result()
    print(f"C decode attention, {'one pool hot' if args.hot else 'pools from memory'}, blocks "
          f"{'shuffled' if args.shuffled else 'in order'}, geometry {args.geometry}, {threads.count()} thread(s); "
          f"read bandwidth {bw.gb_s:.1f} GB/s (timed sums over {bw.buffer_bytes >> 20} MiB: {bw.reader})")
    print("| KV | B | context | median ms/layer | fastest | MB read | GB/s | of the sums' bandwidth |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv']} | {r['batch']} | {r['context']:,} | {r['median_ms']:.3f} | {r['fastest_ms']:.3f} | "
              f"{r['read_bytes'] / 1e6:.2f} | {r['gb_s']:.1f} | {r['gb_s'] / bw.gb_s:.0%} |")
    after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None:
        print(f"1-minute load {load:.2f} before, {after:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
