"""A vLLM server as a bench peer (`kvchat bench --server URL`): the same token ids as kvchat's
own turns, sent to /v1/completions, timed at the client.

Per context and run: turn 1 from a cold prefix cache (the server's cache is reset first when
it allows it), `steps` timed tokens with ignore_eos so the reply never stops early; then the
next turn's ids twice, once with the server's prefix cache holding turn 1 and once after a
reset. Decode ms/token is the gap between streamed tokens; prefill is the client-side TTFT
(request, queue and prompt forward: the server reports no per-request prefill time).
"""
from __future__ import annotations

import time

from kvchat.engine.errors import KvchatError

from ..backends.protocol import RESET
from ..backends.server_shapes import count
from ..backends.server_api import ConnectionLost, ServerError
from ..backends.sse import LOST, TIMEOUT
from .report import Series, Timing


class VllmPeer:
    name = "vLLM server"

    def __init__(self, backend) -> None:
        self.backend = backend
        self.can_reset = backend.capabilities.has(RESET)

    @classmethod
    def connect(cls, args, need_tokens: int) -> VllmPeer:
        from ..backends.deadlines import Deadlines
        from ..backends.vllm import VllmBackend
        backend = VllmBackend(args.server, geometry=getattr(args, "geometry", None),
                              deadlines=Deadlines.parse(getattr(args, "timeouts", None)))
        limit = backend.model.max_model_len
        if limit is not None and need_tokens > limit:
            backend.shutdown()
            raise KvchatError(f"--contexts needs about {need_tokens} positions but the server's --max-model-len is "
                              f"{limit}; use shorter contexts or restart the server with a longer one")
        return cls(backend)

    def describe(self) -> str:
        info = self.backend.info()
        return (f"vLLM server {info.device} serving {info.model} (cache {info.kv_dtype}); timed at the client over "
                "HTTP, so each figure includes the loopback round trip")

    def close(self) -> None:
        self.backend.shutdown()

    def generate(self, ids: list[int], steps: int) -> tuple[Timing, int | None]:
        """Stream steps + 1 tokens for the prompt `ids`; the timing and the server's cached_tokens."""
        b = self.backend
        body = {"model": b.model.name, "prompt": ids, "max_tokens": steps + 1, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        times: list[float] = []
        usage: dict = {}
        t0 = time.perf_counter()
        with b.api.stream_events("/v1/completions", body) as events:
            for chunk in events:
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                    if len(times) > steps + 1:      # more than was asked for: the client stops it
                        break
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
            if events.ended == LOST:       # a broken stream's tokens are no measurement
                raise ConnectionLost(events.why)
            if events.ended == TIMEOUT:
                raise ServerError(events.why)
        if not times:
            raise KvchatError(f"vLLM peer: no token for a {len(ids)}-token prompt")
        ttft = (times[0] - t0) * 1000
        decode = tuple((y - x) * 1000 for x, y in zip(times[:steps + 1], times[1:steps + 1]))
        details = usage.get("prompt_tokens_details")
        cached = count(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens") \
            if isinstance(details, dict) else None
        return Timing(len(ids), ttft, ttft, decode), cached

    def decode_batch(self, prompts: list[list[int]], steps: int) -> list[float]:
        """The prompts as concurrent streams (one thread each), so the server batches them:
        every stream's gaps between tokens (ms), the server's per-user decode step."""
        import threading
        if self.can_reset:
            self.backend.reset_prefix_cache()
        results: list = [None] * len(prompts)

        def one(i: int) -> None:
            try:
                results[i] = self.generate(prompts[i], steps)[0]
            except Exception as err:  # noqa: BLE001  (re-raised below, in the caller's thread)
                results[i] = err

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = next((r for r in results if isinstance(r, Exception)), None)
        if failed is not None:
            raise failed
        return [ms for r in results for ms in r.decode_ms]

    def measure(self, ids1: list[int], ids2: list[int] | None, steps: int, s: Series) -> None:
        if self.can_reset:
            self.backend.reset_prefix_cache()
        first, cached = self.generate(ids1, steps)
        s.add(first)
        if cached:
            s.note(f"turn 1 reused {cached} cached tokens (the server cannot reset its prefix cache); "
                   "its prefill is not a full one")
        if ids2 is None:
            return
        second, cached = self.generate(ids2, 0)
        s.ttft_reuse_ms.append(second.ttft_ms)
        if cached is not None:
            s.next_turn = {"prompt_tokens": len(ids2), "reused_tokens": cached, "computed_tokens": len(ids2) - cached}
        if self.can_reset:
            self.backend.reset_prefix_cache()
            s.ttft_reset_ms.append(self.generate(ids2, 0)[0].ttft_ms)
        else:
            s.note("TTFT without the prefix cache not measured: " + self.backend.capabilities.why_not(RESET))
