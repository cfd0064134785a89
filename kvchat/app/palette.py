"""The command palette (ctrl+p, Textual's own): every key's action and every slash command,
each with its key, found by fuzzy search. An action runs as its key would (the binding's
action, on the chat screen); a command that runs without an argument runs at once; one that
needs an argument is typed into the input ("/cap ") for the user to finish.

The names and help go to the palette as plain Content: Textual reads a string as markup, and
"[f5]" or "/edit [N]" are markup tags to it, so an F-key hint and a usage's optional part
vanished (a "[^r]", no tag, stayed)."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, runtime_checkable

from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.content import Content
from textual.fuzzy import FuzzySearch, Matcher

from ..commands import COMMANDS, RAW, Command, CommandError
from ..keys import KEYS
from ..widgets.chat_input import ChatInput
from .theming import ThemeFile


class ChatSide(Protocol):
    """The chat screen as the palette sees it: where its actions and commands run."""
    @property
    def input(self) -> ChatInput: ...

    def run_command(self, cmd: Command) -> None: ...

    async def run_action(self, action: str) -> None: ...


@runtime_checkable
class KvChatApp(Protocol):
    """The App as the palette sees it (app/shell.py's, which imports this module)."""
    @property
    def chat_screen(self) -> ChatSide: ...

    @property
    def themes(self) -> dict[str, ThemeFile]: ...

    def keymap(self) -> dict[str, str]: ...

    def get_key_display(self, binding: Binding) -> str: ...


def entries(app: KvChatApp) -> list[tuple[str, str, Callable[[], object]]]:
    """(name shown, help, what it runs) for each key and each command; a command that a key of
    the same name runs (/regen and F5's regen) shows that key too."""
    keymap = app.keymap()
    screen = app.chat_screen
    out: list[tuple[str, str, Callable[[], object]]] = []
    shown = {k.label: app.get_key_display(Binding(keymap[k.id].split(",")[0].strip(), "")) for k in KEYS}
    for k in KEYS:
        if k.id == "palette":
            continue
        out.append((f"{k.label}  [{shown[k.label]}]", k.help, partial(screen.run_action, k.action)))
    for spec in COMMANDS.values():
        key = f"  [{shown[spec.name]}]" if spec.name in shown else ""
        out.append((spec.usage + key, spec.help, partial(run_command, app, spec.name)))
    return out


def run_command(app: KvChatApp, name: str) -> None:
    spec = COMMANDS[name]
    arg: Any = None
    try:
        if name in RAW:
            raise CommandError("needs its text")
        if spec.parse_arg is not None:
            arg = spec.parse_arg([], tuple(app.themes))
    except CommandError:        # it needs an argument: the user types it
        field = app.chat_screen.input
        field.restore(f"/{name} ")
        field.focus()
        return
    app.chat_screen.run_command(Command(name, arg))


class KvchatCommands(Provider):
    _fuzzy = FuzzySearch()

    async def discover(self) -> Hits:
        for shown, help_text, run in entries(self._kvchat()):
            yield DiscoveryHit(Content(shown), run, text=shown, help=Content(help_text))   # type: ignore[arg-type]

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for shown, help_text, run in entries(self._kvchat()):
            score = max(matcher.match(shown), matcher.match(help_text) * 0.5)
            if score > 0:
                yield Hit(score, self._highlight(matcher, shown), run, text=shown,
                          help=Content(help_text))   # type: ignore[arg-type]

    def _highlight(self, matcher: Matcher, shown: str) -> Content:
        """The matched characters in the match style, on the plain text (Matcher.highlight
        reads its candidate as markup)."""
        content = Content(shown)
        _, offsets = self._fuzzy.match(matcher.query, shown)
        for i in offsets:
            if not shown[i].isspace():
                content = content.stylize(matcher.match_style, i, i + 1)
        return content

    def _kvchat(self) -> KvChatApp:
        app = self.app
        if not isinstance(app, KvChatApp):
            raise TypeError(f"kvchat's palette runs in KvChatApp, not {type(app).__name__}")
        return app
