"""HTTP to an OpenAI-compatible vLLM server: the URL, the API key, and every failure turned
into one ServerError line that says what happened and what the user can do.

Endpoints used: GET /v1/models, POST /v1/chat/completions (server-sent events),
POST /tokenize, GET /metrics, POST /reset_prefix_cache and GET /server_info (both exist
only on a server started with VLLM_SERVER_DEV_MODE=1).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvchat.engine.errors import KvchatError

API_KEY_ENVS = ("KVCHAT_API_KEY", "OPENAI_API_KEY")
CONNECT_S, READ_S = 5.0, 300.0     # a cold 8k-token prefill on a CPU server takes tens of seconds
Json = dict[str, Any]              # a JSON object as the server sent it


class ServerError(KvchatError):
    """The server could not be reached, or answered something other than what vLLM answers."""
    status: int | None = None      # the HTTP status, where the server answered one


def normalise_url(url: str) -> str:
    """http(s)://HOST[:PORT][/PREFIX][/v1][/] -> http(s)://HOST[:PORT][/PREFIX], or ServerError."""
    text = url.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"--server {url!r}: expected an http:// or https:// base URL such as "
                          "http://127.0.0.1:8000 (the /v1 suffix is optional)")
    try:
        parts.port
    except ValueError:
        raise ServerError(f"--server {url!r}: the port is not a number from 1 to 65535") from None
    if parts.query or parts.fragment:
        raise ServerError(f"--server {url!r}: give the base URL only, without ?query or #fragment")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def api_key() -> str | None:
    for name in API_KEY_ENVS:
        value = os.environ.get(name)
        if value:
            return value
    return None


class ServerApi:
    """One httpx client for one server. Methods raise ServerError, never an httpx error."""

    def __init__(self, url: str) -> None:
        self.url = normalise_url(url)
        key = api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(READ_S, connect=CONNECT_S), follow_redirects=False)

    def close(self) -> None:
        self._http.close()

    # ---- requests ------------------------------------------------------------------------------
    def get_json(self, path: str) -> Json:
        with self._request("GET", path) as r:
            return self._json(r, path)

    def post_json(self, path: str, body: Json | None = None, params: dict[str, str] | None = None) -> Json:
        with self._request("POST", path, json=body, params=params) as r:
            return self._json(r, path)

    def get_text(self, path: str, timeout: float | None = None) -> str:
        kw: dict[str, Any] = {"timeout": httpx.Timeout(timeout, connect=min(timeout, CONNECT_S))} if timeout else {}
        with self._request("GET", path, **kw) as r:
            text: str = r.text
            return text

    def get_optional_json(self, path: str) -> Json | None:
        """For endpoints that exist only in dev mode: None where the server answers 404."""
        try:
            return self.get_json(path)
        except ServerError as err:
            if err.status == 404:
                return None
            raise

    @contextmanager
    def stream_events(self, path: str, body: Json) -> Iterator[Iterator[Json]]:
        """POST and yield each server-sent event's JSON until [DONE]; leaving the with-block
        early closes the connection, which makes vLLM abort the request."""
        with self._request("POST", path, json=body, stream=True) as r:
            yield self._events(r, path)

    def _events(self, r: httpx.Response, path: str) -> Iterator[Json]:
        try:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ServerError(f"{self.url}{path} sent a stream event that is not JSON; "
                                      "is it an OpenAI-compatible server?") from None
                if isinstance(event, dict) and "error" in event:
                    raise ServerError(f"the server stopped the reply: {_error_text(event)}")
                yield event
        except httpx.TimeoutException:
            raise ServerError(f"{self.url} sent nothing for {READ_S:.0f} s mid-reply; "
                              "the reply so far was dropped") from None
        except (httpx.TransportError, httpx.StreamError) as err:
            raise ServerError(f"connection to {self.url} lost mid-reply ({_short(err)}); "
                              "the conversation so far is kept, send again once the server is back") from None

    @contextmanager
    def _request(self, method: str, path: str, stream: bool = False, **kw: Any) -> Iterator[httpx.Response]:
        try:
            if stream:
                with self._http.stream(method, path, **kw) as r:
                    if r.status_code >= 400:
                        r.read()
                    self._check(r, path)
                    yield r
            else:
                r = self._http.request(method, path, **kw)
                self._check(r, path)
                yield r
        except httpx.ConnectError as err:
            raise ServerError(f"nothing answers at {self.url} ({_short(err)}); start the server or "
                              "check --server") from None
        except httpx.TimeoutException:
            raise ServerError(f"{self.url} did not answer {method} {path} in time; is the server "
                              "overloaded or still starting?") from None
        except (httpx.TransportError, httpx.StreamError) as err:
            raise ServerError(f"connection to {self.url} lost ({_short(err)}); the conversation so far "
                              "is kept, try again once the server is back") from None

    def _check(self, r: httpx.Response, path: str) -> None:
        if r.status_code < 400:
            return
        if r.status_code in (401, 403):
            err = ServerError(f"{self.url} refused the request ({r.status_code}): set KVCHAT_API_KEY "
                              "(or OPENAI_API_KEY) to the server's API key")
        elif r.status_code == 404:
            err = ServerError(f"{self.url}{path} does not exist (404): {_error_text(_maybe_json(r))}")
        else:
            err = ServerError(f"{self.url}{path} answered {r.status_code}: {_error_text(_maybe_json(r))}")
        err.status = r.status_code
        raise err

    def _json(self, r: httpx.Response, path: str) -> Json:
        data = _maybe_json(r)
        if not isinstance(data, dict):
            raise ServerError(f"{self.url}{path} did not answer JSON; is --server an OpenAI-compatible "
                              "vLLM server?")
        return data


def _maybe_json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _error_text(body: object) -> str:
    """The server's own message: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or text."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        text = str(err) if err is not None else json.dumps(body)
    elif str(body).lstrip()[:1] == "<":
        return "an HTML page"
    else:
        text = str(body).strip() or "no message"
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:157] + "..."


def _short(err: Exception) -> str:
    text = " ".join(str(err).split()) or err.__class__.__name__
    return text if len(text) <= 100 else text[:97] + "..."
