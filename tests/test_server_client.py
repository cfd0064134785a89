"""The vLLM client's edges, without vLLM: bad URLs, nothing listening, an HTTP server that is
not vLLM, malformed /metrics, an API key, and the KV-event stream's bookkeeping. The servers
here are the standard library's http.server on loopback: real HTTP, real sockets. Talking to
a real vLLM server is tests/server/."""
from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from cli_helpers import fails_with, refusing_port
from kvchat.backends import metrics
from kvchat.backends.kv_events import KvEventStore, KvEventSubscriber

MODELS = {"object": "list", "data": [{"id": "smollm2-135m", "object": "model", "owned_by": "vllm",
                                      "max_model_len": 8192}]}
VLLM_METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2-135m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="0",num_gpu_blocks="100"} 1.0
"""


@contextmanager
def http_server(routes: dict[str, tuple[int, str]], seen: list | None = None):
    """A loopback HTTP server answering GET/POST path -> (status, body)."""
    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            if seen is not None:
                seen.append((self.path, self.headers.get("Authorization")))
            status, body = routes.get(self.path.split("?")[0], (404, "not found"))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url, fragment", [
    ("ftp://127.0.0.1:8000", "expected an http:// or https:// base URL"),
    ("127.0.0.1:8000", "expected an http:// or https:// base URL"),
    ("http://127.0.0.1:99999", "port is not a number"),
    ("http://127.0.0.1:8000/v1?key=x", "without ?query"),
])
def test_a_bad_server_url_is_one_line(capsys, url, fragment):
    fails_with(capsys, ["ask", "--server", url, "hi"], fragment)


def test_a_port_with_nothing_listening_is_one_line(capsys):
    port = free_port()
    fails_with(capsys, ["info", "--server", f"http://127.0.0.1:{port}"], "nothing answers", str(port))


def test_an_http_server_that_is_not_vllm_is_one_line(capsys):
    with http_server({"/": (200, "<html>hello</html>")}) as url:
        fails_with(capsys, ["ask", "--server", url, "hi"], "not an OpenAI-compatible server")


def test_malformed_metrics_are_one_line(capsys):
    routes = {"/v1/models": (200, json.dumps(MODELS)), "/metrics": (200, "vllm:kv_cache_usage_perc{ 0.5 oops\n")}
    with http_server(routes) as url:
        fails_with(capsys, ["info", "--server", url], "not Prometheus text")


def test_metrics_without_vllm_names_are_one_line(capsys):
    routes = {"/v1/models": (200, json.dumps(MODELS)), "/metrics": (200, "# TYPE up gauge\nup 1\n")}
    with http_server(routes) as url:
        fails_with(capsys, ["info", "--server", url], "no vllm: metrics")


def test_the_api_key_is_sent_but_never_printed(capsys, monkeypatch):
    key = "sk-test-do-not-print-123"
    seen: list = []
    routes = {"/v1/models": (401, json.dumps({"error": {"message": "bad key"}}))}
    with http_server(routes, seen) as url:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        monkeypatch.delenv("KVCHAT_API_KEY", raising=False)
        fails_with(capsys, ["info", "--server", url], "KVCHAT_API_KEY")
        monkeypatch.setenv("KVCHAT_API_KEY", key)
        line = fails_with(capsys, ["info", "--server", url], "refused")
    assert key not in line
    assert seen[-1] == ("/v1/models", f"Bearer {key}") and seen[0][1] is None


def test_a_server_with_fp8_cache_and_unknown_model_names_its_unknown_geometry(capsys):
    models = {"data": [{"id": "my-org/mystery-7b", "max_model_len": 4096}]}
    routes = {"/v1/models": (200, json.dumps(models)), "/metrics": (200, VLLM_METRICS)}
    with http_server(routes) as url:
        assert __import__("kvchat.cli.command").cli.command.main(["info", "--server", url, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["kv_bytes_per_token"] is None and "kv_bytes_per_token" in info["unavailable"]
        assert "--geometry" in info["geometry_source"]
        assert info["kv_dtype"] == "fp8" and info["num_blocks"] == 100 and info["block_size"] == 16
        # --geometry supplies it: Llama 3.1 8B in fp8 is 2 x 32 x 8 x 128 x 1 B
        assert __import__("kvchat.cli.command").cli.command.main(["info", "--server", url, "--geometry", "llama-3.1-8b",
                                                  "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["kv_bytes_per_token"] == 65536 and info["kv_capacity_bytes"] == 100 * 16 * 65536
        fails_with(capsys, ["info", "--server", url, "--geometry", "gpt-9"], "--geometry", "llama-3.1-8b")


def test_server_flags_without_a_server_or_with_local_settings_are_one_line(capsys):
    fails_with(capsys, ["ask", "--kv-events", "tcp://127.0.0.1:5557", "hi"], "--kv-events needs --server")
    fails_with(capsys, ["ask", "--server", "http://127.0.0.1:1", "--kv-budget", "1GiB", "hi"], "--kv-budget")


def test_a_malformed_kv_events_endpoint_is_one_line(capsys):
    routes = {"/v1/models": (200, json.dumps(MODELS)), "/metrics": (200, VLLM_METRICS)}
    with http_server(routes) as url:
        fails_with(capsys, ["info", "--server", url, "--kv-events", "tcp://*:5557"], "tcp://HOST:PORT")
        fails_with(capsys, ["info", "--server", url, "--kv-events", "http://x:1"], "tcp://HOST:PORT")


# ---- the parsers, on the formats vLLM sends ---------------------------------------------------
def test_old_metric_names_are_read_where_the_new_ones_are_absent():
    text = ('# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
            '# TYPE vllm:gpu_prefix_cache_queries_total counter\nvllm:gpu_prefix_cache_queries_total{model_name="m"} 10\n'
            '# TYPE vllm:gpu_prefix_cache_hits counter\nvllm:gpu_prefix_cache_hits_total{model_name="m"} 4\n')
    m = metrics.parse(text, "m")
    assert (m.usage, m.prefix_queries, m.prefix_hits, m.hit_rate) == (0.5, 10, 4, 0.4)
    assert m.preemptions is None and m.inter_token is None and m.cache.num_blocks is None


def frames(seq: int, events: list) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events, None])]


def stored(hashes, parent, tokens, block_size=4):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size}


def test_the_kv_event_store_follows_a_conversations_hash_chain():
    store = KvEventStore()
    conv = list(range(10))                 # two full blocks of 4, and a partial one
    store.apply_message(frames(0, [stored([11, 12], None, conv[:8])]))
    store.apply_message(frames(1, [stored([21], None, [9, 9, 9, 9])]))
    assert store.chain(conv, 4) == 2 and store.summary().blocks == 3
    # the same tokens under another parent are another block: no match past the first
    assert store.chain([0, 1, 2, 3, 9, 9, 9, 9], 4) == 1
    store.apply_message(frames(2, [{"type": "BlockRemoved", "block_hashes": [12]}]))
    assert store.chain(conv, 4) == 1
    store.apply_message(frames(3, [{"type": "AllBlocksCleared"}]))
    assert store.chain(conv, 4) == 0 and store.summary().cleared == 1


def test_the_kv_event_store_reads_tagged_arrays_and_counts_gaps_and_garbage():
    store = KvEventStore()
    store.apply_message(frames(5, [["BlockStored", [b"h1"], None, [1, 2], 2, None, None]]))
    store.apply_message(frames(9, [["BlockRemoved", [b"h1"], None]]))
    store.apply_message([b"", b"short", b"x"])
    s = store.summary()
    assert (s.first_seq, s.last_seq, s.gaps, s.undecodable, s.blocks) == (5, 9, 3, 1, 0)


def test_a_subscriber_that_has_joined_gets_the_very_next_message_and_sees_the_publisher_go():
    """A ZMQ publisher drops what it sends before a subscription reaches it, and vLLM sends a
    turn's blocks in one message: a real PUB socket here publishes once, the moment the
    subscriber says it has joined."""
    import zmq
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        assert sub.wait_joined(10)
        pub.send_multipart(frames(0, [stored([11], None, [1, 2, 3, 4])]))
        assert sub.store.wait(lambda s: s.batches == 1, 10), sub.store.summary()
        assert sub.store.chain([1, 2, 3, 4], 4) == 1
        pub.close(linger=0)
        assert sub.store.wait(lambda s: not s.connected, 10)
        assert sub.store.summary().connections == 1
    finally:
        sub.stop()
        ctx.term()


class Publisher:
    """vLLM's KV-event publisher as seen on the wire (vllm/distributed/kv_events.py, 0.32): a PUB
    socket for live batches and a ROUTER that answers `[b"", start]` with every buffered batch
    from `start` on, then an end marker. Written here from that protocol, so the subscriber's
    replay is tested without vLLM (tests/server/ runs it against the real server)."""

    def __init__(self):
        import zmq
        self.zmq, self.ctx = zmq, zmq.Context()
        self.pub, self.router = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.asked: list[int] = []
        self.lock, self.done = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, seq: int, events: list, live: bool = True) -> None:
        payload = msgspec.msgpack.encode([1.0, events, None])
        with self.lock:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def _serve(self):
        while not self.done.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            self.asked.append(int.from_bytes(start, "big"))
            with self.lock:
                kept = [(seq, p) for seq, p in self.buffer if seq >= self.asked[-1]]
            for seq, payload in kept:
                self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self):
        self.done.set()
        self.thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def test_a_replay_endpoint_gives_the_blocks_stored_before_joining_and_fills_a_lost_batch():
    server = Publisher()
    server.publish(0, [stored([11], None, [1, 2, 3, 4])], live=False)     # before kvchat subscribed
    server.publish(1, [stored([12], 11, [5, 6, 7, 8])], live=False)
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{server.port}", replay=f"tcp://127.0.0.1:{server.replay_port}")
    try:
        assert sub.wait_joined(10) and sub.wait_replayed(10)
        s = sub.store.summary()
        assert server.asked == [0] and (s.first_seq, s.last_seq, s.replayed, s.gaps) == (0, 1, 2, 0)
        assert sub.store.chain([1, 2, 3, 4, 5, 6, 7, 8], 4) == 2
        server.publish(2, [stored([13], 12, [9, 9, 9, 9])])
        assert sub.store.wait(lambda s: s.last_seq == 2, 10)
        # batch 3 never reaches the subscriber; batch 4 does, and the numbering's skip asks for 3 on
        server.publish(3, [stored([14], 13, [7, 7, 7, 7])], live=False)
        server.publish(4, [{"type": "BlockRemoved", "block_hashes": [11]}])
        assert sub.store.wait(lambda s: s.last_seq == 4, 10) and sub.wait_replayed(10)
        s = sub.store.summary()
        assert server.asked == [0, 3] and s.gaps == 0 and s.replayed == 4 and s.replay_problem is None
        assert s.blocks == 3 and sub.store.chain([1, 2, 3, 4], 4) == 0      # 14 stored, then 11 removed, in order
        assert s.batches == 5                                                # batch 4 applied once, not twice
    finally:
        sub.stop()
        server.close()


def test_a_replay_endpoint_that_never_answers_lets_live_batches_through_and_says_so(monkeypatch):
    from kvchat.backends import kv_events
    monkeypatch.setattr(kv_events, "REPLAY_WAIT_S", 0.5)
    server = Publisher()
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{server.port}", replay=f"tcp://127.0.0.1:{free_port()}")
    try:
        assert sub.wait_joined(10)
        server.publish(0, [stored([11], None, [1, 2, 3, 4])])
        assert sub.store.wait(lambda s: s.batches == 1 and s.replay_problem is not None, 10), sub.store.summary()
        assert "did not answer within 0.5 s" in sub.store.summary().replay_problem
        assert sub.store.chain([1, 2, 3, 4], 4) == 1
    finally:
        sub.stop()
        server.close()


def test_kv_replay_flags_are_checked(capsys):
    fails_with(capsys, ["ask", "--kv-replay", "tcp://127.0.0.1:5558", "hi"], "--kv-replay needs --server")
    routes = {"/v1/models": (200, json.dumps(MODELS)), "/metrics": (200, VLLM_METRICS)}
    with http_server(routes) as url:
        fails_with(capsys, ["info", "--server", url, "--kv-replay", "tcp://127.0.0.1:5558"], "--kv-replay needs --kv-events")
        fails_with(capsys, ["info", "--server", url, "--kv-events", "tcp://127.0.0.1:5557", "--kv-replay", "tcp://*:5558"],
                   "--kv-replay", "replay_endpoint")


def test_a_kv_events_port_where_nothing_publishes_is_named_in_the_panel_notes():
    from kvchat.backends import vllm
    routes = {"/v1/models": (200, json.dumps(MODELS)), "/metrics": (200, VLLM_METRICS)}
    with http_server(routes) as url:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        b = vllm.VllmBackend(url, kv_events=endpoint)
        try:
            snap = b.snapshot(b.open())
            assert not b.events.store.summary().connected
            assert any(n.startswith(f"no KV-event publisher at {endpoint}") for n in snap.server.notes), snap.server.notes
        finally:
            b.shutdown()


def test_the_chat_app_with_no_server_there_is_one_line_before_the_ui(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    with refusing_port() as port:
        fails_with(capsys, ["--server", f"http://127.0.0.1:{port}"], "nothing answers")
    with http_server({"/": (200, "<html>hello</html>")}) as url:
        fails_with(capsys, ["--server", url], "not an OpenAI-compatible server")
    fails_with(capsys, ["--geometry", "llama-3.1-8b"], "--geometry", "--server")


def test_a_restarted_servers_numbering_clears_the_map():
    store = KvEventStore()
    store.apply_message(frames(7, [stored([11], None, [1, 2, 3, 4])]))
    store.apply_message(frames(0, [stored([31], None, [5, 6, 7, 8])]))
    assert store.chain([1, 2, 3, 4], 4) == 0 and store.chain([5, 6, 7, 8], 4) == 1
    assert store.restarts == 1 and store.summary().gaps == 0


def test_model_gives_the_geometry_from_a_local_config_json(capsys, tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
           "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 1024,
           "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    models = {"data": [{"id": "my-org/tiny", "max_model_len": 2048}]}
    routes = {"/v1/models": (200, json.dumps(models)), "/metrics": (200, VLLM_METRICS)}
    with http_server(routes) as url:
        assert __import__("kvchat.cli.command").cli.command.main(["info", "--server", url, "--model", str(tmp_path), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 1          # fp8 cache: 1 byte per element
        fails_with(capsys, ["info", "--server", url, "--model", str(tmp_path / "nowhere")], "config.json")
