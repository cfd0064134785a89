"""A long reply draws at a bounded cost (kvchat/widgets/fold.py): only its tail is live
Markdown, its head folds into one line that opens to the text as written; the text kept,
the log and /save are never cut; and the app answers a key while such a reply streams in.

The hostile tester's cases (issue 27): a 2,000-row Markdown table froze the chat for about
90 s at 1.8 GB, a reply of 230-400 thousand characters took 46-50 s of UI CPU and /help
12-43 s to appear."""
from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

from textual.app import App, ComposeResult
from textual.widgets import Static
from textual.widgets._markdown import MarkdownBlock, MarkdownTableCellContents

from kvchat.screens.help_screen import HelpScreen
from kvchat.store.log import restore
from kvchat.widgets import Reply, Transcript
from kvchat.widgets.fold import KEEP_CHARS, LIVE_CHARS, LIVE_LINES, LIVE_ROWS, Fold, fold_point, too_long
from kvchat.widgets.transcript import markdown_parser

from .conftest import SIZE, make_app, ready, screen_text, wait_until
from .fake_backend import FakeBackend, FakeConfig

WORDS = ("cache", "block", "token", "layer", "value", "key", "prefix", "decode", "pool", "reuse")


def table(rows: int) -> str:
    return "Here is the table:\n\n| # | name | bytes |\n|---:|---|---:|\n" + "\n".join(
        f"| {i} | {WORDS[i % 10]} {i} | {i * 37 % 1000} |" for i in range(rows))


def prose(chars: int) -> str:
    """Paragraphs, a heading and a code block now and then: many blocks."""
    parts, n, i = [], 0, 0
    while n < chars:
        part = (f"## Part {i}" if i % 12 == 0 else
                "```python\n" + "\n".join(f"x{j} = {j} * {i}" for j in range(5)) + "\n```" if i % 12 == 9 else
                " ".join(WORDS[(i * 3 + j) % 10] for j in range(50)) + f" ({i}).")
        parts.append(part)
        n += len(part) + 2
        i += 1
    return "\n\n".join(parts)


def types(markdown: str) -> list[str]:
    return [t.type for t in markdown_parser().parse(markdown)]


# ---- where a long reply folds ---------------------------------------------------------------------
def test_an_ordinary_reply_never_folds():
    assert not too_long(prose(8_000)) and not too_long(table(50))


def test_prose_folds_at_a_block_boundary_and_keeps_a_bounded_tail():
    text = prose(40_000)
    cut = fold_point(text)
    assert text[cut.at - 2:cut.at] == "\n\n" and cut.carry == ""
    assert KEEP_CHARS // 2 < len(text) - cut.at <= KEEP_CHARS and not too_long(text[cut.at:])


def test_a_table_cut_mid_way_keeps_its_header_so_the_rest_still_draws_as_a_table():
    text = table(500)
    cut = fold_point(text)
    assert cut.carry == "| # | name | bytes |\n|---:|---|---:|\n"
    assert text[cut.at:].startswith("| ") and not too_long(cut.carry + text[cut.at:])
    assert types(cut.carry + text[cut.at:])[:3] == ["table_open", "thead_open", "tr_open"]


def test_a_code_block_cut_mid_way_keeps_its_fence_so_the_rest_still_draws_as_code():
    text = "intro\n\n~~~python\n" + "".join(f"x = {i}\n" for i in range(600)) + "~~~\n\nafter"
    cut = fold_point(text)
    assert cut.carry == "~~~python\n" and text[cut.at:].startswith("x = ")
    assert types(cut.carry + text[cut.at:])[0] == "fence"


def test_one_endless_line_folds_after_a_space():
    text = "word " * 5_000
    cut = fold_point(text)
    assert text[cut.at - 1] == " " and cut.carry == "" and len(text) - cut.at <= KEEP_CHARS


