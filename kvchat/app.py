"""The kvchat app: the chat on the left, the KV cache's telemetry on the right.

Threads: the UI thread owns every widget. Loading the engine, each turn, and each cache
operation run in `@work(thread=True)` workers, one job at a time (a small queue), and
report back only through post_message. A turn holds engine.lock from its prefill to its
last token, so the UI thread never calls an engine method that takes the lock; cache
snapshots are taken by the worker, at most a few times a second (see turn.py).
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, ProgressBar

from engine.errors import KvchatError
from engine.sampler import SamplingParams
from engine.telemetry import CacheSnapshot

from . import keys, theming
from .actions import ChatActions
from .commands import CommandError, message_text, parse
from .jobs import Jobs, one_line
from .messages import EngineFailed, EngineReady, TurnEnded, TurnProgress
from .session import ChatSession, SessionOptions
from .settings import Settings
from .store import Restored
from .turn import Governor, relay
from .widgets import BlockMap, CachePanel, CapGauge, ChatInput, LatencyPanel, Reply, StatusBar, Transcript

NARROW = 90   # below this many columns the panels hide themselves (ctrl+b shows them)


@dataclass(slots=True)
class AppOptions:
    model: str                                  # a label for the loading line
    sampling: SamplingParams
    session: SessionOptions
    theme: str = "dark"
    restored: Restored | None = None            # --resume
    data_root: Path | None = None               # None: the platform's user data dir


class KvChatApp(ChatActions, Jobs, App[int], inherit_bindings=False):
    """App's own ctrl+q / ctrl+c bindings are replaced by keys.KEYS (not inherited)."""

    TITLE = "kvchat"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = keys.bindings()

    def __init__(self, engine_factory: Callable[[], Any], options: AppOptions,
                 settings: Settings | None = None, settings_path: Path | None = None) -> None:
        self.themes = theming.available()
        folder = theming.themes_dir()
        super().__init__(css_path=[folder / theming.BASE_CSS, *(t.path for t in self.themes.values())])
        self.register_theme(theming.HIGH_CONTRAST)
        self.engine_factory = engine_factory
        self.options = options
        self.settings = settings or Settings()
        self.settings_path = settings_path
        self.theme_name = options.theme if options.theme in self.themes else next(iter(self.themes))
        self.engine: Any = None
        self.session: ChatSession | None = None
        self.snapshot: CacheSnapshot | None = None
        self.busy: str | None = "load"          # the running job: load, reply, or an op label
        self.jobs: deque[tuple[str, Callable[[], Any]]] = deque()
        self.cancel = threading.Event()
        self.reply: Reply | None = None
        self.turn_text: str | None = None
        self.user_widget: Any = None
        self.prompt_tokens = 0
        self.context_tokens = 0
        self.quitting = False
        self.exiting = False
        self.governor = Governor()
        self.panels_forced = False
        self.failure: str | None = None         # one line for stderr after exit
        self._load_started = time.perf_counter()

    # ---- layout -------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield StatusBar()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield ChatInput(id="input")
            with VerticalScroll(id="panels"):
                yield CachePanel(id="cache-panel")
                yield CapGauge(id="cap-gauge")
                yield BlockMap(id="block-map")
                yield LatencyPanel(id="latency-panel")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.apply_theme(self.theme_name)
        self.set_keymap(self.settings.keys)
        self.part(StatusBar).info = f"kvchat · {self.options.model}"
        bar = ProgressBar(total=None, show_eta=False, show_percentage=False, id="loading")
        self.part(Transcript).mount(bar)
        self._load_timer = self.set_interval(0.1, self._loading_tick)
        self.part(ChatInput).focus()
        self._load()

    def on_resize(self, event) -> None:
        if not self.panels_forced:
            self.part("#panels").display = event.size.width >= NARROW

    def apply_theme(self, name: str) -> None:
        for t in self.themes.values():
            self.remove_class(t.css_class)
        self.add_class(self.themes[name].css_class)
        self.theme = self.themes[name].base
        self.theme_name = name

    def part(self, selector):
        """A widget of the chat screen, also while a dialog is on top of it."""
        return self.screen_stack[0].query_one(selector)

    def exit(self, *args, **kwargs) -> None:
        self.exiting = True     # worker messages still in the queue are dropped from now on
        super().exit(*args, **kwargs)

    def keymap(self) -> dict[str, str]:
        return {k.id: self.settings.keys.get(k.id, k.keys) for k in keys.KEYS}

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat keys are off while a dialog is open (its own keys win), and need a session."""
        if action in {k.action for k in keys.KEYS}:
            if len(self.screen_stack) > 1:
                return False
            if self.session is None and action not in ("help", "quit", "theme", "toggle_panels"):
                return None
        return True

    # ---- status ---------------------------------------------------------------------------------
    def status(self, state: str) -> None:
        self.part(StatusBar).state = state

    def update_status(self) -> None:
        e, conv = self.engine, self.session.conv
        cap = f"cap {conv.cap:,}" if conv.cap else "no cap"
        self.part(StatusBar).info = (
            f"{e.source.name} · {e.device} · {e.dtype_name} · KV {e.kv_dtype} · "
            f"cache {'on' if conv.mode == 'cache' else 'off'} · {cap} · {conv.policy.name}")

    def notice(self, text: str, error: bool = False) -> None:
        self.part(Transcript).add_notice(text, error)

    def _loading_tick(self) -> None:
        self.status(f"loading {self.options.model} … {time.perf_counter() - self._load_started:.1f} s")

    # ---- loading --------------------------------------------------------------------------------
    @work(thread=True, group="load", exit_on_error=False)
    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self.engine_factory()
        except KvchatError as err:
            self.post_message(EngineFailed(str(err)))
        except Exception as err:  # torch and transformers raise many types; report, never hide
            self.post_message(EngineFailed(f"cannot load the model: {one_line(err)}"))
        else:
            self.post_message(EngineReady(engine, time.perf_counter() - t0))

    async def on_engine_ready(self, msg: EngineReady) -> None:
        if self.exiting:
            return
        self._load_timer.stop()
        self.engine = msg.engine
        restored = self.options.restored
        try:
            self.session = ChatSession.start(self.engine, self.options.session, self.options.data_root, restored)
        except (KvchatError, OSError) as err:
            self.failure = f"cannot start the conversation: {err}"
            self.exit(return_code=2)
            return
        await self.part("#loading").remove()
        transcript = self.part(Transcript)
        if restored is not None:
            await transcript.show_history(self.session.conv.messages, self.session.turns)
            for summary in self.session.turns:
                self.part(LatencyPanel).add_turn(summary)
            transcript.add_notice(f"resumed {restored.path.name}: {len(restored.turns)} turns; the cache "
                                        "is empty, so the next turn prefills the whole history")
            if restored.unanswered:
                self.part(ChatInput).restore(restored.unanswered)
                transcript.add_notice("your last message got no reply; it is back in the input")
        transcript.add_notice(f"{self.engine.source.name} loaded in {msg.seconds:.0f} s; F1 shows the keys")
        self.part(CachePanel).geometry = self.engine.geometry
        self.update_status()
        self.run_op("read the cache", lambda: None)   # first snapshot, taken off the UI thread
        self._job_done()

    def on_engine_failed(self, msg: EngineFailed) -> None:
        self.failure = msg.error
        self.exit(return_code=2)

    # ---- turns ----------------------------------------------------------------------------------
    def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        try:
            cmd = parse(event.text, tuple(self.themes))
        except CommandError as err:
            self.notice(str(err), error=True)
            return
        if cmd is None:
            self.send(message_text(event.text))
        elif self.session is None and cmd.name not in ("help", "theme", "quit", "panel"):
            self.notice(f"/{cmd.name} waits for the model to load", error=True)
        else:
            self.run_command(cmd)

    def send(self, text: str, shown: str | None = None, typed: str | None = None) -> None:
        """Send a message, shown in the transcript as `shown` (a /load preview); `typed` is
        what goes back into the input if the turn cannot run."""
        if self.busy == "reply" or any(label == "reply" for label, _ in self.jobs):
            self.notice("still replying: press escape to stop it, then send", error=True)
            self.part(ChatInput).restore(typed or text)
            return
        if self.busy == "load":
            self.notice("the model is still loading; your message will be sent when it is ready")
        self.start_turn(text, shown, typed)

    def start_turn(self, text: str | None, shown: str | None = None, typed: str | None = None) -> None:
        """Queue a turn: text to send, or None to regenerate the last reply."""
        async def start() -> None:
            transcript = self.part(Transcript)
            if text is None:
                last = transcript.last_reply()
                if last is not None:
                    await last.remove()
            else:
                self.user_widget = await transcript.add_user(shown or text)
            self.reply = await transcript.start_reply()
            self.turn_text = typed or text
            self.cancel = threading.Event()
            self.part(LatencyPanel).begin_turn(self.session.conv.mode)
            self.status("prefilling…")
            self.governor.begin()
            self._turn_worker(self.session, text, self.cancel)
        self.submit("reply", start)

    @work(thread=True, group="turn", exit_on_error=False)
    def _turn_worker(self, session: ChatSession, text: str | None, cancel: threading.Event) -> None:
        conv = session.conv
        try:
            events = (conv.send(text, self.options.sampling, cancel) if text is not None
                      else conv.regenerate(self.options.sampling, cancel))
        except Exception as err:
            self.post_message(TurnEnded(None, one_line(err), accepted=False))
            return
        session.log.sync(conv.messages)
        stats, error = None, None
        try:
            stats = relay(events, lambda: self.engine.snapshot(conv), lambda p: self.post_message(TurnProgress(p)),
                          interval=lambda: self.governor.interval)
        except Exception as err:
            error = one_line(err)
        session.log.sync(conv.messages)
        if stats is not None:
            session.record_turn(stats.summary())
        snap = stats.cache if stats is not None else self.engine.snapshot(conv)
        self.post_message(TurnEnded(stats, error, snapshot=snap))

    async def on_turn_progress(self, msg: TurnProgress) -> None:
        if self.exiting:
            return
        p = msg.progress
        if self.reply is not None:
            await self.reply.append(p.text)
        self.part(LatencyPanel).add_points(p.points)
        if p.prefill is not None:
            self.prompt_tokens = p.prefill.prompt_tokens
        self.context_tokens = self.prompt_tokens + p.generated
        if p.snapshot is not None:
            self.show_snapshot(p.snapshot)
        self.status(f"replying · {p.generated} tokens")
        self.governor.tick()

    async def on_turn_ended(self, msg: TurnEnded) -> None:
        if self.exiting:
            return
        transcript = self.part(Transcript)
        if not msg.accepted:
            if self.reply is not None:
                await self.reply.remove()
            if self.turn_text is not None:
                self.user_widget.refuse(msg.error or "")
                if not self.part(ChatInput).text:
                    self.part(ChatInput).restore(self.turn_text)
            transcript.add_notice(msg.error or "the turn was refused", error=True)
            self.part(LatencyPanel).end_turn(None)
        else:
            summary = msg.stats.summary() if msg.stats is not None else None
            if self.reply is not None:
                await self.reply.finish(summary, error=msg.error)
            self.part(LatencyPanel).end_turn(summary)
            if summary is not None:
                self.context_tokens = summary["prompt_tokens"] + summary["generated_tokens"]
        if msg.snapshot is not None:
            self.show_snapshot(msg.snapshot)
        self.reply = None
        self._job_done()

    async def switch_session(self, session: ChatSession) -> None:
        self.session = session
        await self.part(Transcript).remove_children()
        self.part(LatencyPanel).clear()
        self.context_tokens = 0

    # ---- panels -----------------------------------------------------------------------------------
    def show_snapshot(self, snap: CacheSnapshot) -> None:
        self.snapshot = snap
        self.part(CachePanel).show(snap, self.engine.geometry)
        self.part(BlockMap).show(snap)
        self.update_gauge()

    def update_gauge(self) -> None:
        conv = self.session.conv
        held = self.snapshot.tokens_held if self.snapshot is not None else 0
        tokens = held if conv.mode == "cache" else self.context_tokens
        self.part(CapGauge).show(tokens, conv.cap, conv.policy.name, conv.policy.description,
                                      self.engine.geometry.max_position)


# ---- the entry point ---------------------------------------------------------------------------------
def run_chat(args) -> int:
    """The chat app. Bad flags, settings, or a missing model end here, before the UI starts,
    with one line on stderr and exit status 2."""
    from .launch import LaunchError, prepare
    try:
        app = prepare(args)
    except LaunchError as err:
        print(f"kvchat: {err}", file=sys.stderr)
        return 2
    app.run()
    if app.failure:
        print(f"kvchat: {app.failure}", file=sys.stderr)
        return 2
    return app.return_code or 0
