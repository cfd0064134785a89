"""What the app starts with (AppOptions, built by cli/launch.py from the flags) and how the
backend's load, run in a worker, reports back to it (BackendReady, BackendFailed)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from textual.message import Message

from kvchat.engine.sampler import SamplingParams

from ..backends.protocol import Backend
from ..chat.view import ChatOptions
from ..store.log import Restored


@dataclass(slots=True)
class AppOptions:
    model: str                                  # a label for the loading line
    sampling: SamplingParams
    chat: ChatOptions = field(default_factory=ChatOptions)
    theme: str = "dark"
    restored: Restored | None = None            # --resume
    reopen: list[Path] = field(default_factory=list)   # --resume: the others open at the last quit
    data_root: Path | None = None               # None: the platform's user data dir


class BackendReady(Message):
    def __init__(self, backend: Backend, seconds: float) -> None:
        super().__init__()
        self.backend, self.seconds = backend, seconds


class BackendFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error
