"""The one interface between kvchat's front ends (the app, the CLI, the bench) and whatever
runs the model: kvchat's own engine (local.py), or a serving engine reached over HTTP.

A front end holds a `Backend` and the `Chat`s it opened, and reads only the immutable
types below and the engine's telemetry (TokenEvent, PrefillEvent, TurnStats,
CacheSnapshot). Threading: every method except `capabilities`, `info()` and
`Chat.state()` may block (a turn holds the backend from its prefill to its last token);
the app calls them from worker threads, one job at a time. `state()` and `info()` are
cheap, lock-free reads for the UI thread.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Union, runtime_checkable

from kvchat.engine.errors import KvchatError
from kvchat.engine.geometry import Geometry
from kvchat.engine.telemetry import (CacheSnapshot, PrefillEvent, PrefillProgress, SchedulerSnapshot, TokenEvent,
                                     TurnStats)

if TYPE_CHECKING:
    from kvchat.engine.sampler import SamplingParams

Event = Union[PrefillProgress, PrefillEvent, TokenEvent, TurnStats]   # what a turn yields, in that order
Message = dict[str, str]          # {"role": "system" | "user" | "assistant", "content": ...}

# what a backend may lack; each name is a key of Capabilities.missing
RESET, CACHE_TOGGLE, KV_DTYPE, SINK_WINDOW, BLOCK_MAP, REGENERATE = (
    "reset", "cache_toggle", "kv_dtype", "sink_window", "block_map", "regenerate")



class ReplyLost(KvchatError):
    """The backend lost its connection mid-reply and kept nothing of the turn: the chat's
    messages are as they were. str() is one line that speaks of no conversation (ask, replay,
    bench, crowd and plan have none); the chat says the conversation is kept."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What this backend can do. A front end offers only these, and for anything else shows
    `why_not(name)`: one line saying why and what the user can do instead."""
    policies: tuple[str, ...] = ("stop", "drop-oldest", "sink-window")
    kv_dtypes: tuple[str, ...] = ()          # storage dtypes it can rebuild its cache in; () = fixed
    block_map: str = "pool"                  # "pool": every block of the pool by id; "prefix":
                                             # resident prefix-cached blocks only; "none"
    missing: tuple[tuple[str, str], ...] = ()   # (capability, why) for each it lacks
    concurrent_turns: bool = False           # replies on several chats may run at once (share steps)

    def has(self, name: str) -> bool:
        return all(k != name for k, _ in self.missing)

    def why_not(self, name: str) -> str:
        return next((why for k, why in self.missing if k == name), "")


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """The model and cache as the status line and the panels describe them."""
    kind: str                         # "local" or "vllm"
    model: str
    device: str                       # "cpu", "cuda:0", or the server's URL
    dtype: str                        # weights
    kv_dtype: str                     # cache storage
    bytes_per_token: int | None       # 2 x L x H_kv x d_h x element bytes (+ fp8 scales); None: unknown
    geometry: Geometry | None         # None: unknown geometry (a server's model we cannot match)
    max_position: int | None          # the model's own context limit
    random_weights: bool = False      # the text is gibberish by design; the cache figures are real
    weights: str | None = None        # where the weights were read from, when known


@dataclass(frozen=True, slots=True)
class ChatState:
    """One conversation's settings and cache figures at the moment of the call."""
    messages: tuple[Message, ...]     # copies: changing them changes nothing
    cap: int | None
    policy: str
    policy_description: str
    mode: str                         # "cache" or "off"
    tokens_held: int                  # tokens whose K/V this conversation holds now
    evicted_tokens: int               # evicted by sink-window, since it started
    preempted_pending: int            # tokens freed by preemption, recomputed next turn
    turns: int
    conversation: int | None = None   # the id the scheduler's RequestView and the block map's
                                      # owners name it by (None: the backend cannot tell)

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None


@runtime_checkable
class Chat(Protocol):
    """One conversation of a backend."""

    def state(self) -> ChatState: ...

    def send(self, text: str, sampling: SamplingParams | None = None,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        """Add a user message and stream the reply: one PrefillEvent, a TokenEvent per token,
        then TurnStats. Raises KvchatError (CapExceeded for a refused turn) before the first
        event if the turn cannot run; the messages are then as before the call."""

    def regenerate(self, sampling: SamplingParams | None = None,
                   cancel: threading.Event | None = None) -> Iterator[Event]:
        """Drop the last reply and stream a new one for the same history."""

    def restore(self, messages: list[Message]) -> None:
        """Replace the history (a conversation reopened from disk); the cache starts empty."""

    def truncate(self, n_messages: int) -> None:
        """Keep the first n_messages of the history and drop the rest (edit and resend: the
        edited message is sent next). The cache keeps what it holds; the next turn reuses it
        up to the block where the new text first differs, and computes the rest. Raises
        KvchatError for n_messages outside 0..len(messages)."""

    def reset_cache(self) -> int:
        """Forget the cache; the next turn prefills the whole history. Returns blocks freed."""

    def set_cap(self, cap: int | None) -> None: ...

    def set_policy(self, name: str) -> None: ...

    def set_mode(self, mode: str) -> None:
        """"cache" or "off" (recompute the whole sequence every step)."""

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None or "": none). It is the start of the prompt, so the
        cached prefix no longer matches: the next turn prefills the whole history."""

    def history_tokens(self) -> int | None:
        """Tokens the history renders to with the chat template and the generation prompt
        (a template may add a default system prompt of its own); None where the backend
        cannot tell. May wait on the backend: call it off the UI thread."""

    def message_tokens(self, text: str) -> int | None:
        """Tokens the next prompt grows by when `text` is sent: its own and the chat template's
        around a user turn (the last reply's end, the turn's markers, the reply's header); before
        the first reply, all the template puts before it too (a system prompt). None where the
        backend cannot tell without waiting (a server's /tokenize). Cheap: the draft counter
        calls it on the UI thread while the user types."""


@runtime_checkable
class Backend(Protocol):
    capabilities: Capabilities

    def info(self) -> BackendInfo: ...

    def open(self, system: str | None = None, cap: int | None = None, policy: str = "stop",
             mode: str = "cache") -> Chat:
        """A new conversation (raises KvchatError for a cap or policy it cannot take)."""

    def close(self, chat: Chat) -> None:
        """End a conversation; its full blocks may stay cached for prefix reuse."""

    def snapshot(self, chat: Chat | None = None) -> CacheSnapshot:
        """The cache now, with `chat`'s blocks marked (the panels draw this)."""

    def scheduler(self) -> SchedulerSnapshot | None:
        """Every conversation's request state and the recent steps (the crowd panel draws
        this); None where the backend cannot see its scheduler (a server seen from outside)."""

    def count_tokens(self, text: str) -> int | None:
        """Tokens `text` encodes to (no chat template); None where the backend cannot tell
        cheaply. Cheap and lock-free: the UI thread calls it as the user types."""

    def set_kv_dtype(self, kv_dtype: str) -> str:
        """Rebuild the cache in another storage dtype (every conversation recomputes its
        history next turn); returns the dtype now in force."""

    def shutdown(self) -> None:
        """Release what the backend holds (connections, subscriber threads)."""
