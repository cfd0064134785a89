"""A vLLM server's Prometheus `/metrics`, read into one immutable record for the panels.

The text is parsed by prometheus_client's own parser; this file only picks the figures by
name. Names are those of vLLM 0.32 (`vllm:kv_cache_usage_perc`, `vllm:prefix_cache_*`,
`vllm:inter_token_latency_seconds`); the older names (`vllm:gpu_cache_usage_perc`,
`vllm:gpu_prefix_cache_*`, `vllm:time_per_output_token_seconds`) are read where the new
ones are absent. A figure the server does not export stays None; a figure it exports that no
vLLM could send (NaN, infinite, negative, a pool of a billion blocks) is refused in one line
naming it, before anything is sized from it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvchat.engine.errors import KvchatError


class MetricsError(KvchatError):
    """/metrics could not be read or is not a vLLM server's."""


MAX_BLOCKS = 2**24           # a pool's blocks: 16M blocks of 16 tokens is 268M tokens, past any server
MAX_BLOCK_SIZE = 2**16
MAX_TOKENS = 2**40
DTYPE_LABEL = re.compile(r"[A-Za-z0-9_]{1,32}")


@dataclass(frozen=True, slots=True)
class Histogram:
    count: float
    total: float                                   # sum of observed values, seconds
    buckets: tuple[tuple[float, float], ...]       # (upper bound, cumulative count)

    @property
    def mean_ms(self) -> float | None:
        return 1000.0 * self.total / self.count if self.count else None

    def quantile_ms(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile q (Prometheus' own resolution)."""
        if not self.count:
            return None
        rank = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                return 1000.0 * bound if bound != float("inf") else None
        return None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The labels of `vllm:cache_config_info` that size the pool."""
    block_size: int | None
    num_blocks: int | None                  # num_gpu_blocks: the pool, in blocks
    size_tokens: int | None                 # kv_cache_size_tokens, where exported
    cache_dtype: str | None                 # "auto" means the model's dtype
    prefix_caching: bool | None


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    """One scrape of /metrics, summed over the server's engines for the model served."""
    cache: CacheConfig
    usage: float | None                     # fraction of the pool's blocks in use by requests
    prefix_queries: float | None            # tokens looked up in the prefix cache, since start
    prefix_hits: float | None               # of which found
    preemptions: float | None
    running: float | None
    waiting: float | None
    prompt_tokens: float | None             # counters since start
    generation_tokens: float | None
    inter_token: Histogram | None           # seconds between streamed tokens, server side
    ttft: Histogram | None

    @property
    def hit_rate(self) -> float | None:
        if self.prefix_queries is None or self.prefix_hits is None or not self.prefix_queries:
            return None
        return self.prefix_hits / self.prefix_queries


# (new name, old name) for each figure, as family names (the parser drops "_total" from counters)
_GAUGES = {
    "usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "preemptions": ("vllm:num_preemptions", None),
    "running": ("vllm:num_requests_running", None),
    "waiting": ("vllm:num_requests_waiting", None),
    "prompt_tokens": ("vllm:prompt_tokens", None),
    "generation_tokens": ("vllm:generation_tokens", None),
}
_HISTOGRAMS = {
    "inter_token": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "ttft": ("vllm:time_to_first_token_seconds", None),
}


def parse(text: str, model: str | None = None) -> ServerMetrics:
    """Read a /metrics body; raises MetricsError (one line) for text that is not Prometheus
    exposition format, or that carries no vLLM metric."""
    try:
        families = {f.name: f for f in text_string_to_metric_families(text)}
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError, RecursionError) as err:
        raise MetricsError(f"the server's /metrics is not Prometheus text ({_short(err)})") from None
    if not any(name.startswith("vllm:") for name in families):
        raise MetricsError("the server's /metrics has no vllm: metrics; is it a vLLM server?")

    def samples(family: str, suffix: str = "") -> list[Any] | None:
        # a counter is one family "x" with samples "x_total" when its TYPE line says x_total, and
        # an empty family "x" beside a family "x_total" when it says x: read both
        found = [f for f in (families.get(family), families.get(family + "_total")) if f is not None]
        if not found:
            return None
        wanted = {family + suffix} if suffix else {family, family + "_total"}
        out = [s for f in found for s in f.samples if s.name in wanted]
        if model is not None:
            out = [s for s in out if s.labels.get("model_name", model) == model]
        return out

    def scalar(names: tuple[str | None, ...]) -> float | None:
        for name in names:
            if name is None:
                continue
            found = samples(name)
            if found:
                return sum(_figure(s.name, s.value) for s in found)
        return None

    def histogram(names: tuple[str | None, ...]) -> Histogram | None:
        for name in names:
            if name is None or name not in families:
                continue
            count, total = samples(name, "_count") or [], samples(name, "_sum") or []
            buckets: dict[float, float] = {}
            for s in samples(name, "_bucket") or []:
                le = _bound(s.name, s.labels.get("le"))
                buckets[le] = buckets.get(le, 0.0) + _figure(s.name, s.value)
            return Histogram(count=sum(_figure(s.name, s.value) for s in count),
                             total=sum(_figure(s.name, s.value) for s in total),
                             buckets=tuple(sorted(buckets.items())))
        return None

    figures: dict[str, Any] = {k: scalar(v) for k, v in _GAUGES.items()}
    if figures["usage"] is not None and figures["usage"] > 1.0 + 1e-9:
        raise MetricsError(f"the server's {_GAUGES['usage'][0]} is {figures['usage']!r}; expected a fraction from 0 to 1")
    figures.update({k: histogram(v) for k, v in _HISTOGRAMS.items()})
    return ServerMetrics(cache=_cache_config(families), **figures)


def _figure(name: str, value: float) -> float:
    """A count, a sum of seconds or a usage: finite and not negative."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise MetricsError(f"the server's {_short(name)} is {value!r}; expected a finite number >= 0")
    return float(value)


def _bound(name: str, le: str | None) -> float:
    """A histogram bucket's upper bound (its "le" label): a number or +Inf."""
    try:
        bound = float(le) if le is not None else math.nan
    except ValueError:
        bound = math.nan
    if math.isnan(bound):
        raise MetricsError(f"the server's {_short(name)} has a bucket without a number in its le label")
    return bound


def _cache_config(families: dict[str, Any]) -> CacheConfig:
    f = families.get("vllm:cache_config_info")
    labels = f.samples[0].labels if f is not None and f.samples else {}

    def num(key: str, most: int) -> int | None:
        value = labels.get(key)
        if value in (None, "", "None"):
            return None
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number != int(number) or not 0 <= number <= most:
            raise MetricsError(f"the server's vllm:cache_config_info label {key}={_short(repr(value))}; expected a "
                               f"whole number from 0 to {most:,}")
        return int(number)

    dtype = labels.get("cache_dtype")
    if dtype is not None and not DTYPE_LABEL.fullmatch(dtype):
        raise MetricsError(f"the server's vllm:cache_config_info label cache_dtype={_short(repr(dtype))} is not a "
                           "dtype name")
    prefix = labels.get("enable_prefix_caching")
    block_size = num("block_size", MAX_BLOCK_SIZE)
    return CacheConfig(block_size=block_size or None, num_blocks=num("num_gpu_blocks", MAX_BLOCKS),
                       size_tokens=num("kv_cache_size_tokens", MAX_TOKENS), cache_dtype=dtype,
                       prefix_caching=None if prefix is None else prefix == "True")


def _short(what: object) -> str:
    text = str(what).splitlines()[0] if str(what) else what.__class__.__name__
    return text if len(text) <= 80 else text[:77] + "..."
