"""One conversation on a vLLM server: the messages (the server keeps none) and the reading of
each reply's stream, where the client keeps its own limits: it stops at the max_tokens it
asked for (and at MAX_CHARS_PER_TOKEN characters a token), a cancel or a deadline ends the
stream (sse.py), every chunk is checked (server_shapes.py), and a reply that arrives cut is
kept and marked "cut" or "timeout" rather than taken as whole.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from kvchat.engine.errors import KvchatError
from kvchat.engine.policy import make_policy, reply_room
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.telemetry import PrefillEvent, TokenEvent, TurnStats

from .protocol import CACHE_TOGGLE, SINK_WINDOW, Capabilities, ChatState, Event, Message
from .server_api import ConnectionLost, ServerApi, ServerError, error_text
from .server_model import ServerModel
from .server_shapes import ShapeError, Usage, chunk
from .server_stats import ServerSnapshot
from .sse import CANCELLED, DONE, LOST, TIMEOUT, EventStream
from ..text import Redactor, redact

_FINISH = {"stop": "eos", "length": "max_tokens", "abort": "cancelled"}
DEFAULT_MAX_TOKENS = 512
MAX_CHARS_PER_TOKEN = 256   # no tokenizer's token is longer: a reply past it is not tokens


class Server(Protocol):
    """What a conversation uses of its backend (vllm.VllmBackend)."""
    api: ServerApi
    model: ServerModel
    capabilities: Capabilities
    kv_dtype: str
    resets: int               # prefix-cache resets so far (each frees every conversation's blocks)

    def request_body(self, messages: list[Message], sampling: SamplingParams | None) -> dict[str, Any]: ...
    def count_messages(self, messages: list[Message]) -> int: ...
    def reset_prefix_cache(self) -> int: ...
    def snapshot(self, chat: VllmChat | None = None, wait_for_events: bool = False) -> ServerSnapshot: ...


class VllmChat:
    """One conversation: the messages live here (the server keeps none); the server's prefix
    cache finds the shared prefix of each turn's prompt by itself."""

    def __init__(self, backend: Server, system: str | None, cap: int | None, policy: str) -> None:
        self.backend = backend
        self.messages: list[Message] = [{"role": "system", "content": system}] if system else []
        self.cap: int | None = None
        self.policy = make_policy("stop")
        self.set_cap(cap)
        self.set_policy(policy)
        self.turns = 0
        self.token_ids: tuple[int, ...] = ()     # the last turn's prompt + reply, as the server saw them
        self.context_tokens = 0                  # how many: the server's count (usage), else len(token_ids)
        self._counted_at = backend.resets        # the backend's resets when they were counted
        self.reused_tokens = 0
        self.history: list[TurnStats] = []

    # ---- settings -------------------------------------------------------------------------------
    def state(self) -> ChatState:
        return ChatState(messages=tuple(dict(m) for m in self.messages), cap=self.cap, policy=self.policy.name,
                         policy_description=self.policy.description, mode="cache",
                         tokens_held=self.held_tokens, evicted_tokens=0, preempted_pending=0,
                         turns=self.turns)

    @property
    def held_tokens(self) -> int:
        """The tokens the server's cache holds for this conversation as far as kvchat knows:
        its last prompt and reply, none after a prefix-cache reset (which frees every
        conversation's blocks) until its next turn."""
        return self.context_tokens if self._counted_at == self.backend.resets else 0

    def set_cap(self, cap: int | None) -> None:
        if cap is not None and cap <= 0:
            raise KvchatError(f"cap {cap}: must be a positive number of tokens")
        limit = self.backend.model.max_model_len
        if cap is not None and limit is not None and cap > limit:
            raise KvchatError(f"cap {cap} is over the server's --max-model-len {limit}")
        self.cap = cap

    def set_policy(self, name: str) -> None:
        if name not in self.backend.capabilities.policies:
            why = self.backend.capabilities.why_not(SINK_WINDOW) if name == "sink-window" else ""
            raise KvchatError(why or f"unknown cap policy {name!r}; accepted on a server: "
                              f"{', '.join(self.backend.capabilities.policies)}")
        self.policy = make_policy(name)

    def set_mode(self, mode: str) -> None:
        if mode != "cache":
            raise KvchatError(self.backend.capabilities.why_not(CACHE_TOGGLE))

    def restore(self, messages: list[Message]) -> None:
        self.messages = [dict(m) for m in messages]
        self.token_ids, self.reused_tokens, self.context_tokens = (), 0, 0

    def set_system(self, text: str | None) -> None:
        """The server renders the chat itself; its prefix cache simply misses from the first
        changed block on."""
        if self.messages and self.messages[0]["role"] == "system":
            del self.messages[0]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def history_tokens(self) -> int | None:
        """The server's count (/tokenize); None where it cannot say."""
        try:
            return self.backend.count_messages(self.messages)
        except ServerError:
            return None

    def message_tokens(self, text: str) -> int | None:
        """Unknown: the server counts with /tokenize, a call the typing user must not wait on."""
        return None

    def truncate(self, n_messages: int) -> None:
        """Keep the first n messages (an edited one is resent); the server's prefix cache
        reuses whatever still matches."""
        if not 0 <= n_messages <= len(self.messages):
            raise KvchatError(f"cannot keep {n_messages} messages of {len(self.messages)}")
        self.messages = self.messages[:n_messages]

    def reset_cache(self) -> int:
        return self.backend.reset_prefix_cache()

    # ---- turns ----------------------------------------------------------------------------------
    def send(self, text: str, sampling: SamplingParams | None = None,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        if not text.strip():
            raise KvchatError("empty message: type something to send")
        messages = self.messages + [{"role": "user", "content": text}]
        room = None
        if self.cap is not None:
            count = _LastCount(self.backend.count_messages)
            asked = sampling.max_tokens if sampling is not None else DEFAULT_MAX_TOKENS
            messages = self.policy.fit(messages, count, self.cap, room=reply_room(asked, self.cap))
            room = self.cap - count(messages)      # the policy counted these last: no second /tokenize
        return self._turn(messages, len(self.messages) + 1 - len(messages), sampling, cancel, room)

    def regenerate(self, sampling: SamplingParams | None = None,
                   cancel: threading.Event | None = None) -> Iterator[Event]:
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise KvchatError("nothing to regenerate: the conversation has no reply yet")
        messages = self.messages[:-1]
        room = self.cap - self.backend.count_messages(messages) if self.cap is not None else None
        return self._turn(messages, 0, sampling, cancel, room)

    def _turn(self, messages: list[Message], dropped: int, sampling: SamplingParams | None,
              cancel: threading.Event | None, room: int | None = None) -> Iterator[Event]:
        """The messages change only once the reply has arrived (complete, cancelled, or cut
        with something in it): a broken connection or a failure before any token raises
        ServerError and leaves the conversation as it was. The client itself stops at the
        max_tokens it asked for. `room`: the tokens the cap leaves after the prompt; the
        request asks for no more (at least one, as the local engine shows the token that
        reaches its cap), and a reply that ends there stopped at the cap."""
        b = self.backend
        body = b.request_body(messages, sampling)
        at_cap = False
        if room is not None and room < body["max_tokens"]:
            body["max_tokens"], at_cap = max(1, room), True
        limit = body["max_tokens"]
        prompt_ids: list[int] = []
        reply_ids: list[int] = []
        text: list[str] = []
        decode_ms: list[float] = []
        positions: list[int] = []
        usage: Usage | None = None
        finish = None
        ttft_ms = 0.0
        tokens = chars = 0
        redactor = Redactor()      # a server may echo the API key in the reply itself
        t0 = last = time.perf_counter()
        with b.api.stream_events("/v1/chat/completions", body, cancel) as stream:
            for event in stream:
                if "error" in event:
                    raise ServerError(f"the server stopped the reply: {error_text(event)}")
                try:
                    c = chunk(event)
                except ShapeError as err:
                    raise ServerError(f"{b.api.url}: {err}") from None
                if c.prompt_ids and not prompt_ids:
                    # the block map counts this turn's prompt blocks as this conversation's while
                    # it replies (they showed as other prefixes' "cached" until the reply ended)
                    self.token_ids = tuple(c.prompt_ids)
                prompt_ids = list(c.prompt_ids) or prompt_ids
                usage = c.usage or usage
                for piece in c.pieces:
                    finish = piece.finish or finish
                    ids = list(piece.token_ids)
                    if not ids and not piece.text:
                        continue
                    if tokens + max(1, len(ids)) > limit or chars + len(piece.text) > limit * MAX_CHARS_PER_TOKEN:
                        finish = "past_limit"          # more than was asked for: the client stops it
                        break
                    tokens += max(1, len(ids))
                    chars += len(piece.text)
                    now = time.perf_counter()
                    if not reply_ids and not text:
                        ttft_ms = (now - t0) * 1000
                        n_prompt = len(prompt_ids) or (usage.prompt_tokens if usage else None) or 0
                        yield PrefillEvent(n_prompt, None, None, None)
                    step = (now - last) * 1000 / max(1, len(ids))
                    delta = redactor.feed(piece.text)
                    for i, tid in enumerate(ids or [None]):
                        pos = len(prompt_ids) + len(reply_ids)
                        if reply_ids or text:              # every token after the first is a decode step
                            decode_ms.append(step)
                            positions.append(pos)
                        if tid is not None:
                            reply_ids.append(tid)
                        yield TokenEvent(delta if i == 0 else "", tid, pos, step if decode_ms else ttft_ms)
                        text.append(delta if i == 0 else "")
                    last = now
                if finish == "past_limit":
                    finish = "length"
                    break
                if cancel is not None and cancel.is_set():
                    finish = "abort"
                    break
        finish = self._ending(stream, finish, bool(text))
        if at_cap and finish == "max_tokens":
            finish = "cap"
        reply = redact("".join(text) + redactor.flush())
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.turns += 1
        self.token_ids = tuple(prompt_ids + reply_ids)
        n_prompt = usage.prompt_tokens if usage and usage.prompt_tokens is not None else len(prompt_ids)
        cached = usage.cached_tokens if usage else None
        self.reused_tokens = cached if cached is not None else 0
        unavailable = ["prefill_ms", "evicted_blocks", "preempted", "recomputed_tokens", "reclaimed_blocks"]
        if cached is None:
            unavailable += ["reused_tokens", "computed_tokens"]
        generated = usage.completion_tokens if usage and usage.completion_tokens is not None else len(reply_ids)
        generated = min(generated, max(tokens, len(reply_ids)))
        self.context_tokens, self._counted_at = n_prompt + generated, self.backend.resets
        stats = TurnStats(
            turn=self.turns, prompt_tokens=n_prompt, reused_tokens=cached,
            computed_tokens=max(0, n_prompt - cached) if cached is not None else None,
            generated_tokens=generated, ttft_ms=ttft_ms,
            prefill_ms=None, decode_ms=tuple(decode_ms), positions=tuple(positions),
            stop_reason=finish, reply=reply, mode="cache",
            kv_dtype=b.kv_dtype, policy=self.policy.name, dropped_messages=dropped, evicted_blocks=None,
            preempted=None, recomputed_tokens=None, cache=b.snapshot(self, wait_for_events=True), reclaimed_blocks=None,
            unavailable=tuple(unavailable))
        self.history.append(stats)
        yield stats

    @staticmethod
    def _ending(stream: EventStream, finish: str | None, arrived: bool) -> str:
        """The turn's stop reason. A broken connection, or a stream that ended with nothing in
        it, raises (the conversation stays as it was); a stream that ended in good order but
        without [DONE] or a finish reason, or that a deadline cut, keeps what arrived, marked."""
        if finish == "abort" or stream.ended == CANCELLED:
            return "cancelled"
        if finish is not None:
            return _FINISH.get(finish, finish)
        if stream.ended in (None, DONE):
            return "eos"
        if stream.ended == LOST:
            raise ConnectionLost(stream.why)
        if not arrived:
            raise ServerError(stream.why)
        return "timeout" if stream.ended == TIMEOUT else "cut"


class _LastCount:
    """A message count that remembers its last answer: a cap policy's last count is of the
    messages it keeps, which the turn needs again for the room left to its reply."""

    def __init__(self, count: Callable[[list[Message]], int]) -> None:
        self.count = count
        self.last: tuple[list[Message], int] | None = None

    def __call__(self, messages: list[Message]) -> int:
        if self.last is None or self.last[0] != messages:
            self.last = (list(messages), self.count(messages))
        return self.last[1]
