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

Joining: a ZMQ subscriber connects in the background, and a publisher drops every message sent
before the subscription reaches it. vLLM publishes a turn's stored blocks in one message at the
step that fills them, so a turn sent just after subscribing could lose its whole map, for good.
The subscriber therefore watches its own connection (a ZMQ socket monitor): `wait_joined()`
returns once the handshake with the publisher is done, and the summary says whether a
publisher is connected at all (a wrong port is otherwise a silent, empty map).

Replay: a vLLM server whose --kv-events-config also names a `replay_endpoint` (a ROUTER
socket) keeps its last `buffer_steps` batches (10,000 by default) and sends those from a
sequence number on to whoever asks: `[b"", start (8 bytes, big-endian)]` from a DEALER, answered
by `[b"", topic, seq, payload]` per batch and `[b"", b"", -1 (8 bytes), b""]` at the end. With
it (`--kv-replay`), the subscriber asks for everything from 0 when it joins (the blocks stored
before kvchat subscribed, which it otherwise never learns) and for the missing batches when the
numbering skips; live batches that arrive meanwhile are held and applied after the replayed
ones, duplicates dropped.

Every event is checked before it changes the map: one that is malformed is counted and the
last one's fault kept (the cache panel names it), and the thread keeps listening. The map
holds at most MAX_RESIDENT blocks and a message at most MAX_MESSAGE bytes, whatever a
publisher sends.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvchat.engine.errors import KvchatError

BlockHash = Hashable           # bytes or int, as the server sends it
_decode = msgspec.msgpack.Decoder()
MAX_RESIDENT = 2**19           # blocks in the map: a 70B model on eight GPUs holds about 2^17
MAX_MESSAGE = 64 * 2**20       # bytes in one ZMQ message
MAX_BLOCK_SIZE = 2**16
MAX_HASH_BYTES = 256
SUBSCRIBE_SETTLE_S = 0.2       # after the handshake, for the subscription to reach the publisher (wait_joined)
REPLAY_WAIT_S = 3.0            # how long a replay's answer may take before the held batches go on without it
END_SEQ = -1                   # the sequence number that ends a replay


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
    undecodable: int           # messages and events that were not vLLM's, skipped
    restarts: int = 0          # times the numbering started again (a restarted server)
    last_problem: str | None = None   # what was wrong with the last one skipped
    overflow: int = 0          # stored blocks left out of a full map (MAX_RESIDENT)
    connected: bool = True     # a publisher is connected now (False: nothing can arrive)
    connections: int = 0       # handshakes with a publisher: more than one means it went away and came back
    replayed: int = 0          # batches that came from the replay endpoint (--kv-replay)
    replay_problem: str | None = None  # why the last replay did not complete


