"""The command palette (ctrl+p, Textual's own): every key's action and every slash command,
each with its key, found by fuzzy search. An action runs as its key would (the binding's
action, on the chat screen); a command that runs without an argument runs at once; one that
needs an argument is typed into the input ("/cap ") for the user to finish."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, runtime_checkable

from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider

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
    """(name shown, help, what it runs) for each key and each command."""
    keymap = app.keymap()
    screen = app.chat_screen
    out: list[tuple[str, str, Callable[[], object]]] = []
    for k in KEYS:
        if k.id == "palette":
            continue
        shown = app.get_key_display(Binding(keymap[k.id].split(",")[0].strip(), ""))
        out.append((f"{k.label}  [{shown}]", k.help, partial(screen.run_action, k.action)))
    for spec in COMMANDS.values():
        out.append((spec.usage, spec.help, partial(run_command, app, spec.name)))
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
    async def discover(self) -> Hits:
        for shown, help_text, run in entries(self._kvchat()):
            yield DiscoveryHit(shown, run, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for shown, help_text, run in entries(self._kvchat()):
            score = max(matcher.match(shown), matcher.match(help_text) * 0.5)
            if score > 0:
                yield Hit(score, matcher.highlight(shown), run, help=help_text)

    def _kvchat(self) -> KvChatApp:
        app = self.app
        if not isinstance(app, KvChatApp):
            raise TypeError(f"kvchat's palette runs in KvChatApp, not {type(app).__name__}")
        return app
