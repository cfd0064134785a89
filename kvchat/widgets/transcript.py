"""The transcript: user messages, replies streamed as Markdown with a stats line under each,
and one-line notices (command results and errors).

Replies keep their line breaks: a poem or a list without bullets is drawn as the model wrote
it (each newline inside a paragraph is a hard break), while the text itself, and the saved
Markdown, stay as written. Everything drawn here came from outside kvchat (a model, a server,
a file, a saved log), so it is drawn through `text.inert`: an escape sequence in a reply shows
as `\\x1b[2J`, it never reaches the terminal. The text kept (`.text`) stays as written."""
from __future__ import annotations

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Markdown, Static

from ..store.history import History
from ..store.records import TurnRecord
from ..text import inert, stats_line
from .earlier import Earlier, Entry, page_start
from .fold import Cut, Fold, fold_point, pieces, too_long
from .long_table import ReplyMarkdown


DROPPED = "the model no longer sees this message (drop-oldest dropped it)"


def _keep_line_breaks(state: StateCore) -> None:
    """A newline inside a paragraph is a line break, as the writer meant it (markdown-it's
    `breaks` option does this for HTML only; Textual reads the tokens)."""
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type, child.tag = "hardbreak", "br"


def markdown_parser() -> MarkdownIt:
    """Textual's gfm-like parser, keeping line breaks."""
    md = MarkdownIt("gfm-like")
    md.core.ruler.push("kvchat_line_breaks", _keep_line_breaks)
    return md


class UserMessage(Static):
    """What the user sent, shown as typed (not as Markdown)."""

    DEFAULT_CSS = "UserMessage { margin: 1 0 0 0; padding: 0 1; }"

    def __init__(self, text: str) -> None:
        super().__init__(Text(inert(text)))
        self.text = text

    def refuse(self, reason: str) -> None:
        """The turn was refused: nothing of it entered the conversation."""
        self.add_class("refused")
        self.border_subtitle = "not sent"
        self.tooltip = Text(inert(reason))


class Reply(Vertical):
    """One assistant reply: Markdown that grows as tokens arrive, then a stats line. A long
    reply keeps only its tail as live Markdown, its head folded into one line (fold.py), so
    a batch costs the same at the 300,000th character as at the first."""

    DEFAULT_CSS = """
    Reply { height: auto; padding: 0 1; }
    Reply > Markdown { margin: 0; padding: 0; }
    Reply > .folded { height: auto; }
    Reply > .folded > Static { margin: 0 0 0 0; }
    Reply > .stats { color: $text-muted; }
    Reply > .stats.error { color: $error; }
    """

    def __init__(self, text: str = "", record: TurnRecord | None = None) -> None:
        super().__init__()
        self.text = text
        self.record = record
        self._folded = 0            # characters of text in the fold
        self._folded_lines = 0
        self._carry = ""            # drawn before text[_folded:] (fold.Cut.carry)
        self._shown = 0             # characters of the fold drawn as plain text (an opened fold)
        if too_long(text):
            self._fold(fold_point(text))

    def compose(self):
        yield Fold()
        yield Vertical(classes="folded")
        yield ReplyMarkdown(inert(self._live()), parser_factory=markdown_parser)
        yield Static(Text(stats_line(self.record)) if self.record else "…", classes="stats")

    def on_mount(self) -> None:
        self.query_one(Fold).show(self._folded, self._folded_lines)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    @property
    def folded(self) -> int:
        """Characters of the reply drawn as one folded line (0: all of it is Markdown)."""
        return self._folded

    def _live(self) -> str:
        return self._carry + self.text[self._folded:]

    def _fold(self, cut: Cut) -> None:
        """Move the live part's head, up to cut.at, into the fold."""
        upto = self._folded + cut.at - len(self._carry)
        self._folded_lines += self.text.count("\n", self._folded, upto)
        self._folded, self._carry = upto, cut.carry

    async def append(self, fragment: str) -> None:
        if not fragment:
            return
        self.text += fragment
        live = self._live()
        if too_long(live):
            self._fold(fold_point(live, start=len(self._carry)))
            await self._redraw()
            return
        # appended here and awaited, not through Textual's MarkdownStream: the stream appends in
        # a task of its own after write() returns, so the screen drew the batch after the
        # worker, told it was drawn (chat/worker.py), had begun its next decode step. Every
        # decode step over 25 ms in a 512-token reply overlapped such a draw (24-47 ms of the
        # UI thread's), against 14 of the other 498 steps.
        await self.markdown.append(inert(fragment))

    async def _redraw(self) -> None:
        """The fold changed: its line, its opened text, and the live part from scratch (once
        per KEEP_CHARS, so the parse stays bounded)."""
        fold = self.query_one(Fold)
        fold.show(self._folded, self._folded_lines)
        await self._show_folded(fold.opened)
        await self.markdown.update(inert(self._live()))

    async def _show_folded(self, opened: bool) -> None:
        body = self.query_one(".folded", Vertical)
        if not opened or self._shown > self._folded:
            await body.remove_children()
            self._shown = 0
        if opened and self._shown < self._folded:
            await body.mount_all([Static(piece) for piece in pieces(self.text[self._shown:self._folded])])
            self._shown = self._folded

    async def on_fold_toggled(self, event: Fold.Toggled) -> None:
        event.stop()
        fold = self.query_one(Fold)
        fold.show(self._folded, self._folded_lines)
        await self._show_folded(fold.opened)

    async def finish(self, record: TurnRecord | None, error: str | None = None) -> None:
        self.record = record
        stats = self.query_one(".stats", Static)
        if error:
            stats.update(Text(inert(f"stopped by an error: {error}")))
            stats.add_class("error")
        elif record is not None:
            stats.update(Text(stats_line(record)))
            if record.reply is not None and record.reply != self.text:
                self.text = record.reply   # the detokenizer's final text wins
                self._folded = self._folded_lines = self._shown = 0
                self._carry = ""
                await self.query_one(".folded", Vertical).remove_children()   # an opened fold draws it again
                if too_long(self.text):
                    self._fold(fold_point(self.text))
                await self._redraw()
        else:
            stats.update("")


