"""Server mode counts the conversation's real tokens and stops a reply at the cap (issue 26,
high 4). The server here is fake_vllm with a tokenizer of its own (a token a word, plus a
few for the chat template) and a reply that honours the max_tokens it is sent, as vLLM
does; block size 16, so a context that is not a whole number of blocks shows whether the
figures count full blocks only."""
from __future__ import annotations

import pytest
from rich.console import Console

from kvchat.backends.vllm import VllmBackend
from kvchat.engine import SamplingParams, TurnStats
from kvchat.engine.geometry import KNOWN
from kvchat.text import stats_line
from kvchat.widgets.cache_panel import CachePanel

from .fake_vllm import METRICS, fake_vllm, token

pytestmark = pytest.mark.timeout(30)
REPLY = 40            # the tokens the server would reply with, unless max_tokens stops it first


def count(messages: list[dict]) -> int:
    """The stand-in's chat template: 3 tokens a message, a token a word, 2 for the generation prompt."""
    return sum(3 + len(m["content"].split()) for m in messages) + 2


def tokenize(h) -> None:
    h.send_body(200, {"count": count(h.body["messages"]), "max_model_len": 8192})


def chat(h) -> None:
    """vLLM's stream: the prompt's ids, a token a chunk up to max_tokens, then the usage."""
    n, limit = count(h.body["messages"]), h.body["max_tokens"]
    k = min(REPLY, limit)
    events: list[dict] = [{"prompt_token_ids": list(range(n)), "choices": []}]
    events += [token(" w", 500 + i, ("length" if k < REPLY else "stop") if i == k - 1 else None) for i in range(k)]
    events.append({"choices": [], "usage": {"prompt_tokens": n, "completion_tokens": k,
                                            "prompt_tokens_details": {"cached_tokens": 0}}})
    h.stream(events)


def last_request(server) -> dict:
    return [body for method, path, _, body in server.seen if path == "/v1/chat/completions"][-1]


def turn(conversation, text: str) -> TurnStats:
    return [e for e in conversation.send(text, SamplingParams(max_tokens=200)) if isinstance(e, TurnStats)][-1]


def test_the_cache_figures_count_the_conversations_tokens_not_only_full_blocks():
    with fake_vllm({"/tokenize": tokenize, "/v1/chat/completions": chat}) as s:
        backend = VllmBackend(s.url, geometry="smollm2-135m", kv_dtype="bf16")
        try:
            c = backend.open(cap=4096, policy="drop-oldest")
            stats = turn(c, "what does a KV cache hold")
            context = count([{"role": "user", "content": "what does a KV cache hold"}]) + REPLY    # 51 tokens
            assert context % 16 and stats.prompt_tokens + stats.generated_tokens == context
            snap = backend.snapshot(c)
            bpt = KNOWN["smollm2-135m"].kv_bytes_per_token("bf16")
            assert c.state().tokens_held == snap.tokens_held == context             # not 48, nor 0 (unknown)
            assert snap.bytes_used == context * bpt
            assert snap.blocks_used == 4 and snap.bytes_allocated == 4 * 16 * bpt  # the last one partly filled
            assert "tokens_held" not in snap.unavailable and "bytes_used" not in snap.unavailable
        finally:
            backend.shutdown()


def test_a_reply_stops_at_the_cap_as_in_local_mode_and_the_stats_say_so():
    with fake_vllm({"/tokenize": tokenize, "/v1/chat/completions": chat}) as s:
        backend = VllmBackend(s.url, geometry="smollm2-135m", kv_dtype="bf16")
        try:
            c = backend.open(cap=100, policy="drop-oldest")
            first = turn(c, "what does a KV cache hold")          # 11 tokens, then 40 of the 89 asked for
            assert last_request(s)["max_tokens"] == 100 - 11 and first.stop_reason == "eos"
            second = turn(c, "and what does it cost per token")  # 51 + 3 + 7 + 2 = 63 of 100: 37 left
            sent = last_request(s)
            prompt = count(sent["messages"])
            assert sent["max_tokens"] == 100 - prompt < REPLY       # the request asks only for what fits
            assert second.prompt_tokens + second.generated_tokens == 100 == c.state().tokens_held
            assert second.stop_reason == "cap" and "stopped at the cap" in stats_line(second)
        finally:
            backend.shutdown()


