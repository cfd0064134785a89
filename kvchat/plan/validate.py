"""`kvchat plan --validate`: the simulator against real runs of the same users.

For each load level (light, near saturation, past it), one Poisson trace of multi-turn users
runs for real through kvchat's engine on this CPU (trace_runner.py), and, given `--server
URL`, through a vLLM server; the simulator then replays the trace as it ran (the true prompt
and reply lengths, the true arrival times) with constants calibrated on a different run (a
`kvchat bench --json` record, --calibration FILE). The table sets simulated against measured
percentiles, with each one's error and the mean absolute percentage error; the targets are
10% on TPOT and ITL (p50, p90) and 25% on TTFT (p50, p90).

The load levels come from the calibrated model itself: the time one turn of the mean user
takes alone, S, sets the arrival rates at 0.3, 0.9 and 1.5 turns per S. Each run's texts are
its own (trace_runner's salt), so no level finds an earlier run's prompts in the engine's
prefix cache; a speed probe around each level reports the machine's drift (drift.py); and
each level says where its error comes from, the step-time model or the
scheduler model (diagnose.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..cli.args import UsageError
from .metrics import summarize
from .planner import PlanConfig, run_plan
from .request import SimResult
from .workload import Dist, Trace, Workload, make_trace

COMPARED = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"), ("itl_ms", "p50"),
            ("itl_ms", "p90"))
TARGET = {"ttft_ms": 0.25, "tpot_ms": 0.10, "itl_ms": 0.10}
LEVELS = (("light", 0.3), ("near saturation", 0.9), ("past it", 1.5))
# a workload a 2-core CPU serves in minutes, where the flags give none
DEFAULTS = {"users": 10, "turns": "3", "context": "0-300", "message": "20-60", "reply": "8-32", "think": "exp:1s",
            "pool": "50MB"}


@dataclass(frozen=True, slots=True)
class Row:
    level: str
    metric: str
    measured: float | None
    simulated: float | None

    @property
    def error(self) -> float | None:
        if not self.measured or self.simulated is None:
            return None
        return (self.simulated - self.measured) / self.measured


def compare(level: str, measured: SimResult, simulated: SimResult) -> list[Row]:
    m, s = summarize(measured, {}), summarize(simulated, {})
    return [Row(level, f"{key[:-3].upper()} {q}", m[key][q], s[key][q]) for key, q in COMPARED]


def mape(rows: list[Row], prefix: str) -> float | None:
    errs = [abs(r.error) for r in rows if r.error is not None and r.metric.startswith(prefix)]
    return sum(errs) / len(errs) if errs else None


def table(rows: list[Row], vllm: dict[str, SimResult] | None = None) -> list[str]:
    head = f"{'load':<17}{'metric':<10}{'kvchat, measured':>18}{'simulated':>11}{'error':>8}"
    if vllm:
        head += f"{'vLLM, measured':>16}"
    out = [head]
    for r in rows:
        line = (f"{r.level:<17}{r.metric:<10}{_ms(r.measured):>18}{_ms(r.simulated):>11}"
                f"{'' if r.error is None else format(r.error, '+.1%'):>8}")
        if vllm and r.level in vllm:
            line += f"{_ms(vllm_value(r, vllm)):>16}"
        out.append(line)
    for prefix, name in (("TTFT", "TTFT"), ("TPOT", "TPOT"), ("ITL", "ITL")):
        e = mape(rows, prefix)
        target = TARGET[f"{prefix.lower()}_ms"]
        out.append(f"mean absolute percentage error, {name} p50 and p90: "
                   + ("n/a" if e is None else f"{e:.1%} (target {target:.0%}: {'met' if e <= target else 'missed'})"))
    return out


def vllm_value(r: Row, vllm: dict[str, SimResult]) -> float | None:
    """The vLLM server's measured figure for a row's level and metric (None without --server)."""
    if r.level not in vllm:
        return None
    key, q = {f"{k[:-3].upper()} {p}": (k, p) for k, p in COMPARED}[r.metric]
    return summarize(vllm[r.level], {})[key][q]


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.1f}"


def rates(cfg: PlanConfig) -> list[tuple[str, float]]:
    """Turns per second at each level, from the calibrated time of the mean user's turn alone."""
    w = cfg.workload
    mean = lambda d: Dist("fixed", round(d.mean), text=f"{round(d.mean)}")   # noqa: E731
    alone = Workload(users=1, rate=None, ramp=0.0, turns=Dist("fixed", 1.0, text="1"), think=w.think,
                     context=mean(w.context), message=mean(w.message), reply=mean(w.reply),
                     system_tokens=w.system_tokens, seed=w.seed)
    seconds = run_plan(cfg.variant(workload=alone, trace=None)).summary["e2el_ms"]["mean"] / 1000
    return [(name, load / seconds) for name, load in LEVELS]


