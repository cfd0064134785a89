"""The chat's tools beside the cache: the draft's token count, copying a reply, the command
palette, the model view, the random-weights label, and settings notes kept out of the
transcript."""
from __future__ import annotations

import base64

from textual.command import CommandPalette

from kvchat.chat.clipboard import last_code_block
from kvchat.widgets import ChatInput, Notice, StatusBar
from kvchat.screens.model_info import ModelInfoScreen

from .conftest import screen_text, send, wait_until
from .fake_backend import FakeBackend, FakeConfig, count_tokens

CODE_REPLY = "Here it is:\n```python\nprint('kv')\n```\nand again\n```sh\necho $CACHE\n```\ndone."


def notices(app) -> list[str]:
    return [n.text for n in app.query(Notice)]


async def test_the_draft_shows_the_tokens_and_bytes_it_will_add(fake, running_app):
    """The draft counts what the message adds to the prompt, the chat template's tokens too
    (issue 26 low: '2 shown, 13 used'), as the turn's stats then count it."""
    async with running_app() as (app, pilot):
        field = app.query_one(ChatInput)
        await pilot.press(*"one two three")
        first = count_tokens([{"role": "user", "content": "one two three"}])           # the whole first prompt
        await wait_until(pilot, lambda: field.border_title.startswith(f"draft: {first} tokens (3 typed + "
                                                                       f"{first - 3} chat template)"), what="the count")
        assert f"{first * fake.bytes_per_token // 1024} KiB of cache" in field.border_title
        await pilot.press("enter")
        await wait_until(pilot, lambda: field.border_title == "", what="the count to clear")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and len(app.chat_screen.session.turns) == 1)
        before = app.chat_screen.session.turns[-1]
        assert before.prompt_tokens == first
        await pilot.press(*"four five")
        await wait_until(pilot, lambda: field.border_title.startswith("draft: "), what="the second count")
        shown = int(field.border_title.split()[1])
        assert field.border_title.startswith(f"draft: {shown} tokens (2 typed + {shown - 2} chat template)")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and len(app.chat_screen.session.turns) == 2)
        after = app.chat_screen.session.turns[-1]
        assert after.prompt_tokens - before.prompt_tokens - before.generated_tokens == shown


async def test_the_draft_count_is_throttled_while_typing(running_app):
    async with running_app() as (app, pilot):
        app.chat_screen.draft.delay = 10.0                        # nothing but the first key may count now
        await pilot.press(*"a b c d e f")
        assert app.chat_screen.draft.counts == 1 and app.chat_screen.draft.timer is not None


async def test_no_count_where_the_backend_cannot_tell(running_app):
    async with running_app(FakeBackend(FakeConfig(counts_tokens=False))) as (app, pilot):
        await pilot.press(*"hello world")
        await pilot.pause(0.3)
        assert app.query_one(ChatInput).border_title == ""


def test_the_last_code_block_is_found_closed_or_not():
    assert last_code_block(CODE_REPLY) == "echo $CACHE"
    assert last_code_block("a\n```py\nx = 1\ny = 2") == "x = 1\ny = 2"      # a stopped reply
    assert last_code_block("no code here") is None


async def test_copy_keys_send_the_reply_and_its_code_block_to_the_clipboard(running_app):
    async with running_app(FakeBackend(FakeConfig(replies=(CODE_REPLY,)))) as (app, pilot):
        written: list[str] = []
        write = app._driver.write
        app._driver.write = lambda data: (written.append(data), write(data))
        await send(pilot, "show me code")
        reply = app.chat_screen.session.turns[-1].reply
        await pilot.press("ctrl+y")
        assert app.clipboard == reply
        assert f"\x1b]52;c;{base64.b64encode(reply.encode()).decode()}\a" in written    # the OSC 52 request
        await pilot.press("ctrl+g")
        assert app.clipboard == "echo $CACHE"
        assert f"\x1b]52;c;{base64.b64encode(b'echo $CACHE').decode()}\a" in written
        assert "copied the last code block" in app.query_one(StatusBar).note


async def test_copy_with_no_reply_says_so(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("ctrl+y")
        assert "nothing to copy" in notices(app)[-1] and app.clipboard == ""


async def test_the_palette_lists_keys_and_commands_and_runs_one(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette), what="the palette")
        await pilot.press(*"reset")
        await pilot.pause(0.5)
        text = screen_text(app)
        assert "reset  [^r]" in text and "/reset" in text
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, CommandPalette), what="the palette to close")


