"""What the chat screen shows beside and above the conversation, drawn from a Session and
the backend's info: the status line, and the telemetry panels (KV cache, cap gauge, block
map, latency) in their switcher column.

The panels draw the conversation in focus. A turn in another conversation only updates that
conversation's Session; switching draws the new one's history and last snapshot at once.
"""
from __future__ import annotations

from functools import cached_property

from textual.screen import Screen

from kvchat.engine.policy import POLICIES
from kvchat.engine.telemetry import CacheSnapshot

from ..backends.protocol import BLOCK_MAP, BackendInfo, Capabilities
from ..widgets.block_map import BlockMap
from ..widgets.cache_panel import CachePanel
from ..widgets.cap_gauge import CapGauge
from ..widgets.latency_panel import LatencyPanel
from ..widgets.panel_switcher import PanelSwitcher
from ..widgets.status_bar import StatusBar
from .session import Session


class Panels:
    """Each widget is found on first use (the panels mount inside their switcher after the
    screen itself)."""

    def __init__(self, screen: Screen[None]) -> None:
        self.screen = screen
        self.notes: list[str] = []              # status-line notes (cap, policy, theme...), oldest first
        self.sampling = ""                      # the sampling line, as the status line last showed it

    @cached_property
    def status_bar(self) -> StatusBar:
        return self.screen.query_one(StatusBar)

    @cached_property
    def cache(self) -> CachePanel:
        return self.screen.query_one(CachePanel)

    @cached_property
    def blocks(self) -> BlockMap:
        return self.screen.query_one(BlockMap)

    @cached_property
    def gauge(self) -> CapGauge:
        return self.screen.query_one(CapGauge)

    @cached_property
    def latency(self) -> LatencyPanel:
        return self.screen.query_one(LatencyPanel)

    @cached_property
    def switcher(self) -> PanelSwitcher:
        return self.screen.query_one(PanelSwitcher)

    # ---- the status line --------------------------------------------------------------------------
    def status(self, state: str) -> None:
        """What kvchat is doing: loading, ready, prefilling, replying..."""
        self.status_bar.state = state

    def note(self, text: str) -> None:
        """A setting's change (cap, policy, theme, sampling, a copy): the status line says it
        and `notes` keeps it; the transcript keeps the conversation."""
        self.status_bar.note = text
        self.notes.append(text)

    def settings(self, info: BackendInfo, session: Session, open_chats: int, sampling: str) -> None:
        self.sampling = sampling        # the screen's, which every conversation shares (ctrl+n says so)
        self.status_bar.show_settings(info, session.state, session.number, open_chats, sampling)

    # ---- the telemetry panels ---------------------------------------------------------------------
    def backend_ready(self, info: BackendInfo, caps: Capabilities) -> None:
        self.cache.geometry = info.geometry
        self.latency.show_host = info.kind != "vllm"        # a server's cores are not this machine's
        self.blocks.unavailable(None if caps.block_map != "none" else caps.why_not(BLOCK_MAP) or
                                "this backend cannot say which block holds what")

    def show(self, session: Session, info: BackendInfo) -> None:
        """Another conversation in focus: its latency history and its last snapshot."""
        self.latency.attach(session.latency)
        if session.snapshot is not None:
            self.snapshot(session, session.snapshot, info)
        else:
            self.cap(session, info)

    def snapshot(self, session: Session, snap: CacheSnapshot, info: BackendInfo) -> None:
        self.cache.show(snap, info.geometry, info.dtype)
        self.blocks.show(snap)
        self.cap(session, info)

    def cap(self, session: Session, info: BackendInfo) -> None:
        """The cap gauge: the conversation's tokens against the cap, as the cap is checked
        (the last turn's prompt and reply, whatever the cache holds: after a reset or a
        reopen too); under sink-window, which caps the cache and not the text, the tokens
        the cache holds. It draws the session's state as last read (`Session.refresh`: each
        caller's step reads it once, after what changed it)."""
        s = session.state
        held = session.snapshot.tokens_held if session.snapshot is not None else None
        window = s.policy in POLICIES and POLICIES[s.policy].streaming and s.mode == "cache"
        tokens = held if window and held is not None else session.context_tokens
        self.gauge.show(tokens, s.cap, s.policy, s.policy_description, info.max_position or 0,
                        evicted=s.evicted_tokens)

    def progress(self, session: Session, points: bool, shown: Session | None, snap: CacheSnapshot | None,
                 info: BackendInfo, state: str) -> None:
        """A batch of a reply, in one call: its latency points (drawn if `session`'s history is
        on show), its snapshot (drawn on `shown`, the conversation on show, None if it is not
        the one the snapshot was taken in), and the status line."""
        if points:
            self.latency_changed(session, live=True)
        if shown is not None and snap is not None:
            self.snapshot(shown, snap, info)
        self.status(state)

    def latency_changed(self, session: Session, live: bool) -> None:
        """The session's latency history changed (live: points of the turn in progress)."""
        if self.latency.data is session.latency:
            self.latency.changed(live)
