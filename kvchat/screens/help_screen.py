"""The help screen (F1): every key with its current binding, and every slash command."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ..commands import COMMANDS
from ..keys import KEYS


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 90%; max-width: 110; height: 90%; border: thick $primary; background: $surface; padding: 0 1;
    }
    """
    BINDINGS = [Binding("escape,f1,q", "dismiss", "close", priority=True)]

    def __init__(self, keymap: dict[str, str], config_file: str) -> None:
        super().__init__()
        self.keymap = keymap
        self.config_file = config_file

    def compose(self) -> ComposeResult:
        keys = Table(title="Keys (they work while you type)", title_justify="left", expand=True, box=None)
        keys.add_column("key", style="bold", no_wrap=True)
        keys.add_column("id", style="dim", no_wrap=True)
        keys.add_column("does")
        for k in KEYS:
            keys.add_row(self.keymap.get(k.id, k.keys), k.id, k.help)
        keys.add_row("enter", "", "send the message")
        keys.add_row("ctrl+j", "", "new line in the message")
        keys.add_row("up / down", "", "previous / next sent message (on the first / last line)")
        keys.add_row("pageup / pagedown", "", "scroll the conversation while you type")
        keys.add_row("ctrl+c", "", "copy the selection; with none, stop the reply (as escape)")
        cmds = Table(title="Commands (type in the input)", title_justify="left", expand=True, box=None)
        cmds.add_column("command", style="bold", no_wrap=True)
        cmds.add_column("does")
        for spec in COMMANDS.values():
            cmds.add_row(spec.usage, spec.help)
        cmds.add_row("//text", "send a message that starts with '/'")
        note = Text(f"\nRebind keys in {self.config_file}, e.g. "
                    '{"keys": {"reset_cache": "ctrl+e"}} — ids are in the second column. '
                    "Press escape to close.", style="dim")
        with VerticalScroll():
            yield Static(keys)
            yield Static(Text(""))
            yield Static(cmds)
            yield Static(note)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
