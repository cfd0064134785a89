"""A request: one turn of one conversation inside the scheduler, from its rendered prompt to
its last reply token, and the queue of events its conversation reads.

The scheduler alone changes a request (nano-vllm's Sequence plays this part); the
conversation that submitted it only reads its events, which are appended before the request
is marked finished, so a reader that sees `finished` and then drains the queue has them all.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .sampler import Sampler
from .sequence import Sequence

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
PREFILL, DECODE = "prefill", "decode"


class Fed(NamedTuple):
    """A reply token, once a step has written its K/V (or once it ended the reply unfed):
    the conversation makes a TokenEvent of it, with its text."""
    token_id: int
    position: int        # its position in the text
    latency_ms: float    # the step that fed it (the previous step's for a token that ended the reply)


@dataclass(slots=True, eq=False)
class Request:
    id: int                          # arrival order: a larger id is newer
    seq: Sequence                    # the conversation's cache
    prompt: list[int]                # the rendered prompt
    sampler: Sampler
    max_tokens: int
    stops: frozenset[int]
    limit: int                       # tokens the conversation may hold: its cap, or the model's maximum
    limit_reason: str                # the stop reason at the limit: "cap" or "max_position"
    t0: float                        # perf_counter when the turn began
    mode: str = "cache"              # "off": every step recomputes the whole text, no cache kept
    sink_tokens: int | None = None   # sink-window: the sink tokens kept; None: no window
    chunk_size: int = 512            # most prompt tokens per prefill chunk
    cancel: threading.Event | None = None
    state: str = WAITING
    phase: str = PREFILL             # prefill: computing its text; decode: feeding its newest token
    held: bool = False               # in decode, takes no row while held (Engine.hold)
    tokens: list[int] = field(default_factory=list)   # the prompt, then each reply token kept
    generated: int = 0               # reply tokens kept (the newest is fed by the next step)
    starts: int = 0                  # times admitted (more than once after preemptions)
    preempted: int = 0
    recomputed: int = 0              # tokens computed again because a preemption dropped them
    reused: int = 0                  # prompt tokens whose K/V the first start found cached
    base: int = 0                    # text tokens already cached when the current start began
    first_logits: torch.Tensor | None = None   # (vocab,) fp32: the first reply token's
    prefill_ms: float | None = None
    ttft_ms: float | None = None
    decode_ms: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    step_sequences: list[int] = field(default_factory=list)   # per fed token: sequences in its step
    step_tokens: list[int] = field(default_factory=list)      # and the cached tokens that step read
    stop_reason: str | None = None
    error: BaseException | None = None
    events: deque = field(default_factory=deque)   # PrefillProgress, PrefillEvent, Fed

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    @property
    def streaming(self) -> bool:
        return self.sink_tokens is not None

    @property
    def target(self) -> int:
        """Text tokens a prefill must cover: all of them, but the newest reply token (fed by a
        decode step) once there is one."""
        return len(self.tokens) - (1 if self.generated else 0)

    @property
    def fed(self) -> int:
        """Text tokens whose K/V the cache holds or held (sink-window evicts some)."""
        return len(self.seq.logical)

    @property
    def last_ms(self) -> float:
        return self.decode_ms[-1] if self.decode_ms else (self.ttft_ms or 0.0)

    @property
    def ms_per_token(self) -> float | None:
        return sum(self.decode_ms) / len(self.decode_ms) if self.decode_ms else None

    # ---- what a step does to it (called by the scheduler only) ------------------------------
    def record_feed(self, step_ms: float, sequences: int, context_tokens: int) -> None:
        """A step fed its newest token: that step's time and how many shared it."""
        pos = len(self.tokens) - 1
        self.decode_ms.append(step_ms)
        self.positions.append(pos)
        self.step_sequences.append(sequences)
        self.step_tokens.append(context_tokens)
        self.events.append(Fed(self.tokens[-1], pos, step_ms))

    def take(self, token: int, first: bool) -> str | None:
        """A token sampled for it: kept, to be fed by the next step, or the reply's stop
        reason (a token that ends the reply at the limit is shown, never fed)."""
        if token in self.stops:
            return "eos"
        pos = len(self.tokens)
        self.tokens.append(token)
        self.generated += 1
        self.phase = DECODE
        stop = None
        if self.generated >= self.max_tokens:
            stop = "max_tokens"
        elif not self.streaming and len(self.tokens) >= self.limit:
            stop = self.limit_reason
        elif first and self.cancel is not None and self.cancel.is_set():
            stop = "cancelled"
        if stop is not None:
            self.events.append(Fed(token, pos, self.last_ms))
        return stop

    def cut(self, kept: int) -> None:
        """The reply ends after its first `kept` tokens: the rest, queued or not, is dropped."""
        del self.tokens[len(self.prompt) + kept:]
        for figures in (self.decode_ms, self.positions, self.step_sequences, self.step_tokens):
            del figures[kept:]
        self.generated = kept
        self.stop_reason = "cancelled"
        self.events.clear()
