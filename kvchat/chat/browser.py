"""Saved conversations in the app: the chat browser's actions, reopening conversations
(from the browser or `--resume`), and the model each ran with.

A reopened conversation is a new Session that starts from the saved history with an empty
cache, so its next turn prefills the whole history (Session.open). One saved under another
model says so in one line and starts a new latency series: its old points are not drawn
beside the new model's (they measured other weights), and a "model" event in its log marks
where the new model's turns begin, so a later resume keeps them apart too.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvchat.engine.errors import KvchatError

from ..screens.chat_browser import ChatBrowser
from ..store import catalog
from ..store.history import replies
from ..store.log import ConversationBusy, Restored, StoreError, restore
from ..text import plural, reading_line
from . import numbering
from .conversations import Conversations, read_the_cache
from .host import Host
from .session import Session
from .view import ChatView

SHOWN_PROBLEMS = 5       # damaged records named one by one; past that, counted


class Browser:
    def __init__(self, host: Host, conversations: Conversations, data_root: Path | None = None) -> None:
        self.host = host
        self.conversations = conversations
        self.data_root = data_root
        self._remember_failed = False
        self._peers: set[int] = set()      # other kvchat processes seen with conversations open (catalog.remember_open)

    # ---- the browser screen -----------------------------------------------------------------
    def open_paths(self) -> set[Path]:
        return {s.log.path for s in self.conversations.sessions}

    def show(self) -> None:
        def chosen(path: Path | None) -> None:
            if path is not None:
                self.reopen(path)
        def load(progress: Callable[[int, int], None] | None) -> list[catalog.Summary]:
            return catalog.list_conversations(self.data_root, progress)
        self.host.dialog(ChatBrowser(load, self.open_paths, self.rename, self.delete), chosen)

    def _view_of(self, path: Path) -> ChatView | None:
        return next((v for v in self.conversations.views if v.session is not None and v.session.log.path == path),
                    None)

    def rename(self, summary: catalog.Summary, title: str) -> str | None:
        """Returns a line saying why not, or None."""
        view = self._view_of(summary.path)
        session = view.session if view is not None else None
        try:
            catalog.rename(summary.path, title, session.log if session is not None else None)
        except OSError as err:
            return f"cannot rename {summary.path.name}: {err.strerror or err}"
        if session is not None:
            session.given_title = title
            self.conversations.refresh_bar()
        return None

    def delete(self, summary: catalog.Summary) -> str | None:
        if self._view_of(summary.path) is not None:
            return f"{summary.title!r} is open: close it first ({self.host.keymap['close_conversation']}), then delete"
        try:
            catalog.delete(summary.path)
        except ConversationBusy as err:
            return f"not deleted: {err}"
        except OSError as err:
            return f"cannot delete {summary.path.name}: {err.strerror or err}"
        return None

    # ---- reopening --------------------------------------------------------------------------
    def reopen(self, path: Path) -> None:
        """Show the conversation saved at `path`: switch to it if open, else reopen it as a
        new conversation (after the job in progress when the backend is busy)."""
        open_view = self._view_of(path)
        if open_view is not None:
            self.conversations.switch_to(open_view)
            self.host.notice(f"conversation {open_view.number} is {path.name}, already open")
            return
        host, read = self.host, []

        def tell(done: int, total: int) -> None:        # in the worker: the status line says how far
            host.call_later(host.panels.status, reading_line(path.name, done, total))

        def read_back() -> None:
            """In a worker, after the job in progress: a long log takes seconds to read."""
            try:
                read.append(restore(path, tell))
            except StoreError as err:
                raise KvchatError(str(err)) from None   # one line in the transcript, not "internal error"
        host.run_op(f"reopen {path.name}", read_back, then=lambda: self._open(read[0]), interrupt=False)

    async def _open(self, restored: Restored, focus: bool = True, resuming: bool = False) -> None:
        """Reopen a conversation; `resuming` (--resume) gives it its own number back if free."""
        host, convs = self.host, self.conversations
        saved = restored.number
        number = convs.claim(saved) if resuming else convs.number()
        try:
            session = Session.open(host.backend, number, host.session.options(), self.data_root, restored)
        except (KvchatError, OSError) as err:
            host.notice(f"cannot reopen {restored.path.name}: {err}", error=True)
            return
        view = ChatView(number)
        await convs.add(view, session)
        await self.resumed(view, restored, number=saved)
        if focus:
            convs.switch_to(view, fresh=False)
            host.run_op("read the cache", read_the_cache, interrupt=False)
        self.remember()

    async def reopen_all(self, paths: list[Path]) -> None:
        """--resume: reopen the other conversations open at the last quit, behind the focused one."""
        for path in paths:
            if self._view_of(path) is None:
                try:
                    restored = restore(path)
                except StoreError as err:
                    self.host.notice(str(err), error=True)
                    continue
                await self._open(restored, focus=False, resuming=True)
        self.conversations.views.sort(key=lambda v: v.number)     # the bar and the switch keys in their order
        if len(self.conversations.views) > 1:
            self.host.notice(f"{len(self.conversations.views)} conversations reopened, as open when kvchat last quit; "
                             f"{self.host.keymap['next_conversation']} switches")
        self.conversations.refresh_bar()

    async def resume(self, view: ChatView, restored: Restored) -> None:
        """--resume: the first conversation, restored, says so."""
        session = view.session
        if session is None:
            return
        saved = restored.number
        if saved is not None and saved != view.number:      # no other is open yet: its own number is free
            view.number = session.number = self.conversations.claim(saved)
        await view.show_history(restored.history)
        view.add_notice(f"resumed {restored.path.name}: {plural(replies(restored.messages), 'turn')}; the cache "
                        "is empty, so the next turn prefills the whole history")
        if restored.unanswered:
            self.host.input.restore(restored.unanswered)
            view.add_notice("your last message got no reply; it is back in the input")
        await self.resumed(view, restored, history=False, number=saved)

    async def resumed(self, view: ChatView, restored: Restored, history: bool = True,
                      number: int | None = None) -> None:
        """A reopened conversation's transcript, its notes (a line per damaged record skipped),
        its latency series, and its number kept in its log (`number`: the one kept there)."""
        session = view.session
        if session is None:
            return
        numbering.remember(session.log, view.number, number)
        if history:
            await view.show_history(restored.history)
            view.add_notice(f"reopened {restored.path.name}: {plural(replies(restored.messages), 'turn')}; the "
                            "cache is empty, so the next turn prefills the whole history")
        if restored.problems:
            view.add_notice(f"{plural(restored.skipped, 'damaged record')} of {restored.path.name} skipped "
                            "(a torn line or a hand edit); the rest is restored", error=True)
        for line in restored.problems[:SHOWN_PROBLEMS]:
            view.add_notice(f"  {line}", error=True)
        if len(restored.problems) > SHOWN_PROBLEMS:
            view.add_notice(f"  and {len(restored.problems) - SHOWN_PROBLEMS} more", error=True)
        if restored.dropped:
            view.add_notice(f"{plural(restored.dropped, 'message')} dimmed above: drop-oldest dropped "
                            f"{'it' if restored.dropped == 1 else 'them'}; the model no longer sees them")
        if restored.title is not None:
            session.given_title = restored.title
        model = self.host.backend.info().model
        saved = restored.model
        first = restored.model_from
        if saved is not None and saved != model:
            session.log.event("model", value=model, previous=saved)
            first = len(session.turns)
            view.add_notice(f"saved under {saved}, now running on {model}: its {plural(first, 'turn')} stay in "
                            "the transcript; the latency plot starts a new series for this model").add_class("warning")
        if first:
            session.new_latency_series(first)
        if history and restored.unanswered and view is self.conversations.focused:
            self.host.input.restore(restored.unanswered)
            view.add_notice("your last message got no reply; it is back in the input")

    def remember(self) -> None:
        """Keep the list of open conversations for the next --resume."""
        error = catalog.remember_open([s.log.path for s in self.conversations.sessions], self.data_root,
                                      self._peers)
        if error is not None and not self._remember_failed:    # said once, not on every change
            self._remember_failed = True
            self.host.notice(error, error=True)