# ---- the widget -------------------------------------------------------------------------------------
class TranscriptHost(App):
    def compose(self) -> ComposeResult:
        yield Transcript()


def live_cells(reply: Reply) -> int:
    return len(reply.query(MarkdownTableCellContents)) + len(reply.query(MarkdownBlock))


async def test_a_streamed_2000_row_table_keeps_a_bounded_live_part_and_opens_its_fold_as_written():
    text = table(2_000)
    app = TranscriptHost()
    async with app.run_test(size=(100, 40)) as pilot:
        reply = await app.query_one(Transcript).start_reply()
        most = 0
        for start in range(0, len(text), 700):       # ~25 rows a batch, as the relay sends them
            await reply.append(text[start:start + 700])
            await pilot.pause()
            most = max(most, live_cells(reply))
        await reply.finish(None)
        await pilot.pause()
        assert reply.text == text and reply.folded > len(text) - LIVE_CHARS
        assert most <= 4 * (LIVE_ROWS + 30) * 2          # cells and their blocks, never the 2,000 rows' 6,000
        fold = reply.query_one(Fold)
        assert fold.display and "earlier lines" in str(fold.render())
        assert "1999" in screen_text(app) or reply.markdown.source.rstrip().endswith("| 1999 | reuse 1999 | 963 |")

        fold.focus()
        await pilot.press("enter")                        # open: the folded rows as written
        await pilot.pause()
        shown = "\n".join(str(s.render()) for s in reply.query(".folded > Static"))
        assert shown == text[:reply.folded].removesuffix("\n")
        await pilot.press("enter")                        # and fold again
        await pilot.pause()
        assert not reply.query(".folded > Static")


async def test_a_restored_long_reply_mounts_folded():
    text = prose(300_000)
    app = TranscriptHost()
    async with app.run_test(size=(100, 40)) as pilot:
        reply = Reply(text)
        await app.query_one(Transcript).mount(reply)
        await pilot.pause()
        assert reply.text == text and reply.folded > 0
        assert not too_long(reply.markdown.source) and len(reply.query(MarkdownBlock)) < LIVE_LINES


# ---- the app ------------------------------------------------------------------------------------------
class Costs(NamedTuple):
    help_s: float         # wall seconds from F1 to the help screen
    help_cpu_s: float     # this process's CPU seconds over the same wait
    reply_s: float        # wall seconds from Enter to the reply's end
    reply_cpu_s: float
    folded: int           # characters of the reply folded away at its end
    live_blocks: int      # Markdown blocks still live at its end


async def stream_and_ask_help(text: str, token_delay_s: float) -> Costs:
    """Send a message whose reply is `text` (the fake backend streams it a word a token, as
    the relay batches it), press F1 once half of it is on screen, and measure the wait for
    the help screen and the whole reply, in wall and in CPU seconds.

    The bounds are on CPU seconds: what the fold bounds is the work the app does per batch,
    and the app is one thread, so on a quiet machine its CPU time is what a key waits for.
    On CI's 2 shared cores, beside the process lane's vLLM server and tmux tests, the wall
    time of F1 went from 3 s to 11.5 s (a failed run: the bound was 8 wall seconds); CPU
    seconds do not grow with what else runs. Wall seconds are printed beside them."""
    fake = FakeBackend(FakeConfig(replies=(text,), num_blocks=8192, token_delay_s=token_delay_s))
    app = make_app(fake, max_tokens=len(text.split(" ")) + 10)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        screen.input.load_text("a long one, please")
        s0, sc0 = time.perf_counter(), time.process_time()
        await pilot.press("enter")
        await wait_until(pilot, lambda: screen.view.last_reply() is not None
                         and len(screen.view.last_reply().text) > len(text) // 2, timeout=600, what="half the reply")
        t0, c0 = time.perf_counter(), time.process_time()
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), timeout=600, what="the help screen")
        await pilot.pause()
        help_s, help_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        await pilot.press("escape")
        await wait_until(pilot, lambda: len(screen.session.turns) == 1 and screen.jobs.busy is None,
                         timeout=600, what="the reply's end")
        reply_s, reply_cpu_s = time.perf_counter() - s0, time.process_time() - sc0
        reply = screen.view.last_reply()
        assert reply.text == text
        costs = Costs(help_s, help_cpu_s, reply_s, reply_cpu_s, reply.folded, len(reply.query(MarkdownBlock)))
        screen.input.load_text("/save kept")
        await pilot.press("enter")
        await pilot.pause()
        log = screen.session.log.path
    assert restore(log).messages[-1] == {"role": "assistant", "content": text}
    assert f"## Assistant\n\n{text}\n" in Path("kept.md").read_text()
    print(f"help screen up {help_s:.2f} s after F1 ({help_cpu_s:.2f} CPU-s); "
          f"the whole reply {reply_s:.2f} s ({reply_cpu_s:.2f} CPU-s)")   # -s shows it
    return costs


