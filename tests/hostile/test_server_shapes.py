"""A server's answers of the wrong shape end in one line that names the field, with exit 2,
never in "internal error" (issue 27, medium), and sizes a server claims are bounded before
anything is allocated from them (high 4). The KV-event thread survives malformed events."""
from __future__ import annotations

import json
import resource
import time

import msgspec
import pytest
import zmq

from kvchat.backends.kv_events import KvEventStore, KvEventSubscriber

from .conftest import cli, one_line
from .fake_vllm import METRICS, fake_vllm, models, reply, token

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("entry, field", [
    ({"id": 42}, "id"),
    ({"id": ""}, "id"),
    ({"id": "x" * 100_000}, "id"),
    ({"id": "m", "max_model_len": "8192"}, "max_model_len"),
    ({"id": "m", "max_model_len": 1e999}, "max_model_len"),
    ({"id": "m", "max_model_len": -1}, "max_model_len"),
    ({"id": "m", "max_model_len": 2**80}, "max_model_len"),
], ids=["id-int", "id-empty", "id-huge", "len-string", "len-inf", "len-negative", "len-huge"])
def test_a_malformed_models_list_names_the_field(capsys, entry, field):
    body = json.dumps({"data": [entry]}).replace("Infinity", "1e999")
    with fake_vllm({"/v1/models": (200, body)}) as s:
        code, out, err = cli(capsys, ["info", "--server", s.url])
    one_line(code, err, "/v1/models", field)


@pytest.mark.parametrize("metrics, field", [
    ("# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total 1e999\n", "vllm:num_preemptions"),
    ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running NaN\n", "vllm:num_requests_running"),
    ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting -3\n", "vllm:num_requests_waiting"),
    ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 7e9\n", "vllm:kv_cache_usage_perc"),
    ('# TYPE vllm:time_to_first_token_seconds histogram\nvllm:time_to_first_token_seconds_bucket{x="1"} 3\n'
     'vllm:time_to_first_token_seconds_count 3\nvllm:time_to_first_token_seconds_sum 1\n', "le label"),
    ('# TYPE vllm:time_to_first_token_seconds histogram\nvllm:time_to_first_token_seconds_bucket{le="soon"} 3\n'
     'vllm:time_to_first_token_seconds_count 3\nvllm:time_to_first_token_seconds_sum 1\n', "le label"),
    ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",num_gpu_blocks="inf"} 1\n',
     "num_gpu_blocks"),
    ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",num_gpu_blocks="1e9"} 1\n',
     "num_gpu_blocks"),
    ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="-16",num_gpu_blocks="10"} 1\n',
     "block_size"),
], ids=["counter-inf", "gauge-nan", "gauge-negative", "usage-huge", "bucket-no-le", "bucket-bad-le",
        "blocks-inf", "blocks-1e9", "block-size-negative"])
def test_malformed_metrics_name_the_figure(capsys, metrics, field):
    with fake_vllm({"/metrics": (200, metrics)}) as s:
        code, out, err = cli(capsys, ["info", "--server", s.url, "--geometry", "smollm2-135m"])
    one_line(code, err, field)


def test_metrics_that_are_not_utf8_are_one_line(capsys):
    with fake_vllm({"/metrics": (200, METRICS.encode() + b"# \xff\xfe\n")}) as s:
        code, out, err = cli(capsys, ["info", "--server", s.url])
    one_line(code, err, "not UTF-8")


