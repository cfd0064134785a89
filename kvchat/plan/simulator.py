"""A discrete-event simulation of a vLLM-v1-like scheduler over a step-time model.

Each step, as vLLM v1 schedules it (or as kvchat's engine does, `decode_first`: below): every
running request in order gets the tokens it still
needs (one for a decode, a chunk for a prefill) from a token budget; a request whose blocks
cannot be allocated preempts the newest running request (its blocks freed, its tokens
recomputed later), itself last; then, if nobody was preempted, waiting requests are admitted
first come first served while the budget, the sequence limit and the free blocks allow, each
starting on its longest prefix-cache hit. The step's time comes from the StepTimer; a request
samples a token at the end of a step in which it caught up with its tokens.

Users are closed loops (workload.py): a user's next turn arrives `think` seconds after its
last reply ended. The cap policies act where a client or kvchat would: `stop` refuses a turn
past the limit, `drop-oldest` drops the oldest history segments until the turn fits (the
rewritten prefix is recomputed), `sink-window` computes, holds and reads at most `cap` tokens of
a turn, keeping its window cached from turn to turn (what forgetting the middle does to the
text is not modelled).

Long stretches where every running request only decodes and nothing can change the batch
run in one go (`_stretch`): the same steps, times and tokens, a few Python operations per
step instead of one per request per step. `fast_forward=False` runs every step the long way;
the tests hold the two to the same result.
"""
from __future__ import annotations

import heapq
from collections import deque

from .block_pool import Block, BlockPool, Key
from .idle import IdleHistories
from .request import Request, RequestRecord, SchedulerConfig, SimResult, User
from .step_time import StepTimer
from .workload import Trace

STRETCH_MAX = 512          # steps in one stretch at most: the occupancy series keeps a point per stretch
INF = float("inf")


