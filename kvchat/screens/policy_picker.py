"""Choosing the cap policy from the registered ones (engine.policy.POLICIES); those the
backend does not offer are listed, disabled, with the reason."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from kvchat.engine.policy import POLICIES

from ..backends.protocol import SINK_WINDOW, Capabilities


class PolicyPicker(ModalScreen[str | None]):
    """Dismisses with the chosen policy name, or None on escape."""

    DEFAULT_CSS = """
    PolicyPicker { align: center middle; }
    PolicyPicker > OptionList { width: 72; max-width: 95%; height: auto; border: thick $primary; }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel", priority=True)]

    def __init__(self, current: str, capabilities: Capabilities | None = None) -> None:
        super().__init__()
        self.current = current
        self.capabilities = capabilities or Capabilities()

    def compose(self) -> ComposeResult:
        caps = self.capabilities
        options = [Option(f"{name}: {cls.description}", id=name) if name in caps.policies else
                   Option(f"{name}: not with this backend: {caps.why_not(SINK_WINDOW) if cls.streaming else ''}"
                          .rstrip(": "), id=name, disabled=True)
                   for name, cls in POLICIES.items()]
        picker = OptionList(*options)
        picker.border_title = "cap policy (enter to choose, escape to cancel)"
        yield picker

    def on_mount(self) -> None:
        picker = self.query_one(OptionList)
        names = list(POLICIES)
        picker.highlighted = names.index(self.current) if self.current in names else 0
        picker.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
