"""One conversation as the app holds it: a ChatView is its transcript, and keeps with it
the backend's Chat, its log on disk, its turn records, its latency history, its settings as
the backend last reported them (a ChatState: cap, policy, mode, tokens held...) and the last
cache snapshot taken while it was in focus.

The app keeps one ChatView per open conversation in a ContentSwitcher and draws the panels
for the one in focus (kvchat/chat/conversations.py switches between them). A turn is a
RunningTurn; its worker (jobs.run_turn) posts TurnProgress and TurnEnded to the turn's
ChatView, which draws the reply here; the messages bubble on to the app, which draws the
panels.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from textual.message import Message

from kvchat.engine.telemetry import CacheSnapshot, TurnStats

from ..backends.protocol import Backend, Chat, ChatState
from ..latency import LatencyData
from ..store.records import TurnRecord
from ..text import plural
from ..store.log import ConversationLog, Restored
from .relay import Progress
from ..widgets import Reply, Transcript, UserMessage


@dataclass(slots=True)
class ChatOptions:
    """The settings a conversation starts with (a new one inherits the focused one's)."""
    system: str | None = None
    cap: int | None = None
    policy: str = "stop"
    mode: str = "cache"


def open_chat(backend: Backend, options: ChatOptions, data_root: Path | None = None,
              restored: Restored | None = None) -> tuple[Chat, ConversationLog, list[TurnRecord]]:
    """A new conversation and its log, or one reopened from its log (its cache empty: the
    next turn prefills the restored history). May block: call it from a worker when the
    backend is busy."""
    if restored is not None:
        chat = backend.open(cap=restored.cap, policy=restored.policy, mode=restored.mode)
        chat.restore(restored.messages)
        log = ConversationLog(restored.path, restored.messages, restored=restored)   # the log read once
        log.event("resumed")
        return chat, log, list(restored.turns)
    chat = backend.open(system=options.system, cap=options.cap, policy=options.policy, mode=options.mode)
    log = ConversationLog.create(data_root, model=backend.info().model, system=options.system,
                                 cap=options.cap, policy=options.policy, mode=options.mode)
    return chat, log, []


@dataclass(slots=True, eq=False)
class RunningTurn:
    """A turn from the moment it is asked for (it may wait in the job queue) to its end."""
    view: ChatView                      # the conversation it belongs to
    text: str | None                    # the message to send; None regenerates the last reply
    shown: str | None = None            # what the transcript shows instead (a /load preview)
    typed: str | None = None            # what goes back into the input if the turn is refused
    user: UserMessage | None = None     # the message's widget, once shown
    reply: Reply | None = None          # the reply's widget, once the turn starts
    cancel: threading.Event = field(default_factory=threading.Event)
    prefilled: bool = False             # the backend accepted the turn (its PrefillEvent came)


class TurnProgress(Message):
    """From the turn's worker: a batch of its tokens and latency points, and (usually) a
    cache snapshot of `focus`, the conversation in focus when it was taken."""

    def __init__(self, turn: RunningTurn, progress: Progress, focus: ChatView) -> None:
        super().__init__()
        self.turn, self.progress, self.focus = turn, progress, focus
        self.drawn = threading.Event()    # set once the app has drawn it (the worker may wait on it)


class TurnEnded(Message):
    """From the turn's worker: stats and its record when it produced a reply, error when it
    failed; accepted is False when nothing of it entered the conversation (a refused turn).
    The snapshot is of `focus`, the conversation in focus when it was taken."""

    def __init__(self, turn: RunningTurn, stats: TurnStats | None, record: TurnRecord | None,
                 error: str | None = None, accepted: bool = True, snapshot: CacheSnapshot | None = None,
                 focus: ChatView | None = None) -> None:
        super().__init__()
        self.turn, self.stats, self.record, self.error, self.accepted = turn, stats, record, error, accepted
        self.snapshot, self.focus = snapshot, focus


class LogFailed(Message):
    """From any thread: this conversation's log could not be written (one line)."""

    def __init__(self, line: str) -> None:
        super().__init__()
        self.line = line


class ChatView(Transcript):
    """A conversation's transcript and state. The first one is on screen before the model
    loads (it shows the progress); `attach` gives it its Chat."""

    DEFAULT_CSS = """
    ChatView .dropped { text-opacity: 50%; }
    """

    def __init__(self, number: int, id: str | None = None) -> None:
        super().__init__(id=id or f"transcript-{number}")
        self.number = number                      # shown in the conversation bar; /switch N
        self.chat: Chat | None = None
        self.conversation_log: ConversationLog | None = None
        self.state: ChatState | None = None       # as the backend last reported it
        self.turns: list[TurnRecord] = []         # one per reply, the restored ones first
        self.latency = LatencyData()
        self.snapshot: CacheSnapshot | None = None   # the latest taken while it was in focus
        self.prompt_tokens = 0                    # this turn's prompt, while it streams
        self.context_tokens = 0                   # prompt + generated, the last turn
        self.preempted_noted = False              # its transcript already says it was preempted
        self.given_title: str | None = None       # set by a rename in the chat browser
        self.editing: int | None = None           # index of the user message being edited (editing.py)

    def attach(self, chat: Chat, log: ConversationLog, turns: list[TurnRecord]) -> None:
        self.chat, self.conversation_log = chat, log
        # from the reply's worker too: a log that cannot be written is one line here, and the
        # turn goes on (the log keeps its records in memory)
        log.on_error = lambda line: self.post_message(LogFailed(line))
        if log.error:
            self.post_message(LogFailed(log.error))
        self.turns = list(turns)
        for record in self.turns:
            self.latency.add_turn(record)
        self.refresh_state()

    def on_unmount(self) -> None:
        """Closed or the app ends: release the log's file and its lock, as a process exit would
        (the same process may open the conversation again: the browser, a test)."""
        if self.conversation_log is not None:
            self.conversation_log.close()

    def refresh_state(self) -> ChatState:
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
        """The title given in the chat browser, else the first thing the user said, or "new"."""
        if self.given_title:
            return self.given_title[:13] + "…" if len(self.given_title) > 14 else self.given_title
        first = next((m["content"] for m in self.state.messages if m["role"] == "user"), "")
        words = " ".join(first.split())
        return (words[:13] + "…" if len(words) > 14 else words) or "new"

    def options(self) -> ChatOptions:
        """The settings a new conversation inherits from this one."""
        s = self.state
        return ChatOptions(system=s.system, cap=s.cap, policy=s.policy, mode=s.mode)

    def describe(self, focused: bool) -> str:
        """Its line in /list."""
        s = self.refresh_state()
        cap = f"cap {s.cap:,}" if s.cap else "no cap"
        line = (f"{'●' if focused else ' '} {self.number} {self.title} · {plural(len(self.turns), 'turn')} · "
                f"{s.tokens_held:,} tokens cached · {cap} · {s.policy}")
        if s.mode != "cache":
            line += " · cache off"
        if s.preempted_pending:
            line += f" · preempted: {s.preempted_pending:,} tokens to recompute"
        return line

    # ---- a turn, as this transcript shows it ------------------------------------------------------
    def ask(self, text: str | None, shown: str | None = None, typed: str | None = None) -> RunningTurn:
        """A turn to queue: the message shows at once, the reply when the turn starts."""
        turn = RunningTurn(self, text, shown, typed)
        if text is not None:
            turn.user = UserMessage(shown or text)
            self.mount(turn.user)
        return turn

    async def begin(self, turn: RunningTurn) -> None:
        """The turn starts: a regenerated reply replaces the last one; an empty reply waits."""
        if turn.text is None:
            last = self.last_reply()
            if last is not None:
                await last.remove()
        turn.reply = await self.start_reply()
        backend = getattr(self.app, "backend", None)
        state = self.refresh_state()
        self.latency.begin_turn(state.mode, kv_dtype=backend.info().kv_dtype if backend is not None else None,
                                policy=state.policy, cap=state.cap)

    def on_log_failed(self, msg: LogFailed) -> None:
        self.add_notice(msg.line, error=True)
    def mark_dropped(self, n: int, policy: str | None) -> int:
        """Dim the n oldest messages the model still saw: drop-oldest took them out of what
        it reads, not out of the transcript. Returns how many were marked."""
        shown = [w for w in self.query("UserMessage, Reply")
                 if not w.has_class("dropped") and not w.has_class("refused")]
        marked = shown[:n]
        for w in marked:
            w.add_class("dropped")
            w.tooltip = "the model no longer sees this message"
        if marked:
            backend = getattr(self.app, "backend", None)
            top = backend.info().max_position if backend is not None else None
            cap = self.state.cap if self.state is not None else None
            limit = (f"the cap of {cap:,}" if cap is not None and (top is None or cap <= top)
                     else f"the model's maximum context of {top:,}" if top else "the limit")
            self.add_notice(f"{plural(len(marked), 'message')} dimmed above: {policy or 'the policy'} dropped "
                            f"{'it' if len(marked) == 1 else 'them'} to stay under {limit} tokens; the model no "
                            "longer sees them (the transcript and the saved log keep them)")
        return len(marked)

    async def on_turn_progress(self, msg: TurnProgress) -> None:
        p = msg.progress
        if msg.turn.reply is not None and not getattr(self.app, "exiting", False):
            await msg.turn.reply.append(p.text)
        if p.prefill is not None:
            self.prompt_tokens = p.prefill.prompt_tokens
        self.context_tokens = self.prompt_tokens + p.generated

    async def on_turn_ended(self, msg: TurnEnded) -> None:
        if getattr(self.app, "exiting", False):
            return
        turn = msg.turn
        if not msg.accepted:
            if turn.reply is not None:
                await turn.reply.remove()
            if turn.user is not None:
                turn.user.refuse(msg.error or "")
            self.add_notice(msg.error or "the turn was refused", error=True)
        else:
            if turn.reply is not None:
                await turn.reply.finish(msg.record, error=msg.error)
            if msg.record is not None:
                self.turns.append(msg.record)
                self.context_tokens = msg.record.context_tokens
                if msg.record.dropped_messages:
                    self.mark_dropped(msg.record.dropped_messages, msg.record.policy)
        if msg.stats is not None:
            self.snapshot = msg.stats.cache
        self.refresh_state()
