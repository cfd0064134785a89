"""The command palette (ctrl+p, Textual's own): every key's action and every slash command,
each with its key, found by fuzzy search. An action runs as its key would; a command that
runs without an argument runs at once; one that needs an argument is typed into the input
("/cap ") for the user to finish."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider

from ..commands import COMMANDS, RAW, Command, CommandError
from ..keys import KEYS
from ..widgets import ChatInput


def entries(app) -> list[tuple[str, str, Callable[[], None]]]:
    """(name shown, help, what it runs) for each key and each command."""
    keymap = app.keymap()
    out = []
    for k in KEYS:
        if k.id == "palette":
            continue
        shown = app.get_key_display(Binding(keymap[k.id].split(",")[0].strip(), ""))
        out.append((f"{k.label}  [{shown}]", k.help, partial(app.action_key, k.action)))
    for spec in COMMANDS.values():
        out.append((spec.usage, spec.help, partial(run_command, app, spec.name)))
    return out


def run_command(app, name: str) -> None:
    spec = COMMANDS[name]
    arg = None
    try:
        if name in RAW:
            raise CommandError("needs its text")
        if spec.parse_arg is not None:
            arg = spec.parse_arg([], tuple(app.themes))
    except CommandError:        # it needs an argument: the user types it
        field = app.part(ChatInput)
        field.restore(f"/{name} ")
        field.focus()
        return
    if app.view is None and name not in ("help", "theme", "quit", "panel"):
        app.notice(f"/{name} waits for the model to load", error=True)
        return
    app.controls.run(Command(name, arg))


class KvchatCommands(Provider):
    async def discover(self) -> Hits:
        for shown, help_text, run in entries(self.app):
            yield DiscoveryHit(shown, run, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for shown, help_text, run in entries(self.app):
            score = max(matcher.match(shown), matcher.match(help_text) * 0.5)
            if score > 0:
                yield Hit(score, matcher.highlight(shown), run, help=help_text)
