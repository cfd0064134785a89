"""Idle conversations holding their blocks between turns, as kvchat's engine keeps them.

A conversation's sequence keeps its blocks after a reply ends (engine/scheduler.py): its next
turn starts by handing them back to the prefix cache and matching its text again, which finds
its full blocks (the last, partial one is computed again). Until then nobody else can take
them. When a prompt's blocks or a running request's next block cannot be had from the free
and cached blocks, the engine preempts idle conversations first, the most recently opened
first: their blocks go back to the free list and leave the index, and the whole history is
computed again at the conversation's next turn. A new prompt preempts them only when that is
enough to admit it; a running request preempts them before any running request. The
conversation's last turn closes it, and its blocks go to the cache (the trace runner closes
each user's chat after its turns).

vLLM frees a request's blocks into the prefix cache when it finishes; the simulator does so
unless it models kvchat's engine (SchedulerConfig.decode_first).
"""
from __future__ import annotations

from collections import Counter

from .block_pool import Block, BlockPool
from .request import User


class IdleHistories:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.held: dict[User, list[Block]] = {}

    def hold(self, user: User, blocks: list[Block]) -> None:
        self.held[user] = blocks

    def release(self, user: User) -> None:
        """The user's next turn asks for room: its blocks go back to the cache, to be matched."""
        blocks = self.held.pop(user, None)
        if blocks:
            self.pool.free(blocks)

    def reclaimable(self, keep: list[Block]) -> int:
        """Blocks that preempting every idle conversation would free: those no one else holds
        (a block in `keep`, about to be taken by the request asking, stays)."""
        refs = Counter(b for blocks in self.held.values() for b in blocks)
        kept = set(keep)
        return sum(1 for b, n in refs.items() if b.ref == n and b not in kept)

    def preempt_newest(self) -> User | None:
        """Preempt the most recently opened idle conversation (None when there is none): its
        blocks leave the index, and its history is lost."""
        if not self.held:
            return None
        user = max(self.held, key=lambda u: u.order)
        self.pool.drop(self.held.pop(user))
        user.lost = sum(user.history)
        return user