def level_trace(w: Workload, turns_per_s: float) -> Trace:
    """The users of `w` arriving as a Poisson process so that their turns come at about
    `turns_per_s` (a user sends its mean number of turns)."""
    return make_trace(replace(w, rate=turns_per_s / max(1.0, w.turns.mean), ramp=0.0))


def calibrate_on_a_run(cfg: PlanConfig, backend, engine, seed: int) -> tuple[PlanConfig, str, list[dict]]:
    """Fit the constants to a run of other users (another seed) on the same engine in the same
    process: the machine's state now, not a bench's an hour ago. The run goes at the highest
    level's rate, so that its steps cover what the levels' steps hold (one to several decode
    rows, prompt chunks beside them); a light run gave the fit steps of one sequence alone and
    left it to extrapolate to every busier step. The points are the engine's own steps of that
    run (run_points.py); the per-request overhead is measured on its turns that waited alone.
    The third value is the points as measured and fitted (for --json: a later fitter can be
    checked on them offline)."""
    from dataclasses import replace as dc_replace

    from .calibration import calibration_from_fit, costs_for
    from .diagnose import every_step
    from .fitter import fit
    from .run_points import request_overhead_ms, step_points
    from .step_time import DEFAULT_BW_EFF, DEFAULT_OVERHEAD_MS
    from .trace_runner import run_trace
    w = replace(cfg.workload, seed=seed)
    busiest = rates(cfg)[-1][1]
    with every_step(engine) as records:               # every step of the run, not the panels' last few hundred
        run = run_trace(level_trace(w, busiest), backend, salt=1)
    points = step_points(records, cfg.kv_dtype)
    if len(points) < 3:
        raise UsageError(f"the calibration run gave {len(points)} measured points; give more --users or --turns")
    bw = cfg.hardware.bandwidth
    costs = costs_for(cfg.geometry, cfg.dtype, {cfg.kv_dtype}, kv_scales=True)
    prior = {"overhead": DEFAULT_OVERHEAD_MS / 1e3, "row": 0.0, "weight": 1 / (bw * DEFAULT_BW_EFF),
             "kv": 1 / (bw * DEFAULT_BW_EFF), "lin": 1 / cfg.hardware.bf16_flops, "attn": 1 / cfg.hardware.bf16_flops,
             "request": 0.0}
    f = fit(points, costs, prior, model_kv=cfg.kv_dtype)
    source = f"a calibration run of {w.users} other users (seed {seed}, {len(records)} engine steps)"
    cal = calibration_from_fit(f, "cpu", cfg.geometry.name, cfg.dtype, bw,
                               f"measured: {cfg.hardware.quoted}", source, points)
    alone = request_overhead_ms(run, records)
    request = alone[0] / 1000 if alone else 0.0
    cal = dc_replace(cal, constants={**cal.constants, "request_overhead": max(0.0, request)},
                     sources={**cal.sources, "request_overhead":
                              f"measured on {alone[1]} turns of {source} that waited alone: the TTFT less its steps"
                              if alone else f"no turn of {source} waited alone: 0"})
    note = f"calibrated on {len(points)} points of {source}: fit error {f.mape(points):.1%}"
    consts = ", ".join(f"{k} {cal.constants[k] * 1e3:.2f} ms"
                       for k in ("overhead", "row_overhead", "chunk_overhead", "request_overhead"))
    fixed = sorted(set(f.fixed) - {"request"})
    note += f" ({consts}; {', '.join(fixed)} not identifiable)" if fixed else f" ({consts})"
    kept = [{"what": p.what, "step": list(p.steps[0]), "ms": p.ms, "weight": p.weight, "fitted_ms": q}
            for p, q in zip(points, f.predicted_ms)]
    return cfg.variant(overrides=cal.overrides(cfg.kv_dtype)), note, kept


