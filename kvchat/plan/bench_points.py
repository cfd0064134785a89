"""Measured points for the calibration, read from `kvchat bench --json` records.

From each context of a single-conversation bench (`kvchat bench`): the decode step (median
ms per token, at the mean context of the timed steps), the first turn's prefill (its chunks,
each a step sampling one row), and the next turn's first token
after the cached history; for the fp32 (the model's) cache and the fp8 cache. The bench's
own bandwidth probe, taken in the same run, is the reference bandwidth. (The chunks are the
engine's for a lone prompt, the record's model.prefill_chunk: 2,048 tokens for the bundled
model in bf16, engine/sizing.py; 512 in records written before it was recorded.)

From a batched bench (`kvchat bench --batch 1,2,4 --json`, kind `kvchat-batch-bench`): one
decode step of B sequences per row (kv dtype, context, batch), its time the median of the
row's decode-only steps, the cached tokens it read the row's own mean. Steps of more than
one sequence are what let the fit separate the per-sequence overhead from the per-step one;
they hold no prefill, so the matrix products' rate and the request overhead come from a
single bench given beside it: `--calibrate docs/bench.json,batch.json` fits both at once.

Records of a GPU run calibrate that GPU's table row, named with --gpu (checked against the GPU's
name the record keeps): `kvchat plan --calibrate docs/gpu_batch.json,docs/gpu_bench.json --gpu
h200-sxm`. A new turn's few tokens run there as decode-graph rows, not the prefill chunk the
fit models, so its next-turn points fit loosely.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.geometry import KNOWN, Geometry
from kvchat.engine.sizing import CPU_PREFILL_CHUNK

from ..cli.args import UsageError
from .fitter import Point, StepRow


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
        out.append((n, 1, 1, float(p), n * p + n * (n + 1) / 2, 1))
        done += n
    return tuple(out)


def _median(d: dict, key: str) -> float | None:
    v = (d.get(key) or {}).get("median")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


BENCH_KINDS = "a `kvchat bench --json` or `kvchat bench --batch 1,2,4 --json` record"


def _read(path: str, gpu: str | None = None) -> dict:
    from ..store.files import FileRefused, read_text
    where = f"--calibrate {path!r}"
    try:
        d = json.loads(read_text(Path(path), 64 * 2**20))
    except FileRefused as err:
        raise UsageError(f"{where}: {err}; expected {BENCH_KINDS}") from None
    except (ValueError, RecursionError):
        raise UsageError(f"{where} is not valid JSON; expected {BENCH_KINDS}") from None
    batch = isinstance(d, dict) and d.get("kind") == "kvchat-batch-bench"
    model = d.get("model") if isinstance(d, dict) else None
    if not isinstance(model, dict) or not isinstance(d.get("rows" if batch else "contexts"), (list if batch else dict)):
        raise UsageError(f"{where}: not {BENCH_KINDS} (it needs \"model\" and \"contexts\", or "
                         "\"kind\": \"kvchat-batch-bench\" and \"rows\")")
    device = str(model.get("device"))
    if device != "cpu":
        check_gpu(where, device, (d.get("machine") or {}).get("gpu"), gpu)
    return d


def check_gpu(where: str, device: str, recorded: object, gpu: str | None) -> str:
    """The table key of the GPU a CUDA record was measured on: --gpu, which must be given (the
    constants hold for the hardware they were measured on), be a row of the table, and agree
    with the GPU's name where the record keeps it ("NVIDIA H200" for h200-sxm)."""
    from .hardware import TABLE, find
    named = f" ({recorded})" if isinstance(recorded, str) else ""
    if not device.startswith("cuda"):
        raise UsageError(f"{where}: measured on {device!r}; accepted: cpu or cuda records")
    if not gpu or gpu.strip().lower() == "cpu":
        raise UsageError(f"{where}: measured on a GPU{named}; say which with --gpu (a row of kvchat plan "
                         "--list-gpus, e.g. --gpu h200-sxm)")
    hw = find(gpu)
    family = hw.key.split("-")[0]
    if isinstance(recorded, str) and family not in recorded.lower().replace(" ", ""):
        raise UsageError(f"{where}: measured on {recorded}, not on {hw.name} (--gpu {gpu}); give the --gpu of "
                         f"the GPU it ran on ({', '.join(k for k in TABLE if k.split('-')[0] in recorded.lower())})")
    return hw.key


