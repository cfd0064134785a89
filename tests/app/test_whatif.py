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


def test_whatif_takes_a_number_of_users_after_the_tokens():
    assert parse("/whatif 8b 8192 16") == Command("whatif", ("8b", "8192", "16"))
    assert parse("/whatif 8b 8192 16 40GB") == Command("whatif", ("8b", "8192", "16", "40GB"))


async def test_whatif_16_users_of_8k_on_8b_read_16_gib_of_caches_against_16_gb_of_weights(running_app):
    """The seed's arithmetic, checkable by hand: 2 x 32 layers x 8 KV heads x 128 x 2 B = 128 KiB
    a token; 16 x 8,192 tokens of it = 16 GiB; 8.03 B parameters x 2 B = 16.06 GB of weights;
    and the bundled model in fp32 crosses at 538 MB / 45 KiB = 11,677 tokens (3 users at 4k pass it)."""
    async with running_app() as (app, pilot):
        for text in ("/whatif 8b 8192 16", "/whatif smollm2-135m 4096 3", "/whatif 8b 8192 2 3"):
            app.query_one("#input").load_text(text)
            await pilot.press("enter")
        await wait_until(pilot, lambda: sum("One decode step" in n.text for n in app.chat_screen.view.query(Notice)) == 2
                         and any("one number of users" in n.text for n in app.chat_screen.view.query(Notice)))
        eight, small = [n.text for n in app.chat_screen.view.query(Notice) if "One decode step" in n.text]
        assert "16 x 8,192 x 128 KiB = 16 GiB of caches against 16.06 GB of bf16 weights" in eight
        assert "the caches read more than the weights" in eight
        assert "3 x 4,096 x 22.5 KiB" in small   # bf16, as /whatif sizes every model; fp32 below
        from kvchat.text import what_if_command
        fp32 = what_if_command("smollm2-135m", 4096, kv_dtype="fp32", users=3)
        assert "0.54 GB of fp32 weights" in fp32 and "cross at 11,677 tokens" in fp32
