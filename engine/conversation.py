"""A conversation: its messages, the sequence of blocks holding its cached tokens, and its
turns, each submitted to the scheduler as one request.

A turn renders the whole conversation with the chat template and submits it. The scheduler
starts the request on the longest indexed block-aligned prefix of it (prefix reuse),
prefills the rest in chunks between other conversations' decode steps, then decodes one
token per step beside every other running conversation. `send` yields the request's events
as they come: PrefillProgress per chunk, a PrefillEvent at the first token, a TokenEvent per
token (its text made here, with the step time that fed it), then TurnStats. Reading them is
also what runs the steps (Engine.drive): no thread of the engine's own.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Iterable
from contextlib import contextmanager

import torch

from .detokenizer import Detokenizer
from .errors import KvchatError
from .policy import make_policy, reply_room
from .request import Fed, Request
from .sampler import Sampler, SamplingParams
from .sequence import Sequence
from .streaming import DEFAULT_SINK_TOKENS, check_window_cap
from .telemetry import PrefillEvent, PrefillProgress, TokenEvent, TurnStats
from .template import stop_ids

MODES = ("cache", "off")


class Conversation:
    def __init__(self, engine, system_prompt: str | None = None, cap: int | None = None,
                 policy: str = "stop", conversation_id: int = 0) -> None:
        self.engine = engine
        self.id = conversation_id
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.seq = Sequence(engine.spec.block_size, self._new_table(), owner=conversation_id)
        self.sink_tokens = DEFAULT_SINK_TOKENS
        self.turns = 0
        self.mode = "cache"
        self.cap: int | None = None
        self.set_cap(cap)
        self.policy = make_policy(policy)
        self.history: list[TurnStats] = []
        self.last_logits: torch.Tensor | None = None  # (vocab,) fp32: the first token's logits, last turn
        # prompt tokens per prefill chunk; progress events and cancelling come between chunks
        self.prefill_chunk_size = engine.prefill_chunk
        self._request: Request | None = None
        self._rendered: tuple[tuple[tuple[str, str], ...], tuple[int, ...]] | None = None   # render()'s last

    # ---- settings --------------------------------------------------------------------------
    def _new_table(self) -> torch.Tensor:
        return torch.zeros(self.engine.spec.num_blocks, dtype=torch.int32, device=self.engine.device)

    def set_cap(self, cap: int | None) -> None:
        if cap is not None and (not isinstance(cap, int) or cap <= 0):
            raise KvchatError(f"cap must be a positive number of tokens, got {cap!r}")
        if cap is not None and getattr(self, "policy", None) is not None and self.policy.streaming:
            self._check_window(cap)
        self.cap = cap

    def set_policy(self, name: str) -> None:
        policy = make_policy(name)
        if policy.streaming and self.cap is not None:
            self._check_window(self.cap)
        with self._settled():
            if self.seq.private and not policy.streaming:
                self.engine.blocks.free(self.seq, keep_index=False)  # shifted windows are no text's prefix
            self.policy = policy

    def _check_window(self, cap: int) -> None:
        check_window_cap(cap, self.sink_tokens, self.engine.spec.block_size)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise KvchatError(f"unknown cache mode {mode!r}; accepted: on, off")
        with self._settled():
            if mode == "off":
                self.engine.blocks.free(self.seq, keep_index=False)
            self.mode = mode

    # ---- messages ------------------------------------------------------------------------------
    def truncate(self, n_messages: int) -> None:
        """Keep the first n_messages (an edit or a regeneration further back). The cache stays:
        the next turn reuses what it still shares with the text, except a sink-window cache,
        which is no prefix of the text and starts again."""
        if not 0 <= n_messages <= len(self.messages):
            raise KvchatError(f"cannot keep {n_messages} messages of {len(self.messages)}")
        with self._settled():
            self.messages = self.messages[:n_messages]
            if self.streaming:
                self.engine.blocks.free(self.seq, keep_index=False)

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None or "": none). The old prefix stays cached for the
        conversations that share it; this one recomputes from its first changed block."""
        with self._settled():
            if self.messages and self.messages[0]["role"] == "system":
                del self.messages[0]
            if text:
                self.messages.insert(0, {"role": "system", "content": text})
            self.engine.blocks.free(self.seq, keep_index=True)

    def restore_messages(self, messages: Iterable[dict[str, str]]) -> None:
        """Start over from saved messages (a resumed conversation): the cache is dropped and
        the next turn computes the whole history."""
        with self._settled():
            self.engine.blocks.free(self.seq, keep_index=False)
            self.messages = [dict(m) for m in messages]

    # ---- state ---------------------------------------------------------------------------------
    @property
    def tokens_held(self) -> int:
        return len(self.seq)

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    @property
    def evicted_tokens(self) -> int:
        """Tokens sink-window cut out of this conversation's cache, since start."""
        return self.seq.evicted_tokens

    @property
    def preempted_pending(self) -> int:
        """Tokens a preemption dropped from the cache since the last turn began: recomputed next."""
        return self.seq.lost_tokens

    @property
    def max_position(self) -> int:
        """The model's own context: no cap lets a conversation past it."""
        return self.engine.geometry.max_position

    @property
    def limit(self) -> int:
        """The tokens this conversation may hold: its cap, and never more than the model's maximum."""
        return min(self.cap, self.max_position) if self.cap is not None else self.max_position

    @property
    def limit_name(self) -> str:
        return "the cap" if self.cap is not None and self.cap <= self.max_position else "the model's maximum context"

    @property
    def streaming(self) -> bool:
        """Sink-window evicts at the limit: the cap, or without one the model's maximum."""
        return self.policy.streaming

    # ---- cache ownership ---------------------------------------------------------------------
    def drop_cache(self, keep_index: bool = False) -> int:
        """Free every block of this conversation. With keep_index, full blocks stay cached for
        prefix reuse; without, they are dropped from the index too (a real reset)."""
        with self._settled():
            return self.engine.blocks.free(self.seq, keep_index)

    def resize_table(self) -> None:
        """After the pool was rebuilt with another block count (the cache is empty)."""
        self.seq.table = self._new_table()

    def reset_cache(self) -> int:
        """Forget the cache: the next turn prefills the whole history again."""
        return self.drop_cache(keep_index=False)

    @contextmanager
    def _settled(self) -> Iterator[None]:
        """Hold the engine's lock with no reply of this conversation in the scheduler: one
        still running is stepped to its end first (its reader still gets every event)."""
        eng = self.engine
        with eng.lock:
            req = self._request
            while req is not None and not req.finished:
                if eng.step() is None:
                    eng.abort(req)
            yield

    # ---- rendering ---------------------------------------------------------------------------
    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages' token ids through the chat template. A turn renders its messages twice
        (the policy's fit counts them, then the request takes them), and the whole conversation
        each time: the last rendering is kept and given again for the same messages (at 4,096
        tokens of history each rendering took 6-7 ms of the next turn's 80 ms TTFT on a Xeon)."""
        key = tuple((m["role"], m["content"]) for m in messages)
        if self._rendered is not None and self._rendered[0] == key:
            return list(self._rendered[1])
        ids = self.engine.render(messages)
        self._rendered = (key, tuple(ids))
        return ids

    def stop_ids(self) -> frozenset[int]:
        return stop_ids(self.engine.tokenizer, self.engine.geometry.eos_token_ids)

    # ---- a turn --------------------------------------------------------------------------------
    def send(self, text: str, sampling: SamplingParams | None = None,
             cancel: threading.Event | None = None) -> Iterator[PrefillProgress | PrefillEvent | TokenEvent | TurnStats]:
        """Add a user message and generate the reply: yields PrefillProgress per prompt chunk,
        a PrefillEvent, one TokenEvent per token, then TurnStats. Raises CapExceeded (nothing
        changed) if the stop policy refuses the turn."""
        if not text.strip():
            raise KvchatError("empty message: type something to send")
        messages = self.messages + [{"role": "user", "content": text}]
        sp = sampling or SamplingParams()
        kept = self._fit(messages, reply_room(sp.max_tokens, self.limit))
        dropped = len(messages) - len(kept)
        before, self.messages = self.messages, kept
        return self._turn(sp, cancel, dropped, before)

    def regenerate(self, sampling: SamplingParams | None = None,
                   cancel: threading.Event | None = None) -> Iterator:
        """Drop the last reply and generate it again from the same history."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise KvchatError("nothing to regenerate: the conversation has no reply yet")
        before = list(self.messages)
        self.messages.pop()
        return self._turn(sampling or SamplingParams(), cancel, 0, before)

    def _fit(self, messages, room: int = 0):
        return self.policy.fit(messages, lambda m: len(self.render(m)), self.limit, self.limit_name, room)

    def _turn(self, sp: SamplingParams, cancel, dropped: int, before: list[dict[str, str]]) -> Iterator:
        """`before`: the messages to restore if the turn fails before its first token."""
        eng = self.engine
        t0 = time.perf_counter()
        try:
            req = self._request_for(self.render(self.messages), sp, cancel, t0)
            marks = (eng.blocks.evictions, eng.preemptions, self.evicted_tokens)
            eng.submit(req)
        except BaseException:
            self.messages = before
            raise
        self._request = req
        detok = Detokenizer(eng.tokenizer)
        seen = 0
        try:
            for ev in self._events(req):
                if isinstance(ev, Fed):
                    yield TokenEvent(detok.add(ev.token_id), ev.token_id, ev.position, ev.latency_ms)
                    seen += 1
                    if cancel is not None and cancel.is_set():
                        eng.cut(req, seen)   # other readers' steps may have queued more: the reply ends here
                        break
                    continue
                if isinstance(ev, PrefillEvent):
                    self.last_logits = req.first_logits
                yield ev
            if req.error is not None:
                raise req.error
        except BaseException:
            # an error, a cancelled prefill, or a reader that stopped reading (generator closed)
            if not req.finished:
                eng.abort(req)
            if not seen:
                # no token yet (an error or a cancel before the first, even after the prefill):
                # as if the message was never sent; the next turn reuses what the cache holds
                self.messages = before
            else:
                self._end_turn(detok)   # the reply so far is kept, as the cache holds it
            raise
        tail = self._end_turn(detok)
        stats = self._stats(req, detok.text, dropped, marks)
        self.history.append(stats)
        if tail:
            yield TokenEvent(tail, -1, len(req.tokens) - 1, 0.0)
        yield stats

    def _events(self, req: Request) -> Iterator:
        """The request's events as they are queued; when none is, run a step (or wait for the
        thread running one)."""
        events, drive = req.events, self.engine.drive
        while True:
            if events:
                yield events.popleft()
            elif req.finished:
                if not events:
                    return
            else:
                drive(req)

    def _request_for(self, ids: list[int], sp: SamplingParams, cancel, t0: float) -> Request:
        eng = self.engine
        return Request(
            id=eng.scheduler.next_id(), seq=self.seq, prompt=ids,
            sampler=Sampler(sp, eng.device, vocab_limit=len(eng.tokenizer)), max_tokens=sp.max_tokens,
            stops=self.stop_ids(), limit=self.limit,
            limit_reason="cap" if self.limit_name == "the cap" else "max_position", t0=t0, mode=self.mode,
            sink_tokens=self.sink_tokens if self.streaming else None, chunk_size=self.prefill_chunk_size,
            cancel=cancel)

    def _end_turn(self, detok: Detokenizer) -> str:
        tail = detok.flush()
        self.messages.append({"role": "assistant", "content": detok.text})
        self.turns += 1
        return tail

    def _stats(self, req: Request, reply: str, dropped: int, marks: tuple[int, int, int]) -> TurnStats:
        eng, ids = self.engine, req.prompt
        evictions0, preemptions0, evicted0 = marks
        evicted = (self.evicted_tokens - evicted0) // eng.spec.block_size     # sink-window's, from this conversation
        reclaimed = max(eng.blocks.evictions - evictions0, 0)                # other prefixes' cached blocks
        return TurnStats(
            turn=self.turns, prompt_tokens=len(ids), reused_tokens=req.reused,
            computed_tokens=len(ids) - req.reused, generated_tokens=len(req.tokens) - len(ids),
            ttft_ms=req.ttft_ms or 0.0, prefill_ms=req.prefill_ms or 0.0, decode_ms=tuple(req.decode_ms),
            positions=tuple(req.positions), stop_reason=req.stop_reason or "max_tokens", reply=reply,
            mode=self.mode, kv_dtype=eng.kv_dtype, policy=self.policy.name, dropped_messages=dropped,
            evicted_blocks=evicted, preempted=eng.preemptions - preemptions0,
            recomputed_tokens=req.recomputed if self.mode == "cache" else 0, cache=eng.snapshot(self),
            step_sequences=tuple(req.step_sequences), step_tokens=tuple(req.step_tokens), reclaimed_blocks=reclaimed)
