"""A scripted stand-in for engine.Engine, for fast UI tests only.

Why a fake: loading the real model costs seconds per app, and UI tests of keys, commands,
caps, resets, resizes and error messages need dozens of apps and exact, repeatable
telemetry. FakeEngine has the public surface the app uses (new_conversation, snapshot,
set_kv_dtype, close_conversation, lock, geometry, ...) and replays canned replies word by
word ("one word = one token") with fixed latencies. Its bookkeeping follows the real
engine's rules: bytes used = tokens held x bytes per token, blocks = ceil(tokens / block
size), reused prompt tokens are the held whole blocks, and the real cap policies from
engine.policy decide what a turn keeps. Several conversations share its pool as in the
real engine: another conversation's blocks are OTHER in the block map, and when the pool
is full whole idle conversations are preempted, the most recently started first, and
recompute their tokens on their next turn (TurnStats.preempted / recomputed_tokens).
Under sink-window with a cap it evicts whole blocks after the first (the sink) to stay
within the cap, counting them in evicted_tokens and TurnStats.evicted_blocks.

It is not a model of the block manager: it has no prefix index, so blocks are never
shared (no SHARED), a closed conversation's blocks are freed rather than kept cached, and
LRU eviction of cached blocks never happens (snapshot.evictions stays 0). Those, and the
real preemption, are tested on the real engine (tests/test_experiments.py,
tests/app/test_real_engine.py drives the app on the real bundled model).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

from kvchat.engine.errors import KvchatError
from kvchat.engine.geometry import DTYPE_BYTES, KNOWN
from kvchat.engine.policy import make_policy
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.streaming import DEFAULT_SINK_TOKENS, check_window_cap, sink_blocks
from kvchat.engine.telemetry import FREE, HELD, OTHER, PARTIAL, REUSED, CacheSnapshot, PrefillEvent, TokenEvent, TurnStats

REPLIES = ("Hello there! The **KV cache** keeps keys and values.",
           "Each new token adds one row per layer.",
           "Reusing a prefix skips its prefill.")
MESSAGE_OVERHEAD = 4    # "tokens" of chat template around each message
GENERATION_PROMPT = 3


def count_tokens(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) + MESSAGE_OVERHEAD for m in messages) + GENERATION_PROMPT


@dataclass
class FakeEngineConfig:
    num_blocks: int = 64
    block_size: int = 16
    kv_dtype: str = "fp32"
    token_delay_s: float = 0.0      # per token; tests of stopping set it > 0
    replies: tuple[str, ...] = REPLIES


class FakeConversation:
    def __init__(self, engine: FakeEngine, system_prompt: str | None, cap: int | None, policy: str) -> None:
        self.engine = engine
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.cap = cap
        self.policy = make_policy(policy)
        self.mode = "cache"
        self.block_table: list[int] = []
        self.tokens_held = 0
        self.reused_blocks = 0
        self.turns = 0
        self.history: list[TurnStats] = []
        self.fed = 0                    # tokens fed since the cache was last empty (> tokens_held after evictions)
        self.evicted_tokens = 0         # by sink-window, since start
        self.preempted_pending = 0      # tokens lost to preemption, recomputed next turn
        self.turn_preempted = 0         # conversations this turn preempted

    def set_cap(self, cap: int | None) -> None:
        if cap is not None and cap <= 0:
            raise KvchatError(f"cap must be a positive number of tokens, got {cap!r}")
        if cap is not None and self.policy.streaming:
            self._check_window(cap)
        self.cap = cap

    def set_policy(self, name: str) -> None:
        policy = make_policy(name)
        if policy.streaming and self.cap is not None:
            self._check_window(self.cap)
        self.policy = policy

    def _check_window(self, cap: int) -> None:
        """The real Conversation's rule, from the engine."""
        check_window_cap(cap, DEFAULT_SINK_TOKENS, self.engine.cfg.block_size)

    @property
    def streaming(self) -> bool:
        return self.policy.streaming and self.cap is not None

    def set_mode(self, mode: str) -> None:
        if mode not in ("cache", "off"):
            raise KvchatError(f"unknown cache mode {mode!r}; accepted: on, off")
        with self.engine.lock:
            if mode == "off":
                self.reset_cache()
            self.mode = mode

    def reset_cache(self) -> int:
        with self.engine.lock:
            n = len(self.block_table)
            self.engine.free(self.block_table)
            self.block_table, self.tokens_held, self.reused_blocks, self.fed = [], 0, 0, 0
            return n

    def preempt(self) -> None:
        self.preempted_pending += self.tokens_held
        self.reset_cache()

    def send(self, text: str, sampling: SamplingParams | None = None, cancel: threading.Event | None = None):
        if not text.strip():
            raise KvchatError("empty message: type something to send")
        messages = self.messages + [{"role": "user", "content": text}]
        kept = self.policy.fit(messages, count_tokens, self.cap) if self.cap else messages
        dropped = len(messages) - len(kept)
        before, self.messages = self.messages, kept
        return self._turn(sampling or SamplingParams(), cancel, dropped, before)

    def regenerate(self, sampling: SamplingParams | None = None, cancel: threading.Event | None = None):
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise KvchatError("nothing to regenerate: the conversation has no reply yet")
        before = list(self.messages)
        self.messages.pop()
        return self._turn(sampling or SamplingParams(), cancel, 0, before)

    def _hold(self, fed: int) -> None:
        """The cache now holds `fed` tokens of text, less what sink-window evicted."""
        bs = self.engine.cfg.block_size
        tokens = self.tokens_held + fed - self.fed
        if self.streaming and tokens > self.cap:
            n = -(-(tokens - self.cap) // bs)          # whole blocks after the sink block
            first = sink_blocks(DEFAULT_SINK_TOKENS, bs)
            self.engine.free(self.block_table[first:first + n])
            del self.block_table[first:first + n]
            self.reused_blocks = min(self.reused_blocks, first)
            tokens -= n * bs
            self.evicted_tokens += n * bs
        need = -(-tokens // bs)
        self.block_table += self.engine.allocate(need - len(self.block_table), self)
        self.tokens_held, self.fed = tokens, fed

    def _turn(self, sp: SamplingParams, cancel, dropped: int, before: list[dict[str, str]]):
        eng = self.engine
        with eng.lock:
            if eng.fail_next is not None:      # before the first token: as if never sent, as the engine does
                err, eng.fail_next = eng.fail_next, None
                self.messages = before
                raise err
            prompt = count_tokens(self.messages)
            bs = eng.cfg.block_size
            reused = 0
            recomputed, self.preempted_pending, self.turn_preempted = self.preempted_pending, 0, 0
            evicted0 = self.evicted_tokens
            if self.mode == "cache":
                if self.streaming:
                    reused = min(self.fed, prompt - 1)
                    self.reused_blocks = 0
                else:
                    reused = min(self.tokens_held // bs * bs, (prompt - 1) // bs * bs) if not dropped else 0
                    self.reused_blocks = reused // bs
                    if dropped:
                        self.reset_cache()
                self._hold(prompt)
            yield PrefillEvent(prompt, reused, prompt - reused, 1.0)
            words = eng.cfg.replies[eng.replies_sent % len(eng.cfg.replies)].split()
            eng.replies_sent += 1
            out, decode_ms, positions, stop = [], [], [], "eos"
            try:
                for i, word in enumerate(words[:sp.max_tokens]):
                    pos = prompt + i
                    if self.cap is not None and not self.streaming and pos >= self.cap:
                        stop = "cap"
                        break
                    if eng.cfg.token_delay_s and cancel is not None:
                        cancel.wait(eng.cfg.token_delay_s)
                    if self.mode == "cache":
                        self._hold(pos + 1)
                    ms = 10.0 + 0.01 * pos
                    out.append(word + " ")
                    decode_ms.append(ms)
                    positions.append(pos)
                    yield TokenEvent(word + " ", 1000 + i, pos, ms)
                    if eng.fail_mid_turn is not None:
                        err, eng.fail_mid_turn = eng.fail_mid_turn, None
                        raise err
                    if cancel is not None and cancel.is_set():
                        stop = "cancelled"
                        break
                else:
                    if len(words) > sp.max_tokens:
                        stop = "max_tokens"
            finally:
                reply = "".join(out).strip()
                self.messages.append({"role": "assistant", "content": reply})
                self.turns += 1
            stats = TurnStats(
                turn=self.turns, prompt_tokens=prompt, reused_tokens=reused, computed_tokens=prompt - reused,
                generated_tokens=len(out), ttft_ms=5.0 + 0.1 * (prompt - reused), prefill_ms=1.0,
                decode_ms=tuple(decode_ms), positions=tuple(positions), stop_reason=stop, reply=reply,
                mode=self.mode, kv_dtype=eng.kv_dtype, policy=self.policy.name, dropped_messages=dropped,
                evicted_blocks=(self.evicted_tokens - evicted0) // bs, preempted=self.turn_preempted,
                recomputed_tokens=recomputed if self.mode == "cache" else 0, cache=eng.snapshot(self))
            self.history.append(stats)
            yield stats


class FakeEngine:
    def __init__(self, cfg: FakeEngineConfig | None = None) -> None:
        self.cfg = cfg or FakeEngineConfig()
        self.geometry = KNOWN["smollm2-135m"]
        self.source = SimpleNamespace(name="fake-smollm2", random_weights=True)
        self.device = "cpu"
        self.dtype_name = "fp32"
        self.kv_dtype = self.cfg.kv_dtype
        self.lock = threading.RLock()
        self.conversations: list[FakeConversation] = []
        self.owner: list[FakeConversation | None] = [None] * self.cfg.num_blocks
        self.replies_sent = 0
        self.preemptions = 0
        self.fail_next: Exception | None = None       # raised by the next turn before its first token, once
        self.fail_mid_turn: Exception | None = None   # raised by the next turn after its first token, once

    @property
    def bytes_per_token(self) -> int:
        return self.geometry.kv_bytes_per_token(self.kv_dtype)

    def allocate(self, n: int, requester: FakeConversation) -> list[int]:
        """n free blocks; when too few are free, preempt whole idle conversations, the most
        recently started first (the real engine's make_room, without its cached blocks)."""
        while self.owner.count(None) < n:
            victims = [c for c in reversed(self.conversations) if c is not requester and c.block_table]
            if not victims:
                raise KvchatError(f"KV pool full: this turn needs {n} more blocks; raise --kv-budget or /reset")
            victims[0].preempt()
            requester.turn_preempted += 1
            self.preemptions += 1
        free = [i for i, o in enumerate(self.owner) if o is None][:max(n, 0)]
        for i in free:
            self.owner[i] = requester
        return free

    def free(self, blocks: list[int]) -> None:
        for i in blocks:
            self.owner[i] = None

    def new_conversation(self, system_prompt=None, cap=None, policy="stop") -> FakeConversation:
        conv = FakeConversation(self, system_prompt, cap, policy)
        self.conversations.append(conv)
        return conv

    def close_conversation(self, conv: FakeConversation) -> None:
        with self.lock:
            conv.reset_cache()
            self.conversations.remove(conv)

    def set_kv_dtype(self, kv_dtype: str) -> None:
        if kv_dtype not in ("auto", *DTYPE_BYTES):
            raise KvchatError(f"unknown KV dtype {kv_dtype!r}")
        with self.lock:
            for conv in self.conversations:
                conv.reset_cache()
            self.kv_dtype = "fp32" if kv_dtype == "auto" else kv_dtype

    def snapshot(self, focus: FakeConversation | None = None) -> CacheSnapshot:
        with self.lock:
            bs, bpt, n = self.cfg.block_size, self.bytes_per_token, self.cfg.num_blocks
            codes = bytearray(FREE if o is None else OTHER for o in self.owner)
            held = blocks = 0
            if focus is not None:
                held, blocks = focus.tokens_held, len(focus.block_table)
                for i, b in enumerate(focus.block_table):
                    codes[b] = REUSED if i < focus.reused_blocks else PARTIAL if (i + 1) * bs > held else HELD
            used = sum(o is not None for o in self.owner)
            return CacheSnapshot(
                model=self.source.name, kv_dtype=self.kv_dtype, block_size=bs, num_blocks=n, bytes_per_token=bpt,
                capacity_bytes=n * bs * bpt, tokens_held=held, bytes_used=held * bpt,
                bytes_allocated=blocks * bs * bpt, blocks_used=blocks, wasted_slots=blocks * bs - held,
                pool_free=n - used, pool_active=used, pool_cached=0, pool_shared=0, block_map=bytes(codes),
                cap=focus.cap if focus else None, policy=focus.policy.name if focus else "",
                mode=focus.mode if focus else "cache", evictions=0, preemptions=self.preemptions)
