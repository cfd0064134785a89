"""Calibration points from a vLLM server's own histograms (`kvchat plan --calibrate --server
URL`): kvchat sends probe requests one set at a time and reads the server's /metrics before and
after each, so every histogram's difference belongs to that probe alone.

Probes: B concurrent streams at a context of C tokens, each asking for 16 tokens: the change
in the server's inter-token histogram (its sum over its count) is the mean step time with B
sequences decoding at about C + 8 tokens. One request of P tokens asking for one token: the
change in the time-to-first-token histogram is the request's wait before its first step plus
its prefill, in chunks of the server's token budget. C is N/8 and N, P is N/8, N/2 and N, for
N = --probe-context (2048 by default; 512 suits vLLM on a CPU). Each probe's prompts are fresh
text, so the prefix cache gives nothing back. Each probe runs twice and keeps the faster; one
that does not end within 300 s stops the calibration with a line saying so. The server
must be idle while it is probed.
"""
from __future__ import annotations

import threading

from ..cli.args import UsageError
from .bench_points import Measurements, prefill_steps
from .fitter import Point
from .trace_runner import text_of

PROBE_CONTEXT = 2048        # the longest context probed (--probe-context)
BATCHES = (1, 4)
NEW_TOKENS = 16
REPEATS = 2
PROBE_TIMEOUT_S = 300       # one probe's requests, all together


def contexts(longest: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The decode probes' contexts and the prefill probes' lengths for a longest context N:
    (N/8, N) and (N/8, N/2, N); 2048 gives (256, 2048) and (256, 1024, 2048)."""
    return (longest // 8, longest), (longest // 8, longest // 2, longest)


def probe_count(longest: int, repeats: int = REPEATS) -> int:
    decode_at, prefills = contexts(longest)
    return repeats * (len(decode_at) * len(BATCHES) + len(prefills))


def _hist(backend, name: str) -> tuple[float, float]:
    backend.snapshot()                                   # scrapes /metrics again
    h = getattr(backend.metrics, name)
    if h is None:
        raise UsageError(f"{backend.api.url}/metrics has no {name.replace('_', ' ')} histogram; calibration reads "
                         "vLLM's vllm:inter_token_latency_seconds and vllm:time_to_first_token_seconds")
    return h.count, h.total


def _streams(backend, texts: list[str], max_tokens: int, what: str, timeout_s: float) -> None:
    """The texts sent at once, each asking for max_tokens; all must end within timeout_s (a
    server too slow for the probes' sizes gets one line saying so, not a wait without end)."""
    import time

    from kvchat.engine.sampler import SamplingParams
    errors: list[str] = []

    def one(text: str) -> None:
        chat = backend.open()
        try:
            for _ in chat.send(text, SamplingParams(max_tokens=max_tokens)):
                pass
        except Exception as err:        # reported below, in one line
            errors.append(f"{type(err).__name__}: {err}")
        finally:
            backend.close(chat)

    threads = [threading.Thread(target=one, args=(t,), daemon=True, name="probe") for t in texts]
    for th in threads:
        th.start()
    end = time.monotonic() + timeout_s
    for th in threads:
        th.join(max(0.0, end - time.monotonic()))
    if any(th.is_alive() for th in threads):
        raise UsageError(f"the probe '{what}' did not finish within {timeout_s:g} s: the server is too slow or "
                         "busy for probes this long; --probe-context 512 (or 256) probes shorter contexts")
    if errors:
        raise UsageError(f"a probe request failed: {errors[0]}")


def _timed(backend, hist: str, texts: list[str], max_tokens: int, what: str, timeout_s: float) -> float | None:
    """The mean of the server's `hist` histogram over one probe's requests, in ms (None: the
    histogram did not move)."""
    c0, s0 = _hist(backend, hist)
    _streams(backend, texts, max_tokens, what, timeout_s)
    c1, s1 = _hist(backend, hist)
    return 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else None


def probe_points(backend, kv_dtype: str, budget: int, count=None, seed: int = 0, repeats: int = REPEATS,
                 longest: int = PROBE_CONTEXT, timeout_s: float = PROBE_TIMEOUT_S, say=print) -> list[Point]:
    """Decode probes at each (B, C) and prefill probes at each P, timed by the server itself;
    each probe runs `repeats` times on fresh text and keeps its fastest: whatever else shares
    the machine only ever adds time. `say` gets a line as each probe ends."""
    decode_at, prefills = contexts(longest)
    total = probe_count(longest, repeats)
    done = 0

    def measured(what: str, ms: float | None) -> None:
        nonlocal done
        done += 1
        say(f"  probe {done}/{total}: {what}: " + (f"{ms:,.2f} ms" if ms is not None else "the histogram did not move"))

    points = []
    n = 0
    for ctx in decode_at:
        for b in BATCHES:
            what = f"{b} streams decoding at {ctx}"
            runs = []
            for _ in range(repeats):
                texts = [text_of(ctx, count, seed + 1000 * (n := n + 1) + i) for i in range(b)]
                runs.append(_timed(backend, "inter_token", texts, NEW_TOKENS, what, timeout_s))
                measured(what, runs[-1])
            if (ms := min((r for r in runs if r is not None), default=None)) is not None:
                mid = ctx + NEW_TOKENS / 2
                points.append(Point(what, kv_dtype, ((b, b, b, b * mid, b * (mid + 1)),), ms))
    for p in prefills:
        what = f"prefill of {p}"
        runs = []
        for r in range(repeats):
            runs.append(_timed(backend, "ttft", [text_of(p, count, seed + 7 * p + 100_000 * r)], 1, what, timeout_s))
            measured(what, runs[-1])
        if (ms := min((r for r in runs if r is not None), default=None)) is not None:
            points.append(Point(what, kv_dtype, prefill_steps(p, 0, budget), ms, requests=1))
    return points


def from_server(args) -> Measurements:
    """Probe the server at --server; the hardware it runs on is --gpu (cpu: this machine, whose
    bandwidth is measured here as the reference)."""
    from ..backends.vllm import VllmBackend
    from .hardware import find, gpu_key
    from .options import vllm_defaults
    hw = find(gpu_key(args))
    backend = VllmBackend(args.server, geometry=args.geometry, model_config=args.model)
    try:
        if backend.geometry is None:
            raise UsageError(f"the server's model {backend.model.name!r} has no known geometry ({backend.geometry_source}); "
                             "give --geometry ALIAS or --model PATH to its config.json")
        dtype, kv = backend.model.dtype or "bf16", backend.kv_dtype
        if kv not in ("bf16", "fp16", "fp8", "fp32"):
            raise UsageError(f"the server's cache dtype is {kv!r}; give --kv-dtype")
        budget = args.max_batched_tokens or vllm_defaults(hw)[0]
        longest = args.probe_context or PROBE_CONTEXT
        print(f"probing {args.server}: {probe_count(longest)} probes, contexts to {longest:,} tokens "
              f"(--probe-context), each within {PROBE_TIMEOUT_S} s", flush=True)
        points = probe_points(backend, kv, budget, seed=args.seed, longest=longest,
                              say=lambda line: print(line, flush=True))
    finally:
        backend.shutdown()
    if len(points) < 3:
        raise UsageError(f"the server's histograms gave {len(points)} points; is another client using it?")
    return Measurements(backend.geometry, dtype, hw.key, hw.bandwidth,
                        f"{'measured' if hw.measured else 'spec sheet'}: {hw.source}",
                        f"probes of the vLLM server at {args.server} (its own histograms)", points, kv_scales=False)
