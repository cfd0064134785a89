"""A conversation's history as its log keeps it: every message, the ones drop-oldest took out
of what the model sees included, and which turn wrote each reply.

The backend's Chat holds what the model sees; drop-oldest takes whole turns off its front
when the context would pass the cap. The history keeps them: `dropped` counts the oldest
non-system messages the model no longer sees, so the transcript can dim them, `/save` and
`--resume` keep them, and the chat browser's title and search still read them.

A reply's telemetry is tied to it by position, not by its text (two replies can be the same
words, under greedy decoding often are): the log writes a turn's record right after the
message that holds its reply, so `link` ties the record to the last message. An edit or a
regeneration replaces the list; a reply that is still there keeps its record.

The log (store/log.py) folds its records into a History as it writes them, and `restore`
folds them the same way as it reads them back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .records import TurnRecord

Message = dict[str, str]


def replies(messages: list[Message]) -> int:
    """A conversation's turns, counted by their replies: a regenerated reply takes the place of
    the one before, so it is no other turn (the turn records keep one per reply generated)."""
    return sum(m["role"] == "assistant" for m in messages)


@dataclass(slots=True)
class History:
    messages: list[Message] = field(default_factory=list)   # the system prompt first, then every message
    dropped: int = 0                # the oldest non-system messages the model no longer sees
    replies: dict[int, TurnRecord] = field(default_factory=dict)   # index in messages -> its reply's turn

    @property
    def system(self) -> list[Message]:
        return self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []

    @property
    def chat(self) -> list[Message]:
        """The messages after the system prompt, the dropped ones first."""
        return self.messages[len(self.system):]

    @property
    def visible(self) -> list[Message]:
        """What the model sees: the system prompt and the messages not dropped."""
        return self.system + self.chat[self.dropped:]

    def is_dropped(self, index: int) -> bool:
        """Whether messages[index] is one the model no longer sees."""
        first = len(self.system)
        return first <= index < first + self.dropped

    def append(self, message: Message) -> None:
        self.messages.append({"role": message["role"], "content": message["content"]})

    def replace(self, messages: list[Message]) -> None:
        """A new list (an edit, a regeneration, a new system prompt): replies still in place
        keep their records."""
        same = 0
        for old, new in zip(self.messages, messages):
            if old != new:
                break
            same += 1
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self.replies = {i: r for i, r in self.replies.items() if i < same}
        self.dropped = min(self.dropped, len(self.chat))

    def with_visible(self, visible: list[Message], dropped: int) -> list[Message]:
        """The whole history once the model sees `visible` with `dropped` of the oldest
        messages out of its sight: those come from this history, the rest from `visible`."""
        system = visible[:1] if visible and visible[0]["role"] == "system" else []
        return system + self.chat[:dropped] + visible[len(system):]

    def link(self, record: TurnRecord) -> None:
        """A turn's record, written right after the message holding its reply."""
        last = len(self.messages) - 1
        if last >= 0 and self.messages[last]["role"] == "assistant":
            self.replies[last] = record

    def reply_record(self, index: int) -> TurnRecord | None:
        return self.replies.get(index)
