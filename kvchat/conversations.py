"""Several conversations in the engine's one pool, like a server's users.

A mixin of KvChatApp. Each conversation (a ChatSession) keeps its own transcript widget,
latency history, cap, policy and log file; the panels draw the focused one, and the block
map shows the others' blocks as "other chats" and blocks two conversations hold at once
(the shared system prompt) as "shared". Switching is immediate and touches only widgets:
the fresh snapshot comes from the job in progress (a turn snapshots whichever
conversation is in focus) or from a snapshot job when idle. Opening and closing go
through the job queue, since the engine's list of conversations is read under its lock;
neither stops a reply in another conversation. The engine runs one turn at a time, so a
message sent while another conversation replies waits in the job queue, as a server's
request would.

When the pool is full the engine preempts idle conversations (vLLM's rule: the most
recently started first); after each turn `note_preemptions` tells each one so in its own
transcript, and its tab says "preempted" until its next turn recomputes the cache.
"""
from __future__ import annotations

from textual.binding import Binding

from kvchat.engine.errors import KvchatError
from kvchat.engine.telemetry import CacheSnapshot

from .session import ChatSession
from .widgets import BlockMap, CachePanel, CapGauge, ConversationBar, LatencyPanel, Transcript
from .widgets.conversation_bar import Entry