def single_points(d: dict, where: str) -> tuple[list[Point], float]:
    """A single-conversation bench's points, and its probe's bandwidth (B/s)."""
    try:
        bw = float(d["floor"]["bandwidth"]["gb_s"]) * 1e9
        new_tokens = int(d["new_tokens"])
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{where}: lacks the bench's bandwidth probe (floor.bandwidth.gb_s) or new_tokens") from None
    kv_model = str(d["model"].get("kv_dtype"))
    chunk = d["model"].get("prefill_chunk", CPU_PREFILL_CHUNK)
    if not isinstance(chunk, int) or chunk < 1:
        raise UsageError(f"{where}: model.prefill_chunk is {chunk!r}, not a positive number of tokens")
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
                points.append(Point(f"{series} prefill of {prompt}", kv, prefill_steps(prompt, 0, chunk), pre, requests=1))
            nxt, ttft = s.get("next_turn") or {}, _median(s, "ttft_reuse_ms")
            if ttft is not None and nxt.get("computed_tokens") and nxt.get("reused_tokens") is not None:
                points.append(Point(f"{series} next turn after {ctx}", kv,
                                    prefill_steps(int(nxt["computed_tokens"]), int(nxt["reused_tokens"]), chunk), ttft,
                                    requests=1))
    return points, bw


def batch_points(d: dict, where: str) -> tuple[list[Point], float]:
    """A batched bench's points, one decode step of B sequences per row, and its probe's
    bandwidth (B/s). A row's step: B tokens, B rows sampled, B sequences, the cached tokens
    its steps read (context_tokens_per_step, every user together; else B x the context), and
    that plus B attention pairs (each new token also attends to itself)."""
    try:
        bw = float(d["bandwidth"]["gb_s"]) * 1e9
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{where}: lacks the batched bench's bandwidth probe (bandwidth.gb_s)") from None
    points: list[Point] = []
    for r in d["rows"]:
        try:
            n, ctx, kv = int(r["batch"]), int(r["context"]), str(r["kv_dtype"])
            ms = float(r["step_ms"]["median"])
        except (KeyError, TypeError, ValueError):
            continue                  # a row without its steps (every step had a prompt chunk in it)
        read = r.get("context_tokens_per_step")
        cached = float(read) if isinstance(read, (int, float)) and read > 0 else float(n * ctx)
        if n > 0 and ms > 0:
            points.append(Point(f"batch {n} at {ctx} ({kv})", kv, ((n, n, n, cached, cached + n),), ms))
    return points, bw


def from_bench_json(paths: str, gpu: str | None = None) -> Measurements:
    """`paths`: one bench record, or several separated by commas (the same model and dtype),
    their points fitted together; the first record's bandwidth probe is the reference. Records
    of a CUDA run need `gpu`, the table key of the GPU they ran on (the calibration's hardware)."""
    names = [p.strip() for p in paths.split(",") if p.strip()]
    if not names:
        raise UsageError(f"--calibrate {paths!r}: give {BENCH_KINDS}, or several separated by commas")
    points: list[Point] = []
    models: list[tuple[str, str]] = []
    cmds: list[str] = []
    bws: list[float] = []
    devices: set[str] = set()
    for path in names:
        where = f"--calibrate {path!r}"
        d = _read(path, gpu)
        devices.add("cpu" if d["model"].get("device") == "cpu" else "cuda")
        batch = d.get("kind") == "kvchat-batch-bench"
        got, bw = batch_points(d, where) if batch else single_points(d, where)
        points += got
        bws.append(bw)
        models.append((str(d["model"].get("model")), str(d["model"].get("dtype"))))
        cmds.append(f"`{d.get('command', 'kvchat bench --batch' if batch else 'kvchat bench')}` ({path})")
    where = f"--calibrate {paths!r}"
    if len(set(models)) > 1:
        raise UsageError(f"{where}: the records measured different models or dtypes "
                         f"({', '.join(f'{m} {t}' for m, t in models)}); calibrate on one model's runs")
    if len(points) < 3:
        raise UsageError(f"{where}: found {len(points)} measured points; a calibration needs at least 3")
    name, dtype = models[0]
    if name not in KNOWN:
        raise UsageError(f"{where}: the measured model {name!r} is not in kvchat's table ({', '.join(sorted(KNOWN))}); "
                         "its geometry is needed to know what each step read")
    from .hardware import find
    if len(devices) > 1:
        raise UsageError(f"{where}: the records were measured on a CPU and on a GPU; calibrate on one machine's runs")
    hardware = "cpu" if devices == {"cpu"} else find(str(gpu)).key     # given and checked by _read
    bw = bws[0]
    others = "" if len(bws) == 1 else "; the others' probes: " + ", ".join(f"{b / 1e9:.1f}" for b in bws[1:]) + " GB/s"
    return Measurements(KNOWN[name], dtype, hardware, bw,
                        f"measured: the bench's own probe in the same run ({bw / 1e9:.1f} GB/s, {names[0]}{others})",
                        " and ".join(cmds), points, kv_scales=True)