def run_validate(args, json_path) -> int:
    from kvchat.engine import Engine, EngineConfig

    from ..backends.local import LocalBackend
    from .diagnose import diagnose, every_step
    from .drift import probe_ms
    from .hardware import CPU, gpu_key, measure_cpu
    from .options import plan_config
    from .trace_runner import run_trace
    if gpu_key(args) != CPU:
        raise UsageError("--validate runs the users for real on this machine: use --gpu cpu")
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    cfg = plan_config(args) if args.calibration else plan_config(args, hardware=measure_cpu())
    engine = Engine(EngineConfig(model=args.model or "smollm2-135m", dtype=cfg.dtype, kv_dtype=cfg.kv_dtype,
                                 kv_budget=cfg.pool_bytes, step_tokens=cfg.max_batched_tokens))
    local = LocalBackend(engine)
    server = None
    if args.server:
        from ..backends.vllm import VllmBackend
        server = VllmBackend(args.server)
    cal_points: list[dict] = []
    ref = None                  # the speed probe beside the calibration (none for a file's: taken when?)
    if args.calibration:
        note = f"constants from {args.calibration}"
    else:
        print("kvchat plan --validate: calibrating on a run of other users at the busiest level's rate ...", flush=True)
        cfg, note, cal_points = calibrate_on_a_run(cfg, local, engine, cfg.workload.seed + 1)
        ref = probe_ms(engine)
        note += f"; speed probe {ref:.1f} ms a step"
    print(f"kvchat plan --validate: {note}", flush=True)
    rows: list[Row] = []
    vllm: dict[str, SimResult] = {}
    records = []
    diagnoses = []
    for i, (level, rate) in enumerate(rates(cfg)):
        trace = level_trace(cfg.workload, rate)
        print(f"kvchat plan --validate: {level}: {len(trace.users)} users at {rate:.3f} turns/s, running them "
              "through kvchat's engine ...", flush=True)
        before = probe_ms(engine)
        with every_step(engine) as steps:
            run = run_trace(trace, local, salt=2 + i)          # texts no earlier run's cache holds
        after = probe_ms(engine)
        speed = (before + after) / 2 / ref if ref else None
        sim = run_plan(cfg.variant(trace=run.replayed), log_steps=True)
        rows += compare(level, run.result(), sim.result)
        diagnoses.append(diagnose(level, run, steps, sim, speed))
        if server is not None:
            vllm[level] = run_trace(trace, server, salt=2 + i).result()
        records.append({"level": level, "turns_per_s": rate, "wall_s": run.wall_s, "probe_ms": [before, after],
                        "speed": speed,
                        "errors": [m.error for m in run.measured if m.error]})
    print("\n".join(table(rows, vllm)))
    for d in diagnoses:
        print("\n".join(d.lines()))
    if server is None:
        print("the vLLM column needs --server URL (a vLLM CPU server: scripts/setup-vllm.sh)")
    if json_path is not None:
        import json
        json_path.write_text(json.dumps({"format": "kvchat-plan-validation/1", "calibration": note,
                                         "calibration_points": cal_points, "levels": records,
                                         "diagnosis": [d.to_dict() for d in diagnoses],
                                         "rows": [{"level": r.level, "metric": r.metric, "measured_ms": r.measured,
                                                   "simulated_ms": r.simulated, "error": r.error,
                                                   "vllm_measured_ms": vllm_value(r, vllm)} for r in rows]},
                                        indent=1) + "\n", encoding="utf-8")
    return 0
