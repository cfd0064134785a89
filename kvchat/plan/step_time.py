"""How long one scheduler step takes: a roofline over the step's bytes and FLOPs.

A step runs one forward over every token the scheduler gave it (one row per decoding
sequence, a chunk per prefilling one). Per GPU of a tensor-parallel group:

    t = overhead + rows x row overhead + [a prompt chunk in the step] x chunk overhead
        + max(weight bytes / (B x e_w),  linear FLOPs / (F x e_f))       the matrix products
        + max(KV bytes / (B x e_kv),     attention FLOPs / (F_a x e_a))   attention over the caches
        + 2 x layers x (all-reduce latency + 2 (tp-1)/tp x activation bytes / link)     (tp > 1)

weight bytes: every layer's weights and the output head, read once for the whole step (the
embedding table is only looked up); linear FLOPs: 2 x layer parameters per token, plus the
head for each row that samples a token; KV bytes: each sequence's whole cache read once and
the new tokens' K/V written; attention FLOPs: 4 x heads x head_dim x layers per (query, key)
pair. B, F and F_a are the hardware's bandwidth and dense FLOP/s; the e's the fractions of them
reached. The chunk overhead is the cost of the other path a step with a prompt chunk takes:
kvchat's engine runs a step of decode rows alone as one C call on a CPU (a CUDA graph on a
GPU), a step with a chunk layer by layer in torch, eagerly; on this CPU that path cost 170-280
ms more per step, for the bundled model, than its bytes and FLOPs say (--validate's
calibrations). A request also waits `request overhead` before the scheduler sees it (a
server's HTTP and tokenisation; kvchat's rendering of the chat). Every constant carries where it came from: the spec sheet, a calibration file,
a flag, or a default named as one.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.geometry import DTYPE_BYTES, Geometry

from ..cli.args import UsageError
from .hardware import Hardware

ACTIVATION_BYTES = 2      # bf16 activations cross the all-reduce

# The defaults, used only where nothing was calibrated or given; printed as defaults.
DEFAULT_BW_EFF = 0.8
DEFAULT_FLOPS_EFF = 0.45
DEFAULT_OVERHEAD_MS = 1.0
DEFAULT_ALLREDUCE_US = 10.0
DEFAULT_SOURCE = "default, not calibrated"


@dataclass(frozen=True, slots=True)
class Constant:
    value: float
    unit: str
    source: str

    def text(self) -> str:
        v = self.value
        if self.unit == "B/s":
            return f"{v / 1e9:,.1f} GB/s"
        if self.unit == "FLOP/s":
            return f"{v / 1e12:,.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:,.1f} GFLOP/s"
        if self.unit == "s":
            return f"{v * 1e3:,.3f} ms" if v >= 1e-4 else f"{v * 1e6:,.1f} us"
        return f"{v:.3g}"


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """What one token, one row, one (query, key) pair costs a step, per GPU."""
    weight_bytes: float            # read once per step
    weight_bytes_total: float      # held in memory, all GPUs together
    linear_flops_per_token: float
    head_flops_per_row: float      # the output head, for each row that samples a token
    kv_bytes_per_token: float      # per GPU: its share of the KV heads (x scales for kvchat's fp8)
    kv_bytes_per_token_total: float
    attn_flops_per_pair: float
    allreduce_bytes_per_token: float
    layers: int
    tp: int


def model_costs(geom: Geometry, dtype: str, kv_dtype: str, tp: int, kv_scales: bool) -> ModelCosts:
    """kv_scales: kvchat's fp8 pool keeps an fp32 scale per token, layer, K/V and KV head;
    vLLM's fp8 cache keeps one scale per tensor (nothing per token)."""
    if geom.n_heads % tp:
        raise UsageError(f"--tp {tp}: {geom.name}'s {geom.n_heads} query heads do not split evenly over {tp} GPUs; "
                         f"accepted: a divisor of {geom.n_heads}")
    vh = geom.vocab_size * geom.hidden
    params = geom.param_count()
    layer_params = params - vh - (0 if geom.tie_embeddings else vh)
    wb = DTYPE_BYTES[dtype]
    head_bytes = vh * (2 if dtype == "fp8" else wb)     # fp8 checkpoints keep the embedding and head in bf16
    read = layer_params * wb + head_bytes
    held = read + (0 if geom.tie_embeddings else vh * (2 if dtype == "fp8" else wb))
    kv_heads = max(1, geom.n_kv_heads // tp) if geom.n_kv_heads >= tp else 1   # replicated past n_kv_heads
    per_gpu = 2 * geom.n_layers * kv_heads * geom.head_dim * DTYPE_BYTES[kv_dtype]
    if kv_dtype == "fp8" and kv_scales:
        per_gpu += 2 * geom.n_layers * kv_heads * 4
    return ModelCosts(
        weight_bytes=read / tp, weight_bytes_total=held,
        linear_flops_per_token=2 * layer_params / tp, head_flops_per_row=2 * vh / tp,
        kv_bytes_per_token=per_gpu, kv_bytes_per_token_total=per_gpu * tp,
        attn_flops_per_pair=4 * geom.n_heads * geom.head_dim * geom.n_layers / tp,
        allreduce_bytes_per_token=geom.hidden * ACTIVATION_BYTES, layers=geom.n_layers, tp=tp)


@dataclass(frozen=True, slots=True)
class StepModel:
    costs: ModelCosts
    bandwidth: Constant
    flops: Constant
    attn_flops: Constant
    bw_efficiency: Constant
    kv_bw_efficiency: Constant
    flops_efficiency: Constant
    attn_efficiency: Constant
    overhead: Constant
    row_overhead: Constant
    request_overhead: Constant
    allreduce_latency: Constant
    link_bandwidth: Constant | None
    chunk_overhead: Constant = Constant(0.0, "s", DEFAULT_SOURCE)

    def __post_init__(self) -> None:
        for name in ("bw_efficiency", "kv_bw_efficiency", "flops_efficiency", "attn_efficiency"):
            v = getattr(self, name).value
            if not 0 < v <= 1.5:
                raise UsageError(f"step-time constant {name} = {v}: an efficiency must be in (0, 1.5]")
        for name in ("bandwidth", "flops", "attn_flops"):
            if not getattr(self, name).value > 0:
                raise UsageError(f"step-time constant {name} must be positive, got {getattr(self, name).value}")
        for name in ("overhead", "row_overhead", "request_overhead", "allreduce_latency", "chunk_overhead"):
            if not 0 <= getattr(self, name).value < 60:
                raise UsageError(f"step-time constant {name} = {getattr(self, name).value}: seconds must be in [0, 60)")
        if self.costs.tp > 1 and self.link_bandwidth is None:
            raise UsageError(f"--tp {self.costs.tp}: this hardware has no link between devices; use --tp 1")

    def timer(self) -> StepTimer:
        return StepTimer(self)

    def constants(self) -> list[tuple[str, Constant]]:
        rows = [("bandwidth", self.bandwidth), ("dense FLOP/s, matrix products", self.flops),
                ("dense FLOP/s, attention", self.attn_flops), ("bandwidth efficiency, weights", self.bw_efficiency),
                ("bandwidth efficiency, KV cache", self.kv_bw_efficiency),
                ("FLOP/s efficiency, matrix products", self.flops_efficiency),
                ("FLOP/s efficiency, attention", self.attn_efficiency), ("overhead per step", self.overhead),
                ("overhead per sequence in a step", self.row_overhead),
                ("overhead per step with a prompt chunk", self.chunk_overhead),
                ("overhead per request (before it)", self.request_overhead)]
        if self.costs.tp > 1:
            rows += [("all-reduce latency", self.allreduce_latency),
                     ("link bandwidth, one way", self.link_bandwidth)]      # type: ignore[list-item]
        return rows


CONSTANT_NAMES = ("bandwidth", "flops", "attn_flops", "bw_efficiency", "kv_bw_efficiency", "flops_efficiency",
                  "attn_efficiency", "overhead", "row_overhead", "request_overhead", "allreduce_latency",
                  "link_bandwidth", "chunk_overhead")


def default_model(hw: Hardware, costs: ModelCosts, weight_dtype: str, overrides: dict[str, Constant]) -> StepModel:
    """The hardware's sheet figures, with defaults for what a sheet cannot say; `overrides`
    (a calibration file, then flags) replace any of them by name."""
    sheet = ("measured" if hw.measured else "spec sheet") + f": {hw.source}"
    fp8 = weight_dtype == "fp8" and hw.fp8_flops
    c = {
        "bandwidth": Constant(hw.bandwidth, "B/s", sheet),
        "flops": Constant(hw.flops(weight_dtype), "FLOP/s", sheet + (" (FP8)" if fp8 else " (BF16)")),
        "attn_flops": Constant(hw.bf16_flops, "FLOP/s", sheet + " (BF16: attention runs in bf16)"),
        "bw_efficiency": Constant(DEFAULT_BW_EFF, "", f"{DEFAULT_SOURCE} (inference-sim issue 415 measured 0.82 "
                                                         "on H100; InferSim uses 0.80)"),
        "kv_bw_efficiency": Constant(DEFAULT_BW_EFF, "", f"{DEFAULT_SOURCE} (the weights' figure)"),
        "flops_efficiency": Constant(DEFAULT_FLOPS_EFF, "", f"{DEFAULT_SOURCE} (inference-sim's prefill MFU for "
                                                            "H100)"),
        "attn_efficiency": Constant(DEFAULT_FLOPS_EFF, "", f"{DEFAULT_SOURCE} (the matrix products' figure)"),
        "overhead": Constant(DEFAULT_OVERHEAD_MS / 1e3, "s", DEFAULT_SOURCE),
        "row_overhead": Constant(0.0, "s", DEFAULT_SOURCE),
        "request_overhead": Constant(0.0, "s", f"{DEFAULT_SOURCE}: the server's HTTP and tokenisation time is left "
                                               "out"),
        "allreduce_latency": Constant(DEFAULT_ALLREDUCE_US / 1e6, "s", DEFAULT_SOURCE),
        "link_bandwidth": Constant(hw.link_bandwidth, "B/s", sheet) if hw.link_bandwidth else None,
        "chunk_overhead": Constant(0.0, "s", DEFAULT_SOURCE),
    }
    for name, const in overrides.items():
        if name not in c:
            raise UsageError(f"unknown step-time constant {name!r}; accepted: {', '.join(c)}")
        c[name] = const
    return StepModel(costs, **c)   # type: ignore[arg-type]


class StepTimer:
    """A StepModel's per-unit seconds, computed once: `seconds` runs for every simulated step."""
    __slots__ = ("_w", "_lin", "_head", "_kv", "_att", "_overhead", "_row", "_chunk", "_ar_fixed", "_ar_tok",
                 "request")

    def __init__(self, m: StepModel) -> None:
        c, bw = m.costs, m.bandwidth.value
        f = m.flops.value * m.flops_efficiency.value
        self._w = c.weight_bytes / (bw * m.bw_efficiency.value)
        self._lin = c.linear_flops_per_token / f
        self._head = c.head_flops_per_row / f
        self._kv = c.kv_bytes_per_token / (bw * m.kv_bw_efficiency.value)
        self._att = c.attn_flops_per_pair / (m.attn_flops.value * m.attn_efficiency.value)
        self._overhead, self._row, self._chunk = m.overhead.value, m.row_overhead.value, m.chunk_overhead.value
        self.request = m.request_overhead.value
        self._ar_fixed = self._ar_tok = 0.0
        if c.tp > 1 and m.link_bandwidth is not None:
            self._ar_fixed = 2 * c.layers * m.allreduce_latency.value
            self._ar_tok = 2 * c.layers * 2 * (c.tp - 1) / c.tp * c.allreduce_bytes_per_token / m.link_bandwidth.value

    def seconds(self, tokens: int, logit_rows: int, rows: int, kv_read: float, pairs: float, chunks: int = 0) -> float:
        """One step: `tokens` computed in all, `logit_rows` of them sampling a token, `rows`
        sequences, `kv_read` cached tokens read, `pairs` (query, key) pairs attended, `chunks`
        of the rows prompt chunks (not decode rows)."""
        lin = tokens * self._lin + logit_rows * self._head
        w = self._w
        kv = (kv_read + tokens) * self._kv
        att = pairs * self._att
        return (self._overhead + rows * self._row + (self._chunk if chunks else 0.0) + (w if w > lin else lin)
                + (kv if kv > att else att) + self._ar_fixed + tokens * self._ar_tok)
