"""HTTP to an OpenAI-compatible vLLM server: the URL, the API key, and every failure turned
into one ServerError line that says what happened and what the user can do.

Endpoints used: GET /v1/models, POST /v1/chat/completions (server-sent events),
POST /tokenize, GET /metrics, POST /reset_prefix_cache and GET /server_info (both exist
only on a server started with VLLM_SERVER_DEV_MODE=1).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from kvchat.engine.errors import KvchatError

from ..text import API_KEY_ENVS, keep_secret, keep_url_secrets, redact, shown
from .protocol import ReplyLost
from .deadlines import Deadlines
from .sse import EventStream, StreamError

MAX_BODY = 16 * 2**20      # a plain answer: /metrics of a large server is about 1 MB
Json = dict[str, Any]      # a JSON object as the server sent it


class ServerError(KvchatError):
    """The server could not be reached, or answered something other than what vLLM answers.
    str() is one line, with the server's own words made inert and every secret redacted."""

    def __init__(self, line: str, status: int | None = None) -> None:
        super().__init__(shown(line))
        self.status = status


class ConnectionLost(ServerError, ReplyLost):
    """The connection broke mid-reply (sse.LOST)."""


def normalise_url(url: str) -> str:
    """http(s)://[USER:PASS@]HOST[:PORT][/PREFIX][/v1][/] -> the same without /v1 and the
    trailing slash, or ServerError (which never shows the credentials)."""
    text = url.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"--server {redact(url)!r}: expected an http:// or https:// base URL such as "
                          "http://127.0.0.1:8000 (the /v1 suffix is optional)")
    try:
        parts.port
    except ValueError:
        raise ServerError(f"--server {redact(url)!r}: the port is not a number from 1 to 65535") from None
    if parts.query or parts.fragment:
        raise ServerError(f"--server {redact(url)!r}: give the base URL only, without ?query or #fragment")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def public_url(url: str) -> str:
    """The URL as kvchat shows it: without the user:password part."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"


def api_key() -> str | None:
    for name in API_KEY_ENVS:
        value = os.environ.get(name)
        if value:
            return value
    return None


class ServerApi:
    """One httpx client for one server. Methods raise ServerError, never an httpx error.

    `url` is the server as shown (no credentials); the credentials, if the URL has them, go
    to the server as Basic authorization and are kept as secrets, never shown."""

    def __init__(self, url: str, deadlines: Deadlines | None = None) -> None:
        base = normalise_url(url)
        parts = urlsplit(base)
        for user, password in ((parts.username, parts.password),
                               (unquote(parts.username or ""), unquote(parts.password or ""))):
            keep_url_secrets(user, password)
        self.url = public_url(base)
        self.deadlines = deadlines or Deadlines()
        key = api_key()
        keep_secret(key)
        # identity: an answer is read as sent, so a compressed bomb never inflates in memory
        headers = {"Accept-Encoding": "identity", **({"Authorization": f"Bearer {key}"} if key else {})}
        d = self.deadlines
        self._http = httpx.Client(base_url=base, headers=headers, follow_redirects=False,
                                  timeout=httpx.Timeout(d.answer, connect=d.connect))

    def close(self) -> None:
        self._http.close()

    # ---- requests ------------------------------------------------------------------------------
    def get_json(self, path: str) -> Json:
        return self._json(self._answer("GET", path), path)

    def post_json(self, path: str, body: Json | None = None, params: dict[str, str] | None = None) -> Json:
        return self._json(self._answer("POST", path, json=body, params=params), path)

    def get_text(self, path: str) -> str:
        data = self._answer("GET", path)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ServerError(f"{self.url}{path} answered text that is not UTF-8 (byte {data[err.start]:#04x} "
                              f"at offset {err.start})") from None

    def get_optional_json(self, path: str) -> Json | None:
        """For endpoints that exist only in dev mode: None where the server answers 404."""
        try:
            return self.get_json(path)
        except ServerError as err:
            if err.status == 404:
                return None
            raise

    @contextmanager
    def stream_events(self, path: str, body: Json, cancel: threading.Event | None = None
                      ) -> Iterator[EventStream]:
        """POST and iterate each server-sent event's JSON until [DONE], a deadline, `cancel`,
        or the end of the stream (the EventStream says which). Leaving the with-block early
        closes the connection, which makes vLLM abort the request."""
        d = self.deadlines
        # the stream's own clock (EventStream) stops it on time; httpx's per-read timeout is a backstop
        timeout = httpx.Timeout(max(d.first_token, d.gap) + 5, connect=d.connect)
        with self._request("POST", path, json=body, timeout=timeout) as r:
            if r.status_code >= 400:
                self._check(r.status_code, self._body(r, path, time.monotonic()), path)
            events = EventStream(r, d, cancel, self.url)
            try:
                yield events
            except StreamError as err:
                raise ServerError(str(err)) from None
            finally:
                events.close()

    # ---- reading answers -----------------------------------------------------------------------
    def _answer(self, method: str, path: str, **kw: Any) -> bytes:
        """A plain request's whole answer, within the answer deadline and MAX_BODY bytes."""
        start = time.monotonic()
        with self._request(method, path, **kw) as r:
            body = self._body(r, path, start)
        self._check(r.status_code, body, path)
        return body

    def _body(self, r: httpx.Response, path: str, start: float) -> bytes:
        """httpx's read timeout is per read: the clock here also stops a server that trickles."""
        encoding = r.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ServerError(f"{self.url}{path} answered {encoding!r}-encoded data though kvchat asked for "
                              "none; is a proxy in between?", r.status_code)
        data = bytearray()
        limit = self.deadlines.answer
        try:
            for chunk in r.iter_raw():
                data += chunk
                if len(data) > MAX_BODY:
                    raise ServerError(f"{self.url}{path} answered more than {MAX_BODY // 2**20} MiB; kvchat "
                                      "reads no more than that", r.status_code)
                if time.monotonic() - start > limit:
                    raise httpx.ReadTimeout("trickled past the deadline")
        except httpx.TimeoutException:
            raise ServerError(f"{self.url} did not finish answering {r.request.method} {path} within {limit:g} s "
                              "(--timeouts answer=SECONDS waits longer)", r.status_code) from None
        except (httpx.TransportError, httpx.StreamError) as err:
            raise ServerError(f"connection to {self.url} lost while reading {path} ({_short(err)}); try again "
                              "once the server is back", r.status_code) from None
        return bytes(data)

    @contextmanager
    def _request(self, method: str, path: str, **kw: Any) -> Iterator[httpx.Response]:
        d = self.deadlines
        try:
            with self._http.stream(method, path, **kw) as r:
                yield r
        except httpx.ConnectTimeout:
            raise ServerError(f"{self.url} did not accept a connection within {d.connect:g} s; is it the right "
                              "address? (--timeouts connect=SECONDS waits longer)") from None
        except httpx.ConnectError as err:
            raise ServerError(f"nothing answers at {self.url} ({_short(err)}); start the server or "
                              "check --server") from None
        except httpx.TimeoutException:
            raise ServerError(f"{self.url} did not answer {method} {path} within {d.answer:g} s; is the server "
                              "overloaded or still starting? (--timeouts answer=SECONDS waits longer)") from None
        except (httpx.TransportError, httpx.StreamError) as err:
            raise ServerError(f"connection to {self.url} lost ({_short(err)}); try again once the server "
                              "is back") from None

    def _check(self, status: int, body: bytes, path: str) -> None:
        if status < 400:
            return
        if status in (401, 403):
            raise ServerError(f"{self.url} refused the request ({status}): set KVCHAT_API_KEY "
                              "(or OPENAI_API_KEY) to the server's API key", status)
        if status == 404:
            raise ServerError(f"{self.url}{path} does not exist (404): {error_text(_maybe_json(body))}", status)
        raise ServerError(f"{self.url}{path} answered {status}: {error_text(_maybe_json(body))}", status)

    def _json(self, body: bytes, path: str) -> Json:
        data = _maybe_json(body)
        if not isinstance(data, dict):
            raise ServerError(f"{self.url}{path} did not answer a JSON object; is --server an OpenAI-compatible "
                              "vLLM server?")
        return data


def _maybe_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return body.decode("utf-8", errors="replace")


def error_text(body: object) -> str:
    """The server's own message: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or text;
    one line of at most 160 characters, secrets redacted, inert."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        try:
            text = str(err) if err is not None else json.dumps(body)
        except (ValueError, RecursionError):
            text = "an unreadable message"
    elif str(body).lstrip()[:1] == "<":
        return "an HTML page"
    else:
        text = str(body).strip() or "no message"
    text = shown(" ".join(redact(text).split()))
    return text if len(text) <= 160 else text[:157] + "..."



def _short(err: Exception) -> str:
    text = shown(" ".join(str(err).split()) or err.__class__.__name__)
    return text if len(text) <= 100 else text[:97] + "..."
