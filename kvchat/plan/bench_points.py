"""Measured points for the calibration, read from a `kvchat bench --json` record.

From each context of a single-conversation bench (today's `kvchat bench`): the decode step
(median ms per token, at the mean context of the timed steps), the first turn's prefill (its
chunks of 512 tokens on the CPU, each a step sampling one row), and the next turn's first
token after the cached history; for the fp32 (the model's) cache and the fp8 cache. The
bench's own bandwidth probe, taken in the same run, is the reference bandwidth.

The batched bench (`kvchat bench --batch --json`, the batching issue) adds steps of B
sequences; its rows are read where present (`batch` entries with B, context, kv dtype and
step ms), which is what lets the fit separate the per-sequence overhead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.geometry import KNOWN, Geometry

from ..cli.args import UsageError
from .fitter import Point, StepRow

CPU_PREFILL_CHUNK = 512      # engine/conversation.py: the CPU prefills in chunks of this many tokens


@dataclass(frozen=True, slots=True)
class Measurements:
    """Measured points and what they were measured on: the model's geometry and dtypes, the
    hardware (a table key, or cpu), the peak bandwidth measured beside them, and whether the
    cache keeps kvchat's per-token fp8 scales (kvchat's engine) or not (vLLM)."""
    geometry: Geometry
    dtype: str
    hardware: str
    bandwidth: float
    bandwidth_source: str
    source: str
    points: list[Point]
    kv_scales: bool

    @property
    def model(self) -> str:
        return self.geometry.name


def prefill_steps(computed: int, cached: int, chunk: int = CPU_PREFILL_CHUNK) -> tuple[StepRow, ...]:
    """The steps of a prefill of `computed` tokens after `cached` ones, in chunks."""
    out = []
    done = 0
    while done < computed:
        n = min(chunk, computed - done)
        p = cached + done
        out.append((n, 1, 1, float(p), n * p + n * (n + 1) / 2))
        done += n
    return tuple(out)


def _median(d: dict, key: str) -> float | None:
    v = (d.get(key) or {}).get("median")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def from_bench_json(path: str) -> Measurements:
    from ..store.files import FileRefused, read_text
    where = f"--calibrate {path!r}"
    try:
        d = json.loads(read_text(Path(path), 64 * 2**20))
    except FileRefused as err:
        raise UsageError(f"{where}: {err}; expected a `kvchat bench --json` record") from None
    except (ValueError, RecursionError):
        raise UsageError(f"{where} is not valid JSON; expected a `kvchat bench --json` record") from None
    model = d.get("model") if isinstance(d, dict) else None
    if not isinstance(model, dict) or not isinstance(d.get("contexts"), dict):
        raise UsageError(f"{where}: not a `kvchat bench --json` record (it needs \"model\" and \"contexts\")")
    if model.get("device") != "cpu":
        raise UsageError(f"{where}: measured on {model.get('device')!r}; calibration reads CPU bench records "
                         "(a GPU's comes from its own run: say which GPU it was)")
    try:
        bw = float(d["floor"]["bandwidth"]["gb_s"]) * 1e9
        new_tokens = int(d["new_tokens"])
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{where}: lacks the bench's bandwidth probe (floor.bandwidth.gb_s) or new_tokens") from None
    kv_model = str(model.get("kv_dtype"))
    points: list[Point] = []
    for ctx, row in sorted(d["contexts"].items(), key=lambda kv: int(kv[0])):
        if not isinstance(row, dict):
            continue
        for series, kv in (("kvchat", kv_model), ("kvchat_fp8", "fp8")):
            s = row.get(series)
            if not isinstance(s, dict):
                continue
            prompt = s.get("prefill_tokens")
            if not isinstance(prompt, int) or prompt <= 0:
                continue
            dec = _median(s, "decode_ms")
            if dec is not None:
                mean_ctx = prompt + new_tokens / 2
                points.append(Point(f"{series} decode at {ctx}", kv, ((1, 1, 1, mean_ctx, mean_ctx + 1),), dec))
            pre = _median(s, "prefill_ms")
            if pre is not None:
                points.append(Point(f"{series} prefill of {prompt}", kv, prefill_steps(prompt, 0), pre, requests=1))
            nxt, ttft = s.get("next_turn") or {}, _median(s, "ttft_reuse_ms")
            if ttft is not None and nxt.get("computed_tokens") and nxt.get("reused_tokens") is not None:
                points.append(Point(f"{series} next turn after {ctx}", kv,
                                    prefill_steps(int(nxt["computed_tokens"]), int(nxt["reused_tokens"])), ttft,
                                    requests=1))
    for b in d.get("batch") or []:        # the batched bench, where present
        try:
            n, ctx, kv, ms = int(b["batch"]), int(b["context"]), str(b["kv_dtype"]), float(b["step_ms"])
        except (KeyError, TypeError, ValueError):
            continue
        points.append(Point(f"batch {n} at {ctx} ({kv})", kv, ((n, n, n, float(n * ctx), float(n * (ctx + 1))),), ms))
    if len(points) < 3:
        raise UsageError(f"{where}: found {len(points)} measured points; a calibration needs at least 3")
    cmd = d.get("command", "kvchat bench")
    name = str(model.get("model"))
    if name not in KNOWN:
        raise UsageError(f"{where}: the measured model {name!r} is not in kvchat's table ({', '.join(sorted(KNOWN))}); "
                         "its geometry is needed to know what each step read")
    return Measurements(KNOWN[name], str(model.get("dtype")), "cpu", bw,
                        f"measured: the bench's own probe in the same run ({bw / 1e9:.1f} GB/s, {path})",
                        f"`{cmd}` ({path})", points, kv_scales=True)
