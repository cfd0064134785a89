"""A vLLM server's Prometheus `/metrics`, read into one immutable record for the panels.

The text is parsed by prometheus_client's own parser; this file only picks the figures by
name. Names are those of vLLM 0.32 (`vllm:kv_cache_usage_perc`, `vllm:prefix_cache_*`,
`vllm:inter_token_latency_seconds`); the older names (`vllm:gpu_cache_usage_perc`,
`vllm:gpu_prefix_cache_*`, `vllm:time_per_output_token_seconds`) are read where the new
ones are absent. A figure the server does not export stays None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvchat.engine.errors import KvchatError


class MetricsError(KvchatError):
    """/metrics could not be read or is not a vLLM server's."""


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
    except (ValueError, TypeError, IndexError) as err:
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
                return float(sum(s.value for s in found))
        return None

    def histogram(names: tuple[str | None, ...]) -> Histogram | None:
        for name in names:
            if name is None or name not in families:
                continue
            count, total = samples(name, "_count") or [], samples(name, "_sum") or []
            buckets: dict[float, float] = {}
            for s in samples(name, "_bucket") or []:
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            return Histogram(count=sum(s.value for s in count), total=sum(s.value for s in total),
                             buckets=tuple(sorted(buckets.items())))
        return None

    figures: dict[str, Any] = {k: scalar(v) for k, v in _GAUGES.items()}
    figures.update({k: histogram(v) for k, v in _HISTOGRAMS.items()})
    return ServerMetrics(cache=_cache_config(families), **figures)


def _cache_config(families: dict[str, Any]) -> CacheConfig:
    f = families.get("vllm:cache_config_info")
    labels = f.samples[0].labels if f is not None and f.samples else {}

    def num(key: str) -> int | None:
        value = labels.get(key)
        try:
            return int(float(value)) if value not in (None, "", "None") else None
        except ValueError:
            return None

    prefix = labels.get("enable_prefix_caching")
    return CacheConfig(block_size=num("block_size"), num_blocks=num("num_gpu_blocks"),
                       size_tokens=num("kv_cache_size_tokens"), cache_dtype=labels.get("cache_dtype"),
                       prefix_caching=None if prefix is None else prefix == "True")


def _short(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else err.__class__.__name__
    return text if len(text) <= 80 else text[:77] + "..."
