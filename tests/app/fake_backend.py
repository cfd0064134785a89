"""A scripted Backend (kvchat/backends/protocol.py) for fast UI tests only.

Why a fake: loading the real model costs seconds per app, and UI tests of keys, commands,
caps, resets, resizes and error messages need dozens of apps and exact, repeatable
telemetry. FakeBackend and FakeChat implement the same Protocol as LocalBackend, so the app
cannot tell them apart, and replay canned replies word by word ("one word = one token")
with fixed latencies. A prompt prefills in chunks (`prefill_chunk` words, 512 as on the
CPU engine) with a PrefillProgress before the first and after each, and a cancel between
chunks stops the turn as the engine does: TurnCancelled, the messages as before the call,
nothing held. What decides a turn is the engine's own code: `make_policy` and each
policy's `fit` (stop refuses, drop-oldest drops whole turns), `check_window_cap` and
`sink_blocks` for sink-window. The engine's turn loop itself cannot be reused here: it
needs the model, the tokenizer and the pool's tensors; the fake's is a prefill and a word
loop. Its bookkeeping follows the real engine's rules: bytes used =
tokens held x bytes per token, blocks = ceil(tokens / block size), reused prompt tokens are
the held whole blocks. Several conversations share its pool: another's blocks are OTHER in
the block map, and when the pool is full whole idle conversations are preempted, the most
recently opened first, and recompute their tokens next turn. Under sink-window with a cap
it evicts whole blocks after the sink block to stay within the cap.

It is not a model of the block manager: no prefix index, so blocks are never shared (no
SHARED), a closed conversation's blocks are freed rather than kept cached, and LRU eviction
never happens (snapshot.evictions stays 0). Those, and the real preemption, are tested on
the real engine (tests/test_experiments.py; tests/app/test_real_engine.py drives the app on
the bundled model). `FakeConfig(capabilities=SERVER_LIKE)` plays a backend that lacks what a
vLLM server lacks, and refuses the calls it cannot serve, as a server would.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

from kvchat.backends.protocol import CACHE_TOGGLE, KV_DTYPE, RESET, BackendInfo, ChatState, Event, Message
from kvchat.engine.errors import KvchatError, TurnCancelled
from kvchat.engine.geometry import DTYPE_BYTES, KNOWN
from kvchat.engine.policy import make_policy, reply_room
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.streaming import DEFAULT_SINK_TOKENS, check_window_cap, sink_blocks
from kvchat.engine.telemetry import (FREE, HELD, OTHER, PARTIAL, REUSED, CacheSnapshot, PrefillEvent, PrefillProgress,
                                     RequestView, SchedulerSnapshot,
                                     TokenEvent, TurnStats)

from .fake_config import (GENERATION_PROMPT, LOCAL_LIKE, MESSAGE_OVERHEAD, REPLIES, SERVER_LIKE,  # noqa: F401
                          FakeConfig, count_tokens)


class FakeChat:
    def __init__(self, backend: FakeBackend, system: str | None, cap: int | None, policy: str) -> None:
        self.backend = backend
        self.messages: list[Message] = [{"role": "system", "content": system}] if system else []
        self.policy = make_policy(policy)
        self.cap: int | None = None
        self.set_cap(cap)
        self.mode = "cache"
        self.block_table: list[int] = []
        self.tokens_held = 0
        self.reused_blocks = 0
        self.turns = 0
        self.fed = 0                    # tokens fed since the cache was last empty (> tokens_held after evictions)
        self.evicted_tokens = 0         # by sink-window, since start
        self.preempted_pending = 0      # tokens lost to preemption, recomputed next turn
        self.turn_preempted = 0         # conversations this turn preempted
        backend.opened += 1
        self.id = backend.opened        # as the engine's Conversation.id: the scheduler's name for it
        self.busy = False               # a turn of it is running (the scheduler's "running")
        self.last_ttft_ms: float | None = None

    # ---- the Chat protocol -------------------------------------------------------------------
    def state(self) -> ChatState:
        return ChatState(messages=tuple(dict(m) for m in self.messages), cap=self.cap, policy=self.policy.name,
                         policy_description=self.policy.description, mode=self.mode, tokens_held=self.tokens_held,
                         evicted_tokens=self.evicted_tokens, preempted_pending=self.preempted_pending,
                         turns=self.turns, conversation=self.id)

    def set_cap(self, cap: int | None) -> None:
        if cap is not None and cap <= 0:
            raise KvchatError(f"cap must be a positive number of tokens, got {cap!r}")
        self._check(self.policy, cap)
        self.cap = cap

    def set_policy(self, name: str) -> None:
        policy = make_policy(name)
        if name not in self.backend.capabilities.policies:
            raise KvchatError(f"policy {name} is not offered by this backend")
        self._check(policy, self.cap)
        self.policy = policy

    def _check(self, policy, cap: int | None) -> None:
        if policy.streaming and cap is not None:
            check_window_cap(cap, DEFAULT_SINK_TOKENS, self.backend.cfg.block_size)

    def set_mode(self, mode: str) -> None:
        if mode not in ("cache", "off"):
            raise KvchatError(f"unknown cache mode {mode!r}; accepted: on, off")
        self.backend.refuse(CACHE_TOGGLE)
        with self.backend.lock:
            if mode == "off":
                self._drop()
            self.mode = mode

    def history_tokens(self) -> int | None:
        return count_tokens(self.messages)

    def message_tokens(self, text: str) -> int | None:
        """As its prompts grow: the first, whole; later, the message, its overhead and the
        overhead of the reply before it (whose words the reply's tokens already counted)."""
        if not self.backend.cfg.counts_tokens:
            return None
        if all(m["role"] == "system" for m in self.messages):
            return count_tokens(self.messages + [{"role": "user", "content": text}])
        return len(text.split()) + 2 * MESSAGE_OVERHEAD

    def set_system(self, text: str | None) -> None:
        """The prompt's start changes, so nothing cached matches any more."""
        with self.backend.lock:
            self._drop()
            self.messages = [m for m in self.messages if m["role"] != "system"]
            if text:
                self.messages.insert(0, {"role": "system", "content": text})

    def reset_cache(self) -> int:
        self.backend.refuse(RESET)
        return self._drop()

    def truncate(self, n_messages: int) -> None:
        """The engine's block rule: the held blocks stay cached up to the block holding the
        first dropped token (whole blocks only), so the next turn reuses exactly those."""
        if not 0 <= n_messages <= len(self.messages):
            raise KvchatError(f"cannot keep {n_messages} messages of {len(self.messages)}")
        with self.backend.lock:
            self.messages = self.messages[:n_messages]
            bs = self.backend.cfg.block_size
            kept = min(self.tokens_held, count_tokens(self.messages) - GENERATION_PROMPT) // bs
            if self.streaming:
                kept = 0
            self.backend.free(self.block_table[kept:])
            del self.block_table[kept:]
            self.tokens_held = self.fed = kept * bs
            self.reused_blocks = min(self.reused_blocks, kept)

    def restore(self, messages: list[Message]) -> None:
        self._drop()
        self.messages = [dict(m) for m in messages]

    def send(self, text: str, sampling: SamplingParams | None = None,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        if not text.strip():
            raise KvchatError("empty message: type something to send")
        messages = self.messages + [{"role": "user", "content": text}]
        sp = sampling or SamplingParams()
        kept = self.policy.fit(messages, count_tokens, self.cap, room=reply_room(sp.max_tokens, self.cap)) \
            if self.cap else messages
        before, self.messages = self.messages, kept
        return self._turn(sp, cancel, len(messages) - len(kept), before)

    def regenerate(self, sampling: SamplingParams | None = None,
                   cancel: threading.Event | None = None) -> Iterator[Event]:
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise KvchatError("nothing to regenerate: the conversation has no reply yet")
        before = list(self.messages)
        self.messages.pop()
        return self._turn(sampling or SamplingParams(), cancel, 0, before)

    # ---- the pool ----------------------------------------------------------------------------
    def _drop(self) -> int:
        with self.backend.lock:
            n = len(self.block_table)
            self.backend.free(self.block_table)
            self.block_table, self.tokens_held, self.reused_blocks, self.fed = [], 0, 0, 0
            return n

    def preempt(self) -> None:
        self.preempted_pending += self.tokens_held
        self._drop()

    @property
    def streaming(self) -> bool:
        return self.policy.streaming and self.cap is not None

    def _hold(self, fed: int) -> None:
        """The cache now holds `fed` tokens of text, less what sink-window evicted."""
        bs = self.backend.cfg.block_size
        tokens = self.tokens_held + fed - self.fed
        if self.streaming and tokens > self.cap:
            n = -(-(tokens - self.cap) // bs)          # whole blocks after the sink block
            first = sink_blocks(DEFAULT_SINK_TOKENS, bs)
            self.backend.free(self.block_table[first:first + n])
            del self.block_table[first:first + n]
            self.reused_blocks = min(self.reused_blocks, first)
            tokens -= n * bs
            self.evicted_tokens += n * bs
        self.block_table += self.backend.allocate(-(-tokens // bs) - len(self.block_table), self)
        self.tokens_held, self.fed = tokens, fed

    # ---- a turn ------------------------------------------------------------------------------
    def _prefill(self, dropped: int) -> PrefillEvent:
        prompt = count_tokens(self.messages)
        bs = self.backend.cfg.block_size
        reused = 0
        if self.mode == "cache":
            if self.streaming:
                reused, self.reused_blocks = min(self.fed, prompt - 1), 0
            else:
                if dropped:
                    self._drop()
                reused = min(self.tokens_held // bs * bs, (prompt - 1) // bs * bs)
                self.reused_blocks = reused // bs
        return PrefillEvent(prompt, reused, prompt - reused, 1.0)

    def _chunks(self, prefill: PrefillEvent, cancel) -> Iterator[PrefillProgress]:
        """The engine's progress through a chunked prefill of the computed tokens: done=0
        first, then after each chunk, the cache holding the reused tokens and the chunks
        done so far, as the engine's does; a cancel seen after a chunk that is not the last
        raises TurnCancelled. Times are scripted (0.1 ms per token, as in the TTFT), not measured."""
        cfg = self.backend.cfg
        reused, total = prefill.reused_tokens or 0, prefill.computed_tokens or 0
        self._hold(reused)
        yield PrefillProgress(0, total, 0.0)
        done = 0
        while done < total:
            if cfg.prefill_delay_s:
                if cancel is not None:
                    cancel.wait(cfg.prefill_delay_s)
                else:
                    time.sleep(cfg.prefill_delay_s)
            done = min(done + cfg.prefill_chunk, total)
            self._hold(reused + done)
            yield PrefillProgress(done, total, 0.1 * done)
            if cancel is not None and cancel.is_set() and done < total:
                raise TurnCancelled(f"prefill stopped at {done:,} of {total:,} tokens; the fake keeps no prefix "
                                    "index, so sending again computes them again")

    def _turn(self, sp: SamplingParams, cancel, dropped: int, before: list[Message]) -> Iterator[Event]:
        b = self.backend
        with b.lock:
            self.busy = True
            try:
                yield from self._locked_turn(sp, cancel, dropped, before)
            finally:
                self.busy = False

    def _locked_turn(self, sp: SamplingParams, cancel, dropped: int, before: list[Message]) -> Iterator[Event]:
        b = self.backend
        if b.fail_next is not None:      # before the first token: as if never sent, as the engine does
            err, b.fail_next = b.fail_next, None
            self.messages = before
            raise err
        recomputed, self.preempted_pending, self.turn_preempted = self.preempted_pending, 0, 0
        evicted0 = self.evicted_tokens
        prefill = self._prefill(dropped)
        if self.mode == "cache":         # like the engine: the dense no-cache pass reports no chunks
            try:
                yield from self._chunks(prefill, cancel)
            except TurnCancelled:        # as never sent: the messages back, nothing held
                self._drop()
                self.messages, self.preempted_pending = before, recomputed
                raise
        yield prefill if b.cfg.reports_reuse else PrefillEvent(prefill.prompt_tokens, None, None, None)
        words = b.cfg.replies[b.replies_sent % len(b.cfg.replies)].split(" ")   # newlines stay inside words
        b.replies_sent += 1
        b.sampling_seen.append(replace(sp))
        if sp.temperature > 0:    # "sampling": the same words in a seeded order (greedy keeps the script)
            random.Random(sp.seed).shuffle(words)
        out: list[str] = []
        stop = "max_tokens" if len(words) > sp.max_tokens else "eos"
        try:
            for i, word in enumerate(words[:sp.max_tokens]):
                pos = prefill.prompt_tokens + i
                if self.cap is not None and not self.streaming and pos >= self.cap:
                    stop = "cap"
                    break
                if b.cfg.token_delay_s and cancel is not None:
                    cancel.wait(b.cfg.token_delay_s)
                if self.mode == "cache":
                    self._hold(pos + 1)
                out.append(word + " ")
                yield TokenEvent(word + " ", 1000 + i, pos, 10.0 + 0.01 * pos)
                if b.fail_mid_turn is not None:
                    err, b.fail_mid_turn = b.fail_mid_turn, None
                    raise err
                if cancel is not None and cancel.is_set():
                    stop = "cancelled"
                    break
        finally:
            reply = "".join(out).strip()
            self.messages.append({"role": "assistant", "content": reply})
            self.turns += 1
        positions = tuple(range(prefill.prompt_tokens, prefill.prompt_tokens + len(out)))
        told = b.cfg.reports_reuse
        self.last_ttft_ms = 5.0 + 0.1 * prefill.computed_tokens
        yield TurnStats(
            turn=self.turns, prompt_tokens=prefill.prompt_tokens,
            reused_tokens=prefill.reused_tokens if told else None,
            computed_tokens=prefill.computed_tokens if told else None, generated_tokens=len(out),
            ttft_ms=self.last_ttft_ms, prefill_ms=1.0,
            decode_ms=tuple(10.0 + 0.01 * p for p in positions), positions=positions, stop_reason=stop,
            reply=reply, mode=self.mode, kv_dtype=b.kv_dtype, policy=self.policy.name, dropped_messages=dropped,
            evicted_blocks=(self.evicted_tokens - evicted0) // b.cfg.block_size, preempted=self.turn_preempted,
            recomputed_tokens=recomputed if self.mode == "cache" else 0, cache=b.snapshot(self),
            unavailable=() if told else ("reused_tokens", "computed_tokens"))


class FakeBackend:
    def __init__(self, cfg: FakeConfig | None = None) -> None:
        self.cfg = cfg or FakeConfig()
        self.capabilities = self.cfg.capabilities
        self.geometry = KNOWN["smollm2-135m"]
        self.kv_dtype = self.cfg.kv_dtype
        self.lock = threading.RLock()
        self.chats: list[FakeChat] = []
        self.owner: list[FakeChat | None] = [None] * self.cfg.num_blocks
        self.replies_sent = 0
        self.preemptions = 0
        self.fail_next: Exception | None = None       # raised by the next turn before its first token, once
        self.fail_mid_turn: Exception | None = None   # raised by the next turn after its first token, once
        self.sampling_seen: list[SamplingParams] = []  # each turn's sampling parameters, in order
        self.opened = 0

    def refuse(self, capability: str) -> None:
        """What a backend without `capability` does when asked anyway."""
        if not self.capabilities.has(capability):
            raise KvchatError(self.capabilities.why_not(capability))

    @property
    def scale_bytes_per_token(self) -> int:
        """fp8 keeps one fp32 scale per token, layer, K/V and KV head, as the engine's pool does."""
        g = self.geometry
        return 2 * g.n_layers * g.n_kv_heads * 4 if self.kv_dtype == "fp8" else 0

    @property
    def bytes_per_token(self) -> int:
        """The elements and (fp8) their scales: the engine's convention."""
        return self.geometry.kv_bytes_per_token(self.kv_dtype) + self.scale_bytes_per_token

    # ---- the Backend protocol ----------------------------------------------------------------
    def info(self) -> BackendInfo:
        known = self.cfg.knows_geometry
        return BackendInfo(kind="fake", model=self.cfg.model, device="cpu", dtype="fp32", kv_dtype=self.kv_dtype,
                           bytes_per_token=self.bytes_per_token, geometry=self.geometry if known else None,
                           max_position=self.geometry.max_position if known else None,
                           random_weights=self.cfg.random_weights, weights=None)

    def open(self, system: str | None = None, cap: int | None = None, policy: str = "stop",
             mode: str = "cache") -> FakeChat:
        chat = FakeChat(self, system, cap, policy)
        if mode != "cache":
            chat.set_mode(mode)
        self.chats.append(chat)
        return chat

    def close(self, chat: FakeChat) -> None:
        with self.lock:
            chat._drop()
            self.chats.remove(chat)

    def scheduler(self) -> SchedulerSnapshot:
        """Every open chat as the engine's scheduler lists it; the fake runs one turn at a
        time under its lock, so at most one is running and none waits."""
        with self.lock:
            views = tuple(RequestView(
                conversation=c.id, request=None, state="running" if c.busy else "idle", context_tokens=c.tokens_held,
                blocks_held=len(c.block_table), prompt_tokens=0, generated_tokens=0, ttft_ms=c.last_ttft_ms,
                ms_per_token=10.0 if c.turns else None, preemptions=0, recomputed_tokens=0) for c in self.chats)
            return SchedulerSnapshot(views, sum(c.busy for c in self.chats), 0, self.preemptions, 0, 0, 512, ())

    def count_tokens(self, text: str) -> int | None:
        """One word is one token, as in the replies; None when configured not to know."""
        return len(text.split()) if self.cfg.counts_tokens else None

    def set_kv_dtype(self, kv_dtype: str) -> str:
        self.refuse(KV_DTYPE)
        if kv_dtype not in ("auto", *DTYPE_BYTES):
            raise KvchatError(f"unknown KV dtype {kv_dtype!r}")
        with self.lock:
            for chat in self.chats:
                chat._drop()
            self.kv_dtype = "fp32" if kv_dtype == "auto" else kv_dtype
        return self.kv_dtype

    def shutdown(self) -> None:
        pass

    def snapshot(self, focus: FakeChat | None = None) -> CacheSnapshot:
        with self.lock:
            bs, bpt, n = self.cfg.block_size, self.bytes_per_token, self.cfg.num_blocks
            codes = bytearray(FREE if o is None else OTHER for o in self.owner)
            held = blocks = 0
            if focus is not None:
                held, blocks = focus.tokens_held, len(focus.block_table)
                for i, b in enumerate(focus.block_table):
                    codes[b] = REUSED if i < focus.reused_blocks else PARTIAL if (i + 1) * bs > held else HELD
            used = sum(o is not None for o in self.owner)
            owners = tuple(sorted({o.id for o in self.owner if o is not None}))
            block_owner = bytes(0 if o is None else 1 + owners.index(o.id) for o in self.owner)
            return CacheSnapshot(owners=owners, block_owner=block_owner,
                model="fake-smollm2", kv_dtype=self.kv_dtype, block_size=bs, num_blocks=n, bytes_per_token=bpt,
                scale_bytes_per_token=self.scale_bytes_per_token,
                capacity_bytes=n * bs * bpt, tokens_held=held, bytes_used=held * bpt,
                bytes_allocated=blocks * bs * bpt, blocks_used=blocks, wasted_slots=blocks * bs - held,
                pool_free=n - used, pool_active=used, pool_cached=0, pool_shared=0, block_map=bytes(codes),
                cap=focus.cap if focus else None, policy=focus.policy.name if focus else "",
                mode=focus.mode if focus else "cache", evictions=0, preemptions=self.preemptions)

    # ---- the pool ----------------------------------------------------------------------------
    def allocate(self, n: int, requester: FakeChat) -> list[int]:
        """n free blocks; when too few are free, preempt whole idle conversations, the most
        recently opened first (the real engine's make_room, without its cached blocks)."""
        while self.owner.count(None) < n:
            victims = [c for c in reversed(self.chats) if c is not requester and c.block_table]
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
