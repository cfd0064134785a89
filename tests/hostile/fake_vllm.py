"""A stand-in for a vLLM server, written with the standard library: real HTTP on a loopback
socket, answering as vLLM does by default, and as a hostile or broken server would wherever a
test says so. A real vLLM cannot be made to send a 10^9-block pool, an endless stream or an
escape sequence in its model name; this can, which is why it exists."""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "smollm2-135m"
METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2-135m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="100"} 1.0
"""


def models(name: str = MODEL, max_model_len: object = 8192) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "max_model_len": max_model_len}]}


def token(text: str, tid: int, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "token_ids": [tid], "finish_reason": finish}]}


def usage(prompt: int = 5, completion: int = 2, cached: int | None = 0) -> dict:
    details = {"cached_tokens": cached} if cached is not None else None
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "prompt_tokens_details": details}}


def reply(*texts: str) -> list[dict]:
    """A whole reply as vLLM streams it: the prompt ids, one chunk per token, the usage."""
    out: list[dict] = [{"prompt_token_ids": [1, 2, 3, 4, 5], "choices": []}]
    for i, text in enumerate(texts):
        out.append(token(text, 100 + i, "stop" if i == len(texts) - 1 else None))
    out.append(usage(completion=len(texts)))
    return out


class Handler(BaseHTTPRequestHandler):
    """Answers from the server's routes; a route is (status, body) or a function of the handler."""

    server: FakeServer

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        self.body = json.loads(raw) if raw else None
        self.server.seen.append((self.command, self.path, dict(self.headers), self.body))
        route = self.server.routes.get(self.path.split("?")[0], (404, {"detail": "Not Found"}))
        if callable(route):
            route(self)
        else:
            self.send_body(*route)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass

    @property
    def stopping(self) -> bool:
        return self.server.stopping.is_set()

    def send_body(self, status: int, body: object, content_type: str | None = None) -> None:
        data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type or ("application/json" if isinstance(body, (dict, list))
                                                          else "text/plain"))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        """Headers of an event stream delimited by closing the connection (HTTP/1.0)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.flush()

    def write(self, data: bytes | str) -> bool:
        """False once the client has gone or the server stops."""
        if self.stopping:
            return False
        try:
            self.wfile.write(data.encode() if isinstance(data, str) else data)
            self.wfile.flush()
            return True
        except OSError:
            return False

    def event(self, obj: object) -> bool:
        return self.write(f"data: {json.dumps(obj)}\n\n")

    def stream(self, events: list, done: bool = True, delay: float = 0.0) -> None:
        self.start_stream()
        for e in events:
            if not self.event(e):
                return
            time.sleep(delay)
        if done:
            self.write("data: [DONE]\n\n")

    def hang(self, seconds: float = 60.0) -> None:
        self.server.stopping.wait(seconds)


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, routes: dict) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes = routes
        self.seen: list = []
        self.stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def lost_mid_chunk(h) -> None:
    """A chunked reply that breaks mid-chunk: the connection is lost, it does not end."""
    h.protocol_version = "HTTP/1.1"
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    data = f"data: {json.dumps(token('partial', 5))}\n\n".encode()
    h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" + b"400\r\ndata: {")
    h.wfile.flush()
    h.connection.shutdown(socket.SHUT_RDWR)


def vllm_routes() -> dict:
    """vLLM's answers, path -> (status, body) or a function of the handler."""
    return {
        "/v1/models": (200, models()),
        "/metrics": (200, METRICS),
        "/v1/chat/completions": lambda h: h.stream(reply("Hello", " there")),
        "/tokenize": (200, {"count": 7}),
    }


@contextmanager
def fake_vllm(changes: dict | None = None):
    """A server answering as vLLM does, but for the routes in `changes`."""
    server = FakeServer({**vllm_routes(), **(changes or {})})
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()


@contextmanager
def silent_listener():
    """A port that accepts connections (the kernel completes the handshake) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()

