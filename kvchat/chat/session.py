"""One conversation as kvchat keeps it: a Session, plain data, apart from the ChatView that
draws it (kvchat/chat/view.py).

A Session holds the backend's Chat, its log on disk, its turn records, its latency history,
its settings as the backend last reported them (a ChatState: cap, policy, mode, tokens
held...), the last cache snapshot taken while it was in focus, and what the user set on it
(a title, the message being edited). The chat screen keeps one per open conversation; the
worker's messages update it (`begin_turn`, `progress`, `end_turn`), and the panels and the
conversation's transcript draw from it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.telemetry import CacheSnapshot, TurnStats

from ..backends.protocol import Backend, Chat, ChatState, Message
from ..host_load import HostSampler
from ..latency import LatencyData
from ..store.history import replies
from ..store.log import ConversationLog, Restored
from ..store.records import TurnRecord
from ..text import plural
from . import numbering
from .relay import Progress

TITLE_CHARS = 14        # the conversation bar's label: longer titles are cut to 13 and "…"


@dataclass(slots=True)
class ChatOptions:
    """The settings a conversation starts with (a new one inherits the focused one's)."""
    system: str | None = None
    cap: int | None = None
    policy: str = "stop"
    mode: str = "cache"


def dropped_by(before: Sequence[Message], after: Sequence[Message]) -> int:
    """How many of the oldest messages a send dropped: `after` is `before` with the new user
    message appended and that many messages after the system prompt taken off (drop-oldest);
    0 for any other change (a backend that adds the message only once the reply is done)."""
    k = len(before) + 1 - len(after)
    s = 1 if before and before[0]["role"] == "system" else 0
    if k <= 0 or not after or after[-1]["role"] != "user" or list(after[:s]) != list(before[:s]):
        return 0
    return k if list(after[s:-1]) == list(before[s + k:]) else 0


class Session:
    def __init__(self, number: int, chat: Chat, log: ConversationLog, turns: list[TurnRecord],
                 max_position: int | None = None) -> None:
        self.number = number                      # shown in the conversation bar; /switch N
        self.chat = chat
        self.log = log
        self.turns = list(turns)                  # one per reply, the restored ones first
        self.latency = LatencyData(max_position)  # the model's maximum: sink-window's window without a cap
        self.host = HostSampler()                 # the other processes' share of the cores, per turn
        for record in self.turns:
            self.latency.add_turn(record)
        self.state: ChatState = chat.state()      # as the backend last reported it
        self.snapshot: CacheSnapshot | None = None   # the latest taken while it was in focus
        self.prompt_tokens = 0                    # this turn's prompt, while it streams
        # the conversation's tokens: the last turn's prompt and reply (a reopened one's too), this
        # turn's so far once its prompt is in; what the cap is checked against
        self.context_tokens = self.turns[-1].context_tokens if self.turns else 0
        self._prompt_in = False                   # this turn's PrefillEvent came
        self.preempted_noted = False              # its transcript already says it was preempted
        self.given_title: str | None = None       # set by a rename in the chat browser
        self.editing: int | None = None           # index of the user message being edited (editing.py)

    @classmethod
    def open(cls, backend: Backend, number: int, options: ChatOptions, data_root: Path | None = None,
             restored: Restored | None = None) -> Session:
        """A new conversation and its log, or one reopened from its log (its cache empty: the
        next turn prefills the restored history). May block: call it from a worker when the
        backend is busy."""
        if restored is not None:
            chat = backend.open(cap=restored.cap, policy=restored.policy, mode=restored.mode)
            chat.restore(restored.visible)
            log = ConversationLog(restored.path, restored.messages, restored=restored)   # the log read once
            log.mark("resumed")
            return cls(number, chat, log, restored.turns, backend.info().max_position)
        chat = backend.open(system=options.system, cap=options.cap, policy=options.policy, mode=options.mode)
        log = ConversationLog.create(data_root, model=backend.info().model, system=options.system,
                                     cap=options.cap, policy=options.policy, mode=options.mode)
        numbering.remember(log, number)          # held with the start record until the first message
        return cls(number, chat, log, [], backend.info().max_position)

    def refresh(self) -> ChatState:
        """Read the backend's view of this conversation again (cheap, lock-free)."""
        self.state = self.chat.state()
        return self.state

    @property
    def cap(self) -> int | None:
        return self.state.cap

    @property
    def policy(self) -> str:
        return self.state.policy

    @property
    def mode(self) -> str:
        return self.state.mode

    @property
    def title(self) -> str:
        """The title given in the chat browser, else the first thing the user said (dropped by
        drop-oldest or not), or "new"."""
        said = (m["content"] for m in (*self.log.messages, *self.state.messages) if m["role"] == "user")
        first = next(said, "")
        words = self.given_title or " ".join(first.split())
        return (words[:TITLE_CHARS - 1] + "…" if len(words) > TITLE_CHARS else words) or "new"

    @property
    def turn_count(self) -> int:
        """Its turns: the replies in the conversation, drop-oldest's dropped ones included. A
        regenerated reply takes the place of the one before, so it is no other turn; `turns`
        keeps a record for every reply generated (the telemetry)."""
        return replies(self.log.messages)

    def options(self) -> ChatOptions:
        """The settings a new conversation inherits from this one."""
        s = self.state
        return ChatOptions(system=s.system, cap=s.cap, policy=s.policy, mode=s.mode)

    def describe(self, focused: bool) -> str:
        """Its line in /list."""
        s = self.refresh()
        cap = f"cap {s.cap:,}" if s.cap else "no cap"
        line = (f"{'●' if focused else ' '} {self.number} {self.title} · {plural(self.turn_count, 'turn')} · "
                f"{s.tokens_held:,} tokens cached · {cap} · {s.policy}")
        if s.mode != "cache":
            line += " · cache off"
        if s.preempted_pending:
            line += f" · preempted: {s.preempted_pending:,} tokens to recompute"
        return line

    def new_latency_series(self, first: int) -> None:
        """Keep only the turns from `first` on in the latency history (the ones before ran on
        another model: their points measured other weights)."""
        self.latency = LatencyData(self.latency.max_position)
        for record in self.turns[first:]:
            self.latency.add_turn(record)

    # ---- a turn, as the worker's messages report it -------------------------------------------------
    def begin_turn(self, kv_dtype: str | None) -> None:
        """The turn starts: its latency points go to the series of its cache mode and KV dtype."""
        s = self.refresh()
        self._prompt_in = False
        self.latency.begin_turn(s.mode, kv_dtype=kv_dtype, policy=s.policy, cap=s.cap)
        self.host.start()

    def progress(self, p: Progress) -> None:
        """A batch of the reply; with a snapshot, the backend's state is read again (the panels
        draw both)."""
        self.latency.add_points(p.points)
        if p.snapshot is not None:
            self.refresh()
        if p.prefill is not None:
            self.prompt_tokens = p.prefill.prompt_tokens
            self._prompt_in = True
        if self._prompt_in:
            self.context_tokens = self.prompt_tokens + p.generated

    def end_turn(self, record: TurnRecord | None, stats: TurnStats | None) -> None:
        """The live latency points give way to the record's exact ones; the record joins the
        turns (None: the turn produced no reply)."""
        self.latency.host = self.host.stop() or self.latency.host
        self.latency.end_turn(record)
        if record is not None:
            self.turns.append(record)
            self.context_tokens = record.context_tokens
        if stats is not None:
            self.snapshot = stats.cache
        self.refresh()