class KvEventStore:
    """The resident blocks: hash -> (parent hash, token ids), and the reverse index
    (parent hash, token ids) -> hash that finds a conversation's chain of blocks."""

    def __init__(self) -> None:
        self.lock = threading.RLock()     # wait() predicates call chain() and summary() under it
        self._blocks: dict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = {}
        self._by_content: dict[tuple[BlockHash | None, tuple[int, ...]], BlockHash] = {}
        self.block_size: int | None = None
        self.batches = self.gaps = self.cleared = self.undecodable = self.restarts = self.overflow = 0
        self.last_problem: str | None = None
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.connected = True      # a store fed by hand (tests, replays) has no connection to watch
        self.connections = 0
        self.replayed = 0
        self.replay_problem: str | None = None
        self.changed = threading.Condition(self.lock)

    # ---- applying the stream ------------------------------------------------------------------
    def apply_message(self, frames: Sequence[bytes], replayed: bool = False) -> None:
        """One ZMQ message: (topic, seq, payload); `replayed`: it came from the replay endpoint."""
        try:
            seq = _seq(frames)
            if seq is None:
                raise ValueError(f"a message of {len(frames)} frames; expected topic, sequence, payload")
            batch = _decode.decode(frames[2])
            if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], list):
                raise ValueError("a payload that is not [timestamp, [events], ...]")
            events = batch[1]
        except (ValueError, TypeError, msgspec.DecodeError, RecursionError) as err:
            self.skip(str(err))
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
            self.replayed += replayed
            for event in events:
                try:
                    self._apply(event)
                except BadEvent as err:
                    self.skip(str(err))
            self.changed.notify_all()

    def skip(self, why: str) -> None:
        with self.lock:
            self.undecodable += 1
            self.last_problem = why[:200]

    def _apply(self, event: object) -> None:
        fields = _fields(event)
        kind = fields.get("type")
        if kind == "BlockStored":
            hashes = _hashes(fields.get("block_hashes"))
            parent = None if fields.get("parent_block_hash") is None else _hash(fields["parent_block_hash"])
            block_size = fields.get("block_size")
            if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= MAX_BLOCK_SIZE:
                raise BadEvent(f"BlockStored block_size {block_size!r:.40}; expected a whole number from 1 to "
                               f"{MAX_BLOCK_SIZE}")
            token_ids = fields.get("token_ids")
            if not isinstance(token_ids, list) or len(token_ids) < len(hashes) * block_size \
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise BadEvent(f"BlockStored token_ids: expected {len(hashes)} x {block_size} token ids")
            self.block_size = block_size
            for i, h in enumerate(hashes):
                if h not in self._blocks and len(self._blocks) >= MAX_RESIDENT:
                    self.overflow += 1
                    break
                key = (parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
                self._blocks[h] = key
                self._by_content[key] = h
                parent = h
        elif kind == "BlockRemoved":
            for h in _hashes(fields.get("block_hashes")):
                stored = self._blocks.pop(h) if h in self._blocks else None
                if stored is not None and self._by_content.get(stored) == h:
                    del self._by_content[stored]
        elif kind == "AllBlocksCleared":
            self._clear()
        else:
            raise BadEvent(f"an event of type {str(kind)[:40]!r}; expected BlockStored, BlockRemoved or "
                           "AllBlocksCleared")

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

    def link(self, up: bool) -> None:
        """The subscriber's connection to the publisher came up (a finished handshake) or went down."""
        with self.changed:
            self.connected = up
            self.connections += up
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
                                  cleared=self.cleared, undecodable=self.undecodable, restarts=self.restarts,
                                  last_problem=self.last_problem, overflow=self.overflow,
                                  connected=self.connected, connections=self.connections,
                                  replayed=self.replayed, replay_problem=self.replay_problem)

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


class BadEvent(ValueError):
    """An event that is not vLLM's; str() says which field."""


def _hash(h: object) -> BlockHash:
    """A block hash as vLLM sends it: an int, bytes, a string, or a list of ints."""
    if isinstance(h, bool):
        raise BadEvent("a block hash that is a boolean")
    if isinstance(h, (int, str, bytes)):
        if not isinstance(h, int) and len(h) > MAX_HASH_BYTES:
            raise BadEvent(f"a block hash of {len(h)} bytes; expected at most {MAX_HASH_BYTES}")
        return h
    if isinstance(h, list) and len(h) <= MAX_HASH_BYTES and all(
            isinstance(x, int) and not isinstance(x, bool) for x in h):
        return tuple(h)
    raise BadEvent(f"a block hash that is a {type(h).__name__}; expected an int, bytes or a list of ints")


def _hashes(value: object) -> list[BlockHash]:
    if not isinstance(value, list):
        raise BadEvent(f"block_hashes is a {type(value).__name__}; expected a list")
    return [_hash(h) for h in value]


