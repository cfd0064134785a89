"""Several conversations in the backend's one pool, like a server's users.

`Conversations` holds the open ChatViews (each keeps its own transcript, latency history,
cap, policy and log), which one is in focus, and their numbers. The panels draw the
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

from textual.binding import Binding
from textual.widgets import ContentSwitcher

from kvchat.engine.errors import KvchatError

from .view import ChatOptions, ChatView, RunningTurn, open_chat
from .host import Host
from .jobs import Busy
from ..widgets import ConversationBar, LatencyPanel
from ..widgets.conversation_bar import Entry


class Conversations:
    def __init__(self, app: Host, data_root: Path | None = None) -> None:
        self.app = app
        self.data_root = data_root                 # None: the platform's user data dir
        self.views: list[ChatView] = []
        self.focused: ChatView | None = None
        self.next_number = 1
        self.on_change: Callable[[], None] | None = None   # the open set changed (browser.remember)

    def number(self) -> int:
        n, self.next_number = self.next_number, self.next_number + 1
        return n

    def find(self, number: int) -> ChatView | None:
        found = next((v for v in self.views if v.number == number), None)
        if found is None:
            self.app.notice(f"no conversation {number}; open: {', '.join(str(v.number) for v in self.views)}",
                            error=True)
        return found

    async def add(self, view: ChatView) -> None:
        """List a view, mounting it (hidden until focused) if it is new."""
        if not view.is_attached:
            view.display = False
            await self.app.part(ContentSwitcher).mount(view)
        self.views.append(view)
        if self.on_change is not None:
            self.on_change()

    def switch_to(self, view: ChatView, fresh: bool = True) -> None:
        """Focus a conversation: its transcript, latency history and last snapshot at once,
        then (fresh, when idle) a new snapshot, as the others' blocks may have moved."""
        app = self.app
        if view is not self.focused:
            self.focused = view
            app.part(ContentSwitcher).current = view.id
            app.part(LatencyPanel).attach(view.latency)
            view.refresh_state()
            if view.snapshot is not None:
                app.show_snapshot(view.snapshot)
            else:
                app.update_gauge()
            app.update_status()
        self.refresh_bar()
        if fresh and app.jobs.busy is None:
            app.run_op("read the cache", lambda: None, interrupt=False)

    def refresh_bar(self) -> None:
        app = self.app
        if self.focused is None:
            return
        replying = app.turn.view if app.jobs.busy is Busy.REPLY and app.turn else None
        queued = {job.view for job in app.jobs if isinstance(job, RunningTurn)}
        entries = [Entry(v.number, v.title, len(v.turns),
                         "replying" if v is replying else "queued" if v in queued
                         else "preempted" if v.state.preempted_pending else "")
                   for v in self.views]
        km = {k: app.get_key_display(Binding(v.split(",")[0].strip(), "")) for k, v in app.keymap().items()}
        hint = (f"{km['previous_conversation']} {km['next_conversation']} switch · "
                f"{km['new_conversation']} new · {km['close_conversation']} close")
        app.part(ConversationBar).show(entries, self.focused.number, hint)

    # ---- keys and commands -------------------------------------------------------------------
    def new(self) -> None:
        """Open one at once, even mid-reply, when the backend can take it (opening takes no
        lock); one that starts with the cache off, or one asked for during another operation
        (a pool rebuild), waits for the job in progress."""
        app = self.app
        options = self.focused.options()
        if app.jobs.busy is None or (app.jobs.busy is Busy.REPLY and options.mode == "cache"):
            app.call_later(self._open, options)
        else:
            app.run_op("open a new conversation", lambda: None, then=lambda: self._open(options), interrupt=False)

    async def _open(self, options: ChatOptions) -> None:
        app = self.app
        try:
            chat, log, turns = open_chat(app.backend, options, self.data_root)
        except (KvchatError, OSError) as err:
            app.notice(f"cannot open a new conversation: {err}", error=True)
            return
        view = ChatView(self.number())
        view.attach(chat, log, turns)
        await self.add(view)
        self.switch_to(view, fresh=False)
        app.run_op("read the cache", lambda: None, interrupt=False)
        app.notice(f"conversation {view.number}: new, in the same pool as {len(self.views) - 1} "
                   "other(s), which stay open; their blocks show as other chats in the block map")
        s = view.state
        app.status_note(f"conversation {view.number} inherits {f'cap {s.cap:,}' if s.cap else 'no cap'} and policy "
                        f"{s.policy}{' and the system prompt' if s.system else ''} from the one it was opened from")

    def step(self, delta: int) -> None:
        if len(self.views) < 2:
            self.app.notice(f"only one conversation is open; {self.app.keymap()['new_conversation']} opens another")
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
        app = self.app
        target = self.focused if number is None else self.find(number)
        if target is None:
            return
        last = len(self.views) == 1
        new = ChatView(self.number()) if last else None
        after: list[ChatView] = []

        def run() -> str:
            if new is not None:
                new.attach(*open_chat(app.backend, target.options(), self.data_root))
                after.append(new)
            else:
                after.append(self.focused if self.focused is not target else self._neighbour(target))
            app.backend.close(target.chat)
            target.conversation_log.event("closed")
            target.conversation_log.close()
            saved = target.conversation_log.path.name
            note = f"closed conversation {target.number} (saved as {saved}); its full blocks stay cached"
            return note + (f"; conversation {new.number} is new" if new is not None else "")

        async def then() -> None:
            if new is not None:
                await self.add(new)
            elif target is self.focused:     # the focus may have moved since the worker chose
                after[0] = self._neighbour(target)
            self.views.remove(target)
            if self.on_change is not None:
                self.on_change()
            self.switch_to(after[0] if target is self.focused else self.focused, fresh=False)
            await target.remove()
            self.refresh_bar()
        replying = app.jobs.busy is Busy.REPLY and app.turn.view is target
        app.run_op(f"close conversation {target.number}", run, then, focus=lambda: after[0], interrupt=replying)

    def _neighbour(self, target: ChatView) -> ChatView:
        """The conversation that takes the focus when target closes: the next, else the previous."""
        i = self.views.index(target)
        return self.views[i + 1] if i + 1 < len(self.views) else self.views[i - 1]

    def list(self) -> None:
        lines = [f"{len(self.views)} conversations share the pool (● is this one):"]
        lines += [v.describe(v is self.focused) for v in self.views]
        self.app.notice("\n".join(lines))

    # ---- preemption ----------------------------------------------------------------------------
    def note_preemptions(self, by: ChatView | None) -> None:
        """Tell each newly preempted conversation, in its own transcript, what happened."""
        for v in self.views:
            pending = v.refresh_state().preempted_pending
            if pending and not v.preempted_noted:
                v.preempted_noted = True
                who = f"conversation {by.number}" if by is not None else "another conversation"
                notice = v.add_notice(
                    f"preempted: {who} needed room in the pool, so this conversation's cache was freed; "
                    f"its next turn recomputes {pending:,} tokens")
                notice.add_class("warning")
            elif not pending:
                v.preempted_noted = False
        self.refresh_bar()
