"""The vLLM backend: a running vLLM server behind the Backend protocol.

Where each figure comes from (issue 10):
- reused vs computed per turn: the final stream chunk's `usage.prompt_tokens_details.cached_tokens`
  (the server needs `--enable-prompt-tokens-details`);
- per-token latency: the client's clock between streamed tokens (position = prompt tokens +
  index), TTFT from sending the request to the first token; the server's own histograms from
  /metrics beside them (metrics.py);
- the pool: `vllm:cache_config_info` (block size, blocks) and `vllm:kv_cache_usage_perc`;
- bytes per token: the model geometry (the served name matched against our table, `--geometry`,
  or a local config.json) times the cache element size;
- the block map: the KV-event stream (kv_events.py), matched against this conversation's token
  ids, which the server returns with `return_token_ids`.
What the server cannot tell stays None and is named in `unavailable`; nothing is estimated.
"""
from __future__ import annotations

import argparse
import json
import threading
from typing import Any

from kvchat.engine.errors import KvchatError
from kvchat.engine.geometry import DTYPE_BYTES
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.telemetry import CACHED, FREE, HELD, REUSED

from . import metrics as prom
from .deadlines import Deadlines
from .kv_events import KvEventSubscriber
from .protocol import (BLOCK_MAP, CACHE_TOGGLE, KV_DTYPE, RESET, SINK_WINDOW, BackendInfo, Capabilities, Chat,
                       Message)
from .server_api import ServerApi, ServerError
from .server_model import DTYPES, ServerModel, match_geometry
from .server_shapes import ShapeError, served_model, token_count
from .server_stats import ServerSnapshot, ServerStats
from .vllm_chat import DEFAULT_MAX_TOKENS, VllmChat

EVENT_WAIT_S = 0.5   # after a turn, how long the snapshot waits for the KV events of its blocks
JOIN_WAIT_S = 3.0    # at the start, how long to wait for the KV-event publisher's handshake (kv_events.py)


