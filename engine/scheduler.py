"""The scheduler: which requests share the next step, and what each gets of the pool.

Requests wait in arrival order and run in admission order. Each step (`schedule`) takes:
1. one decode row from every running request past its prompt, oldest first (but those a
   bench holds out: Engine.hold): no prompt can starve a decoding conversation;
2. prompt chunks of running requests still computing theirs, oldest first, then of waiting
   requests admitted in arrival order, within a token budget shared with the decode rows
   (a lone prompt takes its own chunk size, as before batching). Steps are mixed, as in
   vLLM v1: a long prompt advances a chunk per step beside everyone's decode rows instead
   of stopping them for its whole prefill (nano-vllm's prefill-first steps would).

Room: a waiting request is admitted when its prompt's blocks can be had from free blocks,
cached ones (evicted least recently used first, by the block manager) and idle
conversations (preempted newest first); it never preempts a running request. A running
request that needs a block may also preempt running requests, newest first, itself
included when it is the newest (vLLM's rule: the newest request yields), and is then
recomputed from its text when readmitted. Every preemption is counted here, once.

`postprocess` samples, records the tokens in each sequence, emits each request's events and
finishes requests; it returns the step's StepRecord, kept in a ring for the panels.
Nothing here calls up: the conversation reads its request's events, the engine drives steps.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from .block_manager import BlockManager
from .errors import KvchatError, TurnCancelled
from .request import DECODE, FINISHED, PREFILL, RUNNING, WAITING, Request
from .sampler import greedy_rows
from .sequence import Sequence
from .streaming import Shift, claim_window, make_window_room, window_chunk
from .telemetry import PrefillEvent, PrefillProgress, RequestView, SchedulerSnapshot, StepRecord

RECENT_STEPS = 256   # StepRecords kept for the panels


@dataclass(slots=True)
class Plan:
    """One step's rows, in the order the runner computes them and returns their logits."""
    decode: list[Request] = field(default_factory=list)         # one row each: its newest token
    chunks: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, text start, tokens)
    dense: list[Request] = field(default_factory=list)          # cache off: a whole forward each
    shifts: list[tuple[Request, Shift]] = field(default_factory=list)   # sink-window re-rotations, first
    preemptions: int = 0
    yielded: set[int] = field(default_factory=set)              # ids preempted while planning: not readmitted

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks or self.dense)


