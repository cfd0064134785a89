"""One plan: a model on some hardware with a pool, a scheduler and a workload; sized,
simulated and summarised. The CLI (command.py) and the seeds' scenario (scenario.py) build
PlanConfigs; `run_plan` turns one into a PlanResult the report prints.

The pool is what the memory leaves after the weights, as vLLM sizes it, or a size given:

    pool = tp x (utilisation x memory per GPU - weights / tp - working reserve)

and holds blocks of `block_size` tokens, each GPU holding its share of every block's KV
heads. The longest request is the smallest of the model's context, the pool (vLLM refuses
to start with a longer --max-model-len) and the cap.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvchat.engine.errors import KvchatError
from kvchat.engine.geometry import DTYPE_BYTES, KNOWN, Geometry, from_hf_config
from kvchat.engine.native_build import computes_bf16
from kvchat.engine.sizing import WORKING_MARGIN, prefill_chunk

from ..cli.args import UsageError
from .hardware import Hardware
from .metrics import pool_story, summarize
from .request import SchedulerConfig, SimResult
from .simulator import Simulator
from .step_time import Constant, ModelCosts, StepModel, default_model, model_costs
from .workload import Trace, Workload, make_trace

GPU_RESERVE = 2 * 2**30       # per GPU: activations, CUDA graphs, allocator slack (a default, not measured)
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "fp32")
KV_DTYPES = ("bf16", "fp16", "fp8", "fp32")


# ---- the model -------------------------------------------------------------------------------
GEOMETRY_KEYS = {"layers": "n_layers", "hidden": "hidden", "heads": "n_heads", "kv_heads": "n_kv_heads",
                 "head_dim": "head_dim", "intermediate": "intermediate", "vocab": "vocab_size",
                 "max_position": "max_position"}


def model_geometry(model: str | None, geometry: str | None) -> Geometry:
    """--model ALIAS|config.json|DIR, or --geometry ALIAS|layers=..,hidden=..,...; no weights read."""
    if model and geometry:
        raise UsageError("give --model or --geometry, not both")
    text = (model or geometry or "llama-3.1-8b").strip()
    if text.lower() in KNOWN:
        return KNOWN[text.lower()]
    if geometry is not None:
        return _inline_geometry(geometry)
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"--model {text!r}: not an alias ({', '.join(sorted(KNOWN))}), nor a config.json or a "
                         "directory holding one")
    from ..store.files import FileRefused, read_text
    try:
        cfg = json.loads(read_text(path, 4 * 2**20))
    except FileRefused as err:
        raise UsageError(f"--model {str(path)!r}: {err}") from None
    except (ValueError, RecursionError) as err:
        raise UsageError(f"--model {str(path)!r} is not valid JSON ({type(err).__name__}); expected a Llama "
                         "config.json") from None
    return from_hf_config(cfg, path.parent.name or "model")


def _inline_geometry(text: str) -> Geometry:
    accepted = ("--geometry takes an alias or layers=L,hidden=H,heads=N,kv_heads=K,head_dim=D,intermediate=I,"
                "vocab=V[,max_position=P]")
    values: dict[str, Any] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z_]+)\s*=\s*([0-9]+)\s*", part)
        if m is None or m.group(1) not in GEOMETRY_KEYS:
            raise UsageError(f"--geometry {text!r}: cannot read {part.strip()!r}; {accepted}")
        values[GEOMETRY_KEYS[m.group(1)]] = int(m.group(2))
    missing = [k for k, v in GEOMETRY_KEYS.items() if v not in values and k != "max_position"]
    if missing:
        raise UsageError(f"--geometry {text!r} lacks {', '.join(missing)}; {accepted}")
    try:
        return Geometry(name="custom", source="--geometry", **values)
    except KvchatError as err:
        raise UsageError(f"--geometry {text!r}: {err}") from None


# ---- the pool ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PoolPlan:
    bytes: int                 # all GPUs together
    num_blocks: int
    block_size: int
    tokens: int
    source: str


def size_pool(costs: ModelCosts, hw: Hardware, block_size: int, given: int | None, utilisation: float,
              gpus: str, max_position: int) -> PoolPlan:
    tp = costs.tp
    per_gpu_weights = costs.weight_bytes_total / tp
    reserve = WORKING_MARGIN if hw.measured else GPU_RESERVE
    if given is not None:
        if per_gpu_weights + given / tp > hw.memory_bytes:
            raise UsageError(f"impossible pool: --pool {given / 1e9:,.1f} GB and {costs.weight_bytes_total / 1e9:,.1f} "
                             f"GB of weights need {(per_gpu_weights + given / tp) / 1e9:,.1f} GB per GPU on {gpus}, "
                             f"which has {hw.memory_bytes / 1e9:,.1f} GB each; give a smaller --pool, more --tp, or "
                             "--dtype fp8")
        pool, source = given, f"given (--pool {given / 1e9:,.2f} GB)"
    elif hw.measured:
        # kvchat's engine on CPU (engine.default_budget): room for two full contexts, at most a
        # quarter of the memory available, at least 64 MiB
        pool = int(max(min(2 * max_position * costs.kv_bytes_per_token, hw.memory_bytes // 4), 64 * 2**20))
        source = "kvchat's CPU default: two full contexts, at most a quarter of the available memory"
    else:
        left = utilisation * hw.memory_bytes - per_gpu_weights - reserve
        if left <= 0:
            raise UsageError(
                f"impossible pool: {costs.weight_bytes_total / 1e9:,.1f} GB of weights over {tp} GPU(s) is "
                f"{per_gpu_weights / 1e9:,.1f} GB each, and {gpus} at --memory-utilization {utilisation:g} offers "
                f"{(utilisation * hw.memory_bytes - reserve) / 1e9:,.1f} GB each after a "
                f"{reserve / 2**30:g} GiB reserve; raise --tp, use --dtype fp8, or give --pool")
        pool = int(left * tp)
        source = (f"memory: {tp} x ({utilisation:g} x {hw.memory_bytes / 2**30:g} GiB - "
                  f"{per_gpu_weights / 1e9:,.1f} GB weights - {reserve / 2**30:g} GiB reserve (default, "
                  "not measured))")
    num_blocks = int(pool / tp // (block_size * costs.kv_bytes_per_token))
    if num_blocks < 1:
        raise UsageError(f"impossible pool: {pool:,} bytes hold no block of {block_size} tokens "
                         f"({block_size * costs.kv_bytes_per_token_total:,} bytes); give a larger --pool")
    return PoolPlan(pool, num_blocks, block_size, num_blocks * block_size, source)


# ---- one plan -----------------------------------------------------------------------------------
@dataclass(slots=True)
class PlanConfig:
    geometry: Geometry
    hardware: Hardware
    workload: Workload
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    tp: int = 1
    pool_bytes: int | None = None
    utilisation: float = 0.9
    block_size: int = 16
    max_batched_tokens: int = 8192
    max_seqs: int = 256
    prefix_caching: bool = True
    cap: int | None = None
    policy: str = "stop"
    slo: dict[str, float] = field(default_factory=dict)
    overrides: dict[str, Constant] = field(default_factory=dict)
    horizon: float | None = None
    label: str = ""
    trace: Trace | None = None        # replay this instead of drawing the workload's users

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHT_DTYPES:
            raise UsageError(f"--dtype {self.dtype!r}; accepted: {', '.join(WEIGHT_DTYPES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise UsageError(f"--kv-dtype {self.kv_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
        if not 1 <= self.tp <= 64:
            raise UsageError(f"--tp {self.tp}: accepted 1 to 64 GPUs")
        if not (math.isfinite(self.utilisation) and 0 < self.utilisation <= 1):
            raise UsageError(f"--memory-utilization {self.utilisation}: accepted a fraction in (0, 1]")
        if self.hardware.measured and self.tp > 1:
            raise UsageError("--tp: the cpu row is one device; use --tp 1")

    @property
    def gpus(self) -> str:
        return f"{self.tp} x {self.hardware.name}" if self.tp > 1 else self.hardware.name

    def variant(self, **changes) -> PlanConfig:
        return replace(self, **changes)


@dataclass(slots=True)
class PlanResult:
    config: PlanConfig
    costs: ModelCosts
    pool: PoolPlan
    model: StepModel
    sched: SchedulerConfig
    trace: Trace
    result: SimResult
    summary: dict
    others: dict | None
    long: dict | None
    story: dict
    notes: list[str]


def prepare(cfg: PlanConfig) -> tuple[ModelCosts, PoolPlan, StepModel, SchedulerConfig, list[str]]:
    g = cfg.geometry
    costs = model_costs(g, cfg.dtype, cfg.kv_dtype, cfg.tp, kv_scales=cfg.hardware.measured)
    pool = size_pool(costs, cfg.hardware, cfg.block_size, cfg.pool_bytes, cfg.utilisation, cfg.gpus, g.max_position)
    model = default_model(cfg.hardware, costs, cfg.dtype, cfg.overrides)
    notes = []
    max_len = min(g.max_position, pool.tokens)
    if pool.tokens < g.max_position:
        notes.append(f"the pool holds {pool.tokens:,} tokens, fewer than {g.name}'s {g.max_position:,}: requests are "
                     f"limited to {pool.tokens:,} (vLLM refuses to start with a longer --max-model-len)")
    if cfg.cap is not None and cfg.cap > max_len:
        raise UsageError(f"--cap {cfg.cap:,} is past the longest request this plan allows, {max_len:,} tokens "
                         f"({'the pool' if pool.tokens < g.max_position else 'the model'}); accepted: 1 to {max_len:,}")
    sched = SchedulerConfig(num_blocks=pool.num_blocks, max_len=max_len, block_size=cfg.block_size,
                            max_batched_tokens=cfg.max_batched_tokens, max_seqs=cfg.max_seqs,
                            prefix_caching=cfg.prefix_caching, cap=cfg.cap, policy=cfg.policy,
                            decode_first=cfg.hardware.measured,
                            prefill_chunk=prefill_chunk(g, cfg.dtype, "cpu", computes_bf16()) if cfg.hardware.measured
                            else None)
    return costs, pool, model, sched, notes


def run_plan(cfg: PlanConfig, log_steps: bool = False) -> PlanResult:
    """log_steps: keep every simulated step's composition (SimResult.step_log)."""
    costs, pool, model, sched, notes = prepare(cfg)
    trace = cfg.trace if cfg.trace is not None else make_trace(cfg.workload)
    res = Simulator(trace, sched, model.timer(), cfg.horizon, log_steps).run()
    start = min((u.start for u in trace.users), default=0.0)
    has_long = any(u.long for u in trace.users)
    summary = summarize(res, cfg.slo, start)
    others = summarize(res, cfg.slo, start, "others") if has_long else None
    long = summarize(res, cfg.slo, start, "long") if has_long else None
    if res.refused:
        notes.append(f"{len(res.refused)} turn(s) refused by the {cfg.policy} policy (past "
                     f"{sched.limit:,} tokens); those conversations end there")
    if res.unfinished:
        notes.append(f"stopped at the --horizon with {res.unfinished} request(s) unfinished")
    return PlanResult(cfg, costs, pool, model, sched, trace, res, summary, others, long,
                      pool_story(res, pool.num_blocks, start), notes)


def bytes_per_token_text(costs: ModelCosts, kv_dtype: str) -> str:
    return f"{costs.kv_bytes_per_token_total:,.0f} B/token ({kv_dtype})"


def weights_text(costs: ModelCosts, dtype: str) -> str:
    return f"{costs.weight_bytes_total / 1e9:,.1f} GB ({dtype}, {DTYPE_BYTES[dtype]} B/parameter)"
