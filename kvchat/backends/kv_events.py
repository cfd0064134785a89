"""vLLM's KV-cache event stream (ZMQ PUB), kept as the set of resident prefix-cached blocks.

Each message is three frames: topic, an 8-byte big-endian sequence number, and a msgpack
batch `[timestamp, [events], data_parallel_rank]`. An event is a map with a "type" key
(vLLM 0.32: `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
"block_size", ...}`, `{"type": "BlockRemoved", "block_hashes"}`, `{"type": "AllBlocksCleared"}`)
or, from servers that encode them as tagged arrays, `["BlockStored", block_hashes, ...]`
(vllm/distributed/kv_events.py). Fields this file does not use are ignored.

What this can and cannot show: the events name *full* blocks by content hash, with no
physical block ids and nothing about a request's partial last block, so the map built here
is "which prefix blocks are resident", not "which slot of the pool holds what". Blocks stored
before we subscribed are unknown to us; a gap in sequence numbers is counted, not hidden.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvchat.engine.errors import KvchatError

BlockHash = Hashable           # bytes or int, as the server sends it
_decode = msgspec.msgpack.Decoder()


class KvEventsError(KvchatError):
    """The --kv-events endpoint is malformed or unreachable."""


@dataclass(frozen=True, slots=True)
class ResidentBlocks:
    """What the stream has told us so far, at one moment."""
    blocks: int                # resident full blocks we know of
    block_size: int | None     # from the events (None before the first BlockStored)
    batches: int               # messages received
    first_seq: int | None      # the first sequence number seen (> 0: earlier events were missed)
    last_seq: int | None
    gaps: int                  # sequence numbers skipped after the first
    cleared: int               # AllBlocksCleared seen
    undecodable: int           # messages that were not a vLLM event batch
    restarts: int = 0          # times the numbering started again (a restarted server)


class KvEventStore:
    """The resident blocks: hash -> (parent hash, token ids), and the reverse index
    (parent hash, token ids) -> hash that finds a conversation's chain of blocks."""

    def __init__(self) -> None:
        self.lock = threading.RLock()     # wait() predicates call chain() and summary() under it
        self._blocks: dict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = {}
        self._by_content: dict[tuple[BlockHash | None, tuple[int, ...]], BlockHash] = {}
        self.block_size: int | None = None
        self.batches = self.gaps = self.cleared = self.undecodable = self.restarts = 0
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.changed = threading.Condition(self.lock)

    # ---- applying the stream ------------------------------------------------------------------
    def apply_message(self, frames: Sequence[bytes]) -> None:
        """One ZMQ message: (topic, seq, payload)."""
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(f"{len(frames)} frames")
            seq = int.from_bytes(frames[1], "big", signed=True)
            batch = _decode.decode(frames[2])
            events = batch[1]
            if not isinstance(events, list):
                raise ValueError("events is not a list")
        except (ValueError, TypeError, IndexError, msgspec.DecodeError):
            with self.lock:
                self.undecodable += 1
            return
        with self.changed:
            if self.first_seq is None:
                self.first_seq = seq
            elif self.last_seq is not None and seq > self.last_seq + 1:
                self.gaps += seq - self.last_seq - 1
            elif self.last_seq is not None and seq <= self.last_seq:
                # numbering started again: the server restarted with an empty cache
                self._blocks.clear()
                self._by_content.clear()
                self.restarts += 1
            self.last_seq = seq
            self.batches += 1
            for event in events:
                self._apply(event)
            self.changed.notify_all()

    def _apply(self, event: object) -> None:
        fields = _fields(event)
        kind = fields.get("type")
        if kind == "BlockStored" and fields.keys() >= {"block_hashes", "token_ids", "block_size"}:
            parent, token_ids, block_size = fields.get("parent_block_hash"), fields["token_ids"], int(fields["block_size"])
            self.block_size = block_size
            for i, h in enumerate(fields["block_hashes"]):
                key = (_hashable(parent), tuple(token_ids[i * block_size:(i + 1) * block_size]))
                h = _hashable(h)
                self._blocks[h] = key
                self._by_content[key] = h
                parent = h
        elif kind == "BlockRemoved" and "block_hashes" in fields:
            for h in map(_hashable, fields["block_hashes"]):
                stored = self._blocks.pop(h) if h in self._blocks else None
                if stored is not None and self._by_content.get(stored) == h:
                    del self._by_content[stored]
        elif kind == "AllBlocksCleared":
            self._clear()
        else:
            self.undecodable += 1

    def _clear(self) -> None:
        self._blocks.clear()
        self._by_content.clear()
        self.cleared += 1

    def cleared_by_server(self) -> None:
        """The server answered a prefix-cache reset with success. vLLM publishes the matching
        AllBlocksCleared only with its next engine step, so an idle server's map would keep
        showing the old blocks until the next request; the reset's own answer is the truth now."""
        with self.changed:
            self._clear()
            self.changed.notify_all()

    # ---- reading it ---------------------------------------------------------------------------
    def chain(self, token_ids: Sequence[int], block_size: int) -> int:
        """How many leading full blocks of `token_ids` are resident, following the hash chain
        from the first block (the same test vLLM's prefix lookup makes)."""
        n = 0
        parent: BlockHash | None = None
        with self.lock:
            for start in range(0, len(token_ids) - block_size + 1, block_size):
                h = self._by_content.get((parent, tuple(token_ids[start:start + block_size])))
                if h is None:
                    break
                n += 1
                parent = h
        return n

    def summary(self) -> ResidentBlocks:
        with self.lock:
            return ResidentBlocks(blocks=len(self._blocks), block_size=self.block_size, batches=self.batches,
                                  first_seq=self.first_seq, last_seq=self.last_seq, gaps=self.gaps,
                                  cleared=self.cleared, undecodable=self.undecodable, restarts=self.restarts)

    def wait(self, predicate: Callable[[KvEventStore], bool], timeout: float) -> bool:
        """Block until predicate(self) holds after a message (for tests and the CLI)."""
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self), timeout)


# The positional layout of each event when the server encodes them as tagged arrays
# (msgspec array_like); vLLM 0.32 sends maps with a "type" key instead. Both are read.
_POSITIONAL = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
               "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}


def _fields(event: object) -> dict[str, Any]:
    if isinstance(event, dict):
        return event
    if isinstance(event, list) and event and isinstance(event[0], str):
        names = _POSITIONAL.get(event[0], ())
        return {"type": event[0], **dict(zip(names, event[1:]))}
    return {}


def _hashable(h: Any) -> BlockHash:
    return tuple(h) if isinstance(h, list) else h


class KvEventSubscriber:
    """A daemon thread that subscribes to `endpoint` and feeds a KvEventStore."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        check_endpoint(endpoint)
        self.endpoint = endpoint
        self.store = KvEventStore()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)      # so the thread sees stop() within 0.2 s
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as err:
            self._sock.close()
            self._ctx.term()
            raise KvEventsError(f"--kv-events {endpoint}: {err}; expected tcp://HOST:PORT") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                break
            self.store.apply_message(frames)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()


def check_endpoint(endpoint: str) -> None:
    """tcp://HOST:PORT with a numeric port; raises KvEventsError naming what is accepted."""
    prefix = "tcp://"
    host, _, port = endpoint[len(prefix):].rpartition(":") if endpoint.startswith(prefix) else ("", "", "")
    if not host or host == "*" or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvEventsError(f"--kv-events {endpoint!r}: expected tcp://HOST:PORT, the endpoint given to the "
                            "server's --kv-events-config (a server bound to tcp://*:5557 is reached at "
                            "tcp://SERVER-HOST:5557)")
