"""What the four telemetry panels share: they draw only while they are displayed.

A panel is hidden when the switcher shows another one, when F6 hides them all, or when
/panel closes it. The app keeps giving every panel its telemetry (a few times a second
during a turn); a hidden one only keeps it, which costs nothing, and owes the draw. When it
is shown again (the switcher calls `catch_up`, and Textual's Show event does too) it draws
what it holds, so it shows current figures at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from textual.widget import Widget

if TYPE_CHECKING:     # a mixin of widgets: the checker reads it as one
    _Mixin = Widget
else:
    _Mixin = object


class Panel(_Mixin):
    """Mixed into a panel widget (before the Textual class). The panel calls `drawing()`
    where it would draw and draws only if that says True; `draw()` draws everything from
    the state it keeps."""

    _owed = False

    @property
    def shown(self) -> bool:
        """Displayed, and so are all its containers (the screen may still scroll it out of view)."""
        return self.is_mounted and all(node.display for node in self.ancestors_with_self if isinstance(node, Widget))

    @property
    def owes_draw(self) -> bool:
        """Changed while hidden: the next catch_up draws."""
        return self._owed

    def drawing(self) -> bool:
        """Whether to draw a change now; False (hidden) owes the draw to catch_up."""
        if self.shown:
            return True
        self._owed = True
        return False

    def catch_up(self) -> None:
        """Draw what changed while hidden (nothing if nothing did, or if still hidden)."""
        if self._owed and self.shown:
            self._owed = False
            self.draw()

    def draw(self) -> None:
        raise NotImplementedError

    def on_show(self) -> None:
        self.catch_up()
