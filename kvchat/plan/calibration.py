"""Step-time constants fitted to measured steps, and the file that carries them.

A measured point is one or more steps of known composition (tokens, rows sampling a token,
sequences, cached tokens read, attention pairs) and the time they took in all: one decode
step at some context, a prefill of several chunks, a turn's first token after a cached
history. The step-time model (step_time.py) is linear in its unknowns once each step's
roofline branch (memory- or compute-bound) is fixed, so the fit alternates: pick the
branches with the current constants, solve the weighted least squares (relative error) for
the overhead, the per-sequence overhead, the seconds per weight byte and per cache byte, and
the seconds per FLOP; repeat until the branches settle; start from several FLOP rates and
keep the best. What the points cannot tell apart is said and left at its default: weights
and cache share one bandwidth efficiency when every point ran the same weights (their bytes
move in step with the fixed overhead); the per-sequence overhead needs steps of more than one
sequence.

The file (kvchat-plan-calibration/1, JSON) holds the hardware it was measured on, the model,
the constants with their sources, the points and the fit's error; `kvchat plan --calibration
FILE` uses it for plans on that hardware.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.geometry import KNOWN, Geometry

from ..cli.args import UsageError
from .step_time import Constant, ModelCosts, model_costs

CAL_FORMAT = "kvchat-plan-calibration/1"
StepRow = tuple[int, int, int, float, float]       # tokens, logit rows, sequences, cached tokens read, pairs


@dataclass(frozen=True, slots=True)
class Point:
    what: str
    kv_dtype: str
    steps: tuple[StepRow, ...]
    ms: float


@dataclass(frozen=True, slots=True)
class Fit:
    overhead_s: float
    row_s: float
    s_per_weight_byte: float
    s_per_kv_byte: float
    s_per_flop: float
    fixed: dict[str, str]            # constant -> why the points could not fit it
    predicted_ms: tuple[float, ...]

    def mape(self, points: list[Point]) -> float:
        return sum(abs(p - q.ms) / q.ms for p, q in zip(self.predicted_ms, points)) / len(points)


def _regressors(step: StepRow, c: ModelCosts, x: list[float]) -> list[float]:
    """The step's coefficients on [overhead, per sequence, s/weight byte, s/KV byte, s/FLOP]
    with each roofline branch chosen by the current x."""
    tokens, logit_rows, rows, kv, pairs = step
    wb = c.weight_bytes
    lf = c.linear_flops_per_token * tokens + c.head_flops_per_row * logit_rows
    kb = (kv + tokens) * c.kv_bytes_per_token
    af = pairs * c.attn_flops_per_pair
    w_mem, kv_mem = x[2] * wb >= x[4] * lf, x[3] * kb >= x[4] * af
    return [1.0, float(rows), wb if w_mem else 0.0, kb if kv_mem else 0.0, (0.0 if w_mem else lf) + (0.0 if kv_mem else af)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit(points: list[Point], costs: dict[str, ModelCosts], prior: list[float]) -> Fit:
    """prior: [overhead s, s per row, s per weight byte, s per KV byte, s per FLOP], kept for
    whatever the points cannot identify."""
    if len(points) < 3:
        raise UsageError(f"a calibration needs at least 3 measured points, got {len(points)}")
    one_row = all(s[2] == 1 for p in points for s in p.steps)
    fixed = {}
    if one_row:
        fixed["row_overhead"] = "every measured step held one sequence"
    tie = len({costs[p.kv_dtype].weight_bytes for p in points}) == 1
    best: tuple[float, list[float]] | None = None
    for start in (1e-9, 1e-10, 1e-11, 1e-12, 1e-13, 1e-14, 1e-15):
        x = list(prior)
        x[4] = start
        for _ in range(30):
            new = _step_fit(points, costs, x, one_row, tie)
            if new is None or new == x:
                break
            x = new
        err = sum(((_predict(p, costs, x) - p.ms / 1000) * 1000 / p.ms) ** 2 for p in points)
        if best is None or err < best[0]:
            best = (err, x)
    x = best[1]                                              # type: ignore[index]
    if not any(_regressors(s, costs[p.kv_dtype], x)[4] for p in points for s in p.steps):
        x[4] = prior[4]
        fixed["flops_efficiency"] = "no measured step was compute-bound"
    if tie:
        fixed["bw_efficiency (weights)"] = "every point ran the same weights: the weights share the cache's efficiency"
    return Fit(x[0], x[1], x[2], x[3], x[4], fixed, tuple(_predict(p, costs, x) * 1000 for p in points))


def _predict(p: Point, costs: dict[str, ModelCosts], x: list[float]) -> float:
    c = costs[p.kv_dtype]
    return sum(sum(r * v for r, v in zip(_regressors(s, c, x), x)) for s in p.steps)


def _step_fit(points: list[Point], costs: dict[str, ModelCosts], x: list[float], one_row: bool,
              tie: bool) -> list[float] | None:
    free = [0, 2, 3, 4] if one_row else [0, 1, 2, 3, 4]
    rows, ys = [], []
    for p in points:
        phi = [0.0] * 5
        for s in p.steps:
            for i, v in enumerate(_regressors(s, costs[p.kv_dtype], x)):
                phi[i] += v
        if tie:
            phi[3] += phi[2]
            phi[2] = 0.0
        y = p.ms / 1000 - sum(phi[i] * x[i] for i in range(5) if i not in free)
        rows.append([phi[i] / (p.ms / 1000) for i in free])
        ys.append(y / (p.ms / 1000))
    cols = [j for j in range(len(free)) if any(abs(r[j]) > 0 for r in rows)]
    if tie and free.index(2) in cols:
        cols.remove(free.index(2))
    a = [[sum(r[i] * r[j] for r in rows) for j in cols] for i in cols]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in cols]
    sol = _solve(a, b)
    if sol is None:
        return None
    out = list(x)
    for j, v in zip(cols, sol):
        out[free[j]] = v
    if tie:
        out[2] = out[3]
    out[0], out[1] = max(out[0], 0.0), max(out[1], 0.0)
    if min(out[2], out[3], out[4]) <= 0:
        return None
    return out


# ---- the file ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Calibration:
    hardware: str
    model: str
    dtype: str
    source: str
    constants: dict[str, float]
    sources: dict[str, str]
    mape: float
    points: int

    def overrides(self) -> dict[str, Constant]:
        units = {"bandwidth": "B/s", "flops": "FLOP/s", "attn_flops": "FLOP/s", "overhead": "s", "row_overhead": "s"}
        return {k: Constant(v, units.get(k, ""), self.sources[k]) for k, v in self.constants.items()}

    def to_dict(self) -> dict:
        return {"format": CAL_FORMAT, "hardware": self.hardware, "model": self.model, "dtype": self.dtype,
                "source": self.source, "constants": self.constants, "sources": self.sources,
                "fit": {"mape": round(self.mape, 4), "points": self.points}}


def calibration_from_fit(f: Fit, hardware: str, model: str, dtype: str, bandwidth: float, bw_source: str,
                         source: str, points: list[Point]) -> Calibration:
    tag = f"calibrated on {len(points)} points of {source} (fit error {f.mape(points):.1%})"
    const = {"bandwidth": bandwidth, "bw_efficiency": 1 / (f.s_per_weight_byte * bandwidth),
             "kv_bw_efficiency": 1 / (f.s_per_kv_byte * bandwidth), "flops": 1 / f.s_per_flop,
             "attn_flops": 1 / f.s_per_flop, "flops_efficiency": 1.0, "overhead": f.overhead_s,
             "row_overhead": f.row_s}
    src = {k: tag for k in const}
    src["bandwidth"] = bw_source
    src["flops"] = src["attn_flops"] = f"{tag}: the effective rate"
    src["flops_efficiency"] = "calibrated: folded into the fitted FLOP/s"
    for name, why in f.fixed.items():
        key = {"row_overhead": "row_overhead", "flops_efficiency": "flops"}.get(name)
        if key:
            src[key] = f"not identifiable ({why}): {'0' if key == 'row_overhead' else 'default'}"
            if key == "flops":
                src["attn_flops"] = src["flops"]
        else:
            src["bw_efficiency"] = f"{tag}; {why}"
    return Calibration(hardware, model, dtype, source, const, src, f.mape(points), len(points))


def load_calibration(path: str, hardware: str, geom: Geometry) -> Calibration:
    from ..store.files import FileRefused, read_text
    where = f"--calibration {path!r}"
    try:
        d = json.loads(read_text(Path(path), 16 * 2**20))
    except FileRefused as err:
        raise UsageError(f"{where}: {err}; expected a file --calibrate --write-calibration wrote") from None
    except (ValueError, RecursionError):
        raise UsageError(f"{where} is not valid JSON; expected a file --calibrate --write-calibration wrote") from None
    if not isinstance(d, dict) or d.get("format") != CAL_FORMAT:
        raise UsageError(f"{where} is not a {CAL_FORMAT} file; --calibrate BENCH.json --write-calibration FILE "
                         "writes one")
    if d.get("hardware") != hardware:
        raise UsageError(f"{where} was measured on {d.get('hardware')!r}, not {hardware!r}: constants hold for the "
                         "hardware they were measured on; calibrate on it, or plan for that hardware")
    consts, sources = d.get("constants"), d.get("sources")
    names = ("bandwidth", "bw_efficiency", "kv_bw_efficiency", "flops", "attn_flops", "flops_efficiency",
             "overhead", "row_overhead")
    if not isinstance(consts, dict) or not isinstance(sources, dict) or set(consts) != set(names) or \
            any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                for v in consts.values()):
        raise UsageError(f"{where}: \"constants\" must give {', '.join(names)} as finite numbers >= 0")
    fit_ = d.get("fit") or {}
    note = "" if d.get("model") == geom.name else f", fitted on {d.get('model')}"
    src = {k: f"{sources.get(k, 'calibrated')} [{path}{note}]" for k in names}
    return Calibration(d["hardware"], str(d.get("model")), str(d.get("dtype")), str(d.get("source")),
                       {k: float(consts[k]) for k in names}, src, float(fit_.get("mape", math.nan)),
                       int(fit_.get("points", 0)))


def model_of(name: str) -> Geometry:
    if name not in KNOWN:
        raise UsageError(f"the measured model {name!r} is not in kvchat's table ({', '.join(sorted(KNOWN))}); "
                         "its geometry is needed to know what each step read")
    return KNOWN[name]


def costs_for(geom: Geometry, dtype: str, kv_dtypes: set[str], kv_scales: bool) -> dict[str, ModelCosts]:
    return {kv: model_costs(geom, dtype, kv, 1, kv_scales) for kv in kv_dtypes}
