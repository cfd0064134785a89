"""A reply's server-sent events, read with an end to every wait and a bound on every line.

httpx's own timeouts are per socket read: a server that trickles a comment byte every few
seconds, or streams tokens for ever, never trips them. So a small watcher thread keeps the
reply's clock (first event, gap between events, total) and the user's cancel, and when one
of them says stop it shuts the socket down: the read blocked in the reader's thread returns
at once, within a poll (0.05 s), whatever the server does.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from .deadlines import Deadlines, flag_name

MAX_LINE = 4 * 2**20        # one event's line: a token's JSON is a few hundred bytes
POLL_S = 0.05

# how a stream ended
DONE = "done"               # [DONE], as vLLM ends every complete reply
EOF = "eof"                 # the stream ended in good order, but without [DONE]
LOST = "lost"               # the connection broke (a reset, a chunked body cut short)
CANCELLED = "cancelled"     # the user stopped it
TIMEOUT = "timeout"         # a deadline passed


class StreamError(Exception):
    """The stream carried something that is not an event stream; str() is one line."""


class EventStream:
    """Iterate for each event's JSON object. Afterwards, `ended` says how it ended and
    `why` says it in words (for a deadline, which one and how to change it)."""

    def __init__(self, response: httpx.Response, deadlines: Deadlines, cancel: threading.Event | None,
                 where: str) -> None:
        self._r = response
        self._deadlines = deadlines
        self._cancel = cancel
        self._where = where
        self.ended: str | None = None
        self.why = ""
        self.events = 0
        self._start = self._last = time.monotonic()
        self._stop = threading.Event()
        self._cut: str | None = None       # what the watcher stopped the stream for
        self._thread = threading.Thread(target=self._watch, name="sse-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)

    # ---- the reader ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for line in _lines(self._r.iter_raw()):
                if self._cut is not None:
                    break
                if not line.startswith(b"data:"):
                    continue                     # comments, event names, ids: not progress
                data = line[5:].strip()
                if data == b"[DONE]":
                    self._end(DONE, "")
                    return
                self.events += 1
                self._last = time.monotonic()
                yield _event(data, self._where)
        except (httpx.TransportError, httpx.StreamError, OSError) as err:
            if self._cut is None:
                self._end(LOST, f"connection to {self._where} lost mid-reply ({_short(err)}); try again once "
                                "the server is back")
                return
        if self._cut is not None:
            self._end(*self._cut_reason())
        elif self.ended is None:
            self._end(EOF, f"{self._where} ended the reply's stream without [DONE]")

    def _end(self, how: str, why: str) -> None:
        if self.ended is None:
            self.ended, self.why = how, why

    def _cut_reason(self) -> tuple[str, str]:
        if self._cut == CANCELLED:
            return CANCELLED, "stopped"
        d, cut = self._deadlines, self._cut or "total"
        seconds = {"first_token": d.first_token, "gap": d.gap, "total": d.total}[cut]
        what = {"first_token": "sent no reply", "gap": "sent nothing more",
                "total": "was still replying"}[cut]
        return TIMEOUT, (f"{self._where} {what} after {seconds:g} s; stopped waiting "
                         f"(--timeouts {flag_name(cut)}=SECONDS waits longer)")

    # ---- the watcher -----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            reason = self._due()
            if reason is not None:
                self._cut = reason
                _shutdown(self._r)
                return

    def _due(self) -> str | None:
        if self._cancel is not None and self._cancel.is_set():
            return CANCELLED
        now, d = time.monotonic(), self._deadlines
        if now - self._start > d.total:
            return "total"
        if not self.events and now - self._start > d.first_token:
            return "first_token"
        if self.events and now - self._last > d.gap:
            return "gap"
        return None


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Split raw bytes into lines (LF or CRLF), refusing a line longer than MAX_LINE."""
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        start = 0
        while (nl := buf.find(b"\n", start)) >= 0:
            yield bytes(buf[start:nl]).rstrip(b"\r")
            start = nl + 1
        del buf[:start]
        if len(buf) > MAX_LINE:
            raise StreamError(f"a stream line is longer than {MAX_LINE:,} bytes")
    if buf:
        yield bytes(buf).rstrip(b"\r")


def _event(data: bytes, where: str) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except (ValueError, RecursionError):
        raise StreamError(f"{where} sent a stream event that is not JSON; is it an OpenAI-compatible "
                          "server?") from None
    if not isinstance(event, dict):
        raise StreamError(f"{where} sent a stream event that is a JSON {type(event).__name__}, not an object")
    return event


def _shutdown(r: httpx.Response) -> None:
    """Wake the reader blocked in recv(): shutting the socket down makes that read return."""
    stream = r.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if isinstance(sock, socket.socket):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass          # already closed: the reader has its answer
    else:
        r.close()


def _short(err: Exception) -> str:
    text = " ".join(str(err).split()) or err.__class__.__name__
    return text if len(text) <= 100 else text[:97] + "..."