class Conversations:
    sessions: list[ChatSession]
    session: ChatSession | None
    turn_session: ChatSession | None
    waiting: set[ChatSession]                  # with a turn queued behind another's
    next_number: int

    @property
    def transcript(self) -> Transcript:
        """The focused conversation's transcript (the first one while the model loads)."""
        return self.session.transcript if self.session is not None else self.part("#transcript")

    def find_session(self, number: int) -> ChatSession | None:
        found = next((s for s in self.sessions if s.number == number), None)
        if found is None:
            self.notice(f"no conversation {number}; open: {', '.join(str(s.number) for s in self.sessions)}",
                        error=True)
        return found

    async def add_session(self, session: ChatSession, transcript: Transcript | None = None) -> None:
        """Give a new session its transcript (hidden until focused) and list it."""
        if transcript is None:
            transcript = Transcript(id=f"transcript-{session.number}")
            transcript.display = False
            await self.part("#transcripts").mount(transcript)
        session.transcript = transcript
        self.sessions.append(session)

    def switch_to(self, session: ChatSession, fresh: bool = True) -> None:
        """Focus a conversation: its transcript, latency history and last snapshot at once,
        then (fresh, when idle) a new snapshot, as the others' blocks may have moved."""
        if session is not self.session:
            self.session = session
            self.part("#transcripts").current = session.transcript.id
            self.part(LatencyPanel).attach(session.latency)
            if session.snapshot is not None:
                self.show_snapshot(session.snapshot)
            else:
                self.update_gauge()
            self.update_status()
        self.refresh_bar()
        if fresh and self.busy is None:
            self.run_op("read the cache", lambda: None, interrupt=False)

    def refresh_bar(self) -> None:
        if self.session is None:
            return
        replying = self.turn_session if self.busy == "reply" else None
        entries = [Entry(s.number, s.title, len(s.turns),
                         "replying" if s is replying else "queued" if s in self.waiting
                         else "preempted" if s.preempted_tokens else "")
                   for s in self.sessions]
        km = {k: self.get_key_display(Binding(v.split(",")[0].strip(), "")) for k, v in self.keymap().items()}
        hint = (f"{km['previous_conversation']} {km['next_conversation']} switch · "
                f"{km['new_conversation']} new · {km['close_conversation']} close")
        self.part(ConversationBar).show(entries, self.session.number, hint)

    # ---- the focused conversation's panels ------------------------------------------------------
    def take_snapshot(self, session: ChatSession | None, snap: CacheSnapshot) -> None:
        """Keep a session's snapshot; draw it if that session is in focus."""
        if session is None:
            return
        session.snapshot = snap
        if session is self.session:
            self.show_snapshot(snap)

    def show_snapshot(self, snap: CacheSnapshot) -> None:
        self.part(CachePanel).show(snap, self.engine.geometry)
        self.part(BlockMap).show(snap)
        self.update_gauge()

    def update_gauge(self) -> None:
        session = self.session
        conv = session.conv
        held = session.snapshot.tokens_held if session.snapshot is not None else 0
        tokens = held if conv.mode == "cache" else session.context_tokens
        self.part(CapGauge).show(tokens, conv.cap, conv.policy.name, conv.policy.description,
                                 self.engine.geometry.max_position, evicted=conv.evicted_tokens)

    # ---- keys and commands -------------------------------------------------------------------
    def action_new_conversation(self) -> None:
        """Open one at once, even mid-reply: Engine.new_conversation takes no lock. Only a
        conversation that starts with the cache off (set_mode takes the lock) or one asked
        for during another operation (a pool rebuild) waits for the job in progress."""
        options = self.session.options()
        if self.busy is None or (self.busy == "reply" and options.mode == "cache"):
            self.call_later(self._open, options)
        else:
            self.run_op("open a new conversation", lambda: None, then=lambda: self._open(options), interrupt=False)

    async def _open(self, options) -> None:
        try:
            session = ChatSession.start(self.engine, options, self.options.data_root)
        except (KvchatError, OSError) as err:
            self.notice(f"cannot open a new conversation: {err}", error=True)
            return
        session.number = self.next_number
        self.next_number += 1
        await self.add_session(session)
        self.switch_to(session, fresh=False)
        self.run_op("read the cache", lambda: None, interrupt=False)
        self.notice(f"conversation {session.number}: new, in the same pool as {len(self.sessions) - 1} "
                    "other(s), which stay open; their blocks show as other chats in the block map")

    def action_next_conversation(self) -> None:
        self._step(+1)

    def action_previous_conversation(self) -> None:
        self._step(-1)

    def _step(self, delta: int) -> None:
        if len(self.sessions) < 2:
            self.notice(f"only one conversation is open; {self.keymap()['new_conversation']} opens another")
            return
        i = self.sessions.index(self.session)
        self.switch_to(self.sessions[(i + delta) % len(self.sessions)])

    def action_switch_conversation(self, number: int) -> None:
        """A click on the conversation bar, or /switch N."""
        target = self.find_session(number)
        if target is not None:
            self.switch_to(target)

    def action_close_conversation(self) -> None:
        self.close_conversation(None)

    def close_conversation(self, number: int | None) -> None:
        """Close one conversation (default: the focused one). Its log stays on disk and its
        full blocks stay cached for reuse; closing the last one opens a new one."""
        target = self.session if number is None else self.find_session(number)
        if target is None:
            return
        last = len(self.sessions) == 1
        new_number = self.next_number
        if last:
            self.next_number += 1
        after: list[ChatSession] = []

        def run() -> str:
            if last:
                session = ChatSession.start(self.engine, target.options(), self.options.data_root)
                session.number = new_number
                after.append(session)
            else:
                after.append(self.session if self.session is not target else self._neighbour(target))
            self.engine.close_conversation(target.conv)
            target.log.event("closed")
            target.log.close()
            note = f"closed conversation {target.number} (saved as {target.log.path.name}); its full blocks stay cached"
            return note + (f"; conversation {new_number} is new" if last else "")

        async def then() -> None:
            if last:
                await self.add_session(after[0])
            elif target is self.session:     # the focus may have moved since the worker chose
                after[0] = self._neighbour(target)
            self.sessions.remove(target)
            self.switch_to(after[0] if target is self.session else self.session, fresh=False)
            await target.transcript.remove()
            self.refresh_bar()
        replying = self.busy == "reply" and self.turn_session is target
        self.run_op(f"close conversation {target.number}", run, then, focus=lambda: after[0], interrupt=replying)

    def _neighbour(self, target: ChatSession) -> ChatSession:
        """The conversation that takes the focus when target closes: the next, else the previous."""
        i = self.sessions.index(target)
        return self.sessions[i + 1] if i + 1 < len(self.sessions) else self.sessions[i - 1]

    def list_conversations(self) -> None:
        lines = [f"{len(self.sessions)} conversations share the pool (● is this one):"]
        for s in self.sessions:
            conv = s.conv
            cap = f"cap {conv.cap:,}" if conv.cap else "no cap"
            line = (f"{'●' if s is self.session else ' '} {s.number} {s.title} · {len(s.turns)} turns · "
                    f"{conv.tokens_held:,} tokens cached · {cap} · {conv.policy.name}")
            if conv.mode != "cache":
                line += " · cache off"
            if s.preempted_tokens:
                line += f" · preempted: {s.preempted_tokens:,} tokens to recompute"
            lines.append(line)
        self.notice("\n".join(lines))

    # ---- preemption ----------------------------------------------------------------------------
    def note_preemptions(self, by: ChatSession | None) -> None:
        """Tell each newly preempted conversation, in its own transcript, what happened."""
        for s in self.sessions:
            pending = s.preempted_tokens
            if pending and not s.preempted_noted:
                s.preempted_noted = True
                who = f"conversation {by.number}" if by is not None else "another conversation"
                notice = s.transcript.add_notice(
                    f"preempted: {who} needed room in the pool, so this conversation's cache was freed; "
                    f"its next turn recomputes {pending:,} tokens")
                notice.add_class("warning")
            elif not pending:
                s.preempted_noted = False
        self.refresh_bar()