class Notice(Static):
    """A one-line message from kvchat: a command's result, or an error (class "error")."""

    DEFAULT_CSS = """
    Notice { padding: 0 1; color: $text-muted; }
    Notice.error { color: $error; }
    Notice.warning { color: $warning; }
    """

    def __init__(self, text: str, error: bool = False) -> None:
        super().__init__(Text(inert(text)), classes="error" if error else "")
        self.text = text


class Transcript(VerticalScroll):
    """The conversation, kept scrolled to the newest line unless the user scrolls up. A click
    (to select text) leaves the keyboard with the input; Tab focuses it to scroll by keys,
    and a bar on its left shows it has focus."""

    DEFAULT_CSS = """
    Transcript { height: 1fr; }
    Transcript:focus { outline-left: thick $accent; }
    """
    FOCUS_ON_CLICK = False

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str) -> UserMessage:
        widget = UserMessage(text)
        await self.mount(widget)
        return widget

    async def start_reply(self) -> Reply:
        reply = Reply()
        await self.mount(reply)
        return reply

    def add_notice(self, text: str, error: bool = False) -> Notice:
        """Mounts without waiting: notices come from sync handlers too."""
        notice = Notice(text, error)
        self.mount(notice)
        return notice

    async def show_history(self, history: History) -> None:
        """Replay a restored conversation: each reply with its own turn's stats line, the
        messages drop-oldest dropped dimmed. Only the newest page is drawn; one line above it
        stands for the older messages and draws them a page at a time (earlier.py)."""
        entries = [Entry(m["role"], m["content"], history.reply_record(i), history.is_dropped(i))
                   for i, m in enumerate(history.messages) if m["role"] in ("user", "assistant")]
        start = page_start(entries)
        widgets: list[Widget] = [Earlier(entries[:start])] if start else []
        widgets += [self._drawn(e) for e in entries[start:]]
        if widgets:
            await self.mount_all(widgets)

    @staticmethod
    def _drawn(entry: Entry) -> Widget:
        widget: Widget = UserMessage(entry.content) if entry.role == "user" else Reply(entry.content, entry.record)
        if entry.dropped:
            widget.add_class("dropped")
            widget.tooltip = DROPPED
        return widget

    @property
    def earlier(self) -> Earlier | None:
        """The line standing for the messages not drawn yet, if any."""
        found = self.query(Earlier)
        return found.first() if found else None

    async def on_earlier_more(self, event: Earlier.More) -> None:
        """Draw the page before the oldest message drawn, keeping the view where it was."""
        event.stop()
        earlier = self.earlier
        if earlier is None:
            return
        first = next((w for w in self.children if w is not earlier), None)
        await self.mount_all([self._drawn(e) for e in earlier.take_page()], after=earlier)
        if not earlier.hidden:
            await earlier.remove()
        if first is not None:
            self.call_after_refresh(self.scroll_to_widget, first, animate=False, top=True)

    def remove_from_user(self, number: int) -> None:
        """Take the `number`th user message the model still sees (1-based) and all after it
        off the transcript (an edit resends it), whether it is drawn or still waiting above."""
        earlier = self.earlier
        waiting = [i for i, e in enumerate(earlier.entries) if e.role == "user" and not e.dropped] \
            if earlier is not None else []
        if earlier is not None and number <= len(waiting):
            earlier.keep(waiting[number - 1])
            later = list(self.children)[list(self.children).index(earlier) + 1:]
            if not earlier.hidden:
                later.append(earlier)
            self.remove_children(later)
            return
        shown = [w for w in self.query(UserMessage) if not w.has_class("refused") and not w.has_class("dropped")]
        if number - len(waiting) <= len(shown):
            first = shown[number - len(waiting) - 1]
            self.remove_children(list(self.children)[list(self.children).index(first):])

    def last_reply(self) -> Reply | None:
        replies = self.query(Reply)
        return replies.last() if replies else None
