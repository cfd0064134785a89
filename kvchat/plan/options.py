"""`kvchat plan`'s flags turned into a PlanConfig: the workload's distributions, the model,
the hardware (or a calibration's), the scheduler's defaults, the step-time constants given."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvchat.engine.sizing import CPU_PREFILL_CHUNK

from ..cli.args import UsageError

if TYPE_CHECKING:
    from .planner import PlanConfig

NO_SEQ_LIMIT = 1_000_000      # kvchat's engine caps no sequence count: the pool does

DEFAULTS = {"users": 16, "turns": "4", "think": "exp:10s", "context": "1000-3000", "message": "50-150",
            "reply": "100-400", "ramp": "10s"}


def workload(args, long: int | None = None):
    from .workload import Workload, parse_dist
    d: dict[str, Any] = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in DEFAULTS.items()}
    ramp = parse_dist("--ramp", str(d["ramp"]), seconds=True, zero_ok=True)
    if ramp.kind != "fixed":
        raise UsageError(f"--ramp {args.ramp!r}: give one duration, e.g. 10s")
    if args.rate is not None and args.ramp is not None:
        raise UsageError("give --rate (Poisson arrivals) or --ramp (a spread start), not both")
    return Workload(users=d["users"], rate=args.rate, ramp=ramp.a,
                    turns=parse_dist("--turns", str(d["turns"])),
                    think=parse_dist("--think", str(d["think"]), seconds=True, zero_ok=True),
                    context=parse_dist("--context", str(d["context"]), zero_ok=True),
                    message=parse_dist("--message", str(d["message"])),
                    reply=parse_dist("--reply", str(d["reply"])),
                    system_tokens=args.system_prompt, long_tokens=long if long is not None else args.long,
                    seed=args.seed)


def plan_config(args: argparse.Namespace, **changes: Any) -> PlanConfig:
    from kvchat.engine.units import parse_bytes

    from .hardware import CPU, TABLE, cpu_calibrated, find, gpu_key
    from .metrics import parse_slo
    from .planner import PlanConfig, model_geometry
    from .request import POLICIES
    from .step_time import Constant
    from .workload import parse_dist, read_trace
    geom = model_geometry(args.model, args.geometry)
    if args.policy not in POLICIES:
        raise UsageError(f"unknown cap policy {args.policy!r}; accepted: {', '.join(POLICIES)}")
    key = gpu_key(args)
    hw = changes.get("hardware") or (None if args.calibration and (key == CPU or key in TABLE) else find(key))
    cpu = hw.measured if hw is not None else key == CPU
    dtype = args.dtype or ("fp32" if cpu else "bf16")          # kvchat's engine runs fp32 on a CPU
    kv = args.kv_dtype if args.kv_dtype != "auto" else ("bf16" if dtype == "fp8" else dtype)
    overrides = {}
    if args.calibration:
        from .calibration import load_calibration
        cal = load_calibration(args.calibration, key, geom)
        overrides.update(cal.overrides(kv))
        if hw is None:
            hw = cpu_calibrated(cal.constants["bandwidth"], cal.constants["flops"], cal.sources["bandwidth"]) \
                if key == CPU else TABLE[key]
    for flag, names, scale in (("bw_efficiency", ("bw_efficiency", "kv_bw_efficiency"), 1.0),
                               ("flops_efficiency", ("flops_efficiency", "attn_efficiency"), 1.0),
                               ("overhead_ms", ("overhead",), 1e-3)):
        value = getattr(args, flag)
        if value is not None:
            for name in names:
                overrides[name] = Constant(value * scale, "s" if name == "overhead" else "",
                                           f"given (--{flag.replace('_', '-')})")
    budget, seqs = vllm_defaults(hw)
    horizon = None
    if args.horizon is not None:
        h = parse_dist("--horizon", args.horizon, seconds=True)
        if h.kind != "fixed":
            raise UsageError(f"--horizon {args.horizon!r}: give one duration, e.g. 1h or 3600s")
        horizon = h.a
    values = dict(geometry=geom, hardware=hw, workload=workload(args), dtype=dtype, kv_dtype=kv, tp=args.tp,
                  pool_bytes=parse_bytes(args.pool) if args.pool else None, utilisation=args.memory_utilization,
                  block_size=args.block_size, max_batched_tokens=args.max_batched_tokens or budget,
                  max_seqs=args.max_seqs or seqs,
                  prefix_caching=not args.no_prefix_cache, cap=args.cap, policy=args.policy,
                  slo=parse_slo(args.slo) if args.slo else {}, overrides=overrides, horizon=horizon,
                  trace=read_trace(args.trace) if args.trace else None)
    values.update(changes)
    return PlanConfig(**values)


def vllm_defaults(hw) -> tuple[int, int]:
    """The scheduler's defaults. On a GPU, vLLM's API server's (EngineArgs.get_batch_defaults):
    a larger token budget and more sequences on GPUs of 70 GiB or more, except the A100. On
    the cpu row, kvchat's batched engine as it runs (engine/scheduler.py, EngineConfig's
    step_tokens left unset): a budget of one prefill chunk, 512 tokens, shared by the decode
    rows and the prompt chunks of a step, and no limit on the sequences running but the pool
    (the simulator's step order is the engine's there too: PlanConfig.decode_first)."""
    if hw.measured:
        return CPU_PREFILL_CHUNK, NO_SEQ_LIMIT
    if hw.memory_bytes >= 70 * 2**30 and "a100" not in hw.key:
        return 8192, 1024
    return 2048, 256
