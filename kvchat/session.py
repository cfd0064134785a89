"""One conversation as the app holds it: the engine's Conversation, its log on disk, and
the per-turn telemetry summaries that the panels draw.

The app holds a list of sessions and one current session; today "new conversation"
replaces the current one, and several live sessions sharing the pool only need a switcher.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .store import ConversationLog, Restored


@dataclass(slots=True)
class SessionOptions:
    system: str | None = None
    cap: int | None = None
    policy: str = "stop"
    mode: str = "cache"


@dataclass(slots=True)
class ChatSession:
    conv: Any                                  # engine.Conversation, or a test's stand-in
    log: ConversationLog
    turns: list[dict[str, Any]] = field(default_factory=list)   # TurnStats.summary() per reply

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

    def record_turn(self, summary: dict[str, Any]) -> None:
        self.turns.append(summary)
        self.log.turn(summary)

    def options(self) -> SessionOptions:
        """The settings a new conversation inherits from this one."""
        conv = self.conv
        system = conv.messages[0]["content"] if conv.messages and conv.messages[0]["role"] == "system" else None
        return SessionOptions(system=system, cap=conv.cap, policy=conv.policy.name, mode=conv.mode)
