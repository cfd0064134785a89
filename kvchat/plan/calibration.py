"""The calibration file: step-time constants fitted to measured runs (fitter.py), with the
hardware they were measured on, the model, each constant's source and the fit's error.

    {"format": "kvchat-plan-calibration/1", "hardware": "cpu", "model": "smollm2-135m",
     "dtype": "fp32", "source": "`kvchat bench ...` (docs/bench.json)",
     "constants": {"bandwidth": 4.9e10, "bw_efficiency": 0.64, "kv_bw_efficiency": {"fp32": 0.64,
                   "fp8": 0.2}, "flops": 1.7e11, "attn_flops": 1.1e11, "flops_efficiency": 1.0,
                   "attn_efficiency": 1.0, "overhead": 0.0063, "row_overhead": 0.0,
                   "request_overhead": 0.074, "chunk_overhead": 0.15},
     "sources": {name: "where it came from", ...}, "fit": {"mape": 0.09, "points": 24}}

FLOP/s are the fitted effective rates (their efficiencies 1); the bandwidth is the peak the
measurement took beside the steps, with the fitted efficiencies, unless the steps read the
weights faster than that peak (a busy machine's copy test can read low): then the bandwidth is
the steps' effective rate, its efficiency 1. A file without chunk_overhead (written before it
was fitted) reads as 0. `kvchat plan --calibration
FILE` applies it to plans on the same hardware (any model: the constants describe the machine
and the engine, the model's bytes and FLOPs come from its geometry).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.geometry import Geometry

from ..cli.args import UsageError
from .fitter import ATTN, CHUNK, LIN, OVERHEAD, REQUEST, ROW, WEIGHT, Fit, Point
from .step_time import Constant, ModelCosts, model_costs

CAL_FORMAT = "kvchat-plan-calibration/1"
SCALARS = ("bandwidth", "bw_efficiency", "flops", "attn_flops", "flops_efficiency", "attn_efficiency", "overhead",
           "row_overhead", "request_overhead", "chunk_overhead")
UNITS = {"bandwidth": "B/s", "flops": "FLOP/s", "attn_flops": "FLOP/s", "overhead": "s", "row_overhead": "s",
         "request_overhead": "s", "chunk_overhead": "s"}


@dataclass(frozen=True, slots=True)
class Calibration:
    hardware: str
    model: str
    dtype: str
    source: str
    constants: dict[str, float]
    kv_efficiency: dict[str, float]      # per cache dtype measured
    sources: dict[str, str]
    mape: float
    points: int

    def overrides(self, kv_dtype: str) -> dict[str, Constant]:
        out = {k: Constant(v, UNITS.get(k, ""), self.sources[k]) for k, v in self.constants.items()}
        if kv_dtype in self.kv_efficiency:
            out["kv_bw_efficiency"] = Constant(self.kv_efficiency[kv_dtype], "", self.sources["kv_bw_efficiency"])
        else:
            measured = self.dtype if self.dtype in self.kv_efficiency else next(iter(self.kv_efficiency))
            out["kv_bw_efficiency"] = Constant(self.kv_efficiency[measured], "",
                                               f"{self.sources['kv_bw_efficiency']}; measured for a {measured} "
                                               f"cache, not {kv_dtype}")
        return out

    def to_dict(self) -> dict:
        return {"format": CAL_FORMAT, "hardware": self.hardware, "model": self.model, "dtype": self.dtype,
                "source": self.source, "constants": {**self.constants, "kv_bw_efficiency": self.kv_efficiency},
                "sources": self.sources, "fit": {"mape": round(self.mape, 4), "points": self.points}}


def calibration_from_fit(f: Fit, hardware: str, model: str, dtype: str, bandwidth: float, bw_source: str,
                         source: str, points: list[Point]) -> Calibration:
    tag = f"calibrated on {len(points)} points of {source}, fit error {f.mape(points):.1%}"
    x = f.x
    if 1 / x[WEIGHT] > bandwidth:             # the steps read faster than the measured peak
        bw_source = (f"{tag}: the rate the steps read the weights at, above the {bandwidth / 1e9:,.1f} GB/s "
                     f"{bw_source}")
        bandwidth = 1 / x[WEIGHT]
    const = {"bandwidth": bandwidth, "bw_efficiency": 1 / (x[WEIGHT] * bandwidth), "flops": 1 / x[LIN],
             "attn_flops": 1 / x[ATTN], "flops_efficiency": 1.0, "attn_efficiency": 1.0, "overhead": x[OVERHEAD],
             "row_overhead": x[ROW], "request_overhead": x[REQUEST], "chunk_overhead": x[CHUNK]}
    kv = {n[3:]: 1 / (v * bandwidth) for n, v in zip(f.names, x) if n.startswith("kv:")}
    src = {k: tag for k in (*const, "kv_bw_efficiency")}
    src["bandwidth"] = bw_source
    src["flops"] = src["attn_flops"] = f"{tag}: the effective rate"
    src["flops_efficiency"] = src["attn_efficiency"] = "calibrated: folded into the fitted FLOP/s"
    names = {"row": "row_overhead", "request": "request_overhead", "lin": "flops", "attn": "attn_flops",
             "weight": "bw_efficiency", "chunk": "chunk_overhead"}
    for unknown, why in f.fixed.items():
        key = names.get(unknown)
        if key == "bw_efficiency":
            src[key] = f"{tag}; {why}"
        elif key:
            src[key] = f"not identifiable here ({why}): kept at {const[key]:.3g}"
    return Calibration(hardware, model, dtype, source, const, kv, src, f.mape(points), len(points))


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0


def load_calibration(path: str, hardware: str, geom: Geometry) -> Calibration:
    from ..store.files import FileRefused, read_text
    where = f"--calibration {path!r}"
    wrote = "expected a file `kvchat plan --calibrate BENCH.json --write-calibration FILE` wrote"
    try:
        d = json.loads(read_text(Path(path), 16 * 2**20))
    except FileRefused as err:
        raise UsageError(f"{where}: {err}; {wrote}") from None
    except (ValueError, RecursionError):
        raise UsageError(f"{where} is not valid JSON; {wrote}") from None
    if not isinstance(d, dict) or d.get("format") != CAL_FORMAT:
        raise UsageError(f"{where} is not a {CAL_FORMAT} file; {wrote}")
    if d.get("hardware") != hardware:
        raise UsageError(f"{where} was measured on {d.get('hardware')!r}, not {hardware!r}: constants hold for the "
                         "hardware they were measured on; calibrate on it, or plan for that hardware")
    consts: dict = d["constants"] if isinstance(d.get("constants"), dict) else {}
    sources: dict = d["sources"] if isinstance(d.get("sources"), dict) else {}
    kv = consts.get("kv_bw_efficiency")
    if "chunk_overhead" not in consts:                    # a file from before it was fitted
        consts = {**consts, "chunk_overhead": 0.0}
        sources = {**sources, "chunk_overhead": "not in this file (written before it was fitted): 0"}
    if set(consts) != {*SCALARS, "kv_bw_efficiency"} or not all(_number(consts[k]) for k in SCALARS) or \
            not isinstance(kv, dict) or not kv or not all(_number(v) and v > 0 for v in kv.values()):
        raise UsageError(f"{where}: \"constants\" must give {', '.join(SCALARS)} as finite numbers >= 0 and "
                         "kv_bw_efficiency as {cache dtype: number}")
    fit_: dict = d["fit"] if isinstance(d.get("fit"), dict) else {}
    note = "" if d.get("model") == geom.name else f", fitted on {d.get('model')}"
    src = {k: f"{sources.get(k, 'calibrated')} [{path}{note}]" for k in (*SCALARS, "kv_bw_efficiency")}
    mape = fit_.get("mape")
    return Calibration(hardware, str(d.get("model")), str(d.get("dtype")), str(d.get("source")),
                       {k: float(consts[k]) for k in SCALARS}, {str(k): float(v) for k, v in kv.items()}, src,
                       float(mape) if isinstance(mape, (int, float)) and _number(mape) else math.nan,
                       int(fit_.get("points", 0) or 0))


def costs_for(geom: Geometry, dtype: str, kv_dtypes: set[str], kv_scales: bool) -> dict[str, ModelCosts]:
    return {kv: model_costs(geom, dtype, kv, 1, kv_scales) for kv in kv_dtypes}
