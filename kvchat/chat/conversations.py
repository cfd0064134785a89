"""Several conversations in the backend's one pool, like a server's users.

`Conversations` holds the open ChatViews (each draws its own Session: transcript, latency
history, cap, policy, log), which one is in focus, and their numbers. The panels draw the
focused one; the block map shows the others' blocks as "other chats" and blocks two
conversations hold at once (the shared system prompt) as "shared". Switching is immediate
and touches only widgets: the fresh snapshot comes from the job in progress (a turn
snapshots whichever conversation is in focus) or from a snapshot job when idle. Opening
and closing go through the job queue when the backend is busy; neither stops a reply in
another conversation. The backend runs one turn at a time, so a message sent while another
conversation replies waits in the job queue, as a server's request would.

When the pool is full the engine preempts idle conversations (vLLM's rule: the most
recently started first); after each turn `note_preemptions` tells each one so in its own
transcript, and its tab says "preempted" until its next turn recomputes the cache.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvchat.engine.errors import KvchatError

from ..widgets.conversation_bar import Entry
from .host import Host
from .jobs import Busy, RunningTurn
from .messages import LogFailed
from .session import ChatOptions, Session
from .view import ChatView


def read_the_cache() -> None:
    """An op that only takes a fresh snapshot (the worker takes one after every op)."""


class Conversations:
    def __init__(self, host: Host, data_root: Path | None = None) -> None:
        self.host = host
        self.data_root = data_root                 # None: the platform's user data dir
        self.views: list[ChatView] = []
        self.focused: ChatView | None = None
        self.next_number = 1
        self.on_change: Callable[[], None] | None = None   # the open set changed (browser.remember)

    @property
    def session(self) -> Session | None:
        """The conversation in focus (None until the backend is loaded)."""
        return self.focused.session if self.focused is not None else None

    @property
    def sessions(self) -> list[Session]:
        return [v.session for v in self.views if v.session is not None]

    def number(self) -> int:
        n, self.next_number = self.next_number, self.next_number + 1
        return n

    def claim(self, wanted: int | None) -> int:
        """`wanted` (a resumed conversation's own number) unless an open one has it; else the next."""
        if wanted is None or any(v.number == wanted for v in self.views):
            return self.number()
        self.next_number = max(self.next_number, wanted + 1)
        return wanted

    def view_of(self, session: Session) -> ChatView | None:
        return next((v for v in self.views if v.session is session), None)

    def find(self, number: int) -> ChatView | None:
        found = next((v for v in self.views if v.number == number), None)
        if found is None:
            self.host.notice(f"no conversation {number}; open: {', '.join(str(v.number) for v in self.views)}",
                             error=True)
        return found

    async def add(self, view: ChatView, session: Session) -> None:
        """List a view with its session, mounting it (hidden until focused) if it is new."""
        view.attach(session)
        # from the reply's worker too: a log that cannot be written is one line in its
        # transcript, and the turn goes on (the log keeps its records in memory)
        post = self.host.post_message

        def failed(line: str) -> None:
            post(LogFailed(session, line))
        session.log.on_error = failed
        if session.log.error:
            failed(session.log.error)
        if not view.is_attached:
            view.display = False
            await self.host.transcripts.mount(view)
        self.views.append(view)
        if self.on_change is not None:
            self.on_change()

    def switch_to(self, view: ChatView, fresh: bool = True) -> None:
        """Focus a conversation: its transcript, latency history and last snapshot at once,
        then (fresh, when idle) a new snapshot, as the others' blocks may have moved."""
        host = self.host
        if view is not self.focused and view.session is not None:
            self.focused = view
            host.transcripts.current = view.id
            view.session.refresh()
            host.panels.show(view.session, host.backend.info())
            host.show_settings()
        self.refresh_bar()
        if fresh and host.jobs.busy is None:
            host.run_op("read the cache", read_the_cache, interrupt=False)

    def refresh_bar(self) -> None:
        if self.focused is None:
            return
        jobs = self.host.jobs
        replying = jobs.replying.view if jobs.replying is not None else None
        queued = {job.view for job in jobs if isinstance(job, RunningTurn)}
        entries = [Entry(v.number, s.title, s.turn_count,
                         "replying" if v is replying else "queued" if v in queued
                         else "preempted" if s.state.preempted_pending else "")
                   for v in self.views if (s := v.session) is not None]
        km = self.host.key_display
        hint = (f"{km('previous_conversation')} {km('next_conversation')} switch · "
                f"{km('new_conversation')} new · {km('close_conversation')} close")
        self.host.bar.show(entries, self.focused.number, hint)

    # ---- keys and commands -------------------------------------------------------------------
    async def new(self) -> None:
        """Open one at once, even mid-reply, when the backend can take it (opening takes no
        lock); one that starts with the cache off, or one asked for during another operation
        (a pool rebuild), waits for the job in progress."""
        host, session = self.host, self.session
        if session is None:
            return
        options = session.options()
        if host.jobs.busy is None or (host.jobs.busy is Busy.REPLY and options.mode == "cache"):
            await self._open(options)
        else:
            host.run_op("open a new conversation", read_the_cache, then=lambda: self._open(options),
                        interrupt=False)

    async def _open(self, options: ChatOptions) -> None:
        host = self.host
        number = self.number()
        try:
            session = Session.open(host.backend, number, options, self.data_root)
        except (KvchatError, OSError) as err:
            host.notice(f"cannot open a new conversation: {err}", error=True)
            return
        view = ChatView(number)
        await self.add(view, session)
        self.switch_to(view, fresh=False)
        host.run_op("read the cache", read_the_cache, interrupt=False)
        host.notice(f"conversation {view.number}: new, in the same pool as {len(self.views) - 1} "
                    "other(s), which stay open; their blocks show as other chats in the block map")
        s = session.state
        system = "its system prompt" if s.system else "no system prompt"
        host.panels.note(f"conversation {view.number} inherits {f'cap {s.cap:,}' if s.cap else 'no cap'}, "
                         f"policy {s.policy} and {system} from the one it was opened from; sampling "
                         f"({host.panels.sampling}) is shared by every conversation")

    def step(self, delta: int) -> None:
        if self.focused is None:
            return
        if len(self.views) < 2:
            self.host.notice(f"only one conversation is open; {self.host.keymap['new_conversation']} opens another")
            return
        i = self.views.index(self.focused)
        self.switch_to(self.views[(i + delta) % len(self.views)])

    def switch(self, number: int) -> None:
        target = self.find(number)
        if target is not None:
            self.switch_to(target)

    def close(self, number: int | None) -> None:
        """Close one conversation (default: the focused one). Its log stays on disk and its
        full blocks stay cached for reuse; closing the last one opens a new one."""
        host = self.host
        target = self.focused if number is None else self.find(number)
        if target is None or target.session is None:
            return
        closing = target.session
        new = ChatView(self.number()) if len(self.views) == 1 else None
        opened: list[Session] = []
        after: list[ChatView] = []

        def run() -> str:
            if new is not None:
                opened.append(Session.open(host.backend, new.number, closing.options(), self.data_root))
                after.append(new)
            else:
                focused = self.focused
                after.append(focused if focused is not None and focused is not target else self._neighbour(target))
            host.backend.close(closing.chat)
            closing.log.event("closed")
            closing.log.close()
            note = f"closed conversation {target.number} (saved as {closing.log.path.name}); its full blocks stay cached"
            return note + (f"; conversation {new.number} is new" if new is not None else "")

        def focus() -> Session:           # whose snapshot the op takes: the one in focus after the close
            return opened[0] if after[0] is new else after[0].session or closing

        async def then() -> None:
            if new is not None:
                await self.add(new, opened[0])
            elif target is self.focused:     # the focus may have moved since the worker chose
                after[0] = self._neighbour(target)
            self.views.remove(target)
            if self.on_change is not None:
                self.on_change()
            self.switch_to(after[0] if target is self.focused else self.focused or after[0], fresh=False)
            await target.remove()
            self.refresh_bar()
        replying = host.jobs.replying_in(target)
        host.run_op(f"close conversation {target.number}", run, then, focus=focus, interrupt=replying)

    def _neighbour(self, target: ChatView) -> ChatView:
        """The conversation that takes the focus when target closes: the next, else the previous."""
        i = self.views.index(target)
        return self.views[i + 1] if i + 1 < len(self.views) else self.views[i - 1]

    def list(self) -> None:
        lines = [f"{len(self.views)} conversations share the pool (● is this one):"]
        lines += [s.describe(v is self.focused) for v in self.views if (s := v.session) is not None]
        self.host.notice("\n".join(lines))

    # ---- preemption ----------------------------------------------------------------------------
    def note_preemptions(self, by: Session | None) -> None:
        """Tell each newly preempted conversation, in its own transcript, what happened."""
        for v in self.views:
            s = v.session
            if s is None:
                continue
            pending = s.refresh().preempted_pending
            if pending and not s.preempted_noted:
                s.preempted_noted = True
                who = f"conversation {by.number}" if by is not None else "another conversation"
                notice = v.add_notice(
                    f"preempted: {who} needed room in the pool, so this conversation's cache was freed; "
                    f"its next turn recomputes {pending:,} tokens")
                notice.add_class("warning")
            elif not pending:
                s.preempted_noted = False
        self.refresh_bar()
