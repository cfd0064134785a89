"""Edit and resend a message the user sent earlier.

`/edit N` (or the edit key, for the last one) puts user message N back in the input; the
next Enter resends it in its place: the history from that message on is dropped
(`Chat.truncate`, in a job, so it waits for nothing the backend holds) and the edited text
is sent as a new turn. The cache keeps its blocks, so the turn reuses the history up to the
block where the new text first differs and computes the rest: the reused figure under the
reply, and the block map, show the prefix reuse breaking at exactly the edited block.
"""
from __future__ import annotations

from .conversations import Conversations
from .host import Host
from ..text import plural
from ..widgets import ChatInput, UserMessage


class Editor:
    def __init__(self, app: Host, conversations: Conversations) -> None:
        self.app = app
        self.conversations = conversations

    def editing(self) -> bool:
        view = self.app.view
        return view is not None and view.editing is not None

    def user_messages(self) -> list[int]:
        """Indices in the history of the focused conversation's user messages."""
        return [i for i, m in enumerate(self.app.view.refresh_state().messages) if m["role"] == "user"]

    def start(self, number: int | None) -> None:
        """Put user message `number` (1 = the first; None = the last) in the input to edit."""
        app, view = self.app, self.app.view
        if app.replying(view) or app.queued(view):
            app.notice("still replying: press escape to stop it, then edit", error=True)
            return
        users = self.user_messages()
        if not users:
            app.notice("nothing to edit: you have sent no message in this conversation yet", error=True)
            return
        number = len(users) if number is None else number
        if not 1 <= number <= len(users):
            app.notice(f"no message {number} to edit: you sent {plural(len(users), 'message')} (1 to {len(users)})",
                       error=True)
            return
        index = users[number - 1]
        messages = view.state.messages
        view.editing = index
        app.part(ChatInput).restore(messages[index]["content"])
        after = len(messages) - index - 1
        app.notice(f"editing your message {number} of {len(users)}: enter resends it and drops "
                   f"{plural(after, 'message')} after it; /edit off leaves the conversation as it is")

    def cancel(self) -> None:
        view = self.app.view
        if view.editing is None:
            self.app.notice("not editing a message", error=True)
            return
        view.editing = None
        self.app.part(ChatInput).load_text("")
        self.app.notice("edit cancelled: the conversation is as it was")

    def resend(self, text: str) -> None:
        """Drop the history from the edited message on, then send `text` in its place."""
        app, view = self.app, self.app.view
        index, view.editing = view.editing, None
        if app.replying(view) or app.queued(view):
            app.notice("still replying: press escape to stop it, then send the edit again", error=True)
            app.part(ChatInput).restore(text)
            view.editing = index
            return
        number = sum(m["role"] == "user" for m in view.state.messages[:index]) + 1
        shown = [w for w in view.query(UserMessage) if not w.has_class("refused")]
        if number <= len(shown):         # drop the edited message and all that came after it
            first = shown[number - 1]
            later = list(view.children)[list(view.children).index(first):]
            view.remove_children(later)

        def truncate() -> str:
            view.chat.truncate(index)
            view.conversation_log.sync(list(view.chat.state().messages))
            return (f"edited message {number}: the history after it is dropped; the cache keeps its blocks, "
                    "so this turn reuses them up to the block holding the edit")
        app.run_op(f"drop the history after message {number}", truncate, interrupt=False)
        app.send(text)
