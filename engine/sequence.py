"""A sequence: the cache side of one conversation, which pool blocks hold which tokens.

The sequence owns its block table (and the table's copy on the device that the kernels
read); the block manager is the only thing that changes it (`allocate`, `append`,
`free`, `match_prefix`, `evict`, `truncate`), as in nano-vllm. No torch here: the device
table is any 1-D integer tensor, written through its own methods.
"""
from __future__ import annotations


def blocks_for(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def block_runs(table: list[int]) -> tuple[tuple[int, int], ...]:
    """A block table as maximal runs of consecutive ids, ((first id, blocks), ...):
    [4, 5, 6, 9, 10] -> ((4, 3), (9, 2))."""
    runs: list[tuple[int, int]] = []
    for b in table:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return tuple(runs)


class Sequence:
    def __init__(self, block_size: int, table=None, owner: int = 0) -> None:
        self.block_size = block_size
        self.owner = owner               # the id of the conversation whose cache this is
        self.block_table: list[int] = []
        self.tokens: list[int] = []      # tokens whose K/V the blocks hold, in cache order
        self.logical: list[int] = []     # every token written since the cache was last empty, in
                                         # text order (equal to tokens unless blocks were evicted)
        self.chains: list[int] = []      # chain ids of the indexed full blocks, in order
        self.reused_blocks = 0           # leading blocks that came from the prefix index
        self.private = False             # never indexed (sink-window shifts its blocks' positions)
        self.table = table               # (max_blocks,) int32 on the device, or None: the kernels' copy
        # counters the block manager's free() keeps:
        self.evicted_tokens = 0          # cut out by sink-window, since start
        self.lost_tokens = 0             # dropped by preemption since its last turn began: recomputed next
        self.preemptions = 0             # times preempted, since start
        self.recomputed_tokens = 0       # tokens computed again after preemptions, since start

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def blocks_needed(self, n_tokens: int) -> int:
        """Fresh blocks this sequence needs to hold n_tokens."""
        return max(blocks_for(n_tokens, self.block_size) - len(self.block_table), 0)

    def slot(self, pos: int) -> int:
        """The flat pool slot of cache position pos."""
        return self.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        bs = self.block_size
        return [self.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The block table as runs of consecutive ids: the CPU attention path reads each run
        of the pool as one view."""
        return block_runs(self.block_table)

    def write_table(self, start: int = 0) -> None:
        """Copy block_table[start:] to the device table."""
        if self.table is not None and start < len(self.block_table):
            self.table[start:len(self.block_table)] = self.table.new_tensor(self.block_table[start:])
