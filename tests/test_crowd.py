"""The crowd on the real engine (the bundled model, few tokens): simulated users share the
scheduler's steps with the user's own conversation, their histories grow, the user's own
reply is the one it gets alone, and stopping them frees their conversations at once."""
from __future__ import annotations

import time

import pytest

from kvchat.backends.local import LocalBackend
from kvchat.crowd.driver import Crowd, CrowdConfig, message
from kvchat.engine import SamplingParams, TurnStats
from kvchat.engine.errors import KvchatError


def reply(chat, text: str) -> str:
    stats = [ev for ev in chat.send(text, SamplingParams(max_tokens=6)) if isinstance(ev, TurnStats)]
    return stats[-1].reply


def test_three_users_share_the_steps_beside_the_users_own_conversation(engine):
    backend = LocalBackend(engine)
    own = backend.open()
    alone = reply(own, "Name a colour.")
    own.truncate(0)
    first_step = engine.scheduler_snapshot().steps
    crowd = Crowd(backend, CrowdConfig(users=3, think_s=0.05, reply_tokens=4))
    crowd.start()
    try:
        together = reply(own, "Name a colour.")
        deadline = time.monotonic() + 120
        while min(u.turns for u in crowd.users) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ids = set(crowd.owners())
        views = {v.conversation: v for v in backend.scheduler().conversations}
        assert ids <= set(views) and own.state().conversation not in ids and len(ids) == 3
    finally:
        assert crowd.stop(wait_s=1.0), "a crowd user was still inside a turn a second after stop"
    assert together == alone        # greedy: the user's own reply is the one it got alone
    turns = crowd.turns()
    assert all(t.error is None for t in turns), [t.error for t in turns if t.error]
    for u in crowd.users:
        mine = [t for t in turns if t.user == u.index]
        assert len(mine) >= 2 and u.state == "left"
        # the history grows: the second prompt holds the first turn, its reply and a new question
        assert mine[1].prompt_tokens > mine[0].context_tokens
        assert mine[1].reused_tokens > 0                      # the first turn's blocks were reused
        assert all(t.ttft_ms is not None and t.ttft_ms > 0 for t in mine)
    steps = [s for s in engine.steps() if s.index >= first_step]
    assert max(s.sequences for s in steps) >= 2                # some steps carried several users at once
    left = {v.conversation for v in backend.scheduler().conversations}
    assert not ids & left                                      # their conversations are closed
    backend.close(own)


def test_the_long_user_pastes_a_report_and_adds_to_it_every_turn():
    first, second = message(0, 0, True, 300), message(0, 1, True, 300)
    assert len(first.split()) >= 300 and "Section 1.1." in first
    assert "Section 2.1." in second and second not in first
    assert message(1, 0, False, 300) != message(2, 0, False, 300)   # users start at their own question


@pytest.mark.parametrize("kw", [dict(users=0), dict(users=65), dict(users=2, think_s=-1.0),
                                dict(users=2, think_s=float("nan")), dict(users=2, reply_tokens=0)])
def test_a_bad_crowd_is_refused_in_one_line(kw):
    with pytest.raises(KvchatError) as err:
        CrowdConfig(**kw)
    assert "\n" not in str(err.value)


def test_the_seed_scenario_one_long_user_in_a_small_pool_preempts_the_others():
    """The texts' scenario at the bundled model's scale: a 24 MiB pool holds 544 tokens (34
    blocks of 16 at 45 KiB a token, fp32); the long user pastes about 300 tokens and adds
    more every turn, the three others chat beside it, and the pool runs out: the scheduler
    preempts and recomputes, and the long user holds most of the pool at some moment."""
    from kvchat.crowd.report import run_crowd
    from kvchat.engine import Engine, EngineConfig
    backend = LocalBackend(Engine(EngineConfig(kv_dtype="fp32", kv_budget="24MiB")))
    blocks = backend.snapshot().num_blocks
    shares: list[float] = []
    assert backend.scheduler().preemptions == 0

    def sample(_turn) -> None:
        views = backend.scheduler().conversations
        shares.extend(v.blocks_held / blocks for v in views)
    run = run_crowd(backend, CrowdConfig(users=4, long=True, think_s=0.05, reply_tokens=4, long_words=230), 12.0,
                    on_turn=sample)
    assert run.stopped_in_time
    assert run.preemptions and run.preemptions > 0 and run.recomputed_tokens and run.recomputed_tokens > 0
    long_turns = [t for t in run.turns if t.long and t.error is None]
    assert long_turns and max(t.context_tokens for t in long_turns) > blocks * 16 // 2
    assert max(shares) >= 0.5, max(shares)
    others = [t for t in run.turns if not t.long and t.error is None]
    assert len({t.user for t in others}) == 3     # the others kept getting their turns


def test_the_users_own_cost_reads_its_turns_steps():
    """The crowd panel's line on the user's own curve: mean ms/token, mean cached tokens its
    steps read over every sequence, and its own mean context, from its turn record."""
    from kvchat.crowd.figures import own_cost
    from kvchat.engine.telemetry import TurnSummary
    rec = TurnSummary(decode_ms=(10.0, 14.0), positions=(100, 101), step_sequences=(3, 4), step_tokens=(900, 1300))
    assert own_cost(rec) == (12.0, 1100.0, 100.5)
    assert own_cost(rec.to_dict()) == (12.0, 1100.0, 100.5)       # a restored record reads the same
    assert own_cost(TurnSummary()) is None and own_cost(None) is None


def test_an_idle_conversation_whose_cache_was_freed_still_shows_its_tokens(engine):
    """An idle conversation whose blocks were taken (here by a reset; in a full pool by another
    user's turn) holds no token: the crowd panel's ctx is still the conversation's last prompt
    and reply, and its pool share 0 says it holds nothing."""
    from kvchat.crowd.figures import Meter
    backend = LocalBackend(engine)
    own = backend.open()
    stats = [ev for ev in own.send("Name a colour.", SamplingParams(max_tokens=6)) if isinstance(ev, TurnStats)][-1]
    tokens = stats.prompt_tokens + stats.generated_tokens
    me = own.state().conversation

    def row_and_view():
        sched = backend.scheduler()
        view = next(v for v in sched.conversations if v.conversation == me)
        return Meter().figures([], sched, backend.snapshot(own), me).rows[0], view
    row, view = row_and_view()
    assert row.own and view.state == "idle" and 0 < view.context_tokens <= tokens == row.context_tokens
    assert row.blocks_held > 0
    own.reset_cache()
    row, view = row_and_view()
    assert view.context_tokens == 0 and row.context_tokens == tokens          # what it holds; what it is
    assert row.blocks_held == 0 and row.pool_share == 0
    backend.close(own)
