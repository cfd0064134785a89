"""The kvchat app: the chat on the left, the KV cache's telemetry on the right.

Threads: the UI thread owns every widget. Loading the engine, each turn, and each cache
operation run in `@work(thread=True)` workers, one job at a time (a small queue), and
report back only through post_message. A turn holds engine.lock from its prefill to its
last token, so the UI thread never calls an engine method that takes the lock; cache
snapshots are taken by the worker, at most a few times a second (see turn.py), of the
conversation in focus at that moment (several share the pool: see conversations.py).
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
from textual.widgets import ContentSwitcher, Footer, ProgressBar

from kvchat.engine.errors import KvchatError
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.telemetry import CacheSnapshot

from . import keys, theming
from .actions import ChatActions
from .commands import CommandError, message_text, parse
from .conversations import Conversations
from .jobs import Jobs, one_line
from .records import TurnRecord
from .messages import EngineFailed, EngineReady, TurnEnded, TurnProgress
from .session import ChatSession, SessionOptions
from .settings import Settings
from .store import Restored
from .turn import Governor, relay
from .widgets import (BlockMap, CachePanel, CapGauge, ChatInput, ConversationBar, LatencyPanel, Reply, StatusBar,
                      Transcript, UserMessage)

NARROW = 90   # below this many columns the panels hide themselves (ctrl+b shows them)


@dataclass(slots=True)
class AppOptions:
    model: str                                  # a label for the loading line
    sampling: SamplingParams
    session: SessionOptions
    theme: str = "dark"
    restored: Restored | None = None            # --resume
    data_root: Path | None = None               # None: the platform's user data dir


class KvChatApp(ChatActions, Conversations, Jobs, App[int], inherit_bindings=False):
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
        self.sessions: list[ChatSession] = []
        self.session: ChatSession | None = None     # the conversation in focus
        self.turn_session: ChatSession | None = None   # the one whose turn runs (or ran last)
        self.waiting: set[ChatSession] = set()          # those with a turn in the job queue
        self.next_number = 1
        self.busy: str | None = "load"          # the running job: load, reply, or an op label
        self.jobs: deque[tuple[str, Callable[[], Any]]] = deque()
        self.cancel = threading.Event()
        self.reply: Reply | None = None
        self.turn_text: str | None = None
        self.user_widget: Any = None
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
                yield ConversationBar(id="conversations", classes="single")
                with ContentSwitcher(id="transcripts", initial="transcript"):
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
        self.transcript.mount(bar)
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

    @property
    def snapshot(self) -> CacheSnapshot | None:
        """The focused conversation's latest cache snapshot."""
        return self.session.snapshot if self.session is not None else None

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
        chat = f"chat {self.session.number} of {len(self.sessions)} · " if len(self.sessions) > 1 else ""
        self.part(StatusBar).info = (
            f"{chat}{e.source.name} · {e.device} · {e.dtype_name} · KV {e.kv_dtype} · "
            f"cache {'on' if conv.mode == 'cache' else 'off'} · {cap} · {conv.policy.name}")

    def notice(self, text: str, error: bool = False) -> None:
        """A line in the focused conversation's transcript."""
        self.transcript.add_notice(text, error)

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
            session = ChatSession.start(self.engine, self.options.session, self.options.data_root, restored)
        except (KvchatError, OSError) as err:
            self.failure = f"cannot start the conversation: {err}"
            self.exit(return_code=2)
            return
        session.number = self.next_number
        self.next_number += 1
        transcript = self.part("#transcript")
        await self.add_session(session, transcript)
        self.session = session
        await self.part("#loading").remove()
        if restored is not None:
            await transcript.show_history(session.conv.messages, session.turns)
            for summary in session.turns:
                session.latency.add_turn(summary)
            transcript.add_notice(f"resumed {restored.path.name}: {len(restored.turns)} turns; the cache "
                                        "is empty, so the next turn prefills the whole history")
            if restored.unanswered:
                self.part(ChatInput).restore(restored.unanswered)
                transcript.add_notice("your last message got no reply; it is back in the input")
        transcript.add_notice(f"{self.engine.source.name} loaded in {msg.seconds:.0f} s; F1 shows the keys")
        self.part(LatencyPanel).attach(session.latency)
        self.part(CachePanel).geometry = self.engine.geometry
        self.update_status()
        self.refresh_bar()
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
        session = self.session
        if (self.busy == "reply" and self.turn_session is session) or session in self.waiting or (
                session is None and any(label == "reply" for label, _ in self.jobs)):
            self.notice("still replying: press escape to stop it, then send", error=True)
            self.part(ChatInput).restore(typed or text)
            return
        if self.busy == "load":
            self.notice("the model is still loading; your message will be sent when it is ready")
        elif self.busy == "reply":
            self.notice(f"queued: conversation {self.turn_session.number} is replying, and the engine runs one "
                        "turn at a time; this one starts when it ends")
        self.start_turn(text, shown, typed)

    def start_turn(self, text: str | None, shown: str | None = None, typed: str | None = None) -> None:
        """Queue a turn of the focused conversation: text to send, or None to regenerate the
        last reply."""
        asked = self.session                       # None while the model loads: the first one
        shown_now = None
        if asked is not None:
            self.waiting.add(asked)
            if text is not None and self.busy is not None:   # shown while it waits its turn
                shown_now = UserMessage(shown or text)
                asked.transcript.mount(shown_now)

        async def start() -> None:
            session = asked or self.session
            self.waiting.discard(session)
            if session not in self.sessions:       # closed while the turn waited in the queue
                self._job_done()
                return
            transcript = session.transcript
            if text is None:
                last = transcript.last_reply()
                if last is not None:
                    await last.remove()
            else:
                self.user_widget = shown_now or await transcript.add_user(shown or text)
            self.reply = await transcript.start_reply()
            self.turn_text = typed or text
            self.turn_session = session
            self.cancel = threading.Event()
            session.latency.begin_turn(session.conv.mode)
            self.status("prefilling…")
            self.refresh_bar()
            self.governor.begin()
            self._turn_worker(session, text, self.cancel)
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
        focus, prefilled = [self.session], [False]

        def snapshot():
            """Of the conversation in focus now: the user may have switched mid-reply."""
            focus[0] = self.session
            return self.engine.snapshot(focus[0].conv)

        def emit(p) -> None:
            prefilled[0] = prefilled[0] or p.prefill is not None
            self.post_message(TurnProgress(p, focus[0]))
        try:
            stats = relay(events, snapshot, emit, interval=lambda: self.governor.interval)
        except Exception as err:
            error = one_line(err)
        session.log.sync(conv.messages)
        if stats is not None:
            session.record_turn(TurnRecord.from_stats(stats))
        viewer = self.session
        snap = stats.cache if stats is not None and viewer is session else self.engine.snapshot(viewer.conv)
        # failing before its first token, the engine restores the messages: as if never sent
        self.post_message(TurnEnded(stats, error, accepted=stats is not None or prefilled[0], snapshot=snap,
                                    focus=viewer))

    async def on_turn_progress(self, msg: TurnProgress) -> None:
        if self.exiting:
            return
        p, session = msg.progress, self.turn_session
        if self.reply is not None:
            await self.reply.append(p.text)
        if session is self.session:
            self.part(LatencyPanel).add_points(p.points)
        else:
            session.latency.add_points(p.points)
        if p.prefill is not None:
            session.prompt_tokens = p.prefill.prompt_tokens
        session.context_tokens = session.prompt_tokens + p.generated
        if p.snapshot is not None:
            self.take_snapshot(msg.focus, p.snapshot)
        if p.prefill is not None:
            self.note_preemptions(session)       # making room for the prompt may have preempted others
        where = f"conversation {session.number} " if session is not self.session else ""
        self.status(f"{where}replying · {p.generated} tokens")
        self.governor.tick()

    async def on_turn_ended(self, msg: TurnEnded) -> None:
        if self.exiting:
            return
        session = self.turn_session
        latency = self.part(LatencyPanel) if session is self.session else session.latency
        if not msg.accepted:
            if self.reply is not None:
                await self.reply.remove()
            if self.turn_text is not None:
                self.user_widget.refuse(msg.error or "")
                if not self.part(ChatInput).text and session is self.session:
                    self.part(ChatInput).restore(self.turn_text)
            session.transcript.add_notice(msg.error or "the turn was refused", error=True)
            latency.end_turn(None)
        else:
            summary = TurnRecord.from_stats(msg.stats) if msg.stats is not None else None
            if self.reply is not None:
                await self.reply.finish(summary, error=msg.error)
            latency.end_turn(summary)
            if summary is not None:
                session.context_tokens = summary.context_tokens
        if msg.stats is not None:
            session.snapshot = msg.stats.cache
        if msg.snapshot is not None:
            self.take_snapshot(msg.focus, msg.snapshot)
        self.reply = None
        self._job_done()
        self.note_preemptions(session)

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
