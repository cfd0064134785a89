"""Context-cap policies: what happens when a conversation would hold more than its cap.

A policy looks at the messages a turn would render and either returns the messages to
keep or raises CapExceeded. New policies register in POLICIES.
"""
from __future__ import annotations

from collections.abc import Callable

from .errors import CapExceeded, KvchatError

Messages = list[dict[str, str]]
CountFn = Callable[[Messages], int]  # tokens the messages render to (with the generation prompt)


class CapPolicy:
    name = "base"
    description = ""
    streaming = False  # True: the cache itself evicts blocks mid-sequence (engine/streaming.py)

    def fit(self, messages: Messages, count: CountFn, cap: int, limit: str = "the cap", room: int = 0) -> Messages:
        """`limit` names the cap in messages: "the cap", or "the model's maximum context".
        `room`: the tokens a policy that drops history leaves free for the reply (see
        reply_room); a policy that refuses only refuses past the cap itself."""
        raise NotImplementedError


class StopPolicy(CapPolicy):
    name = "stop"
    description = "refuse a turn that would pass the cap"

    def fit(self, messages: Messages, count: CountFn, cap: int, limit: str = "the cap", room: int = 0) -> Messages:
        n = count(messages)
        if n > cap:
            # /reset would not help: the history itself is too long, cached or not
            raise CapExceeded(f"this turn needs {n:,} tokens but {limit} is {cap:,}: {n - cap:,} over; "
                              f"{_remedies(limit)}")
        return messages


class DropOldestPolicy(CapPolicy):
    name = "drop-oldest"
    description = "drop whole oldest turns (keeping the system prompt) until the chat fits"

    def fit(self, messages: Messages, count: CountFn, cap: int, limit: str = "the cap", room: int = 0) -> Messages:
        """Drops until the prompt leaves `room` for the reply (dropping only to fit the prompt
        let the reply stop at the cap a few tokens in); the newest message is kept whenever
        it fits the cap itself, with whatever room that leaves."""
        kept = list(messages)
        head = 1 if kept and kept[0]["role"] == "system" else 0
        while count(kept) > cap - room:
            # the oldest turn: a user message and the replies up to the next user message
            if len(kept) - head <= 1 and count(kept) <= cap:
                break
            if len(kept) - head <= 1:
                raise CapExceeded(f"the newest message alone needs {count(kept):,} tokens, over {limit} "
                                  f"of {cap:,}; {'raise the cap or ' if limit == 'the cap' else ''}send less")
            end = head + 1
            while end < len(kept) - 1 and kept[end]["role"] != "user":
                end += 1
            del kept[head:end]
        return kept


class SinkWindowPolicy(CapPolicy):
    name = "sink-window"
    description = "keep the first tokens (attention sinks) and a recent window; evict blocks between"
    streaming = True

    def fit(self, messages: Messages, count: CountFn, cap: int, limit: str = "the cap", room: int = 0) -> Messages:
        return messages  # nothing is dropped from the text; the cache evicts instead


def reply_room(max_tokens: int, cap: int) -> int:
    """The tokens a policy that drops history keeps free for the reply: the reply's max
    tokens, but never more than a quarter of the cap (a small cap keeps most of its history)."""
    return max(0, min(max_tokens, cap // 4))


def _remedies(limit: str) -> str:
    raise_cap = "raise the cap (/cap), " if limit == "the cap" else ""
    return (f"{raise_cap}switch to /policy drop-oldest (or sink-window), or start a new conversation "
            "(ctrl+n) with what matters")


POLICIES: dict[str, type[CapPolicy]] = {p.name: p for p in (StopPolicy, DropOldestPolicy, SinkWindowPolicy)}


def make_policy(name: str) -> CapPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise KvchatError(f"unknown cap policy {name!r}; accepted: {', '.join(POLICIES)}") from None