class KvEventSubscriber:
    """A daemon thread that subscribes to `endpoint` and feeds a KvEventStore; with `replay`
    (the server's replay endpoint), it also asks for the batches it did not see."""

    def __init__(self, endpoint: str, topic: str = "", replay: str | None = None) -> None:
        check_endpoint(endpoint)
        if replay is not None:
            check_endpoint(replay, "--kv-replay", "replay_endpoint")
        self.endpoint, self.replay_endpoint = endpoint, replay
        self.store = KvEventStore()
        self.store.connected = False
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        # the connection's own events: the handshake done (the subscription goes out right after
        # it) and the publisher gone; watched by the same thread that reads the messages
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._replay: zmq.Socket[bytes] | None = None
        self._asked: float | None = None          # when the pending replay request went out
        self._replayed: list[list[bytes]] = []    # its batches so far
        self._held: list[list[bytes]] = []        # live batches that came meanwhile
        try:
            self._sock.connect(endpoint)
            if replay is not None:
                self._replay = self._ctx.socket(zmq.DEALER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
                self._replay.connect(replay)
        except zmq.ZMQError as err:
            self._close()
            raise KvEventsError(f"--kv-events {endpoint}: {err}; expected tcp://HOST:PORT") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def wait_joined(self, timeout: float) -> bool:
        """Block until the subscription is in place, at most `timeout` seconds; False if no
        publisher answered. Messages published before that are lost to this subscriber
        (unless a replay endpoint sends them).

        The handshake is the last thing this end sees: the subscription goes out after it and
        takes effect when the publisher's side has read it, with no answer. So this waits
        SUBSCRIBE_SETTLE_S past the handshake (on loopback a publish 1 ms after it arrived in 20
        of 20 tries here, one at once in 16 of 20)."""
        start = time.monotonic()
        if not self.store.wait(lambda s: s.connected, timeout):
            return False
        time.sleep(max(0.0, min(SUBSCRIBE_SETTLE_S, start + timeout - time.monotonic())))
        return True

    def wait_replayed(self, timeout: float) -> bool:
        """Block until no replay is pending (True at once without a replay endpoint)."""
        return self.store.wait(lambda s: self._asked is None, timeout)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(200))        # so the thread sees stop() within 0.2 s
                if self._monitor in ready:
                    self._watch_link()
                if self._replay is not None and self._replay in ready:
                    self._read_replay()
                if self._asked is not None and time.monotonic() - self._asked > REPLAY_WAIT_S:
                    self._finish_replay(f"{self.replay_endpoint} did not answer within {REPLAY_WAIT_S:g} s")
                if self._sock not in ready:
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                break
            self._live(frames)

    def _apply(self, frames: Sequence[bytes], replayed: bool = False) -> None:
        try:
            self.store.apply_message(frames, replayed)
        except Exception as err:   # a fault the checks above missed must not end the map: count it, go on
            self.store.skip(f"{type(err).__name__}: {err}")

    def _live(self, frames: list[bytes]) -> None:
        if self._asked is not None:
            self._held.append(frames)
            return
        last = self.store.last_seq
        seq = _seq(frames)
        if self._replay is not None and last is not None and seq is not None and seq > last + 1:
            self._held.append(frames)           # the numbering skipped: ask for what is missing first
            self._ask(last + 1)
            return
        self._apply(frames)

    def _ask(self, start: int) -> None:
        assert self._replay is not None
        try:
            self._replay.send_multipart([b"", start.to_bytes(8, "big", signed=True)], zmq.NOBLOCK)
        except zmq.ZMQError as err:            # nothing connected there yet: the held batches go on
            self._finish_replay(f"{self.replay_endpoint}: {err}")
            return
        self._asked, self._replayed = time.monotonic(), []

    def _read_replay(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if self._asked is None:
                continue                        # the late answer of a request given up on
            if len(frames) == 4 and frames[0] == b"" and _seq(frames[1:]) == END_SEQ:
                self._finish_replay(None)
            elif len(frames) == 4 and frames[0] == b"":
                self._replayed.append(frames[1:])
            else:
                self._finish_replay(f"{self.replay_endpoint} answered with {len(frames)} frames; expected "
                                    "an empty frame, topic, sequence and payload")

    def _finish_replay(self, problem: str | None) -> None:
        """Apply the replayed batches in order, then the held live ones they did not already hold."""
        replayed = sorted(((_seq(f) or 0, f) for f in self._replayed), key=lambda sf: sf[0])
        for seq, frames in replayed:
            if self.store.last_seq is None or seq > self.store.last_seq:
                self._apply(frames, replayed=True)
        seen = {seq for seq, _ in replayed}
        for frames in self._held:
            if _seq(frames) not in seen:
                self._apply(frames)
        with self.store.changed:
            self._asked, self._replayed, self._held = None, [], []
            self.store.replay_problem = problem
            self.store.changed.notify_all()

    def _watch_link(self) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._replay is not None and self._asked is None:
                    # what was published before we joined (or while the publisher was away);
                    # asked before the join is told, so wait_replayed() after wait_joined() waits for it
                    last = self.store.last_seq
                    self._ask(0 if last is None else last + 1)
                self.store.link(True)
            elif event == zmq.EVENT_DISCONNECTED:
                self.store.link(False)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._close()

    def _close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()


def _seq(frames: Sequence[bytes]) -> int | None:
    """The sequence number of a (topic, seq, payload) message, or None where it has none."""
    return int.from_bytes(frames[1], "big", signed=True) if len(frames) == 3 and len(frames[1]) == 8 else None


def check_endpoint(endpoint: str, flag: str = "--kv-events", field: str = "endpoint") -> None:
    """tcp://HOST:PORT with a numeric port; raises KvEventsError naming what is accepted."""
    prefix = "tcp://"
    host, _, port = endpoint[len(prefix):].rpartition(":") if endpoint.startswith(prefix) else ("", "", "")
    if not host or host == "*" or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvEventsError(f"{flag} {endpoint!r}: expected tcp://HOST:PORT, the {field} given to the "
                            "server's --kv-events-config (a server bound to tcp://*:5557 is reached at "
                            "tcp://SERVER-HOST:5557)")