@pytest.mark.parametrize("exported", [False, True], ids=["no-counter", "counter"])
def test_the_cache_panel_says_what_a_servers_preempted_figure_counts_and_n_a_without_one(exported):
    """Issue 26: the panel said "preempted 0 conversations" where the turn record says
    unavailable; a server counts requests, every client's, when its /metrics has the counter."""
    metrics = METRICS + ("vllm:num_preemptions_total{engine=\"0\",model_name=\"smollm2-135m\"} 3.0\n"
                         if exported else "")
    with fake_vllm({"/tokenize": tokenize, "/v1/chat/completions": chat, "/metrics": (200, metrics)}) as s:
        backend = VllmBackend(s.url, geometry="smollm2-135m", kv_dtype="bf16")
        try:
            c = backend.open()
            turn(c, "hello there")
            console = Console(width=100, record=True)
            console.print(CachePanel().render_snapshot(backend.snapshot(c)))
            text = console.export_text()
        finally:
            backend.shutdown()
    row = next(line for line in text.splitlines() if line.startswith("preempted"))
    if exported:
        assert row.split()[1] == "3" and "requests, server-wide" in row and "per turn: n/a" in row
    else:
        assert row.split()[1] == "n/a"
    assert next(line for line in text.splitlines() if line.startswith("reclaimed")).split()[1] == "n/a"


def test_while_a_reply_streams_the_block_map_counts_its_prompt_blocks_as_this_conversations():
    """Issue 26 low: in server mode the running conversation's blocks showed as "cached" (other
    prefixes') until the reply ended. The KV events here are fed to the backend's store as the
    server would publish them once it has computed the prompt's blocks."""
    import msgspec

    from kvchat.backends.kv_events import KvEventStore
    from kvchat.engine.telemetry import CACHED, HELD, TokenEvent

    def slow(h):
        n = count(h.body["messages"])
        h.stream([{"prompt_token_ids": list(range(n)), "choices": []},
                  *[token(" w", 500 + i, "stop" if i == 5 else None) for i in range(6)]], delay=0.05)

    with fake_vllm({"/tokenize": tokenize, "/v1/chat/completions": slow}) as s:
        backend = VllmBackend(s.url, geometry="smollm2-135m", kv_dtype="bf16")
        store = KvEventStore()
        # a subscriber's stand-in, the store fed by hand (no replay endpoint)
        backend.events = type("Events", (), {"store": store, "stop": lambda self: None,
                                             "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": None})()
        try:
            c = backend.open()
            text = " ".join(f"word{i}" for i in range(40))     # 45 prompt tokens: 2 full blocks of 16
            n = count([{"role": "user", "content": text}])
            ids = list(range(n))
            store.apply_message([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [
                {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                 "token_ids": ids[:32], "block_size": 16}], None])])
            turn_events = c.send(text, SamplingParams(max_tokens=20))
            next(e for e in turn_events if isinstance(e, TokenEvent))
            live = backend.snapshot(c).block_map
            list(turn_events)
        finally:
            backend.shutdown()
    assert live.count(HELD) == 2 and live.count(CACHED) == 0


def test_a_prefix_cache_reset_leaves_every_conversation_holding_nothing_until_its_next_turn():
    """POST /reset_prefix_cache frees every conversation's blocks on the server: the panel's
    tokens and the state's held tokens read 0 for each (the real server's test saw the panel
    keep the conversation's count after ctrl+r), and the next turn counts again."""
    routes = {"/tokenize": tokenize, "/v1/chat/completions": chat,
              "/server_info": lambda h: h.send_body(200, {"vllm_config": "dtype=torch.bfloat16"}),
              "/reset_prefix_cache": lambda h: h.send_body(200, {})}
    with fake_vllm(routes) as s:
        backend = VllmBackend(s.url, geometry="smollm2-135m", kv_dtype="bf16")
        try:
            a, b = backend.open(), backend.open()
            turn(a, "what does a KV cache hold")
            turn(b, "and what does it cost")
            assert backend.snapshot(a).tokens_held > 0 and b.state().tokens_held > 0
            a.reset_cache()
            for c in (a, b):
                snap = backend.snapshot(c)
                assert snap.tokens_held == c.state().tokens_held == 0 and snap.blocks_used == 0
            again = turn(a, "once more")
            assert backend.snapshot(a).tokens_held == again.prompt_tokens + again.generated_tokens > 0
            assert b.state().tokens_held == 0
        finally:
            backend.shutdown()
