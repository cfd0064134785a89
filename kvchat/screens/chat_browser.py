"""The chat browser: the saved conversations in a table, to open, rename, delete or search.

The screen draws what it is given (a list of catalog.Summary, from `load`) and hands every
change to its callbacks (kvchat/chat/browser.py does them): it never reads or writes a file
itself. Keys: enter opens, r renames, d deletes (after a y/n question), / searches,
escape closes (or leaves the rename or search box).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Static

from ..store.catalog import Summary
from ..text import inert

Progress = Callable[[int, int], None]


class Confirm(ModalScreen[bool]):
    """A yes/no question; y or enter says yes, n or escape no."""

    DEFAULT_CSS = """
    Confirm { align: center middle; }
    Confirm > Static { width: 70; height: auto; border: thick $error; padding: 1 2; background: $surface; }
    """
    BINDINGS = [Binding("y,enter", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        yield Static(f"{self.question}\n\n[b]y[/b] yes · [b]n[/b] no", id="question")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class ChatBrowser(ModalScreen[Path | None]):
    """Dismissed with the path of the conversation to open, or None."""

    DEFAULT_CSS = """
    ChatBrowser { align: center middle; }
    ChatBrowser > Vertical { width: 90%; height: 80%; border: thick $accent; background: $surface; padding: 0 1; }
    ChatBrowser #search, ChatBrowser #rename { display: none; }
    ChatBrowser #search.shown, ChatBrowser #rename.shown { display: block; }
    ChatBrowser DataTable { height: 1fr; }
    ChatBrowser #browser-note { height: auto; color: $text-muted; }
    """
    BINDINGS = [
        Binding("escape", "back", "close", id="browser.close"),
        Binding("slash", "search", "search", id="browser.search"),
        Binding("r", "rename", "rename", id="browser.rename"),
        Binding("d", "delete", "delete", id="browser.delete"),
    ]

    def __init__(self, load: Callable[[Progress | None], list[Summary]], open_paths: Callable[[], set[Path]],
                 rename: Callable[[Summary, str], str | None], delete: Callable[[Summary], str | None]) -> None:
        super().__init__()
        self._load, self._open_paths, self._rename, self._delete = load, open_paths, rename, delete
        self.summaries: list[Summary] = []
        self.query_text = ""
        self.loaded = False             # the first reading of the logs, in a thread, has ended

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Saved conversations · enter open · r rename · d delete · / search · escape close",
                         id="browser-title")
            yield Input(placeholder="search the conversations' text", id="search")
            yield Input(placeholder="a new title (enter saves, escape cancels)", id="rename")
            yield DataTable(id="chats", cursor_type="row", zebra_stripes=True)
            yield Static("", id="browser-note")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("title", "model", "last used", "tokens", "turns", "")
        table.focus()
        # a folder of long logs takes seconds to read the first time: in a thread, so the keys
        # (escape among them) answer meanwhile and the line below says how far it is
        self.note("reading the saved conversations ...")
        self.run_worker(self._read_all, thread=True, exclusive=True, group="browser-read")

    def _read_all(self) -> None:
        """In the worker's thread: every log's summary, then the table, on the app's thread."""
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if time.monotonic() - last[0] > 0.2 and done < total:
                last[0] = time.monotonic()
                self._from_thread(self._progress, f"reading the saved conversations: {done:,} of {total:,}")
        self._from_thread(self._read, self._load(progress))

    def _from_thread(self, fn: Callable[..., object], *args: object) -> None:
        try:
            self.app.call_from_thread(fn, *args)
        except RuntimeError:             # the app has quit meanwhile
            pass

    def _progress(self, text: str) -> None:
        if self.is_attached and not self.loaded:
            self.note(text)

    def _read(self, summaries: list[Summary]) -> None:
        if not self.is_attached:         # closed while the logs were read
            return
        self.summaries, self.loaded = summaries, True
        self.redraw()

    # ---- the list ---------------------------------------------------------------------------
    @property
    def shown(self) -> list[Summary]:
        """The conversations the search matches, as the table lists them."""
        return [s for s in self.summaries if s.matches(self.query_text)]

    def reload(self) -> None:
        """After a rename or a delete: only the changed log is read again (catalog.summarize)."""
        self.summaries = self._load(None)
        self.loaded = True
        self.redraw()

    def redraw(self) -> None:
        table = self.query_one(DataTable)
        row = table.cursor_row
        table.clear()
        opened = self._open_paths()
        for s in self.shown:
            table.add_row(Text(inert(s.title)), Text(inert(s.model or "(not recorded)")), s.when(), f"{s.tokens:,}",
                          str(s.turns),
                          "open" if s.path in opened else "", key=str(s.path))
        if table.row_count:
            table.move_cursor(row=min(max(row, 0), table.row_count - 1))
        found = f"{len(self.shown)} of {len(self.summaries)}" if self.query_text else f"{len(self.summaries)}"
        self.note(f"{found} conversations" + (f" matching {self.query_text!r}" if self.query_text else ""))

    def note(self, text: str) -> None:
        """A line under the table; titles and file names in it come from the logs."""
        self.query_one("#browser-note", Static).update(Text(inert(text)))

    @property
    def selected(self) -> Summary | None:
        table = self.query_one(DataTable)
        shown = self.shown
        return shown[table.cursor_row] if shown and 0 <= table.cursor_row < len(shown) else None

    # ---- keys -------------------------------------------------------------------------------
    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        chosen = self.selected
        if chosen is not None:
            self.dismiss(chosen.path)

    def action_search(self) -> None:
        box = self.query_one("#search", Input)
        box.add_class("shown")
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "search":
            self.query_text = event.value
            self.redraw()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "rename":
            chosen = self.selected
            title = event.value.strip()
            self._close_box(event.input)
            if chosen is None or not title:
                self.note("rename cancelled: the title is empty" if chosen else "no conversation selected")
                return
            error = self._rename(chosen, title)
            self.reload()
            self.note(error or f"renamed to {title!r}")
        else:
            self.query_one(DataTable).focus()

    def _close_box(self, box: Input) -> None:
        box.remove_class("shown")
        self.query_one(DataTable).focus()

    def action_rename(self) -> None:
        chosen = self.selected
        if chosen is None:
            return
        box = self.query_one("#rename", Input)
        box.value = chosen.title
        box.add_class("shown")
        box.focus()

    def action_delete(self) -> None:
        chosen = self.selected
        if chosen is None:
            return
        if chosen.path in self._open_paths():
            self.note(f"{chosen.title!r} is open: close that conversation first, then delete it")
            return

        def answered(yes: bool | None) -> None:
            if not yes:
                self.note("not deleted")
                return
            error = self._delete(chosen)
            self.reload()
            self.note(error or f"deleted {chosen.title!r} ({chosen.path.name})")
        self.app.push_screen(Confirm(escape(inert(f"Delete {chosen.title!r} ({plural_turns(chosen.turns)}, "
                                                  f"{chosen.path.name})? This cannot be undone."))), answered)

    def action_back(self) -> None:
        """Escape: leave the rename or search box first, then the browser."""
        for box in self.query(Input):
            if box.has_class("shown") and box.has_focus:
                if box.id == "search" and box.value:
                    box.value = ""
                self._close_box(box)
                return
        self.dismiss(None)


def plural_turns(n: int) -> str:
    return f"{n} turn" if n == 1 else f"{n} turns"