class VllmBackend:
    """A vLLM server at `url`; `kv_events` (tcp://HOST:PORT) adds the block map."""

    def __init__(self, url: str, kv_events: str | None = None, geometry: str | None = None,
                 model_config: str | None = None, kv_dtype: str | None = None,
                 deadlines: Deadlines | None = None, kv_replay: str | None = None) -> None:
        self.api = ServerApi(url, deadlines)
        self.events: KvEventSubscriber | None = None
        self.resets = 0           # prefix-cache resets kvchat made: each frees every conversation's blocks
        try:
            self.model = self._probe()
            self.metrics = self._scrape()
            self.geometry, self.geometry_source = match_geometry(self.model.name, geometry, model_config)
            self.kv_dtype = self._kv_dtype(kv_dtype)
            if kv_replay is not None and kv_events is None:
                raise KvchatError("--kv-replay needs --kv-events tcp://HOST:PORT (the replay fills in that stream)")
            if kv_events is not None:
                self.events = KvEventSubscriber(kv_events, replay=kv_replay)
                # a turn sent before the subscription is in place would lose its blocks' events
                # (one message per step) for good; a wrong port costs this wait once, and the
                # cache panel then says nothing is connected. With a replay endpoint, the blocks
                # stored before kvchat subscribed arrive before the first snapshot.
                if self.events.wait_joined(JOIN_WAIT_S):
                    self.events.wait_replayed(JOIN_WAIT_S)
        except BaseException:
            self.shutdown()
            raise
        self.metrics_error: str | None = None
        self.capabilities = self._capabilities()
        self._lock = threading.Lock()

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> VllmBackend:
        """From the command line's flags (--server, --kv-events, --geometry, and --model as a
        local config.json, --kv-dtype as the cache's element type when the server cannot say).
        Flags that size kvchat's own engine are refused: the server sized its own."""
        local_only = [flag for flag, given in (
            ("--random-weights", getattr(args, "random_weights", False)),
            ("--kv-budget", getattr(args, "kv_budget", None)),
            ("--device", getattr(args, "device", "auto") != "auto"),
            ("--dtype", getattr(args, "dtype", "auto") != "auto"),
            ("--no-cache", getattr(args, "no_cache", False))) if given]
        if local_only:
            raise KvchatError(f"{', '.join(local_only)}: local-engine setting{'s' if len(local_only) > 1 else ''}; "
                              "with --server the server's own flags decide (vllm --dtype, --kv-cache-dtype, "
                              "--gpu-memory-utilization)")
        return cls(args.server, kv_events=getattr(args, "kv_events", None), kv_replay=getattr(args, "kv_replay", None),
                   geometry=getattr(args, "geometry", None),
                   model_config=getattr(args, "model", None), kv_dtype=getattr(args, "kv_dtype", None),
                   deadlines=Deadlines.parse(getattr(args, "timeouts", None)))

    # ---- connecting -----------------------------------------------------------------------------
    def _probe(self) -> ServerModel:
        try:
            models = self.api.get_json("/v1/models")
        except ServerError as err:
            if err.status in (404, 405):
                raise ServerError(f"{self.api.url} is not an OpenAI-compatible server (GET /v1/models answered "
                                  f"{err.status}); give --server the vLLM server's base URL") from None
            raise
        try:
            name, limit = served_model(models)
        except ShapeError as err:
            raise ServerError(f"{self.api.url}{err}" if str(err).startswith("/") else f"{self.api.url}: {err}") from None
        info = self.api.get_optional_json("/server_info")
        dtype = None
        if info is not None:
            cfg = info.get("vllm_config")
            try:
                text = cfg if isinstance(cfg, str) else json.dumps(cfg)
            except (TypeError, ValueError, RecursionError):
                text = ""
            for dname in ("bfloat16", "float16", "float32"):
                if f"dtype=torch.{dname}" in text or f'"dtype": "{dname}"' in text:
                    dtype = DTYPES[dname]
                    break
        return ServerModel(name=name, max_model_len=limit, dtype=dtype, dev_mode=info is not None)

    def _scrape(self) -> prom.ServerMetrics:
        try:
            text = self.api.get_text("/metrics")
        except ServerError as err:
            if getattr(err, "status", None) == 404:
                raise ServerError(f"{self.api.url} has no /metrics (404); kvchat --server needs a vLLM "
                                  "server") from None
            raise
        try:
            return prom.parse(text, self.model.name)
        except prom.MetricsError as err:
            raise ServerError(f"{self.api.url}: {err}") from None

    def _kv_dtype(self, hint: str | None) -> str:
        """The cache's element type: the server's --kv-cache-dtype, or for "auto" the weights'
        dtype (from /server_info), or the user's --kv-dtype; "unknown" if none says."""
        label = self.metrics.cache.cache_dtype
        if label and label != "auto":
            return DTYPES.get(label, label)
        if self.model.dtype:
            return self.model.dtype
        if hint and hint != "auto":
            return hint
        return "unknown"

    def _capabilities(self) -> Capabilities:
        missing = [
            (SINK_WINDOW, "sink-window evicts blocks inside kvchat's own engine; on a vLLM server use "
                          "/policy drop-oldest (the client trims what it sends)"),
            (KV_DTYPE, "the server's cache dtype is fixed when it starts (vllm --kv-cache-dtype)"),
            (CACHE_TOGGLE, "a vLLM server always decodes with its KV cache; cache-off mode is a local-engine "
                           "experiment"),
        ]
        if not self.model.dev_mode:
            missing.append((RESET, "the server allows POST /reset_prefix_cache only when started with "
                                   "VLLM_SERVER_DEV_MODE=1; restart it so, or start a new conversation"))
        if self.events is None:
            missing.append((BLOCK_MAP, "no KV-event stream: start the server with --kv-events-config "
                                       "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":"
                                       "\"tcp://*:5557\"}' and give kvchat --kv-events tcp://HOST:5557"))
        return Capabilities(policies=("stop", "drop-oldest"), kv_dtypes=(),
                            block_map="prefix" if self.events is not None else "none", missing=tuple(missing))

    # ---- the protocol ---------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int | None:
        if self.geometry is None or self.kv_dtype not in DTYPE_BYTES:
            return None
        return self.geometry.kv_bytes_per_token(self.kv_dtype)

    def count_tokens(self, text: str) -> int | None:
        """Unknown: counting needs the server's /tokenize, a network call the UI thread must not
        wait on while the user types."""
        return None

    def info(self) -> BackendInfo:
        return BackendInfo(kind="vllm", model=self.model.name, device=self.api.url,
                           dtype=self.model.dtype or "unknown", kv_dtype=self.kv_dtype,
                           bytes_per_token=self.bytes_per_token, geometry=self.geometry,
                           max_position=self.model.max_model_len)

    def open(self, system: str | None = None, cap: int | None = None, policy: str = "stop",
             mode: str = "cache") -> VllmChat:
        chat = VllmChat(self, system, cap, policy)
        chat.set_mode(mode)
        return chat

    def close(self, chat: Chat) -> None:
        pass          # the server holds no conversation; its cached blocks stay for prefix reuse

    def scheduler(self) -> None:
        """A server's scheduler is seen only through /metrics (the crowd panel marks the rows
        it cannot fill)."""
        return None

    def set_kv_dtype(self, kv_dtype: str) -> str:
        raise KvchatError(self.capabilities.why_not(KV_DTYPE))

    def shutdown(self) -> None:
        if self.events is not None:
            self.events.stop()
            self.events = None
        self.api.close()

    def reset_prefix_cache(self) -> int:
        """POST /reset_prefix_cache: the whole server's prefix cache, every client's. Returns the
        resident blocks the KV events knew of before (0 without a stream)."""
        if not self.capabilities.has(RESET):
            raise KvchatError(self.capabilities.why_not(RESET))
        before = self.events.store.summary().blocks if self.events is not None else 0
        answer = self.api.post_json("/reset_prefix_cache")
        if answer.get("success") is False:
            raise ServerError("the server refused to reset its prefix cache: blocks are still held by "
                              "running requests; try again when it is idle")
        self.resets += 1
        if self.events is not None:
            self.events.store.cleared_by_server()
        return before

    # ---- requests -------------------------------------------------------------------------------
    def request_body(self, messages: list[Message], sampling: SamplingParams | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model.name, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        body["max_tokens"] = sampling.max_tokens if sampling is not None else DEFAULT_MAX_TOKENS
        if sampling is not None:
            body.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if sampling.top_k:
                body["top_k"] = sampling.top_k
            if sampling.seed is not None:
                body["seed"] = sampling.seed
        return body

    def count_messages(self, messages: list[Message]) -> int:
        """Tokens the messages render to with the chat template and generation prompt (/tokenize)."""
        data = self.api.post_json("/tokenize", {"model": self.model.name, "messages": messages,
                                                "add_generation_prompt": True})
        try:
            return token_count(data)
        except ShapeError as err:
            raise ServerError(f"{self.api.url}{err}") from None

    # ---- the panels -----------------------------------------------------------------------------
    def snapshot(self, chat: Chat | None = None, wait_for_events: bool = False) -> ServerSnapshot:
        if chat is not None and not isinstance(chat, VllmChat):
            raise TypeError(f"a {type(chat).__name__} is not a conversation of the vLLM backend")
        return self._snapshot(chat, wait_for_events)

    def _snapshot(self, chat: VllmChat | None, wait_for_events: bool) -> ServerSnapshot:
        """Scrapes /metrics; where that fails after a good start, keeps the last good scrape and
        names the failure in server.notes (the app retries on its next poll)."""
        notes: list[str] = []
        try:
            self.metrics = self._scrape()
            self.metrics_error = None
        except ServerError as err:
            self.metrics_error = str(err)
            notes.append(f"metrics: {err} (showing the last good figures)")
        m, cc = self.metrics, self.metrics.cache
        bs, nb, bpt = cc.block_size, cc.num_blocks, self.bytes_per_token
        unavailable = ["wasted_slots", "pool_shared", "evictions"]
        if bpt is None:
            unavailable.append("bytes_per_token")
            notes.append(self.geometry_source if self.geometry is None else
                         f"the cache element size is unknown (cache_dtype {cc.cache_dtype!r}); give --kv-dtype")
        active = round(m.usage * nb) if m.usage is not None and nb else None
        mine: int | None = None
        resident: int | None = None
        store = self.events.store.summary() if self.events is not None else None
        if self.events is not None and bs:
            if wait_for_events and chat is not None and chat.token_ids:
                want = len(chat.token_ids) // bs
                self.events.store.wait(lambda s: s.chain(chat.token_ids, bs) >= want, EVENT_WAIT_S)
            store = self.events.store.summary()
            mine = self.events.store.chain(chat.token_ids, bs) if chat is not None else 0
            resident = store.blocks
            if not store.connected:
                notes.append(f"no KV-event publisher at {self.events.endpoint}{' now' if store.connections else ''}: "
                             "the map cannot change until one answers (the server's --kv-events-config endpoint "
                             "tcp://*:PORT, reached as tcp://SERVER-HOST:PORT)")
            if store.first_seq:
                notes.append(f"KV events before sequence {store.first_seq} were not seen: blocks stored "
                             "before kvchat subscribed are missing from the map"
                             + ("" if self.events.replay_endpoint else
                                " (a replay_endpoint in the server's --kv-events-config, given as --kv-replay, "
                                "sends them)"))
            if store.replay_problem:
                notes.append(f"KV-event replay: {store.replay_problem}")
            if store.restarts:
                notes.append(f"the server restarted {store.restarts} time(s): the map starts again from empty")
            if store.gaps:
                notes.append(f"{store.gaps} KV-event batches were lost: the map may be stale until a reset")
            if store.undecodable:
                notes.append(f"{store.undecodable} malformed KV events skipped (the last: {store.last_problem})")
            if store.overflow:
                notes.append(f"the map is full ({store.blocks:,} blocks): {store.overflow} stored blocks left out")
            if chat is not None and chat.context_tokens:
                notes.append(f"of this conversation's {chat.context_tokens:,} tokens, {mine * bs:,} sit in "
                             f"{mine:,} resident full blocks (the server frees a partial last block)")
        else:
            notes.append(self.capabilities.why_not(BLOCK_MAP) or "the server reports no block size")
            unavailable += ["pool_cached", "block_map"]
        # the conversation's tokens as the server counted them (its last turn's prompt and reply),
        # not only the full blocks the KV events report: what its cap is checked against
        held = chat.held_tokens if chat is not None else None
        if held is None:
            unavailable += ["tokens_held", "bytes_used"]
        filled = -(-held // bs) if held is not None and bs else None      # the blocks they fill, the last partly
        if filled is None:
            unavailable += ["blocks_used", "bytes_allocated"]
        codes = b""
        if mine is not None and resident is not None and nb and bs:
            reused = min(mine, (chat.reused_tokens // bs) if chat is not None else 0)
            others = max(0, min(nb - mine, resident - mine))
            codes = (bytes([REUSED]) * reused + bytes([HELD]) * (mine - reused) + bytes([CACHED]) * others
                     + bytes([FREE]) * max(0, nb - mine - others))
        cached = max(0, resident - (active or 0)) if resident is not None else None
        if nb is None:
            unavailable += ["num_blocks", "capacity_bytes", "pool_free"]
        server = ServerStats(
            url=self.api.url, usage=m.usage, prefix_hit_rate=m.hit_rate, preemptions=_int(m.preemptions),
            running=_int(m.running), waiting=_int(m.waiting),
            inter_token_ms=m.inter_token.mean_ms if m.inter_token else None,
            ttft_ms=m.ttft.mean_ms if m.ttft else None, resident_blocks=resident,
            event_batches=store.batches if store else None, event_gaps=store.gaps if store else None,
            event_replayed=store.replayed if store and self.events and self.events.replay_endpoint else None,
            notes=tuple(notes) + ("the map shows resident full prefix blocks by content, in no physical "
                                  "order; partial last blocks and block ids are not reported",))
        return ServerSnapshot(
            model=self.model.name, kv_dtype=self.kv_dtype, block_size=bs or 0, num_blocks=nb or 0,
            bytes_per_token=bpt, capacity_bytes=nb * bs * bpt if nb and bs and bpt else None,
            tokens_held=held, bytes_used=held * bpt if held is not None and bpt else None,
            bytes_allocated=filled * bs * bpt if filled is not None and bs and bpt else None,
            blocks_used=filled, wasted_slots=None, pool_free=max(0, nb - (active or 0) - (cached or 0)) if nb else None,
            pool_active=active, pool_cached=cached, pool_shared=None, block_map=codes,
            cap=chat.cap if chat is not None else None, policy=chat.policy.name if chat is not None else "",
            mode="cache", evictions=None, preemptions=_int(m.preemptions), source="vllm",
            unavailable=tuple(dict.fromkeys(unavailable)), server=server)


def _int(x: float | None) -> int | None:
    return int(x) if x is not None else None
