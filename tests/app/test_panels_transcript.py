"""Replies keep their line breaks on screen (a poem, a list without bullets), the saved
Markdown keeps the text as written, and the stats line reads long times in seconds."""
from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widgets._markdown import MarkdownBlock

from kvchat.store.history import History
from kvchat.store.export import export
from kvchat.text import stats_line
from kvchat.widgets import Reply, Transcript

from .conftest import screen_text
from .panel_host import as_turn

POEM = "Roses are red,\nviolets are blue,\nthe cache holds keys\nand values too."
LIST = "first: flour\nsecond: eggs\n\nthen bake"


class TranscriptHost(App):
    def compose(self) -> ComposeResult:
        yield Transcript()


def lines(app) -> list[str]:
    return [line.strip().replace("\u00a0", " ") for line in screen_text(app).splitlines()]


def summary(**over):
    s = {"turn": 1, "reply": POEM, "prompt_tokens": 12, "reused_tokens": 0, "computed_tokens": 12,
         "generated_tokens": 16, "ttft_ms": 212_234.0, "decode_ms": [40.0] * 16, "mode": "cache"}
    return as_turn({**s, **over})


async def test_a_restored_reply_keeps_each_line_of_a_poem_and_a_list_without_bullets():
    app = TranscriptHost()
    async with app.run_test(size=(80, 30)) as pilot:
        await app.query_one(Transcript).show_history(History([{"role": "user", "content": "a poem?"},
                                                             {"role": "assistant", "content": POEM},
                                                             {"role": "assistant", "content": LIST}]))
        await pilot.pause()
        shown = lines(app)
    for line in (*POEM.splitlines(), "first: flour", "second: eggs", "then bake"):
        assert line in shown


async def test_a_streamed_reply_keeps_its_line_breaks():
    app = TranscriptHost()
    async with app.run_test(size=(80, 30)) as pilot:
        reply = await app.query_one(Transcript).start_reply()
        for word in POEM.replace("\n", "\n ").split(" "):
            await reply.append(word if word.endswith("\n") else word + " ")
        await reply.finish(summary(reply=None))
        await pilot.pause()
        shown = lines(app)
        assert reply.text.replace(" \n", "\n").strip() == POEM        # the text itself is not rewritten
    for line in POEM.splitlines():
        assert line in shown


def test_the_saved_markdown_keeps_the_text_as_written(tmp_path):
    md, _ = export(tmp_path / "chat", History([{"role": "user", "content": "a poem?"},
                                               {"role": "assistant", "content": POEM}]), [summary()], "fake")
    assert f"\n{POEM}\n" in md.read_text(encoding="utf-8")


def test_the_stats_line_reads_a_long_ttft_in_seconds_and_one_token_in_the_singular():
    line = stats_line(summary())
    assert "TTFT 212.2 s" in line and "212234" not in line
    assert "TTFT 850 ms" in stats_line(summary(ttft_ms=850.0))
    assert stats_line(summary(generated_tokens=1)).startswith("1 token ·")


async def test_the_reply_shows_the_ttft_in_seconds():
    app = TranscriptHost()
    async with app.run_test(size=(120, 20)) as pilot:
        await app.query_one(Transcript).mount(Reply(POEM, summary()))
        await pilot.pause()
        assert any("TTFT 212.2 s" in line for line in lines(app))


async def test_a_batch_of_a_reply_is_parsed_and_mounted_when_its_append_returns():
    """The worker's next decode step waits for the screen to draw each batch: on_turn_progress
    awaits Reply.append, then asks for a call after the next refresh (chat/worker.py). So the
    batch's blocks must be mounted when append returns, or the refresh that ends the wait draws
    the old text and the batch is drawn during the next step. Textual's MarkdownStream, which
    the reply used, only queued a fragment in write() and appended it in a task of its own
    (session 28: each decode step over 25 ms in a 512-token reply overlapped that late draw)."""
    app = TranscriptHost()
    async with app.run_test(size=(80, 30)) as pilot:
        reply = Reply()
        await app.query_one(Transcript).mount(reply)
        await pilot.pause()
        batches = ("First para", "graph, one.\n\nSecond ", "one, **bold**.\n\n- an item")
        for batch, blocks in zip(batches, (1, 2, 3)):
            await reply.append(batch)                      # no pause: what the next refresh draws
            assert reply.markdown.source == reply.text
            shown = [b for b in reply.markdown.children if isinstance(b, MarkdownBlock)]
            assert len(shown) == blocks, (batch, shown)
        await pilot.pause()
        assert any("Second one, bold." in line for line in lines(app)), lines(app)
