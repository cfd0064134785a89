"""Messages typed but not yet sent when the app quits: each waited in the job queue behind the
reply in progress (or the model's load), or still sat in the input (ctrl+q pressed in the same
instant as Enter reaches the App before the input has handled Enter). Quitting drops the queue,
never the text: each conversation's waiting messages, then the focused one's draft (unless it is
a command), go to its log as its unanswered last message, which --resume puts back in the input.

The conversation whose reply is still running gets them through that turn
(`RunningTurn.keep_after`): its worker writes them after the reply's own end, so the log keeps
the order they were typed in. A conversation the load has not opened yet gets its log now.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..commands import is_message, message_text
from ..store.log import ConversationLog, Restored
from .jobs import JobQueue, RunningTurn
from .session import ChatOptions

if TYPE_CHECKING:
    from .view import ChatView


def keep_unsent(jobs: JobQueue, draft: tuple[ChatView, str] | None, options: ChatOptions,
                data_root: Path | None, model: str, restored: Restored | None = None) -> None:
    """Take the waiting jobs out of the queue; write their messages, and a draft that is not
    blank, where they belong."""
    by_view: dict[int, tuple[ChatView, list[str]]] = {}
    for job in jobs:
        if isinstance(job, RunningTurn) and job.text is not None:
            by_view.setdefault(id(job.view), (job.view, []))[1].append(job.text)
    jobs.clear()
    if draft is not None and draft[1].strip() and is_message(draft[1]):    # a command's draft is no message
        by_view.setdefault(id(draft[0]), (draft[0], []))[1].append(message_text(draft[1]))
    replying = jobs.replying
    for view, texts in by_view.values():
        if replying is not None and replying.view is view and replying.keep_after(texts):
            continue
        if view.session is not None:
            view.session.log.keep_unsent(texts)
        elif restored is not None:      # typed while the model loads, into a resumed conversation
            ConversationLog(restored.path, restored.messages, restored=restored).keep_unsent(texts)
        else:                           # into a new one: it has no log yet
            log = ConversationLog.create(data_root, model=model, system=options.system, cap=options.cap,
                                         policy=options.policy, mode=options.mode)
            log.keep_unsent(texts)