class Simulator:
    def __init__(self, trace: Trace, cfg: SchedulerConfig, timer: StepTimer, horizon: float | None = None,
                 log_steps: bool = False) -> None:
        self.cfg, self.timer, self.horizon = cfg, timer, horizon
        self.bs = cfg.block_size
        self.system = trace.system_tokens
        self.pool = BlockPool(cfg.num_blocks, cfg.prefix_caching)
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.events: list[tuple[float, int, User]] = []
        self.now = 0.0
        self.res = SimResult(step_log=[] if log_steps else None)
        self.long_req: Request | None = None
        # kvchat's engine keeps a conversation's blocks between its turns (idle.py); vLLM frees them
        self.idle = IdleHistories(self.pool) if cfg.decode_first else None
        # a request reaches the scheduler this long after it is sent (its arrival, for TTFT)
        self.delay = timer.request
        for i, u in enumerate(trace.users):
            heapq.heappush(self.events, (u.start + u.turns[0].think + self.delay, i, User(u, i)))
        self._seq = len(trace.users)

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        res, events = self.res, self.events
        while True:
            while events and events[0][0] <= self.now:
                t, _, user = heapq.heappop(events)
                self._arrive(user, t)
            if not self.running and not self.waiting:
                if not events:
                    break
                self.now = events[0][0]
                continue
            if self.horizon is not None and self.now > self.horizon:
                res.unfinished = len(self.running) + len(self.waiting)
                break
            if self.cfg.fast_forward and self._decode_only() and (not self.waiting or self._blocked()):
                if not self._stretch():
                    self._step()
            else:
                self._step()
            long = self.long_req
            res.samples.append((self.now, self.pool.num_used, self.pool.cached_free, len(self.running),
                                len(self.waiting), len(long.blocks) if long is not None else 0))
        res.end, res.evictions = self.now, self.pool.evictions
        return res

    # ---- users -----------------------------------------------------------------------------------
    def _arrive(self, user: User, t: float) -> None:
        """A user's turn arrives: the cap policy shapes its prompt, or refuses it."""
        cfg, turn = self.cfg, user.trace.turns[user.turn]
        hist = sum(user.history)
        need = self.system + hist + turn.new
        limit = cfg.limit
        window = None
        if cfg.policy == "sink-window":
            window = limit
            prompt, max_out = min(need, window), turn.reply
        else:
            if cfg.policy == "drop-oldest":
                dropped = False
                while user.history and self.system + hist + turn.new + turn.reply > limit:
                    hist -= user.history.pop(0)
                    dropped = True
                if dropped:
                    user.epoch += 1       # the text after the system prompt moved: no block of it matches
                need = self.system + hist + turn.new
            if need >= limit:             # at least one reply token must fit
                self.res.refused.append((user.trace.uid, user.turn, need))
                if self.idle is not None:
                    self.idle.release(user)   # the chat is closed: its blocks go to the cache
                return                    # the conversation ends here, as a refused chat does
            prompt, max_out = need, min(turn.reply, limit - need)
        req = Request(user, t - self.delay, prompt, turn.new, max_out, window)
        if user.long:
            self.long_req = req
        self.waiting.append(req)

    def _finish(self, r: Request) -> None:
        self.running.remove(r)
        u = r.user
        if self.idle is not None and u.turn + 1 < len(u.trace.turns):
            self.idle.hold(u, r.blocks)       # kept for its next turn (its last closes the chat)
        else:
            self.pool.free(r.blocks)
        r.blocks = []
        self.res.records.append(RequestRecord(u.trace.uid, r.turn, u.long, r.arrival, r.prompt, r.hits, r.out,
                                              r.first_t - r.arrival, self.now - r.arrival,   # type: ignore[operator]
                                              r.preemptions, r.recomputed))
        u.history.append(r.new + r.out)
        u.turn += 1
        if u.turn < len(u.trace.turns):
            self._seq += 1
            heapq.heappush(self.events, (self.now + u.trace.turns[u.turn].think + self.delay, self._seq, u))

    # ---- blocks ----------------------------------------------------------------------------------
    def _key(self, r: Request, j: int) -> Key:
        return (-1, 0, j) if (j + 1) * self.bs <= self.system else (r.user.trace.uid, r.epoch, j)

    def _keys(self, r: Request) -> list[Key]:
        """The keys of the full blocks a prefix hit may cover: at least one token is left to
        compute; a sink-window turn recomputes at least its new message."""
        n = (r.num_tokens - 1) // self.bs
        if r.window is not None:
            n = min(n, (r.num_tokens - r.new) // self.bs)
        shared = min(n, self.system // self.bs)
        uid, epoch = r.user.trace.uid, r.epoch
        return [(-1, 0, j) for j in range(shared)] + [(uid, epoch, j) for j in range(shared, n)]

    def _blocks_for(self, r: Request, tokens: int) -> int:
        return -(-r.held(tokens) // self.bs)

    def _hash(self, r: Request) -> None:
        full = r.held(r.computed) // self.bs
        if full > r.hashed:
            pool, blocks = self.pool, r.blocks
            for j in range(r.hashed, min(full, len(blocks))):
                pool.cache(blocks[j], self._key(r, j))
            r.hashed = full

    def _preempt(self, r: Request) -> None:
        self.pool.free(r.blocks)
        r.blocks, r.hashed, r.computed = [], 0, 0
        r.preemptions += 1
        self.res.preemptions += 1
        self.waiting.appendleft(r)

    def _preempt_idle(self) -> bool:
        """Preempt the newest idle conversation (kvchat's engine); False when none is idle."""
        if self.idle is None or self.idle.preempt_newest() is None:
            return False
        self.res.preemptions += 1
        return True

    def _computed(self, r, before: int) -> None:
        """r's computed tokens went from `before` up: what was computed before a preemption
        counts as recomputed, the high-water mark follows, and new full blocks are hashed."""
        if r.high > before:
            again = min(r.computed - before, r.high - before)
            r.recomputed += again
            self.res.recomputed += again
        r.high = max(r.high, r.computed)
        self._hash(r)

    def _admit(self, r, admission, running: list) -> int:
        """Move the head of the waiting queue into `running` with the blocks its admission
        found cached and the ones it allocates; the prompt tokens it takes this step."""
        hits, n, need = admission
        self.waiting.popleft()
        self.pool.touch(hits)
        while need > self.pool.num_free and self._preempt_idle():
            pass
        r.blocks = hits + self.pool.allocate(need)
        lost, r.user.lost = r.user.lost, 0      # a preempted idle history, computed again (as the engine counts it)
        r.recomputed += lost
        self.res.recomputed += lost
        r.computed, r.hashed = len(hits) * self.bs, len(hits)
        if not r.admitted:
            r.admitted, r.hits = True, r.computed
        running.append(r)
        return n

    def _admission(self, r: Request, budget: int, whole: bool = False) -> tuple[list[Block], int, int] | None:
        """(prefix hits, tokens to compute now, blocks to allocate) for a waiting request, or
        None when the free blocks cannot take it. `whole`: the blocks of its whole prompt at
        once (kvchat's engine), not only of the chunk computed now (vLLM). kvchat's engine
        first hands the turn's own held history back to the cache (idle.py), and admits it
        when preempting idle conversations makes room."""
        if self.idle is not None:
            self.idle.release(r.user)
        hits = self.pool.match(self._keys(r))
        start = len(hits) * self.bs
        n = min(r.num_tokens - start, budget)
        need = self._blocks_for(r, r.num_tokens if whole else start + n) - len(hits)
        short = need + self.pool.taken_from_free(hits) - self.pool.num_free
        if short > 0 and (self.idle is None or self.idle.reclaimable(hits) < short):
            return None
        return hits, n, need

    def _blocked(self) -> bool:
        """Whether the waiting head cannot be admitted now; then it cannot until a request
        finishes (decodes only take blocks, and an evicted hit costs a fresh block)."""
        cfg = self.cfg
        if len(self.running) >= cfg.max_seqs or cfg.max_batched_tokens - len(self.running) <= 0:
            return True
        head = self.waiting[0]
        if self.idle is not None and head.user in self.idle.held:
            # its admission first hands its held history back to the cache, a change of state
            # that must come where the step-by-step path makes it (after the step's decode rows
            # took their blocks), so the step runs the long way: asking here once let a decode
            # row evict one of the released blocks and cost the turn a prefix hit
            return False
        return self._admission(head, cfg.max_batched_tokens - len(self.running), cfg.decode_first) is None

    # ---- one step, the long way ----------------------------------------------------------------
    def _step(self) -> None:
        sched = self._plan_decode_first() if self.cfg.decode_first else self._plan()
        self._run(sched)

    def _plan(self) -> list[tuple[Request, int]]:
        """vLLM v1's order: every running request in admission order from the budget."""
        cfg, pool, running = self.cfg, self.pool, self.running
        budget = cfg.max_batched_tokens
        sched: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.computed, budget)
            need = self._blocks_for(r, r.computed + n) - len(r.blocks)
            while need > pool.num_free:
                victim = running.pop()     # the newest; never one scheduled already (they sit before r)
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            else:
                if need:
                    r.blocks += pool.allocate(need)
                sched.append((r, n))
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            while self.waiting and budget > 0 and len(running) < cfg.max_seqs:
                r = self.waiting[0]
                got = self._admission(r, budget)
                if got is None:
                    break
                n = self._admit(r, got, running)
                sched.append((r, n))
                budget -= n
        return sched

    def _plan_decode_first(self) -> list[tuple[Request, int]]:
        """kvchat's engine's order (engine/scheduler.py): a decode row for every running
        request past its prompt, never left out (the budget may go below zero), then prompt
        chunks of running requests, then waiting requests admitted in arrival order while the
        budget lasts (a lone prompt takes prefill_chunk, past the budget). A request short of blocks preempts
        the newest running one, itself when it is the newest, even one already given a row
        this step (its row is taken back); one preempted this step is not readmitted in it."""
        cfg, pool, running = self.cfg, self.pool, self.running
        chunk = cfg.prefill_chunk or cfg.max_batched_tokens
        budget = cfg.max_batched_tokens
        sched: dict[int, tuple[Request, int]] = {}
        yielded: set[int] = set()
        decoding = [r for r in running if r.out and r.num_tokens - r.computed == 1]
        order = decoding + [r for r in running if not (r.out and r.num_tokens - r.computed == 1)]
        for r in order:
            if id(r) in yielded:
                continue
            decode = r.out and r.num_tokens - r.computed == 1
            n = 1 if decode else min(r.num_tokens - r.computed, chunk, budget if sched else chunk)
            if n <= 0:
                continue
            need = self._blocks_for(r, r.computed + n) - len(r.blocks)
            while need > pool.num_free:
                if self._preempt_idle():        # idle conversations first, the newest first
                    continue
                victim = running.pop()          # the newest
                yielded.add(id(victim))
                taken = sched.pop(id(victim), None)
                if taken is not None:
                    budget += taken[1]
                self._preempt(victim)
                if victim is r:
                    break
            if id(r) in yielded:
                continue
            if need:
                r.blocks += pool.allocate(need)
            sched[id(r)] = (r, n)
            budget -= n
        while self.waiting and (budget > 0 or not sched) and len(running) < cfg.max_seqs:
            r = self.waiting[0]
            if id(r) in yielded:
                break
            admit = self._admission(r, budget if sched else chunk, whole=True)
            if admit is None:
                break
            n = self._admit(r, admit, running)
            sched[id(r)] = (r, n)
            budget -= n
        return list(sched.values())

    def _run(self, sched: list[tuple[Request, int]]) -> None:
        if not sched:
            return                    # everyone preempted this step; the next step admits again
        tokens = rows = logit_rows = decodes = 0
        kv = pairs = 0.0
        for r, n in sched:
            ctx = r.held(r.computed)
            if n == 1 and r.out and r.computed == r.num_tokens - 1:
                decodes += 1
            tokens += n
            rows += 1
            kv += ctx
            pairs += n * ctx + n * (n + 1) / 2
            if r.computed + n == r.num_tokens:
                logit_rows += 1
        dt = self.timer.seconds(tokens, logit_rows, rows, kv, pairs, rows - decodes)
        self.now += dt
        if self.res.step_log is not None:
            self.res.step_log.append((decodes, rows - decodes, tokens - decodes, dt))
        self.res.steps += 1
        self.res.tokens_scheduled += tokens
        now, itl = self.now, self.res.itl
        for r, n in sched:
            r.computed += n
            self._computed(r, r.computed - n)
            if r.computed == r.num_tokens:
                r.out += 1
                if r.first_t is None:
                    r.first_t = now
                else:
                    itl.append((now - r.last_t, 1))
                r.last_t = now
                if r.out >= r.max_out:
                    self._finish(r)

    # ---- many decode steps at once ----------------------------------------------------------------
    def _decode_only(self) -> bool:
        running = self.running
        if not running or len(running) > self.cfg.max_batched_tokens:
            return False
        for r in running:
            if r.num_tokens - r.computed != 1 or not r.out:    # a last prefill chunk of one token is no decode
                return False
        return True

    def _need(self, k: int) -> int:
        """Blocks the running requests need to take k more decode steps."""
        bs, total = self.bs, 0
        for r in self.running:
            extra = -(-r.held(r.computed + k) // bs) - len(r.blocks)
            if extra > 0:
                total += extra
        return total

    def _stretch(self) -> bool:
        """Up to STRETCH_MAX decode steps of the whole running batch, stopping at the first
        finish, the first arrival that could be admitted, a sink-window reaching its window,
        or the free blocks running out (the next step preempts, the long way). False when
        not even one step can run this way."""
        running, pool, bs = self.running, self.pool, self.bs
        k = STRETCH_MAX
        grow, kv0 = 0, 0
        for r in running:
            left = r.max_out - r.out
            if left < k:
                k = left
            h = r.held(r.computed)
            kv0 += h
            if r.window is None or r.computed < r.window:
                grow += 1
                if r.window is not None and r.window - r.computed < k:
                    k = r.window - r.computed
        free = pool.num_free
        if self._need(k) > free:
            lo, hi = 0, k                  # the most steps whose blocks fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._need(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if k < 1:
            return False
        b = len(running)
        now = self.now
        next_arrival = self.events[0][0] if self.events and not self.waiting else INF
        late = [r for r in running if r.last_t < now]    # skipped last step (the budget ran out): a longer first gap
        seconds, itl, log = self.timer.seconds, self.res.itl, self.res.step_log
        t = now
        steps = 0
        while steps < k:
            kv = kv0 + grow * steps
            last = t
            t += seconds(b, b, b, kv, kv + b)
            dt = t - last                   # as the step-by-step path takes it: a difference of clock readings
            if steps == 0 and late:
                itl.extend((t - r.last_t, 1) for r in late)
                if b > len(late):
                    itl.append((dt, b - len(late)))
            else:
                itl.append((dt, b))
            if log is not None:
                log.append((b, 0, 0, dt))
            steps += 1
            if t >= next_arrival:
                break
        self.now = t
        self.res.steps += steps
        self.res.stretches += 1
        self.res.tokens_scheduled += b * steps
        done = []
        for r in list(running):
            before = r.computed
            r.computed += steps
            r.out += steps
            need = -(-r.held(r.computed) // bs) - len(r.blocks)
            if need > 0:
                r.blocks += pool.allocate(need)
            self._computed(r, before)
            r.last_t = t
            if r.out >= r.max_out:
                done.append(r)
        for r in done:
            self._finish(r)
        return True
