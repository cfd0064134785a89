"""A resumed conversation of thousands of messages draws only its newest page (issue 27's
97 MB log: drawing every message took tens of seconds, the app frozen meanwhile). One line
above stands for the older messages and draws them a page at a time, in order; the
conversation itself (the history, /save) keeps every message."""
from __future__ import annotations

import json

from kvchat.store.log import conversations_dir, restore
from kvchat.widgets import Reply, UserMessage
from kvchat.widgets.earlier import PAGE_MESSAGES, Earlier

from .conftest import SIZE, make_app, ready, record_status, wait_until

TURNS = 1500        # 3,000 messages


def write_log(turns: int = TURNS):
    """A log as kvchat writes it: a start record, then per turn the user's message, the reply
    and the turn's record."""
    folder = conversations_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "long.jsonl"
    lines = [{"type": "start", "time": 1.7e9, "model": "fake-smollm2", "system": None, "cap": None,
              "policy": "stop", "mode": "cache"}]
    for i in range(turns):
        lines += [{"type": "message", "role": "user", "content": f"question {i}"},
                  {"type": "message", "role": "assistant", "content": f"answer {i}"},
                  {"type": "turn", "turn": i + 1, "prompt_tokens": 10 * i + 5, "reused_tokens": 0,
                   "computed_tokens": 10 * i + 5, "generated_tokens": 3, "ttft_ms": 4.0, "prefill_ms": 3.0,
                   "decode_ms": [1.0, 1.0, 1.0], "positions": [10 * i + 5, 10 * i + 6, 10 * i + 7],
                   "stop_reason": "eos", "reply": f"answer {i}", "mode": "cache", "kv_dtype": "fp32",
                   "policy": "stop"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def drawn(view) -> list[str]:
    return [w.text for w in view.query("UserMessage, Reply")]


def everything(turns: int = TURNS) -> list[str]:
    return [text for i in range(turns) for text in (f"question {i}", f"answer {i}")]


async def test_a_resumed_conversation_of_thousands_of_messages_draws_one_page_and_more_on_demand(tmp_path):
    restored = restore(write_log())
    async with make_app(restored=restored).run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = pilot.app.chat_screen.view
        shown = drawn(view)
        assert 0 < len(shown) <= PAGE_MESSAGES and shown == everything()[-len(shown):]
        assert len(list(view.walk_children())) < 20 * PAGE_MESSAGES      # widgets bounded, not per message
        earlier = view.query_one(Earlier)
        assert earlier.hidden == 2 * TURNS - len(shown)
        assert f"{earlier.hidden:,} earlier messages" in str(earlier.render())
        assert len(pilot.app.chat_screen.session.log.history.messages) == 2 * TURNS   # nothing lost

        earlier.focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(drawn(view)) > len(shown), what="the page before")
        twice = drawn(view)
        assert twice == everything()[-len(twice):] and len(twice) <= 2 * PAGE_MESSAGES   # in order, one page more
        assert earlier.hidden == 2 * TURNS - len(twice)
        assert list(view.children).index(earlier) == 0            # the line stays above them all

        pilot.app.chat_screen.input.focus()
        pilot.app.chat_screen.input.load_text(f"/save {tmp_path / 'all'}")
        await pilot.press("enter")
        await wait_until(pilot, (tmp_path / "all.md").exists, what="the saved transcript")
        md = (tmp_path / "all.md").read_text()
        assert "question 0\n" in md and f"answer {TURNS - 1}\n" in md    # /save keeps what is not drawn
        pilot.app.chat_screen.session.log.close()


async def test_the_last_page_drawn_removes_the_line_and_dropping_dims_the_messages_not_drawn_yet():
    turns = PAGE_MESSAGES       # two pages
    restored = restore(write_log(turns))
    async with make_app(restored=restored).run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = pilot.app.chat_screen.view
        earlier = view.query_one(Earlier)
        assert view.mark_dropped(3, "drop-oldest", None) == 3      # as a turn that drops does
        assert [e.dropped for e in earlier.entries[:4]] == [True, True, True, False]
        while view.query(Earlier):
            view.query_one(Earlier).action_show_more()
            await pilot.pause()
        await wait_until(pilot, lambda: len(drawn(view)) == 2 * turns, what="every message drawn")
        assert drawn(view) == everything(turns)
        widgets = list(view.query("UserMessage, Reply"))
        assert isinstance(widgets[0], UserMessage) and isinstance(widgets[1], Reply)
        assert [w.has_class("dropped") for w in widgets[:4]] == [True, True, True, False]
        pilot.app.chat_screen.session.log.close()


async def test_reopening_a_long_log_from_the_browser_says_how_far_the_read_is(running_app, monkeypatch):
    """The read runs in a worker (the app was frozen while a 97 MB log was read on its
    thread) and the status line gives its bytes read of the total."""
    import kvchat.store.log_records as log_records
    path = write_log()
    size = path.stat().st_size
    monkeypatch.setattr(log_records, "PROGRESS_BYTES", size // 5)
    async with running_app() as (app, pilot):
        seen = record_status(app)
        app.chat_screen.browser.reopen(path)
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2, what="the reopened log")
        lines = [line for line in seen if line.startswith("reading long.jsonl: ")]
        assert len(lines) >= 5 and lines[-1].endswith("(100%)")
        percents = [int(line.rsplit("(", 1)[1].rstrip("%)")) for line in lines]
        assert percents == sorted(percents) and percents[0] < 50
        await wait_until(pilot, lambda: bool(drawn(app.chat_screen.view)), what="the reopened page drawn")
        assert drawn(app.chat_screen.view) == everything()[-len(drawn(app.chat_screen.view)):]
        for session in app.chat_screen.conversations.sessions:
            session.log.close()


async def test_an_edit_of_a_message_not_drawn_yet_cuts_the_transcript_there_and_keeps_what_came_before():
    """/edit 2 on a resumed conversation whose second message waits above the page: the
    transcript keeps message 1 and its reply (still waiting) and nothing from message 2 on."""
    turns = PAGE_MESSAGES       # two pages: the first 30 turns wait above the drawn page
    restored = restore(write_log(turns))
    async with make_app(restored=restored).run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = pilot.app.chat_screen
        view = screen.view
        screen.input.load_text("/edit 2")
        await pilot.press("enter")
        await wait_until(pilot, lambda: screen.input.text == "question 1", what="message 2 in the input")
        screen.input.load_text("question 1, asked again")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(screen.session.turns) == turns + 1 and screen.jobs.busy is None,
                         what="the edited turn's reply")
        earlier = view.query_one(Earlier)
        assert earlier.hidden == 2                              # message 1 and its reply
        shown = drawn(view)
        assert shown[0] == "question 1, asked again" and len(shown) == 2
        earlier.action_show_more()
        await wait_until(pilot, lambda: len(drawn(view)) == 4, what="message 1 drawn")
        assert drawn(view)[:3] == ["question 0", "answer 0", "question 1, asked again"]
        assert [m["content"] for m in screen.session.log.history.messages[:3]] == \
            ["question 0", "answer 0", "question 1, asked again"]
        screen.session.log.close()
