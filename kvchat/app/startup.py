"""What the app starts with: AppOptions, built by cli/launch.py from the flags."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvchat.engine.sampler import SamplingParams

from ..chat.session import ChatOptions
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
