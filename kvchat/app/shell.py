"""The kvchat app: the chat on the left, the KV cache's telemetry on the right.

Parts, one file each: a ChatView per conversation and the RunningTurn (chat/view.py), the
open conversations and the focus (chat/conversations.py), what keys and commands do
(chat/controls.py), the job queue and its workers (chat/jobs.py), the relay of a turn's events
(chat/relay.py); chat/host.py is the app as those parts see it. The app sees the model only
through a Backend (backends/protocol.py) and the engine's telemetry types.

Threads: the UI thread owns every widget. Loading the backend, each turn, and each
operation that may block run in thread workers, one job at a time (JobQueue), and report
back only through messages. A turn holds the backend from its prefill to its last token,
so the UI thread calls only what never waits on it (`state()`, `info()`, set_cap);
snapshots are taken by the worker, at most a few times a second (chat/relay.py), of the
conversation in focus at that moment.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from textual import events
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import ContentSwitcher, Footer, ProgressBar

from kvchat.engine.errors import KvchatError
from kvchat.engine.telemetry import CacheSnapshot

from .. import keys
from . import theming
from ..backends.protocol import BLOCK_MAP, Backend
from ..chat.browser import Browser
from ..chat.view import ChatView, RunningTurn, TurnEnded, TurnProgress, open_chat
from ..commands import CommandError, message_text, parse
from ..chat.controls import Controls
from ..chat.conversations import Conversations
from ..chat.draft import DraftCounter
from ..chat.editing import Editor
from ..chat.generation import Generation
from ..chat.generation import describe as describe_sampling
from ..chat.jobs import Busy, Job, JobQueue, Op, OpEnded, one_line, run_op, run_turn
from ..widgets.layout import layout_for
from .palette import KvchatCommands
from ..text import prefill_line
from ..text import plural
from ..store.settings import Settings
from .startup import AppOptions, BackendFailed, BackendReady
from ..chat.relay import Governor
from ..widgets import (BlockMap, CachePanel, CapGauge, ChatInput, ConversationBar, LatencyPanel, PanelSwitcher, StatusBar)

RANDOM_WEIGHTS = ("random weights (--random-weights): the text is gibberish by design; the cache, its blocks "
                  "and the latency are real")


class KvChatApp(App[int], inherit_bindings=False):
    """App's own ctrl+q / ctrl+c bindings are replaced by keys.KEYS (not inherited)."""

    TITLE = "kvchat"
    ENABLE_COMMAND_PALETTE = False     # its built-in ctrl+p binding: keys.KEYS has a rebindable one instead
    COMMANDS = {KvchatCommands}
    BINDINGS = keys.bindings()

    def __init__(self, backend_factory: Callable[[], Backend], options: AppOptions,
                 settings: Settings | None = None, settings_path: Path | None = None) -> None:
        self.themes = theming.available()
        folder = theming.themes_dir()
        super().__init__(css_path=[folder / theming.BASE_CSS, *(t.path for t in self.themes.values())])
        self.register_theme(theming.HIGH_CONTRAST)
        self.backend_factory = backend_factory
        self.options = options
        self.settings = settings or Settings()
        self.settings_path = settings_path
        self.theme_name = options.theme if options.theme in self.themes else next(iter(self.themes))
        self.backend: Backend | None = None
        self.conversations = Conversations(self, options.data_root)
        self.controls = Controls(self, self.conversations)
        self.browser = Browser(self, self.conversations, options.data_root)
        self.editor = Editor(self, self.conversations)
        self.conversations.on_change = self.browser.remember
        self.jobs = JobQueue(self._start_job)
        self.turn: RunningTurn | None = None        # the running turn (the last one, once idle)
        self.governor = Governor()
        self.quitting = False
        self.exiting = False
        self.failure: str | None = None         # one line for stderr after exit
        self._load_started = time.perf_counter()
        self.use_command_palette = True         # opened by keys.KEYS' "palette" key
        self.generation = Generation(self, options.sampling)
        self.draft = DraftCounter(self)
        self.notes: list[str] = []              # status-line notes (cap, policy, theme...), oldest first

    # ---- layout -------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield StatusBar()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield ConversationBar(id="conversations", classes="single")
                with ContentSwitcher(id="transcripts", initial="transcript"):
                    yield ChatView(self.conversations.number(), id="transcript")
                yield ChatInput(id="input")
            yield PanelSwitcher(id="panels")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.apply_theme(self.theme_name)
        self.set_keymap(self.settings.keys)
        self.part(StatusBar).info = f"kvchat · {self.options.model}"
        self.transcript.mount(ProgressBar(total=None, show_eta=False, show_percentage=False, id="loading"))
        self._load_timer = self.set_interval(0.1, self._loading_tick)
        self.part(ChatInput).focus()
        self.part(PanelSwitcher).set_hint(self.keymap()["next_panel"].split(",")[0])
        self.part(PanelSwitcher).use_layout(layout_for(self.size.width, self.size.height))
        self.run_worker(self._load, thread=True, group="load", exit_on_error=False)

    def on_resize(self, event) -> None:
        self.part(PanelSwitcher).use_layout(layout_for(event.size.width, event.size.height))

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
    def view(self) -> ChatView | None:
        """The conversation in focus (None until the backend is loaded)."""
        return self.conversations.focused

    @property
    def views(self) -> list[ChatView]:
        return self.conversations.views

    @property
    def transcript(self) -> ChatView:
        """The focused conversation's view (the first one while the model loads)."""
        return self.view if self.view is not None else self.part("#transcript")

    @property
    def busy(self) -> Busy | None:
        return self.jobs.busy

    @property
    def snapshot(self) -> CacheSnapshot | None:
        """The focused conversation's latest cache snapshot."""
        return self.view.snapshot if self.view is not None else None

    def keymap(self) -> dict[str, str]:
        return {k.id: self.settings.keys.get(k.id, k.keys) for k in keys.KEYS}

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat keys are off while a dialog is open (its own keys win), and need a conversation."""
        if action == "key":
            if len(self.screen_stack) > 1:
                return False
            if self.view is None and parameters[0] not in ("help", "quit", "theme", "toggle_panels", "next_panel"):
                return None
        return True

    # ---- status and panels ----------------------------------------------------------------------
    def status(self, state: str) -> None:
        self.part(StatusBar).state = state

    def update_status(self) -> None:
        self.part(StatusBar).show_settings(self.backend.info(), self.view.state, self.view.number, len(self.views),
                                           describe_sampling(self.options.sampling))

    def status_note(self, text: str) -> None:
        """A setting's change (cap, policy, theme, sampling, a copy): the status line says it
        and `notes` keeps it; the transcript keeps the conversation."""
        self.part(StatusBar).note = text
        self.notes.append(text)

    def notice(self, text: str, error: bool = False) -> None:
        """A line in the focused conversation's transcript."""
        self.transcript.add_notice(text, error)

    def take_snapshot(self, view: ChatView | None, snap: CacheSnapshot) -> None:
        """Keep a conversation's snapshot; draw it if that one is in focus."""
        if view is None:
            return
        view.snapshot = snap
        if view is self.view:
            self.show_snapshot(snap)

    def show_snapshot(self, snap: CacheSnapshot) -> None:
        info = self.backend.info()
        self.part(CachePanel).show(snap, info.geometry, info.dtype)
        self.part(BlockMap).show(snap)
        self.update_gauge()

    def update_gauge(self) -> None:
        view = self.view
        s = view.refresh_state()
        held = view.snapshot.tokens_held if view.snapshot is not None else 0
        # held is None for a server without a KV-event stream: the gauge shows the context sent
        tokens = held if s.mode == "cache" and held is not None else view.context_tokens
        self.part(CapGauge).show(tokens, s.cap, s.policy, s.policy_description,
                                 self.backend.info().max_position or 0, evicted=s.evicted_tokens)

    # ---- loading --------------------------------------------------------------------------------
    def _loading_tick(self) -> None:
        self.status(f"loading {self.options.model} … {time.perf_counter() - self._load_started:.1f} s")

    def _load(self) -> None:
        """In a worker: build the backend (the model load takes seconds)."""
        t0 = time.perf_counter()
        try:
            backend = self.backend_factory()
        except KvchatError as err:
            self.post_message(BackendFailed(str(err)))
        except Exception as err:  # torch and transformers raise many types; report, never hide
            self.post_message(BackendFailed(f"cannot load the model: {one_line(err)}"))
        else:
            self.post_message(BackendReady(backend, time.perf_counter() - t0))

    async def on_backend_ready(self, msg: BackendReady) -> None:
        if self.exiting:
            return
        self._load_timer.stop()
        self.backend = msg.backend
        restored = self.options.restored
        try:
            opened = open_chat(self.backend, self.options.chat, self.options.data_root, restored)
        except (KvchatError, OSError) as err:
            self.failure = f"cannot start the conversation: {err}"
            self.exit(return_code=2)
            return
        view: ChatView = self.part("#transcript")
        view.attach(*opened)
        await self.conversations.add(view)
        self.conversations.focused = view
        await self.part("#loading").remove()
        if restored is not None:
            await view.show_history(list(view.state.messages), view.turns)
            view.add_notice(f"resumed {restored.path.name}: {plural(len(restored.turns), 'turn')}; the cache "
                            "is empty, so the next turn prefills the whole history")
            if restored.unanswered:
                self.part(ChatInput).restore(restored.unanswered)
                view.add_notice("your last message got no reply; it is back in the input")
            await self.browser.resumed(view, restored, history=False)
        info, caps = self.backend.info(), self.backend.capabilities
        view.add_notice(f"{info.model} loaded in {msg.seconds:.0f} s; F1 shows the keys")
        if info.random_weights:
            view.add_notice(RANDOM_WEIGHTS, error=False).add_class("warning")
        self.part(LatencyPanel).attach(view.latency)
        self.part(CachePanel).geometry = info.geometry
        self.part(BlockMap).unavailable(None if caps.block_map != "none" else caps.why_not(BLOCK_MAP) or
                                        "this backend cannot say which block holds what")
        if self.options.reopen:
            await self.browser.reopen_all(self.options.reopen)
        self.update_status()
        self.conversations.refresh_bar()
        self.run_op("read the cache", lambda: None)   # first snapshot, taken off the UI thread
        self.job_done()

    def on_backend_failed(self, msg: BackendFailed) -> None:
        self.failure = msg.error
        self.exit(return_code=2)

    # ---- turns ----------------------------------------------------------------------------------
    def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        try:
            cmd = parse(event.text, tuple(self.themes))
        except CommandError as err:
            self.notice(str(err), error=True)
            return
        if cmd is None and self.editor.editing():
            self.editor.resend(message_text(event.text))
        elif cmd is None:
            self.send(message_text(event.text))
        elif self.view is None and cmd.name not in ("help", "theme", "quit", "panel"):
            self.notice(f"/{cmd.name} waits for the model to load", error=True)
        else:
            self.controls.run(cmd)

    def send(self, text: str, shown: str | None = None, typed: str | None = None) -> None:
        """Send a message, shown in the transcript as `shown` (a /load preview); `typed` is
        what goes back into the input if the turn cannot run."""
        view = self.transcript
        if self.replying(view) or self.queued(view):
            self.notice("still replying: press escape to stop it, then send", error=True)
            self.part(ChatInput).restore(typed or text)
            return
        if self.busy is Busy.LOAD:
            self.notice("the model is still loading; your message will be sent when it is ready")
        elif self.busy is Busy.REPLY:
            self.notice(f"queued: conversation {self.turn.view.number} is replying, and the engine runs one "
                        "turn at a time; this one starts when it ends")
        self.submit(view.ask(text, shown, typed))

    def replying(self, view: ChatView) -> bool:
        return self.busy is Busy.REPLY and self.turn is not None and self.turn.view is view

    def queued(self, view: ChatView) -> bool:
        return any(isinstance(job, RunningTurn) and job.view is view for job in self.jobs)

    def submit(self, turn: RunningTurn) -> None:
        self.jobs.submit(turn)

    def _start_job(self, job: Job) -> None:
        if isinstance(job, Op):
            self.status(f"{job.label}…")
            self.call_later(self.run_worker, partial(run_op, job, self.backend, lambda: self.view, self.post_message),
                            thread=True, group="op", exit_on_error=False)
        else:
            self.call_later(self._start_turn, job)

    async def _start_turn(self, turn: RunningTurn) -> None:
        view = turn.view
        if view not in self.views:       # closed while the turn waited in the queue
            self.job_done()
            return
        self.turn = turn
        await view.begin(turn)
        self.status("prefilling…")
        self.conversations.refresh_bar()
        self.governor.begin()
        self.run_worker(partial(run_turn, turn, self.backend, self.options.sampling, lambda: self.view,
                                lambda: self.governor.interval), thread=True, group="turn", exit_on_error=False)

    def on_turn_progress(self, msg: TurnProgress) -> None:
        """After the turn's ChatView drew the text: the panels and the status line."""
        if self.exiting:
            msg.drawn.set()
            return
        p, view = msg.progress, msg.turn.view
        if view is self.view:
            self.part(LatencyPanel).add_points(p.points)
        else:
            view.latency.add_points(p.points)
        if p.snapshot is not None:
            self.take_snapshot(msg.focus, p.snapshot)
        if p.prefill is not None:
            self.conversations.note_preemptions(view)   # making room for the prompt may have preempted others
        where = f"conversation {view.number} " if view is not self.view else ""
        if p.prefill_progress is not None:
            self.status(where + prefill_line(p.prefill_progress))
        else:
            self.status(f"{where}replying · {p.generated} tokens")
        self.governor.tick()
        self.call_after_refresh(msg.drawn.set)      # the worker's next step waits for this draw

    def on_turn_ended(self, msg: TurnEnded) -> None:
        """After the turn's ChatView finished the reply (or showed the refusal)."""
        if self.exiting:
            return
        turn, view = msg.turn, msg.turn.view
        (self.part(LatencyPanel) if view is self.view else view.latency).end_turn(msg.record)
        if not msg.accepted and turn.text is not None and view is self.view and not self.part(ChatInput).text:
            self.part(ChatInput).restore(turn.typed or turn.text)
        if msg.snapshot is not None:
            self.take_snapshot(msg.focus, msg.snapshot)
        self.job_done()
        self.conversations.note_preemptions(view)

    # ---- operations -----------------------------------------------------------------------------
    def run_op(self, label: str, run: Callable[[], str | None], then=None,
               focus: Callable[[], ChatView] | None = None, interrupt: bool = True) -> None:
        """Run a backend operation in a worker, after the current job; stops a reply first
        unless interrupt is False (then it waits for the reply to end)."""
        if self.busy is Busy.REPLY and interrupt:
            self.turn.cancel.set()
            self.notice(f"stopping the reply to {label}")
        self.jobs.submit(Op(label, run, then, focus))

    async def on_op_ended(self, msg: OpEnded) -> None:
        if self.exiting:
            return
        if msg.then is not None:
            result = msg.then()
            if hasattr(result, "__await__"):
                await result
        for view in self.views:
            view.refresh_state()
        if msg.snapshot is not None:
            self.take_snapshot(msg.focus, msg.snapshot)
        self.update_status()
        if msg.error:
            self.notice(msg.error, error=True)
        elif msg.note:
            self.notice(msg.note)
        self.job_done()

    def job_done(self) -> None:
        idle = not self.jobs
        if idle:
            self.status("quitting" if self.quitting else "ready")
        self.jobs.done()
        if idle and self.quitting:
            self.exit()

    def quit_when_idle(self) -> None:
        """Let the reply in progress end (so it is saved), then exit."""
        self.quitting = True
        self.jobs.clear()
        if self.busy in (None, Busy.LOAD):    # a load cannot be interrupted; the process ends after it
            self.exit()
            return
        if self.turn is not None:
            self.turn.cancel.set()
        self.status("quitting…")
        self.set_timer(10, lambda: self.exit())   # a stuck job must not keep the app open

    # ---- keys ---------------------------------------------------------------------------------------
    def action_key(self, name: str) -> None:
        """Every key of keys.KEYS (bound as `key('name')`); chat/controls.py does what it says."""
        self.controls.key(name)

    def action_switch_conversation(self, number: int) -> None:
        """A click on the conversation bar."""
        self.conversations.switch(number)

    # ---- typing goes to the input -----------------------------------------------------------------
    def on_key(self, event: events.Key) -> None:
        """A character typed while another widget has focus (the transcript, a panel, a code
        block: none of them takes characters) goes to the input, which takes focus back;
        Tab still moves focus, and the focused widget keeps its own keys (arrows, pages)."""
        if not event.is_printable or not event.character or len(self.screen_stack) > 1:
            return
        field = self.part(ChatInput)
        if self.focused is field:
            return
        event.stop()
        field.focus()
        field.insert(event.character)

    def on_text_area_changed(self, event) -> None:
        """The draft changed: its token count beside the input, throttled."""
        if isinstance(event.text_area, ChatInput):
            self.draft.changed()


