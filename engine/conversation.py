"""A conversation: its messages, the blocks holding its cached tokens, and one turn's loop.

Each turn renders the whole conversation with the chat template, takes a reference on the
longest indexed block-aligned prefix of it (`match_prefix`), prefills only the rest, then
decodes one token per step, writing one K and V row per layer each step.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from .block_manager import ROOT_KEY
from .cuda_graph import decoder_for
from .detokenizer import Detokenizer
from .errors import KvchatError
from .kv_cache import blocks_for
from .model import Step
from .policy import make_policy
from .sampler import Sampler, SamplingParams
from .streaming import DEFAULT_SINK_TOKENS, check_window_cap, claim_window, evict_middle, prefill_window
from .telemetry import PrefillEvent, TokenEvent, TurnStats

PREFILL_CHUNK = 8192  # a cold prefill in one causal call takes the flash kernel; a masked chunk does not
MODES = ("cache", "off")


class Conversation:
    def __init__(self, engine, system_prompt: str | None = None, cap: int | None = None,
                 policy: str = "stop") -> None:
        self.engine = engine
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.tokens: list[int] = []        # tokens whose K/V this conversation's blocks hold, in cache order
        self.logical: list[int] = []       # every token fed since the cache was last empty, in text order
                                           # (equal to tokens unless sink-window evicted some)
        self.sink_tokens = DEFAULT_SINK_TOKENS
        self.evicted_tokens = 0            # by sink-window, since start
        self._private = False              # blocks unshared and unindexed (sink-window rewrites keys)
        self.block_table: list[int] = []
        self.block_keys: list[int] = []    # keys of the indexed full blocks, in order
        self.reused_blocks = 0             # leading blocks that came from the prefix index this turn
        self.turns = 0
        self.mode = "cache"
        self.cap: int | None = None
        self.set_cap(cap)
        self.policy = make_policy(policy)
        self.preempted_pending = 0          # tokens lost to preemption, recomputed next turn
        self.history: list[TurnStats] = []
        self.last_logits: torch.Tensor | None = None  # (vocab,) fp32: the first token's logits, last turn
        self._table = torch.zeros(self._max_blocks(), dtype=torch.int32, device=engine.device)

    # ---- settings --------------------------------------------------------------------------
    def _max_blocks(self) -> int:
        return self.engine.spec.num_blocks

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
            if self._private and not policy.streaming:
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
        return len(self.tokens)

    # ---- cache ownership ---------------------------------------------------------------------
    def drop_cache(self, keep_index: bool = False) -> int:
        """Free every block of this conversation. With keep_index, full blocks stay cached for
        prefix reuse; without, they are dropped from the index too (a real reset)."""
        with self.engine.lock:
            n = len(self.block_table)
            if keep_index:
                self.engine.blocks.release(self.block_table)
            else:
                self.engine.blocks.forget(self.block_table)
            self.block_table, self.block_keys, self.tokens, self.logical = [], [], [], []
            self.reused_blocks = 0
            self._private = False
            return n

    def resize_table(self) -> None:
        """After the pool was rebuilt with another block count (the cache is empty)."""
        self._table = torch.zeros(self._max_blocks(), dtype=torch.int32, device=self.engine.device)

    def reset_cache(self) -> int:
        """Forget the cache: the next turn prefills the whole history again."""
        return self.drop_cache(keep_index=False)

    def preempt(self) -> None:
        """Freed for another conversation (vLLM-style): its cache is recomputed next turn."""
        self.preempted_pending += len(self.tokens)
        self.drop_cache(keep_index=False)

    # ---- rendering ---------------------------------------------------------------------------
    def render(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
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
        if self.cap is None:
            return messages
        return self.policy.fit(messages, lambda m: len(self.render(m)), self.cap)

    def _turn(self, sp: SamplingParams, cancel, dropped: int, before: list[dict[str, str]]) -> Iterator:
        """`before`: the messages to restore if the turn fails before its first token."""
        eng = self.engine
        with eng.lock:
            try:
                prefill = self._prefill_turn()
            except BaseException:
                self.messages = before  # nothing was generated: as if the message was never sent
                raise
            ids, reused, preempted, recomputed, evictions0, evicted0, logits, prefill_ms, t0 = prefill
            sampler = Sampler(sp, eng.device, vocab_limit=len(eng.tokenizer))
            stops = self.stop_ids()
            detok = Detokenizer(eng.tokenizer)
            seq = list(ids)                     # every token of this turn's sequence
            decode_ms: list[float] = []
            positions: list[int] = []
            ttft_ms = 0.0
            stop_reason = "max_tokens"
            try:
                token = int(sampler(logits))
                ttft_ms = (time.perf_counter() - t0) * 1000
                yield PrefillEvent(len(ids), reused, len(ids) - reused, prefill_ms)
                for i in range(sp.max_tokens):
                    if token in stops:
                        stop_reason = "eos"
                        break
                    delta = detok.add(token)
                    pos = len(seq)
                    seq.append(token)
                    if i == sp.max_tokens - 1:
                        yield TokenEvent(delta, token, pos, decode_ms[-1] if decode_ms else ttft_ms)
                        break
                    if self.cap is not None and not self.streaming and len(seq) >= self.cap:
                        stop_reason = "cap"
                        yield TokenEvent(delta, token, pos, decode_ms[-1] if decode_ms else ttft_ms)
                        break
                    if cancel is not None and cancel.is_set():
                        stop_reason = "cancelled"
                        yield TokenEvent(delta, token, pos, decode_ms[-1] if decode_ms else ttft_ms)
                        break
                    ts = time.perf_counter()
                    if self.mode == "cache":
                        if self.streaming and self.tokens_held + 1 > self.cap:
                            evict_middle(self, 1)
                        cpos = self.tokens_held  # the position in the cache (= pos unless sink-window evicted)
                        preempted += self._make_room_for(cpos)
                        logits = self._decode(token, cpos)
                    else:
                        logits = eng.model.forward_dense(torch.tensor(seq, device=eng.device))[0]
                    token = int(sampler(logits))  # reading the token synchronises the device
                    ms = (time.perf_counter() - ts) * 1000
                    decode_ms.append(ms)
                    positions.append(pos)
                    yield TokenEvent(delta, seq[-1], pos, ms)
                    if cancel is not None and cancel.is_set():
                        stop_reason = "cancelled"
                        break
            finally:
                # runs on normal exit, on cancellation and if the consumer closes the
                # generator: the cache stays consistent with self.tokens either way
                tail = detok.flush()
                reply = detok.text
                self.messages.append({"role": "assistant", "content": reply})
                self.turns += 1
            stats = TurnStats(
                turn=self.turns, prompt_tokens=len(ids), reused_tokens=reused,
                computed_tokens=len(ids) - reused, generated_tokens=len(seq) - len(ids), ttft_ms=ttft_ms,
                prefill_ms=prefill_ms, decode_ms=tuple(decode_ms), positions=tuple(positions),
                stop_reason=stop_reason, reply=reply, mode=self.mode, kv_dtype=eng.kv_dtype,
                policy=self.policy.name, dropped_messages=dropped,
                evicted_blocks=eng.blocks.evictions - evictions0 + (self.evicted_tokens - evicted0) // eng.spec.block_size,
                preempted=preempted,
                recomputed_tokens=recomputed if self.mode == "cache" else 0,
                cache=eng.snapshot(self))
            self.history.append(stats)
            if tail:
                yield TokenEvent(tail, -1, len(seq) - 1, 0.0)
            yield stats

    def _prefill_turn(self):
        """Render, claim blocks and prefill; the first half of a turn."""
        eng = self.engine
        t0 = time.perf_counter()
        ids = self.render(self.messages)
        evictions0 = eng.blocks.evictions
        recomputed = self.preempted_pending
        preempted = 0
        evicted0 = self.evicted_tokens
        if self.mode == "cache" and self.streaming:
            reused, preempted = claim_window(self, ids), 0
            logits = prefill_window(self, ids[reused:])
        elif self.mode == "cache":
            preempted = self._claim(ids)
            reused = len(self.tokens)
            logits = self._prefill(ids[reused:], reused)
        else:
            reused = 0
            logits = eng.model.forward_dense(torch.tensor(ids, device=eng.device))[0]
        self._sync()
        self.preempted_pending = 0
        self.last_logits = logits
        prefill_ms = (time.perf_counter() - t0) * 1000
        return ids, reused, preempted, recomputed, evictions0, evicted0, logits, prefill_ms, t0

    # ---- cache mechanics ----------------------------------------------------------------------
    def _claim(self, ids: list[int]) -> int:
        """Swap last turn's blocks for this turn's: release ours (full blocks stay indexed),
        take the longest indexed prefix of `ids` (at least one token left to compute), and
        allocate blocks for the rest. Returns conversations preempted to make room."""
        bm = self.engine.blocks
        bm.release(self.block_table)
        matched = bm.match_prefix(ids[:-1])
        bs = bm.block_size
        self.block_table = list(matched)
        self.block_keys = [bm.key_of(b) for b in matched]
        self.reused_blocks = len(matched)
        self.tokens = list(ids[: len(matched) * bs])
        self.logical = list(self.tokens)
        self._private = False
        need = blocks_for(len(ids), bs) - len(matched)
        preempted = self.engine.make_room(need, self)
        self.block_table += bm.allocate(need)
        self._table[: len(self.block_table)] = torch.tensor(self.block_table, dtype=torch.int32)
        return preempted

    @property
    def streaming(self) -> bool:
        return self.policy.streaming and self.cap is not None

    def _make_room_for(self, pos: int) -> int:
        """Before writing position pos: add a block when pos starts a new one."""
        bs = self.engine.blocks.block_size
        if pos // bs < len(self.block_table):
            return 0
        preempted = self.engine.make_room(1, self)
        (block_id,) = self.engine.blocks.allocate(1)
        self._table[len(self.block_table)] = block_id
        self.block_table.append(block_id)
        return preempted

    def _run_start(self) -> int | None:
        """The first block id if this conversation's blocks are one ascending run."""
        bt = self.block_table
        if bt and bt[-1] - bt[0] == len(bt) - 1 and bt == list(range(bt[0], bt[0] + len(bt))):
            return bt[0]
        return None

    def _slots(self, start: int, end: int) -> torch.Tensor:
        bs = self.engine.blocks.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(self.block_table, dtype=torch.int64)
        return (table[pos // bs] * bs + pos % bs).to(self.engine.device)

    def _prefill(self, new_ids: list[int], start: int) -> torch.Tensor:
        eng = self.engine
        logits = None
        for c0 in range(0, len(new_ids), PREFILL_CHUNK):
            chunk = new_ids[c0:c0 + PREFILL_CHUNK]
            p0 = start + c0
            step = Step(self._table, self._slots(p0, p0 + len(chunk)), p0, decode=False,
                        first_block=self._run_start())
            logits = eng.model.forward(torch.tensor(chunk, device=eng.device),
                                       torch.arange(p0, p0 + len(chunk), device=eng.device), step, eng.pool)
            self._wrote(chunk)
        return logits[0]

    def _decode(self, token: int, pos: int) -> torch.Tensor:
        eng = self.engine
        bs = eng.blocks.block_size
        slot = self.block_table[pos // bs] * bs + pos % bs
        if eng.device.type == "cuda":  # static shapes, replayed from a CUDA graph
            logits = decoder_for(eng.model, eng.pool)(token, pos, slot, self._table, pos // bs + 1)
            self._wrote([token])
            return logits
        step = Step(self._table, torch.tensor([slot], device=eng.device), pos, decode=True,
                    first_block=self._run_start())
        logits = eng.model.forward(torch.tensor([token], device=eng.device),
                                   torch.tensor([pos], device=eng.device), step, eng.pool)
        self._wrote([token])
        return logits[0]

    def _wrote(self, new_tokens: list[int]) -> None:
        """Record tokens now in the cache and index every block they filled."""
        bm = self.engine.blocks
        bs = bm.block_size
        self.tokens.extend(new_tokens)
        self.logical.extend(new_tokens)
        if self._private:
            return
        while len(self.block_keys) < len(self.tokens) // bs:
            i = len(self.block_keys)
            parent = self.block_keys[-1] if self.block_keys else ROOT_KEY
            self.block_keys.append(bm.commit(self.block_table[i], parent, self.tokens[i * bs:(i + 1) * bs]))

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