def test_a_billion_block_pool_is_refused_before_any_map_is_built(capsys):
    metrics = METRICS.replace('num_gpu_blocks="100"', 'num_gpu_blocks="1000000000"')
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with fake_vllm({"/metrics": (200, metrics)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
    one_line(code, err, "num_gpu_blocks")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024     # KiB: under 200 MB


@pytest.mark.parametrize("event, field", [
    ({"choices": {"0": 1}}, "choices"),
    ({"choices": ["x"]}, "choices[0]"),
    ({"choices": [{"delta": "text"}]}, "delta"),
    ({"choices": [{"delta": {"content": 42}}]}, "delta.content"),
    ({"choices": [{"delta": {"content": "a"}, "token_ids": ["1"]}]}, "token_ids[0]"),
    ({"choices": [{"delta": {"content": "a"}, "token_ids": 5}]}, "token_ids"),
    ({"choices": [{"delta": {"content": "a"}, "finish_reason": {"why": 1}}]}, "finish_reason"),
    ({"choices": [], "usage": {"prompt_tokens": 1e999}}, "usage.prompt_tokens"),
    ({"choices": [], "usage": {"prompt_tokens": float("nan")}}, "usage.prompt_tokens"),
    ({"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": "all"}}},
     "cached_tokens"),
    ({"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 9}}}, "cached"),
    ({"choices": [], "usage": "lots"}, "usage"),
    ({"prompt_token_ids": "1,2,3", "choices": []}, "prompt_token_ids"),
    ([1, 2, 3], "not an object"),
    ("[[[[" * 100_000, "not JSON"),
], ids=["choices-dict", "choice-str", "delta-str", "content-int", "token-id-str", "token-ids-int", "finish-dict",
        "usage-inf", "usage-nan", "cached-str", "cached-over", "usage-str", "prompt-ids-str", "event-list",
        "event-deep"])
def test_a_malformed_stream_event_names_the_field(capsys, event, field):
    data = event if isinstance(event, str) else json.dumps(event).replace("Infinity", "1e999")

    def answer(h):
        h.start_stream()
        h.event(token("ok", 3))
        h.write(f"data: {data}\n\n")
        h.write("data: [DONE]\n\n")
    with fake_vllm({"/v1/chat/completions": answer}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
    one_line(code, err, field)


def test_a_malformed_token_count_names_the_field(capsys, tmp_path):
    f = tmp_path / "chat.json"
    f.write_text(json.dumps(["one", "two"]))
    with fake_vllm({"/tokenize": (200, {"count": "many"})}) as s:
        code, out, err = cli(capsys, ["replay", "--server", s.url, "--cap", "100", "--policy", "drop-oldest", str(f)])
    one_line(code, err, "/tokenize", "count")


def test_deeply_nested_server_info_is_one_line(capsys):
    with fake_vllm({"/server_info": (200, "[" * 100_000 + "]" * 100_000)}) as s:
        code, out, err = cli(capsys, ["info", "--server", s.url])
    one_line(code, err, "/server_info")


def test_a_reply_without_cached_tokens_is_complete_and_says_reused_is_unknown(capsys):
    events = [token("a", 1), token("b", 2, "stop"),
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}}]
    with fake_vllm({"/v1/chat/completions": lambda h: h.stream(events)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi", "--json"])
    record = json.loads(out)
    assert code == 0 and record["reused_tokens"] is None and "reused_tokens" in record["unavailable"]


# ---- the KV-event stream ---------------------------------------------------------------------------
def frames(seq: int, events) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events, None])]


def stored(hashes, tokens, block_size=4, parent=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size}


BAD_EVENTS = {
    "block-size-str": stored([1], [1, 2, 3, 4], block_size="4"),
    "block-size-huge": stored([1], [1, 2, 3, 4], block_size=2**40),
    "tokens-int": stored([1], 5),
    "tokens-short": stored([1, 2], [1, 2, 3, 4]),
    "hash-nested": stored([[[1]]], [1, 2, 3, 4]),
    "hash-dict": stored([{"a": 1}], [1, 2, 3, 4]),
    "hashes-int": {"type": "BlockRemoved", "block_hashes": 7},
    "type-unknown": {"type": "Surprise"},
    "not-a-map": 12,
}


@pytest.mark.parametrize("name", sorted(BAD_EVENTS))
def test_a_malformed_kv_event_is_counted_and_the_next_is_applied(name):
    store = KvEventStore()
    store.apply_message(frames(0, [BAD_EVENTS[name]]))
    store.apply_message(frames(1, [stored([11], [1, 2, 3, 4])]))
    s = store.summary()
    assert s.undecodable == 1 and s.last_problem and store.chain([1, 2, 3, 4], 4) == 1


def test_the_kv_event_thread_keeps_listening_after_malformed_events():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 10
        seq = 0
        while not store_has(sub.store) and time.monotonic() < deadline:   # until the subscription is live
            for bad in BAD_EVENTS.values():
                pub.send_multipart(frames(seq, [bad]))
                seq += 1
            pub.send_multipart([b"", b"x", b"\xc1"])                      # not even msgpack
            pub.send_multipart(frames(seq, [stored([seq + 100], [1, 2, 3, 4])]))
            seq += 1
            time.sleep(0.05)
        assert store_has(sub.store) and sub._thread.is_alive()
        assert sub.store.summary().undecodable >= len(BAD_EVENTS)
    finally:
        sub.stop()
        pub.close()
        ctx.term()


def store_has(store: KvEventStore) -> bool:
    return store.chain([1, 2, 3, 4], 4) == 1


def test_reply_then_cut_is_marked_in_the_log_record_too(capsys):
    events = reply("only", " part")[:-1]                # the last token's finish and the usage never come
    events[-1]["choices"][0]["finish_reason"] = None
    with fake_vllm({"/v1/chat/completions": lambda h: h.stream(events, done=False)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi", "--json"])
    assert code == 2 and json.loads(out)["stop_reason"] == "cut" and json.loads(out)["reply"] == "only part"