async def test_help_answers_within_seconds_while_a_2000_row_table_streams_in():
    """Measured here (2 cores, a quiet machine): F1 answered after 1.5 CPU-s (3.0 s of wall;
    pushing the help screen itself costs ~1.5 CPU-s after a 4,000-character reply), the
    whole reply 8.1 CPU-s. With the fold switched off (transcript.too_long patched to say
    no; a table past 20 rows still one widget): 6.2-12.5 CPU-s and 178-189 CPU-s (each batch
    re-parsed the whole table). The bounds, 4 and 40 CPU-s, leave 2.5x and 5x over the fold
    and catch its absence."""
    costs = await stream_and_ask_help(table(2_000), token_delay_s=0.0005)
    assert costs.help_cpu_s < 4.0 and costs.reply_cpu_s < 40.0


async def test_help_answers_within_seconds_while_a_60k_character_reply_streams_in():
    """60,000 characters of prose (five times the fold's threshold). F1 answered after 2.0-2.2
    CPU-s here, the whole reply 5.7 CPU-s. At this length the fold saves little (switched
    off: 2.1-2.3 and 8.0 CPU-s; its cost grows with the square of the length: the code before
    the fold did not stream a 300k reply's first half within 25 minutes, scripts/
    long_reply_cost.py --case prose, and 300k is too slow for the suite even folded), so what
    shows the fold at work here is the reply's end: its head folded away and few blocks live."""
    costs = await stream_and_ask_help(prose(60_000), token_delay_s=0.0002)
    assert costs.help_cpu_s < 4.0
    assert costs.folded > 60_000 - 2 * KEEP_CHARS and costs.live_blocks < LIVE_LINES


# ---- the log's turn records, checked at C speed ---------------------------------------------------------
def test_a_turn_record_checked_at_c_speed_still_names_a_bad_latency():
    """decode_ms and positions are checked with sum/min/max (a 97 MB log's Python loop over
    them cost most of its read); a bad item still falls to the slow test that names it."""
    import pytest

    from kvchat.store.records import RecordError, TurnRecord

    good = {"turn": 1, "prompt_tokens": 3, "generated_tokens": 3, "decode_ms": [1.0, 2, 3.5], "positions": [3, 4, 5]}
    assert TurnRecord.from_dict(good).decode_ms == (1.0, 2, 3.5)
    for bad, named in (([1.0, float("nan"), 2.0], "decode_ms[1]"), ([1.0, 2.0, 10**400], "decode_ms[2]"),
                       ([True, 1.0, 2.0], "decode_ms[0]"), ([1.0, -2.0, 3.0], "decode_ms[1]")):
        with pytest.raises(RecordError, match=named.replace("[", r"\[")):
            TurnRecord.from_dict({**good, "decode_ms": bad})
    with pytest.raises(RecordError, match=r"positions\[2\]"):
        TurnRecord.from_dict({**good, "positions": [3, 4, 2**60]})