async def test_the_palette_shows_each_entrys_key_and_the_usages_brackets_on_screen(running_app):
    """Issue 26 low: the palette lacked the F-key hints. Its strings went to Textual as markup,
    where "[f5]" is a tag: the F-keys vanished (a "[^r]" stayed), and so did "/edit [N]"'s and
    "/crowd N [long]"'s optional parts. Checked on the rendered palette, listed and searched."""
    async with running_app(size=(120, 70)) as (app, pilot):
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette), what="the palette")
        await pilot.pause(0.5)
        text = screen_text(app)
        for entry in ("help  [f1]", "policy  [f2]", "cap -  [f3]", "regen  [f5]", "panels  [f6]", "cache  [f7]",
                      "kv  [f8]", "close  [f9]", "reset  [^r]", "/crowd N [long] for more"):
            assert entry in text, entry
        await pilot.press(*"regen")
        await pilot.pause(0.5)
        text = screen_text(app)
        assert "regen  [f5]" in text and "/regen  [f5]" in text     # the command a key runs shows the key too
        for _ in "regen":
            await pilot.press("backspace")
        await pilot.press(*"edit")
        await pilot.pause(0.5)
        assert "/edit [N] | off  [alt+e]" in screen_text(app)
        await pilot.press("escape")


async def test_the_palette_lists_every_key_and_command(running_app):
    from kvchat.commands import COMMANDS
    from kvchat.keys import KEYS
    from kvchat.app.palette import entries
    async with running_app() as (app, pilot):
        shown = [name for name, _, _ in entries(app)]
        assert all(any(name.startswith(k.label + "  [") for name in shown) for k in KEYS if k.id != "palette")
        assert all(any(name.startswith(spec.usage) for name in shown) for spec in COMMANDS.values())
        assert "cache  [f7]" in shown and "panels  [f6]" in shown


async def test_a_palette_command_that_needs_an_argument_is_typed_into_the_input(running_app):
    from kvchat.app.palette import run_command
    async with running_app() as (app, pilot):
        run_command(app, "cap")
        assert app.query_one(ChatInput).text == "/cap "
        run_command(app, "list")
        await pilot.pause()
        assert "● 1 new" in notices(app)[-1]


async def test_the_model_view_shows_geometry_pool_and_the_cost_at_full_context(running_app):
    async with running_app() as (app, pilot):
        app.query_one(ChatInput).load_text("/model")
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ModelInfoScreen), what="the model view")
        await pilot.pause()
        text = screen_text(app)
        for part in ("30 layers", "3 KV heads of 64", "46,080 B", "64 blocks of 16 tokens",
                     "8,192 tokens (the model's maximum)", "360 MiB", "weights fp32 · KV cache fp32"):
            assert part in text, part
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, ModelInfoScreen), what="it to close")


async def test_random_weights_are_labelled_in_the_status_line_and_the_transcript(running_app):
    async with running_app() as (app, pilot):
        assert "gibberish by design" in app.query_one(StatusBar).warning
        assert any("gibberish by design" in n for n in notices(app))
        assert "gibberish by design" in screen_text(app).splitlines()[0]


async def test_real_weights_are_not_labelled(running_app):
    async with running_app(FakeBackend(FakeConfig(random_weights=False))) as (app, pilot):
        assert app.query_one(StatusBar).warning == ""
        assert not any("gibberish" in n for n in notices(app))


async def test_cap_policy_and_theme_changes_go_to_the_status_line_not_the_transcript(running_app):
    async with running_app() as (app, pilot):
        before = notices(app)
        await pilot.press("f3")
        assert app.query_one(StatusBar).note == "cap 4,096 tokens"
        app.query_one(ChatInput).load_text("/policy drop-oldest")
        await pilot.press("enter")
        await pilot.pause()
        assert app.query_one(StatusBar).note.startswith("policy drop-oldest")
        await pilot.press("ctrl+t")
        assert app.query_one(StatusBar).note == "theme light"
        assert notices(app) == before
        assert app.chat_screen.panels.notes[-3:] == ["cap 4,096 tokens", app.chat_screen.panels.notes[-2], "theme light"]


async def test_ctrl_n_says_the_new_conversation_inherits_the_cap_policy_and_system_prompt_and_shares_sampling(running_app):
    async with running_app(cap=2048, policy="drop-oldest") as (app, pilot):
        old = app.chat_screen.view
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat_screen.view is not old and app.chat_screen.jobs.busy is None, what="the new conversation")
        note = app.query_one(StatusBar).note
        assert "inherits cap 2,048, policy drop-oldest and no system prompt" in note
        assert note.endswith("; sampling (greedy) is shared by every conversation")
