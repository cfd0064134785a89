"""The runner's CUDA-graph step with short prompt chunks (engine/runner.py `_graphed`): the rows
it hands the decoder and the logits rows it keeps. The decoder here records its inputs and
returns each row's index as its logits, since graph replay needs a GPU; the arithmetic of such
rows is tested on the real kernels in tests/test_kernels_model.py
(test_graph_decoder_runs_a_prompt_chunk_as_rows_of_one_sequence)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from kvchat.engine.runner import Runner

BS = 4


class Seq:
    def __init__(self, length: int, blocks: list[int]) -> None:
        self.length, self.block_table, self.block_size = length, blocks, BS
        self.table = torch.tensor(blocks + [0] * 4, dtype=torch.int32)

    def __len__(self) -> int:
        return self.length

    def slot(self, pos: int) -> int:
        return self.block_table[pos // BS] * BS + pos % BS

    def slots(self, start: int, end: int) -> list[int]:
        return [self.slot(p) for p in range(start, end)]


class Recorder:
    max_batch = 64

    def decode(self, tokens, positions, slots, tables, lens):
        self.args = (list(tokens), list(positions), list(slots), [t.tolist() for t in tables], list(lens))
        return torch.arange(len(tokens), dtype=torch.float32)[:, None].repeat(1, 3)   # row i's "logits": i


def test_decode_rows_then_each_chunk_as_its_rows_and_its_last_row_kept():
    a = SimpleNamespace(seq=Seq(5, [7, 2]), tokens=[1, 2, 3, 4, 5, 11])          # decoding, cache 5 long
    b = SimpleNamespace(seq=Seq(6, [3, 9, 4]), tokens=[20, 21, 22, 23, 24, 25, 26, 27, 28])   # 3 new tokens
    runner = Runner.__new__(Runner)
    dec = Recorder()
    ids, pos, slots, lens = [11], [5], [a.seq.slot(5)], [6]
    logits, context = runner._graphed(dec, [a], [(b, 6, 3)], ids, pos, slots, lens)
    tokens, positions, got_slots, tables, got_lens = dec.args
    assert tokens == [11, 26, 27, 28] and positions == [5, 6, 7, 8]
    assert got_slots == [2 * BS + 1, 9 * BS + 2, 9 * BS + 3, 4 * BS + 0]
    assert got_lens == [6, 7, 8, 9]                     # each chunk row sees itself and the rows before
    assert tables[0] == [7, 2, 0] and tables[1] == tables[2] == tables[3] == [3, 9, 4]
    assert logits[:, 0].tolist() == [0, 3]              # the decode row, then the chunk's last row
    assert context == 6 + 9


def test_decode_rows_alone_keep_every_row():
    a = SimpleNamespace(seq=Seq(5, [7, 2]), tokens=[1, 2, 3, 4, 5, 11])
    b = SimpleNamespace(seq=Seq(2, [1]), tokens=[8, 9, 10])
    runner = Runner.__new__(Runner)
    logits, context = runner._graphed(Recorder(), [a, b], [], [11, 10], [5, 2], [a.seq.slot(5), b.seq.slot(2)], [6, 3])
    assert logits[:, 0].tolist() == [0, 1] and context == 9


def test_a_chunk_goes_through_the_graph_while_its_rows_read_at_most_twelve_weights():
    """Llama 3.1 8B in bf16: 15.0 GB of weights a step, 128 KiB of cache a token. 40 rows after
    32k tokens read 172 GB (the H200's 60 ms, within the bound); after 64k they would read twice
    that, and the eager prefill, which reads the cache once, is cheaper."""
    from kvchat.engine import runner as runner_mod
    runner = Runner.__new__(Runner)
    runner.pool = SimpleNamespace(spec=SimpleNamespace(stored_bytes_per_token=131_072))
    runner.model = SimpleNamespace(step_weight_bytes=15_010_000_000)
    assert runner_mod.CHUNK_READS == 12

    def chunk(cached: int, n: int):
        return (SimpleNamespace(seq=Seq(cached, [0])), 0, n)
    assert runner._rows_pay([chunk(32_768, 40)]) and runner._rows_pay([chunk(8_192, 23)])
    assert not runner._rows_pay([chunk(65_536, 40)])
    assert not runner._rows_pay([chunk(32_768, 40), chunk(32_768, 4)])    # the step's chunks together
