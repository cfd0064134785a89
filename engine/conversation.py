"""A conversation: its messages, the sequence of blocks holding its cached tokens, and one
turn's loop.

Each turn renders the whole conversation with the chat template, starts its sequence on the
longest indexed block-aligned prefix of it (`BlockManager.match_prefix`), prefills only the
rest, then decodes one token per step, writing one K and V row per layer each step. Every
block a conversation gains comes through `reserve` (make room, then allocate).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import torch

from . import chat_template
from .cuda_graph import decoder_for
from .detokenizer import Detokenizer
from .errors import KvchatError, TurnCancelled
from .model import Step
from .policy import make_policy
from .sampler import Sampler, SamplingParams
from .sequence import Sequence
from .streaming import DEFAULT_SINK_TOKENS, check_window_cap, claim_window, evict_middle, prefill_window
from .telemetry import PrefillEvent, PrefillProgress, TokenEvent, TurnStats

PREFILL_CHUNK = 8192  # a cold prefill in one causal call takes the flash kernel; a masked chunk does not
CPU_PREFILL_CHUNK = 512  # on CPU an 8k prompt takes minutes: chunks this size report progress and can stop
MODES = ("cache", "off")


@dataclass(slots=True)
class Turn:
    """One turn's running figures, from its prefill to its TurnStats."""
    ids: list[int]                 # the rendered prompt
    tokens: list[int]              # the prompt, then each reply token as it is sampled
    t0: float                      # perf_counter at the start
    recomputed: int                # tokens lost to preemption since the last turn
    evictions0: int                # the counters at the start: the turn's share is the difference
    preemptions0: int
    evicted0: int
    reused: int = 0                # prompt tokens whose K/V came from the cache
    logits: torch.Tensor | None = None  # (vocab,) fp32: the first reply token's
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    stop_reason: str = "max_tokens"

    @property
    def last_ms(self) -> float:
        return self.decode_ms[-1] if self.decode_ms else self.ttft_ms


