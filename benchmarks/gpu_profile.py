"""Where a decode step's GPU time goes: the engine's decode steps at one context, run with the
CUDA graph set aside under torch's profiler, their kernels summed by name (a graph's replay
shows as one launch, its kernels' times are the same). Each kernel's time per step beside the
bytes it must read gives what to fix first.

    python benchmarks/gpu_profile.py --model DIR --random-weights --context 1024 --steps 16
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kv-budget", default="8GiB")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args(argv)
    os.environ["KVCHAT_CUDA_GRAPH"] = "0"         # read at each step: the kernels one by one
    import torch
    from torch.profiler import ProfilerActivity, profile
    from kvchat.engine import Engine, EngineConfig, SamplingParams
    engine = Engine(EngineConfig(model=args.model, random_weights=args.random_weights, kv_budget=args.kv_budget))
    cuda = engine.device.type == "cuda"
    def prompt() -> list[int]:   # fresh ids each time: no prefix of an earlier run is reused
        return torch.randint(0, engine.geometry.vocab_size, (args.context,)).tolist()

    def kernels(max_tokens: int) -> tuple[dict[str, list[float]], list]:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            _, steps = engine.generate([prompt()], SamplingParams(max_tokens=max_tokens), ignore_eos=True)
            if cuda:
                torch.cuda.synchronize()
        out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for ev in prof.key_averages():
            us = ev.device_time_total if cuda else ev.self_cpu_time_total
            if us > 0 and (not cuda or ev.device_type == torch.autograd.DeviceType.CUDA):
                out[ev.key][0] += ev.count
                out[ev.key][1] += us
        return out, steps

    engine.generate([prompt()], SamplingParams(max_tokens=4), ignore_eos=True)          # warm-up
    alone, _ = kernels(1)                                     # the prefill and its one token
    both, steps = kernels(args.steps + 1)                     # the same, then args.steps decode steps
    totals = {k: [c - alone.get(k, [0, 0.0])[0], us - alone.get(k, [0, 0.0])[1]] for k, (c, us) in both.items()}
    totals = {k: v for k, v in totals.items() if v[1] > 0}
    decode = [s for s in steps if s.decode_rows and not s.prefill_tokens]
    n = max(1, len(decode))
    wall = sorted(s.step_ms for s in decode)[n // 2]
    kernel_sum = sum(t for _, t in totals.values())
    print(f"gpu_profile: {engine.describe()['model']} {engine.dtype_name} on {engine.device}, context {args.context}: "
          f"{len(decode)} eager decode steps, median {wall:.2f} ms; their kernels {kernel_sum / 1000 / n:.3f} ms a step "
          "(the profile of a prefill alone subtracted)")
    print(f"{'kernel':<90} {'calls':>7} {'us/step':>9} {'share':>6}")
    for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{name[:90]:<90} {count:>7.0f} {us / n:>9.1f} {us / kernel_sum:>6.1%}")
    return 0


if __name__ == "__main__":
    # on the main thread: torch's profiler starts its CUDA tracing where it was registered; the
    # engine's steps still run on its compute thread, and CUDA's tracing sees every thread
    sys.exit(main())
