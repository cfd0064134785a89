"""One conversation as the app holds it: the engine's Conversation, its log on disk, the
per-turn telemetry summaries, and what its view shows (its transcript widget, its latency
history, its last cache snapshot).

The app holds several sessions, all in the engine's one pool, and draws the panels for the
focused one (kvchat/conversations.py switches between them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.engine.telemetry import CacheSnapshot

from .latency import LatencyData
from .records import TurnRecord
from .store import ConversationLog, Restored


@dataclass(slots=True)
class SessionOptions:
    system: str | None = None
    cap: int | None = None
    policy: str = "stop"
    mode: str = "cache"


@dataclass(slots=True, eq=False)       # compared and hashed by identity
class ChatSession:
    conv: Any                                  # engine.Conversation, or a test's stand-in
    log: ConversationLog
    turns: list[TurnRecord] = field(default_factory=list)   # one per reply
    number: int = 1                            # shown in the conversation bar; /switch N
    transcript: Any = None                     # its Transcript widget, once mounted
    latency: LatencyData = field(default_factory=LatencyData)
    snapshot: CacheSnapshot | None = None      # the latest taken while it was in focus
    prompt_tokens: int = 0                     # this turn's prompt, while it streams
    context_tokens: int = 0                    # prompt + generated, the last turn
    preempted_noted: bool = False              # its view already says it was preempted

    @classmethod
    def start(cls, engine, options: SessionOptions, data_root: Path | None = None,
              restored: Restored | None = None) -> ChatSession:
        """A new conversation, or one reopened from its log (its cache empty: the next turn
        prefills the restored history)."""
        cap = restored.cap if restored else options.cap
        policy = restored.policy if restored else options.policy
        mode = restored.mode if restored else options.mode
        conv = engine.new_conversation(system_prompt=None if restored else options.system,
                                       cap=cap, policy=policy)
        if mode != "cache":
            conv.set_mode(mode)
        if restored is not None:
            conv.messages = [dict(m) for m in restored.messages]
            log = ConversationLog(restored.path, conv.messages)
            log.event("resumed")
            return cls(conv, log, list(restored.turns))
        log = ConversationLog.create(data_root, model=engine.source.name, system=options.system,
                                     cap=cap, policy=policy, mode=mode)
        return cls(conv, log)

    @property
    def title(self) -> str:
        """The first thing the user said, or "new"."""
        first = next((m["content"] for m in self.conv.messages if m["role"] == "user"), "")
        words = " ".join(first.split())
        return (words[:13] + "…" if len(words) > 14 else words) or "new"

    @property
    def preempted_tokens(self) -> int:
        """Tokens freed by preemption that its next turn recomputes (0 if none)."""
        return self.conv.preempted_pending

    def record_turn(self, record: TurnRecord) -> None:
        self.turns.append(record)
        self.log.turn(record)

    def options(self) -> SessionOptions:
        """The settings a new conversation inherits from this one."""
        conv = self.conv
        system = conv.messages[0]["content"] if conv.messages and conv.messages[0]["role"] == "system" else None
        return SessionOptions(system=system, cap=conv.cap, policy=conv.policy.name, mode=conv.mode)
