"""A conversation's transcript: the ChatView draws its Session (kvchat/chat/session.py).

The chat screen keeps one ChatView per open conversation in a ContentSwitcher and shows the
one in focus (kvchat/chat/conversations.py switches between them). A turn's message shows
at once (`show_user`), its reply when the turn starts (`begin_reply`); the chat screen, which
receives the worker's messages, has the turn's ChatView draw the text and the end.
"""
from __future__ import annotations

from textual.widget import Widget

from ..store.history import History
from ..store.records import TurnRecord
from ..text import collapsed, plural
from ..widgets.transcript import DROPPED, Reply, Transcript, UserMessage
from .session import Session


class ChatView(Transcript):
    """The first one is on screen before the model loads (it shows the progress); `attach`
    gives it its Session."""

    DEFAULT_CSS = """
    ChatView .dropped, ChatView .dropped * { text-opacity: 50%; }
    """

    def __init__(self, number: int, id: str | None = None) -> None:
        super().__init__(id=id or f"transcript-{number}")
        self.number = number
        self.session: Session | None = None

    def attach(self, session: Session) -> None:
        self.session = session

    def on_unmount(self) -> None:
        """Closed or the app ends: release the log's file and its lock, as a process exit would
        (the same process may open the conversation again: the browser, a test)."""
        if self.session is not None:
            self.session.log.close()

    async def show_history(self, history: History) -> None:
        """A resumed conversation, a long message (a /load's) collapsed as it was shown live
        (the model and the log keep all of it)."""
        shown = [{**m, "content": collapsed(m["content"])} if m["role"] == "user" else m for m in history.messages]
        await super().show_history(History(shown, history.dropped, history.replies))

    # ---- a turn -------------------------------------------------------------------------------
    def show_user(self, text: str) -> UserMessage:
        """A message to send: it shows at once, while its turn may still wait in the queue."""
        widget = UserMessage(text)
        self.mount(widget)
        return widget

    async def begin_reply(self, regenerate: bool) -> Reply:
        """The turn starts: a regenerated reply replaces the last one; an empty reply waits."""
        if regenerate:
            last = self.last_reply()
            if last is not None:
                await last.remove()
        return await self.start_reply()

    async def refuse(self, user: UserMessage | None, reply: Reply | None, error: str | None) -> None:
        """Nothing of the turn entered the conversation."""
        if reply is not None:
            await reply.remove()
        if user is not None:
            user.refuse(error or "")
        self.add_notice(error or "the turn was refused", error=True)

    async def finish(self, reply: Reply | None, record: TurnRecord | None, error: str | None,
                     max_position: int | None) -> None:
        if reply is not None:
            await reply.finish(record, error=error)
        if record is not None and record.dropped_messages:
            self.mark_dropped(record.dropped_messages, record.policy, max_position)

    def mark_dropped(self, n: int, policy: str | None, max_position: int | None) -> int:
        """Dim the n oldest messages the model still saw: drop-oldest took them out of what
        it reads, not out of the transcript. Returns how many were marked."""
        earlier = self.earlier             # the oldest messages may not be drawn yet (earlier.py)
        waiting = [e for e in earlier.entries if not e.dropped][:n] if earlier is not None else []
        for e in waiting:
            e.dropped = True
        shown: list[Widget] = [w for w in self.query("UserMessage, Reply")
                               if not w.has_class("dropped") and not w.has_class("refused")]
        for w in shown[:n - len(waiting)]:
            w.add_class("dropped")
            w.tooltip = DROPPED
        marked = len(waiting) + len(shown[:n - len(waiting)])
        if marked:
            top = max_position
            cap = self.session.cap if self.session is not None else None
            limit = (f"the cap of {cap:,}" if cap is not None and (top is None or cap <= top)
                     else f"the model's maximum context of {top:,}" if top else "the limit")
            self.add_notice(f"{plural(marked, 'message')} dimmed above: {policy or 'the policy'} dropped "
                            f"{'it' if marked == 1 else 'them'} to stay under {limit} tokens; the model no "
                            "longer sees them (the transcript, /save and --resume keep them, dimmed)")
        return marked
