"""The local backend: kvchat's own engine (kvchat/engine) behind the Backend protocol."""
from __future__ import annotations

import threading
from collections.abc import Iterator

from kvchat.engine.conversation import Conversation
from kvchat.engine.engine import KV_DTYPES, Engine, EngineConfig, Preflight
from kvchat.engine.errors import KvchatError
from kvchat.engine.policy import POLICIES
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.sources import ModelSource
from kvchat.engine.telemetry import CacheSnapshot, SchedulerSnapshot
from kvchat.engine.template import turn_overhead

from .protocol import BackendInfo, Capabilities, Chat, ChatState, Event, Message


class LocalChat:
    """An engine Conversation, seen through the Chat protocol."""

    def __init__(self, conv: Conversation) -> None:
        self.conv = conv
        self._overhead: int | None = None      # the template's tokens per user turn, once measured

    def state(self) -> ChatState:
        c = self.conv
        return ChatState(messages=tuple(dict(m) for m in c.messages), cap=c.cap, policy=c.policy.name,
                         policy_description=c.policy.description, mode=c.mode, tokens_held=c.tokens_held,
                         evicted_tokens=c.evicted_tokens, preempted_pending=c.preempted_pending, turns=c.turns,
                         conversation=c.id)

    def send(self, text: str, sampling: SamplingParams | None = None,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        return self.conv.send(text, sampling, cancel)

    def regenerate(self, sampling: SamplingParams | None = None,
                   cancel: threading.Event | None = None) -> Iterator[Event]:
        return self.conv.regenerate(sampling, cancel)

    def restore(self, messages: list[Message]) -> None:
        self.conv.restore_messages(messages)

    def truncate(self, n_messages: int) -> None:
        self.conv.truncate(n_messages)

    def reset_cache(self) -> int:
        return self.conv.reset_cache()

    def set_cap(self, cap: int | None) -> None:
        self.conv.set_cap(cap)

    def set_policy(self, name: str) -> None:
        self.conv.set_policy(name)

    def set_mode(self, mode: str) -> None:
        self.conv.set_mode(mode)

    def set_system(self, text: str | None) -> None:
        self.conv.set_system(text)

    def history_tokens(self) -> int | None:
        return len(self.conv.render(self.conv.messages))

    def message_tokens(self, text: str) -> int | None:
        """Before the first reply the whole first prompt is rendered (it is short); after, the
        message's tokens and the template's per-turn tokens, measured once, so a long history
        is not rendered on every keystroke."""
        conv, message = self.conv, {"role": "user", "content": text}
        tok = conv.engine.tokenizer
        try:
            if all(m["role"] == "system" for m in conv.messages):
                return len(conv.render(conv.messages + [message]))
            if self._overhead is None:
                self._overhead = turn_overhead(tok)
            return len(tok.encode(text, add_special_tokens=False)) + self._overhead
        except (RuntimeError, KvchatError):   # the turn's thread holds the tokenizer; a template that fails
            return None


class LocalBackend:
    """One Engine: one model, one KV pool shared by every conversation."""

    capabilities = Capabilities(policies=tuple(POLICIES), kv_dtypes=tuple(k for k in KV_DTYPES if k != "auto"),
                                block_map="pool", concurrent_turns=True)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def load(cls, config: EngineConfig, source: ModelSource | None = None,
             checked: Preflight | None = None) -> LocalBackend:
        return cls(Engine(config, source=source, checked=checked))

    def info(self) -> BackendInfo:
        e = self.engine
        return BackendInfo(kind="local", model=e.source.name, device=str(e.device), dtype=e.dtype_name,
                           kv_dtype=e.kv_dtype, bytes_per_token=e.bytes_per_token, geometry=e.geometry,
                           max_position=e.geometry.max_position, random_weights=e.source.random_weights,
                           weights=str(e.source.path) if e.source.path is not None else None)

    def open(self, system: str | None = None, cap: int | None = None, policy: str = "stop",
             mode: str = "cache") -> LocalChat:
        conv = self.engine.new_conversation(system_prompt=system, cap=cap, policy=policy)
        chat = LocalChat(conv)
        if mode != "cache":
            try:
                conv.set_mode(mode)
            except BaseException:
                self.engine.close_conversation(conv)
                raise
        return chat

    def close(self, chat: Chat) -> None:
        self.engine.close_conversation(_conversation(chat))

    def snapshot(self, chat: Chat | None = None) -> CacheSnapshot:
        return self.engine.snapshot(_conversation(chat) if chat is not None else None)

    def scheduler(self) -> SchedulerSnapshot:
        return self.engine.scheduler_snapshot()

    def count_tokens(self, text: str) -> int | None:
        try:
            return len(self.engine.tokenizer.encode(text, add_special_tokens=False))
        except RuntimeError:    # a fast tokenizer borrowed by the turn's thread ("Already borrowed"):
            return None         # unknown this time; the draft counts again on the next keystroke

    def set_kv_dtype(self, kv_dtype: str) -> str:
        self.engine.set_kv_dtype(kv_dtype)
        return self.engine.kv_dtype

    def shutdown(self) -> None:
        pass


def _conversation(chat: Chat) -> Conversation:
    """The engine's Conversation behind one of this backend's chats."""
    if not isinstance(chat, LocalChat):
        raise TypeError(f"a {type(chat).__name__} is not a conversation of the local backend")
    return chat.conv
