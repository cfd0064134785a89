"""What the simulation moves around: its scheduler settings, the users (closed-loop
conversations), the requests (one turn each, with the tokens computed and the blocks held),
and what it hands back (a record per finished request, the inter-token gaps, the pool's
occupancy over time).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .block_pool import Block
from .workload import UserTrace

POLICIES = ("stop", "drop-oldest", "sink-window")


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int
    max_len: int                       # the longest sequence a request may reach (model, pool, --max-model-len)
    block_size: int = 16
    max_batched_tokens: int = 8192
    max_seqs: int = 256
    prefix_caching: bool = True
    cap: int | None = None
    policy: str = "stop"
    fast_forward: bool = True
    decode_first: bool = False         # kvchat's engine's step order, not vLLM's (simulator._plan_decode_first)
    prefill_chunk: int | None = None   # decode_first: a prompt's most tokens a step (the engine's lone chunk,
                                       # engine/sizing.py); None: max_batched_tokens

    def __post_init__(self) -> None:
        for name in ("num_blocks", "max_len", "block_size", "max_batched_tokens", "max_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown cap policy {self.policy!r}; accepted: {', '.join(POLICIES)}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {self.prefill_chunk}")
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"cap must be positive, got {self.cap}")
        if self.max_len > self.num_blocks * self.block_size:
            raise ValueError(f"max_len {self.max_len} is past the pool's {self.num_blocks * self.block_size} tokens: "
                             "a request could never fit")

    @property
    def limit(self) -> int:
        return min(self.cap, self.max_len) if self.cap is not None else self.max_len


class User:
    __slots__ = ("trace", "history", "epoch", "turn", "long", "order", "lost")

    def __init__(self, trace: UserTrace, order: int = 0) -> None:
        self.trace = trace
        self.order = order            # when its conversation was opened (idle ones are preempted newest first)
        self.lost = 0                 # history tokens its preempted idle blocks held: recomputed next turn
        self.history = list(trace.history)
        self.epoch = 0
        self.turn = 0
        self.long = trace.long


class Request:
    __slots__ = ("user", "turn", "arrival", "prompt", "new", "max_out", "computed", "out", "blocks", "hashed",
                 "window", "epoch", "first_t", "last_t", "hits", "admitted", "preemptions", "recomputed", "high")

    def __init__(self, user: User, arrival: float, prompt: int, new: int, max_out: int, window: int | None) -> None:
        self.user, self.turn, self.arrival = user, user.turn, arrival
        self.prompt, self.new, self.max_out, self.window = prompt, new, max_out, window
        self.epoch = user.epoch
        self.computed = self.out = self.hashed = self.hits = self.preemptions = self.recomputed = self.high = 0
        self.blocks: list[Block] = []
        self.first_t: float | None = None
        self.last_t = arrival
        self.admitted = False

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.out

    def held(self, tokens: int) -> int:
        """Tokens of K/V this request holds at `tokens` computed (sink-window: at most its window)."""
        return tokens if self.window is None or tokens < self.window else self.window


@dataclass(frozen=True, slots=True)
class RequestRecord:
    user: int
    turn: int
    long: bool
    arrival: float
    prompt: int
    cached: int            # prompt tokens found in the prefix cache when first admitted
    output: int
    ttft: float
    e2e: float
    preemptions: int
    recomputed: int


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord] = field(default_factory=list)
    refused: list[tuple[int, int, int]] = field(default_factory=list)   # (user, turn, tokens the turn needed)
    itl: list[tuple[float, int]] = field(default_factory=list)          # (seconds, how many tokens waited that long)
    samples: list[tuple[float, int, int, int, int, int]] = field(default_factory=list)
    # (t, blocks in use, cached evictable blocks, running, waiting, blocks the long user holds)
    steps: int = 0
    stretches: int = 0
    preemptions: int = 0
    recomputed: int = 0
    evictions: int = 0
    end: float = 0.0
    unfinished: int = 0    # requests still queued or running when the horizon stopped the run
    tokens_scheduled: int = 0
    # each step's (decode rows, prompt chunks, prompt tokens, seconds), kept only when the
    # Simulator was asked to (log_steps): validate's diagnostics set them beside the engine's
    step_log: list[tuple[int, int, int, float]] | None = None