class Scheduler:
    def __init__(self, blocks: BlockManager, token_budget: int, weight_bytes: int = 0,
                 cache_bytes_per_token: int = 0) -> None:
        if token_budget <= 0:
            raise ValueError(f"token_budget must be positive, got {token_budget}")
        self.blocks = blocks
        self.token_budget = token_budget
        self.weight_bytes = weight_bytes                  # what one forward reads of the weights
        self.cache_bytes_per_token = cache_bytes_per_token
        self.sequences: list[Sequence] = []               # every conversation's cache, oldest first
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []                  # in admission order
        self.current: dict[Sequence, Request] = {}        # each sequence's unfinished request
        self.latest: dict[Sequence, Request] = {}         # and its latest request, finished or not
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.steps = 0
        self.recent: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self._ids = itertools.count(1)

    # ---- sequences and requests ------------------------------------------------------------
    def attach(self, seq: Sequence) -> None:
        self.sequences.append(seq)

    def detach(self, seq: Sequence) -> None:
        req = self.current.get(seq)
        if req is not None:
            self.abort(req)
        self.latest.pop(seq, None)
        if seq in self.sequences:
            self.sequences.remove(seq)

    def next_id(self) -> int:
        """A new request's id: arrival order (count() is atomic, so no lock is needed)."""
        return next(self._ids)

    def add(self, req: Request) -> None:
        if req.seq in self.current:
            raise KvchatError("this conversation already has a reply running; wait for it or stop it first")
        req.state = WAITING
        self.waiting.append(req)
        self.current[req.seq] = self.latest[req.seq] = req

    def abort(self, req: Request, reason: str = "cancelled") -> None:
        """End a request now (its conversation closed, or stopped reading)."""
        if req.finished:
            return
        if req.state == RUNNING and req.generated == 0 and req.mode == "cache" and not req.streaming:
            self.blocks.free(req.seq, keep_index=True)   # the prompt's unwritten blocks; the chunks done stay cached
        self._stop(req, reason)

    def cut(self, req: Request, kept: int) -> None:
        """Its reader cancelled after `kept` reply tokens while other readers' steps ran
        ahead: the reply ends at the tokens it saw (the cache may hold a few more, which
        the next turn's prefix match leaves unused)."""
        if req.finished and kept >= req.generated:
            return
        if not req.finished:
            self._stop(req, "cancelled")
        req.cut(kept)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def requeue_running(self) -> None:
        """Every running request back to waiting, its cache dropped, as before the pool is
        rebuilt (another KV dtype): each recomputes its text in the new pool."""
        for req in reversed(self.running):
            if req.mode == "cache":
                self.blocks.free(req.seq, keep_index=False)
            req.state, req.phase = WAITING, PREFILL
            self.waiting.appendleft(req)
        self.running.clear()

    # ---- a step ---------------------------------------------------------------------------------
    def schedule(self) -> Plan | None:
        plan = Plan()
        self._cancel_requested()
        budget = self.token_budget
        for req in list(self.running):
            if req.state == RUNNING and req.phase == DECODE and not req.held:
                budget -= self._schedule_decode(req, plan)
        for req in list(self.running):
            if req.state == RUNNING and req.phase == PREFILL:
                budget -= self._schedule_chunk(req, plan, budget)
        for _ in range(len(self.waiting)):   # at most once each: a request that yields is not retried
            if not self.waiting or (budget <= 0 and plan):
                break
            req = self.waiting[0]
            if req.id in plan.yielded or not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            if req.phase == PREFILL:
                budget -= self._schedule_chunk(req, plan, budget)
            else:   # a recomputation that found its whole text cached (_begin): its row now, or
                budget -= self._schedule_decode(req, plan)   # a step could come back empty while busy
        return plan if plan else None

    def _schedule_decode(self, req: Request, plan: Plan) -> int:
        if req.mode == "off":
            plan.dense.append(req)
            return 0
        seq = req.seq
        if req.sink_tokens is not None and len(seq) + 1 > req.limit:     # a sink window
            shift = make_window_room(self.blocks, seq, req.sink_tokens, req.limit, 1)
            if shift is not None:
                plan.shifts.append((req, shift))
        if not self._grow(req, len(seq) + 1, plan):
            return 0
        plan.decode.append(req)
        return 1

    def _schedule_chunk(self, req: Request, plan: Plan, budget: int) -> int:
        """The next chunk of req's text, within the budget; returns the tokens taken."""
        if req.mode == "off":
            plan.dense.append(req)
            return 0
        seq, start = req.seq, req.fed
        n = min(req.target - start, req.chunk_size)
        if plan:   # others share this step: the budget bounds it; a lone prompt takes its chunk
            n = min(n, budget)
        sink = req.sink_tokens          # None: no sink window
        if sink is not None:
            n = min(n, window_chunk(req.limit, sink, seq.block_size, req.chunk_size))
        if n <= 0:
            return 0
        if sink is not None:
            shift = make_window_room(self.blocks, seq, sink, req.limit, n)
            if shift is not None:
                plan.shifts.append((req, shift))
            if not self._grow(req, len(seq) + n, plan):
                return 0
        plan.chunks.append((req, start, n))
        return n

    def postprocess(self, plan: Plan, logits: torch.Tensor, t0: float, context_tokens: int,
                    forwards: int) -> StepRecord:
        """logits: (R, vocab) fp32, one row per decode row, per chunk, per cache-off request,
        in the plan's order. Samples, records and emits; t0: perf_counter at the step's start."""
        # (request, its chunk (None: a token fed), whether its prompt is done and a token wanted)
        entries = ([(r, None, True) for r in plan.decode]
                   + [(c[0], c, c[1] + c[2] >= c[0].target and not c[0].generated) for c in plan.chunks]
                   + [(r, None if r.phase == DECODE else (r, 0, 0), True) for r in plan.dense])
        picks = self._sample([e[0] for e in entries], logits, [e[2] for e in entries])   # waits for the device
        step_ms = (time.perf_counter() - t0) * 1000
        shared, out = (len(entries), context_tokens), 0
        for i, (req, chunk, done) in enumerate(entries):
            if chunk is None:
                self._fed(req, step_ms, shared)
                out += self._after_feed(req, picks[i])
                continue
            if req.mode == "cache":
                self.blocks.append(req.seq, req.tokens[chunk[1]:chunk[1] + chunk[2]])
            out += self._after_chunk(req, done, picks[i], logits, i)
        self.steps += 1
        prefill = sum(n for _, _, n in plan.chunks)
        record = StepRecord(
            index=self.steps, rows=len(plan.decode) + prefill + len(plan.dense), decode_rows=len(plan.decode),
            prefill_tokens=prefill, prefill_chunks=len(plan.chunks), dense_rows=len(plan.dense),
            sequences=len(entries), context_tokens=context_tokens, tokens_out=out, step_ms=step_ms,
            weight_bytes=self.weight_bytes * forwards, cache_bytes=context_tokens * self.cache_bytes_per_token,
            preemptions=plan.preemptions, time=time.monotonic())
        self.recent.append(record)
        return record

    def fail(self, plan: Plan, err: BaseException) -> None:
        """The step's forward raised: every request in it ends with the error, and its cache,
        written in part, is dropped (its conversation recomputes it next turn)."""
        for req in {id(r): r for r in list(plan.decode) + [c[0] for c in plan.chunks] + plan.dense}.values():
            if req.mode == "cache":
                self.blocks.free(req.seq, keep_index=False)
            req.error = err
            self._stop(req, "error")

    # ---- postprocess pieces ----------------------------------------------------------------------
    def _sample(self, rows: list[Request], logits: torch.Tensor, wanted: list[bool]) -> list[int]:
        if not rows:
            return []
        greedy = [r.sampler.p.temperature == 0 for r in rows]
        limit = rows[0].sampler.vocab_limit
        if all(greedy) and all(r.sampler.vocab_limit == limit for r in rows):
            return greedy_rows(logits if limit is None or limit >= logits.shape[-1] else logits[:, :limit])
        return [int(r.sampler(row)) if want else -1 for r, row, want in zip(rows, logits, wanted)]

    def _fed(self, req: Request, step_ms: float, shared: tuple[int, int]) -> None:
        """The step wrote the K/V of req's newest token."""
        if req.mode == "cache":
            self.blocks.append(req.seq, req.tokens[-1:])
        req.record_feed(step_ms, *shared)

    def _after_feed(self, req: Request, token: int) -> int:
        if req.cancel is not None and req.cancel.is_set():
            self._stop(req, "cancelled")     # the token this step sampled is not kept
            return 0
        self._take(req, token, first=False)
        return 1

    def _after_chunk(self, req: Request, done: bool, token: int, logits: torch.Tensor, row: int) -> int:
        if req.generated:           # a recomputed text: its newest token is fed next step
            if req.target <= req.fed or req.mode == "off":
                req.phase = DECODE
            return 0
        now = (time.perf_counter() - req.t0) * 1000
        if req.mode == "cache":
            req.events.append(PrefillProgress(req.fed - req.base, req.target - req.base, now))
        if not done:
            return 0
        req.first_logits = logits[row]
        req.prefill_ms = req.ttft_ms = now
        req.events.append(PrefillEvent(len(req.prompt), req.reused, len(req.prompt) - req.reused, now))
        self._take(req, token, first=True)
        return 1

    def _take(self, req: Request, token: int, first: bool) -> None:
        stop = req.take(token, first)
        if stop is not None:
            self._stop(req, stop)

    def _cancel_requested(self) -> None:
        for req in list(self.running) + list(self.waiting):
            if req.cancel is None or not req.cancel.is_set():
                continue
            if req.generated:
                req.tokens.pop()      # sampled but never shown: not part of the reply
                req.generated -= 1
                self._stop(req, "cancelled")
                continue
            if req.starts == 0:
                done, total = 0, req.target
            else:
                done, total = max(req.fed - req.base, 0), max(req.target - req.base, 0)
                if req.mode == "cache" and not req.streaming:
                    self.blocks.free(req.seq, keep_index=True)   # the chunks done stay cached
            req.error = TurnCancelled(f"prefill stopped at {done:,} of {total:,} tokens; the chunks done stay "
                                      "cached, so sending again reuses them")
            self._stop(req, "cancelled")

    def _stop(self, req: Request, reason: str) -> None:
        req.stop_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.current.get(req.seq) is req:
            del self.current[req.seq]
        req.state = FINISHED     # last: a reader that sees it finds every event queued

    # ---- room -------------------------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        """Start req: claim its cached prefix and the blocks of its whole prompt (its window's
        first chunk under sink-window). False: not now (running requests hold the room)."""
        req.starts += 1
        req.state, req.phase = RUNNING, PREFILL
        seq = req.seq
        if req.mode == "off":
            self._begin(req, 0)
            return True
        pending = 1 if req.generated else 0
        if req.sink_tokens is not None:    # a sink window
            kept = claim_window(self.blocks, seq, req.tokens[:req.target + 1], req.sink_tokens)
            self._begin(req, kept)
            return True
        self.blocks.free(seq)
        kept = self.blocks.match_prefix(seq, req.tokens[:req.target - 1 + pending])
        need = seq.blocks_needed(req.target)
        hopeless = seq.num_blocks + need > self.blocks.num_blocks
        if hopeless or not self._room(need, req, preempt_running=False):
            self.blocks.free(seq)
            req.starts -= 1
            req.state = WAITING
            if hopeless or not self.running:
                self._refuse(req, need)
            return False
        self.blocks.allocate(seq, need)
        self._begin(req, kept)
        return True

    def _begin(self, req: Request, kept: int) -> None:
        seq = req.seq
        lost, seq.lost_tokens = seq.lost_tokens, 0
        req.recomputed += lost
        seq.recomputed_tokens += lost
        self.recomputed_tokens += lost
        if req.starts == 1:
            req.reused = kept
        req.base = kept
        if req.mode == "cache" and req.generated == 0:
            req.events.append(PrefillProgress(0, req.target - kept, (time.perf_counter() - req.t0) * 1000))
        if req.mode == "cache" and kept >= req.target:
            req.phase = DECODE     # a recomputation that found its whole text cached

    def _grow(self, req: Request, n_tokens: int, plan: Plan) -> bool:
        """Blocks for req to hold n_tokens; preempts as needed. False: req was preempted or
        refused, and takes no row this step."""
        need = req.seq.blocks_needed(n_tokens)
        if need == 0:
            return True
        if not self._room(need, req, preempt_running=True, plan=plan):
            return False
        self.blocks.allocate(req.seq, need)
        return True

    def _room(self, need: int, req: Request, preempt_running: bool, plan: Plan | None = None) -> bool:
        bm = self.blocks
        if bm.can_allocate(need):
            return True
        idle = [s for s in reversed(self.sequences) if s is not req.seq and s.block_table and not self._running(s)]
        if not preempt_running and bm.num_free + bm.num_cached + self._reclaimable(idle) < need:
            return False   # preempting idle conversations would not be enough: leave them be
        for seq in idle:   # the most recently opened first
            self._preempt_idle(seq, plan)
            if bm.can_allocate(need):
                return True
        if not preempt_running:
            return False
        while not bm.can_allocate(need):
            others = [r for r in self.running if r is not req and r.mode == "cache" and r.seq.block_table]
            if not others:
                self._refuse(req, need)
                return False
            newest = max(others, key=lambda r: r.id)
            if req.id > newest.id:   # req is the newest: it yields
                self._preempt(req, plan)
                return False
            self._preempt(newest, plan)
        return True

    def _running(self, seq: Sequence) -> bool:
        req = self.current.get(seq)
        return req is not None and req.state == RUNNING

    def _reclaimable(self, seqs: list[Sequence]) -> int:
        """Blocks that preempting every one of seqs would free (a block another sequence
        also holds stays)."""
        refs = Counter(b for s in seqs for b in s.block_table)
        return sum(1 for b, n in refs.items() if self.blocks.blocks[b].ref_count == n)

    def _preempt_idle(self, seq: Sequence, plan: Plan | None) -> None:
        seq.lost_tokens += len(seq)
        self.blocks.free(seq, keep_index=False)
        self._count(seq, plan)

    def _preempt(self, req: Request, plan: Plan | None) -> None:
        """A running request yields its blocks: back to the front of the queue, to recompute."""
        seq = req.seq
        seq.lost_tokens += len(seq)
        self.blocks.free(seq, keep_index=False)
        req.state, req.phase = WAITING, PREFILL
        req.preempted += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        self._count(seq, plan)
        if plan is not None:   # rows this step gave it before it yielded
            plan.yielded.add(req.id)
            plan.decode = [r for r in plan.decode if r is not req]
            plan.chunks = [c for c in plan.chunks if c[0] is not req]
            plan.shifts = [x for x in plan.shifts if x[0] is not req]

    def _count(self, seq: Sequence, plan: Plan | None) -> None:
        self.preemptions += 1
        seq.preemptions += 1
        if plan is not None:
            plan.preemptions += 1

    def _refuse(self, req: Request, need: int) -> None:
        bs = self.blocks.block_size
        req.error = KvchatError(
            f"KV pool full: this turn needs {need} more blocks of {bs} tokens, more than the pool can free even "
            f"by preempting every other conversation; raise --kv-budget, set a cap, or /reset")
        if req.mode == "cache" and not req.streaming:
            self.blocks.free(req.seq, keep_index=True)
        self._stop(req, "error")

    # ---- telemetry --------------------------------------------------------------------------------
    def snapshot(self) -> SchedulerSnapshot:
        views = []
        for seq in self.sequences:
            req = self.latest.get(seq)
            state = "idle"
            if req is not None and not req.finished:
                state = ("waiting" if not req.preempted else "preempted") if req.state == WAITING else (
                    "prefill" if req.phase == PREFILL else "running")
            views.append(RequestView(
                conversation=seq.owner, request=req.id if req is not None and not req.finished else None,
                state=state, context_tokens=len(seq), blocks_held=seq.num_blocks,
                prompt_tokens=len(req.prompt) if req else 0, generated_tokens=req.generated if req else 0,
                ttft_ms=req.ttft_ms if req else None, ms_per_token=req.ms_per_token if req else None,
                preemptions=seq.preemptions, recomputed_tokens=seq.recomputed_tokens))
        return SchedulerSnapshot(
            conversations=tuple(views), running=len(self.running), waiting=len(self.waiting),
            preemptions=self.preemptions, recomputed_tokens=self.recomputed_tokens, steps=self.steps,
            token_budget=self.token_budget, recent=tuple(self.recent))
