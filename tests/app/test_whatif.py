"""/whatif in the app says what `kvchat info --tokens` says: one shared sentence
(kvchat/text.py) over the same arithmetic (engine/sizing.py)."""
from __future__ import annotations

import pytest

from kvchat.commands import Command, CommandError, parse
from kvchat.engine.sizing import what_if
from kvchat.engine.sources import resolve
from kvchat.text import what_if_line
from kvchat.widgets import Notice

from .conftest import wait_until


def test_whatif_parses_model_tokens_and_an_optional_budget():
    assert parse("/whatif 70b 30000") == Command("whatif", ("70b", "30000", None))
    assert parse("/whatif 70b 30000 15GB") == Command("whatif", ("70b", "30000", "15GB"))
    with pytest.raises(CommandError, match="usage: /whatif MODEL TOKENS"):
        parse("/whatif 70b")


async def test_whatif_70b_30000_in_15gb_is_two_thirds_of_the_budget_and_one_user(running_app):
    async with running_app() as (app, pilot):
        app.query_one("#input").load_text("/whatif 70b 30000 15GB")
        await pilot.press("enter")
        await wait_until(pilot, lambda: any("What if" in n.text for n in app.chat_screen.view.query(Notice)))
        line = [n.text for n in app.chat_screen.view.query(Notice) if "What if" in n.text][-1]
        g = resolve("llama-3.1-70b", random_weights=True).geometry
        assert line.endswith(what_if_line(what_if(g, "bf16", 30_000, 1, 15 * 10**9)))
        assert "30,000 tokens x 327,680 B per token = 9.83 GB" in line
        assert "66% of the 15.00 GB budget; 1 such conversation fits" in line


async def test_whatif_names_a_bad_token_count(running_app):
    async with running_app() as (app, pilot):
        app.query_one("#input").load_text("/whatif 70b lots")
        await pilot.press("enter")
        await wait_until(pilot, lambda: any("whole number of tokens" in n.text for n in app.chat_screen.view.query(Notice)))
