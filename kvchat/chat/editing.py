"""Edit and resend a message the user sent earlier.

`/edit N` (or the edit key, for the last one) puts user message N back in the input; the
next Enter resends it in its place: the history from that message on is dropped
(`Chat.truncate`, in a job, so it waits for nothing the backend holds) and the edited text
is sent as a new turn. The cache keeps its blocks, so the turn reuses the history up to the
block where the new text first differs and computes the rest: the reused figure under the
reply, and the block map, show the prefix reuse breaking at exactly the edited block.
"""
from __future__ import annotations

from ..text import plural
from .host import Host

STILL_REPLYING = "still replying: press escape to stop it, then "


class Editor:
    def __init__(self, host: Host) -> None:
        self.host = host

    def busy(self, then: str) -> bool:
        """The focused conversation replies, or waits to: say so (`then`: what to do after)."""
        jobs, view = self.host.jobs, self.host.view
        if jobs.replying_in(view) or jobs.queued_in(view):
            self.host.notice(STILL_REPLYING + then, error=True)
            return True
        return False

    def start(self, number: int | None) -> None:
        """Put user message `number` (1 = the first; None = the last) in the input to edit."""
        host, session = self.host, self.host.session
        if self.busy("edit"):
            return
        users = [i for i, m in enumerate(session.refresh().messages) if m["role"] == "user"]
        if not users:
            host.notice("nothing to edit: you have sent no message in this conversation yet", error=True)
            return
        number = len(users) if number is None else number
        if not 1 <= number <= len(users):
            host.notice(f"no message {number} to edit: you sent {plural(len(users), 'message')} (1 to {len(users)})",
                        error=True)
            return
        index = users[number - 1]
        messages = session.state.messages
        session.editing = index
        host.input.restore(messages[index]["content"])
        after = len(messages) - index - 1
        host.notice(f"editing your message {number} of {len(users)}: enter resends it and drops "
                    f"{plural(after, 'message')} after it; /edit off leaves the conversation as it is")

    def cancel(self) -> None:
        session = self.host.session
        if session.editing is None:
            self.host.notice("not editing a message", error=True)
            return
        session.editing = None
        self.host.input.load_text("")
        self.host.notice("edit cancelled: the conversation is as it was")

    def resend(self, text: str) -> None:
        """Drop the history from the edited message on, then send `text` in its place."""
        host, view, session = self.host, self.host.view, self.host.session
        index = session.editing
        if index is None:
            return
        if self.busy("send the edit again"):
            host.input.restore(text)
            return
        session.editing = None
        number = sum(m["role"] == "user" for m in session.state.messages[:index]) + 1
        view.remove_from_user(number)    # drop the edited message and all that came after it

        def truncate() -> str:
            session.chat.truncate(index)
            session.log.sync(list(session.chat.state().messages))
            return (f"edited message {number}: the history after it is dropped; the cache keeps its blocks, "
                    "so this turn reuses them up to the block holding the edit")
        host.run_op(f"drop the history after message {number}", truncate, interrupt=False)
        host.send(text)