class Conversation:
    def __init__(self, engine, system_prompt: str | None = None, cap: int | None = None,
                 policy: str = "stop") -> None:
        self.engine = engine
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.seq = Sequence(engine.spec.block_size, self._new_table())
        self.sink_tokens = DEFAULT_SINK_TOKENS
        self.evicted_tokens = 0            # by sink-window, since start
        self.turns = 0
        self.mode = "cache"
        self.cap: int | None = None
        self.set_cap(cap)
        self.policy = make_policy(policy)
        self.preempted_pending = 0          # tokens lost to preemption, recomputed next turn
        self.history: list[TurnStats] = []
        self.last_logits: torch.Tensor | None = None  # (vocab,) fp32: the first token's logits, last turn
        # prompt tokens per prefill call; progress events and cancelling come between chunks
        self.prefill_chunk_size = PREFILL_CHUNK if engine.device.type == "cuda" else CPU_PREFILL_CHUNK

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
        with self.engine.lock:
            if self.seq.private and not policy.streaming:
                self.drop_cache()  # shifted windows are no text's prefix: recompute, then index again
            self.policy = policy

    def _check_window(self, cap: int) -> None:
        check_window_cap(cap, self.sink_tokens, self.engine.spec.block_size)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise KvchatError(f"unknown cache mode {mode!r}; accepted: on, off")
        with self.engine.lock:
            if mode == "off":
                self.drop_cache()
            self.mode = mode

    @property
    def tokens_held(self) -> int:
        return len(self.seq)

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

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
        with self.engine.lock:
            return self.engine.blocks.free(self.seq, keep_index)

    def resize_table(self) -> None:
        """After the pool was rebuilt with another block count (the cache is empty)."""
        self.seq.table = self._new_table()

    def reset_cache(self) -> int:
        """Forget the cache: the next turn prefills the whole history again."""
        return self.drop_cache(keep_index=False)

    def preempt(self) -> None:
        """Freed for another conversation (vLLM-style): its cache is recomputed next turn."""
        self.preempted_pending += len(self.seq)
        self.drop_cache(keep_index=False)

    def reserve(self, n_tokens: int) -> None:
        """Give the cache blocks for n_tokens: the one path by which a conversation gains
        blocks. Room comes from cached blocks first, then from preempting idle conversations
        (counted once, in engine.preemptions)."""
        need = self.seq.blocks_needed(n_tokens)
        if need:
            self.engine.make_room(need, self)
            self.engine.blocks.allocate(self.seq, need)

    # ---- rendering ---------------------------------------------------------------------------
    def render(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None):
            return chat_template.render(tok, messages)   # a template that raises: one line, nothing changed
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return list(tok.encode(text))

    def stop_ids(self) -> set[int]:
        tok = self.engine.tokenizer
        ids = set(self.engine.geometry.eos_token_ids)
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
        for name in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>"):
            tid = tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tok.unk_token_id and tid >= 0:
                ids.add(tid)
        return ids

    # ---- a turn --------------------------------------------------------------------------------
    def send(self, text: str, sampling: SamplingParams | None = None,
             cancel: threading.Event | None = None) -> Iterator[PrefillEvent | TokenEvent | TurnStats]:
        """Add a user message and generate the reply: yields a PrefillEvent, one TokenEvent
        per token, then TurnStats. Raises CapExceeded (nothing changed) if the stop policy
        refuses the turn."""
        if not text.strip():
            raise KvchatError("empty message: type something to send")
        messages = self.messages + [{"role": "user", "content": text}]
        kept = self._fit(messages)
        dropped = len(messages) - len(kept)
        before, self.messages = self.messages, kept
        return self._turn(sampling or SamplingParams(), cancel, dropped, before)

    def regenerate(self, sampling: SamplingParams | None = None,
                   cancel: threading.Event | None = None) -> Iterator:
        """Drop the last reply and generate it again from the same history."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise KvchatError("nothing to regenerate: the conversation has no reply yet")
        before = list(self.messages)
        self.messages.pop()
        return self._turn(sampling or SamplingParams(), cancel, 0, before)

    def _fit(self, messages):
        return self.policy.fit(messages, lambda m: len(self.render(m)), self.limit, self.limit_name)

    def _turn(self, sp: SamplingParams, cancel, dropped: int, before: list[dict[str, str]]) -> Iterator:
        """`before`: the messages to restore if the turn fails before its first token."""
        eng = self.engine
        with eng.lock:
            try:
                turn = yield from self._prefill_turn(cancel)
            except BaseException:
                self.messages = before  # nothing was generated: as if the message was never sent
                raise
            detok = Detokenizer(eng.tokenizer)
            sampler = Sampler(sp, eng.device, vocab_limit=len(eng.tokenizer))
            try:
                yield from self._generate(turn, sampler, detok, sp.max_tokens, cancel)
            finally:
                # runs on normal exit, on cancellation and if the consumer closes the
                # generator: the cache stays consistent with self.seq either way
                tail = detok.flush()
                self.messages.append({"role": "assistant", "content": detok.text})
                self.turns += 1
            stats = self._stats(turn, detok.text, dropped)
            self.history.append(stats)
            if tail:
                yield TokenEvent(tail, -1, len(turn.tokens) - 1, 0.0)
            yield stats

    def _prefill_turn(self, cancel: threading.Event | None = None) -> Generator[PrefillProgress, None, Turn]:
        """Render, claim blocks and prefill; the first half of a turn. Yields PrefillProgress
        before the first chunk and after each; returns the Turn. Raises TurnCancelled between
        chunks if `cancel` is set: the chunks done stay cached (indexed for prefix reuse, or
        held by a sink-window sequence), so the cache is consistent and a retry reuses them."""
        eng = self.engine
        t0 = time.perf_counter()
        ids = self.render(self.messages)
        turn = Turn(ids, list(ids), t0, recomputed=self.preempted_pending, evictions0=eng.blocks.evictions,
                    preemptions0=eng.preemptions, evicted0=self.evicted_tokens)
        if self.mode == "cache":
            turn.reused = claim_window(self, ids) if self.streaming else self._claim(ids)
            new_ids = ids[turn.reused:]
            chunks = (prefill_window(self, new_ids, self.prefill_chunk_size, steps=True) if self.streaming
                      else self._prefill(new_ids, turn.reused))
            yield PrefillProgress(0, len(new_ids), 0.0)
            while True:
                try:
                    done = next(chunks)
                except StopIteration as end:
                    turn.logits = end.value
                    break
                self._sync()
                yield PrefillProgress(done, len(new_ids), (time.perf_counter() - t0) * 1000)
                if cancel is not None and cancel.is_set() and done < len(new_ids):
                    chunks.close()
                    if not self.streaming:
                        eng.blocks.free(self.seq, keep_index=True)   # drop the blocks reserved for the rest
                    raise TurnCancelled(f"prefill stopped at {done:,} of {len(new_ids):,} tokens; the "
                                        "chunks done stay cached, so sending again reuses them")
        else:
            turn.logits = eng.model.forward_dense(torch.tensor(ids, device=eng.device))[0]
        self._sync()
        self.preempted_pending = 0
        self.last_logits = turn.logits
        turn.prefill_ms = (time.perf_counter() - t0) * 1000
        return turn

    def _generate(self, turn: Turn, sampler: Sampler, detok: Detokenizer, max_tokens: int,
                  cancel: threading.Event | None) -> Iterator[PrefillEvent | TokenEvent]:
        """The decode loop: a PrefillEvent, then one TokenEvent per token; sets turn.stop_reason."""
        stops = self.stop_ids()
        token = int(sampler(turn.logits))
        turn.ttft_ms = (time.perf_counter() - turn.t0) * 1000
        yield PrefillEvent(len(turn.ids), turn.reused, len(turn.ids) - turn.reused, turn.prefill_ms)
        for i in range(max_tokens):
            if token in stops:
                turn.stop_reason = "eos"
                return
            delta = detok.add(token)
            pos = len(turn.tokens)
            turn.tokens.append(token)
            stop = self._stop_before_step(i == max_tokens - 1, len(turn.tokens), cancel)
            ms = turn.last_ms
            if stop is None:
                ts = time.perf_counter()
                token = int(sampler(self._step(turn.tokens)))  # reading the token synchronises the device
                ms = (time.perf_counter() - ts) * 1000
                turn.decode_ms.append(ms)
                turn.positions.append(pos)
            yield TokenEvent(delta, turn.tokens[-1], pos, ms)
            if stop is None and cancel is not None and cancel.is_set():
                stop = "cancelled"
            if stop is not None:
                turn.stop_reason = stop
                return

    def _stop_before_step(self, last: bool, n_tokens: int, cancel: threading.Event | None) -> str | None:
        if last:
            return "max_tokens"
        if not self.streaming and n_tokens >= self.limit:
            return "cap" if self.limit_name == "the cap" else "max_position"
        if cancel is not None and cancel.is_set():
            return "cancelled"
        return None

    def _step(self, tokens: list[int]) -> torch.Tensor:
        """Feed the turn's newest token; returns the next token's logits (vocab,) fp32."""
        eng = self.engine
        if self.mode != "cache":
            return eng.model.forward_dense(torch.tensor(tokens, device=eng.device))[0]
        if self.streaming and len(self.seq) + 1 > self.limit:
            evict_middle(self, 1)
        pos = len(self.seq)  # the position in the cache (= in the text unless sink-window evicted)
        self.reserve(pos + 1)
        return self._decode(tokens[-1], pos)

    def _stats(self, turn: Turn, reply: str, dropped: int) -> TurnStats:
        eng, ids = self.engine, turn.ids
        evicted = eng.blocks.evictions - turn.evictions0 + (self.evicted_tokens - turn.evicted0) // eng.spec.block_size
        return TurnStats(
            turn=self.turns, prompt_tokens=len(ids), reused_tokens=turn.reused,
            computed_tokens=len(ids) - turn.reused, generated_tokens=len(turn.tokens) - len(ids),
            ttft_ms=turn.ttft_ms, prefill_ms=turn.prefill_ms, decode_ms=tuple(turn.decode_ms),
            positions=tuple(turn.positions), stop_reason=turn.stop_reason, reply=reply, mode=self.mode,
            kv_dtype=eng.kv_dtype, policy=self.policy.name, dropped_messages=dropped, evicted_blocks=evicted,
            preempted=eng.preemptions - turn.preemptions0,
            recomputed_tokens=turn.recomputed if self.mode == "cache" else 0, cache=eng.snapshot(self))

    # ---- cache mechanics ----------------------------------------------------------------------
    def _claim(self, ids: list[int]) -> int:
        """Swap last turn's blocks for this turn's: release ours (full blocks stay indexed),
        start on the longest indexed prefix of `ids` (at least one token left to compute),
        and reserve blocks for the rest. Returns the tokens reused."""
        bm = self.engine.blocks
        bm.free(self.seq)
        reused = bm.match_prefix(self.seq, ids[:-1])
        self.reserve(len(ids))
        return reused

    def _prefill(self, new_ids: list[int], start: int) -> Generator[int, None, torch.Tensor]:
        """Prefill in chunks, yielding the tokens done after each; returns the last
        token's logits (vocab,)."""
        size = self.prefill_chunk_size
        for c0 in range(0, len(new_ids), size):
            logits = self.prefill_chunk(new_ids[c0:c0 + size], start + c0)
            yield min(c0 + size, len(new_ids))
        return logits[0]

    def prefill_chunk(self, chunk: list[int], p0: int, last_only: bool = True) -> torch.Tensor:
        """Feed `chunk` at cache positions p0.. (its blocks reserved): its K/V are written and
        recorded in the sequence. Returns logits (1, vocab), or (T, vocab) without last_only."""
        eng, seq = self.engine, self.seq
        step = Step(seq.table, torch.tensor(seq.slots(p0, p0 + len(chunk)), device=eng.device), p0,
                    decode=False, runs=seq.runs)
        logits = eng.model.forward(torch.tensor(chunk, device=eng.device),
                                   torch.arange(p0, p0 + len(chunk), device=eng.device), step, eng.pool,
                                   last_only=last_only)
        eng.blocks.append(seq, chunk)
        return logits

    def _decode(self, token: int, pos: int) -> torch.Tensor:
        """One token at cache position pos (its block reserved); logits (vocab,) fp32."""
        eng, seq = self.engine, self.seq
        slot = seq.slot(pos)
        if eng.device.type == "cuda":  # static shapes, replayed from a CUDA graph
            logits = decoder_for(eng.model, eng.pool)(token, pos, slot, seq.table, pos // seq.block_size + 1)
        else:
            step = Step(seq.table, torch.tensor([slot], device=eng.device), pos, decode=True,
                        runs=seq.runs)
            logits = eng.model.forward(torch.tensor([token], device=eng.device),
                                       torch.tensor([pos], device=eng.device), step, eng.pool)[0]
        eng.blocks.append(seq, [token])
        return logits

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
