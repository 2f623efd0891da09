"""``EventPublisher``: the thread that turns the sink's changes into vLLM's KV event batches
on a ZMQ PUB socket, and answers replay requests on a ROUTER socket.

Every ``batch_interval_s`` it ``take``s what changed (``tiercache.events.sink``), turns each
key into its engine's hash (``tiercache.link.namespaces``), and publishes per namespace
batches of at most ``MAX_HASHES_PER_BATCH`` block hashes (``tiercache.events.wire`` has the
frames; a batch encodes to less than ``MAX_BATCH_BYTES``), each numbered in one sequence
for the whole stream and kept for replay (``tiercache.events.replay``). A resync publishes
``AllBlocksCleared`` on the bare topic first. A stop publishes what is left, then
``AllBlocksCleared`` (the node's cache is no longer served), and closes both sockets.

Never in the index's way: the hook only touches the sink; this thread owns both sockets
and everything it sends. What peers may hold is bounded (``EventsConfig.peer_memory_bytes``):

* ZMQ's PUB drops a batch for a subscriber whose queue holds ``hwm`` batches (it sees a gap
  in the sequence numbers and may ask for a replay); replay answers go out as the
  requester's queue (``hwm`` batches, ``ROUTER_MANDATORY``) takes them
  (``tiercache.events.replay.Replays``), at most ``REPLAY_BUDGET`` batches between two
  looks at the sockets, so a replay flood never holds the interpreter the control plane
  shares for long;
* a batch is sent as one ``zmq.Frame``, kept by the replay buffer: every queue it sits in
  shares its bytes;
* each port's ``PeerTable`` (``tiercache.events.peers``) caps its connections at
  ``max_peers`` and drops a peer that acknowledged nothing for ``peer_timeout_s`` while
  bytes waited for it (and a subscriber sending more than subscriptions need), counted by
  reason; a peer must finish ZMQ's handshake within ``peer_timeout_s``, and TCP keepalive
  finds peers that vanished;
* incoming messages are bounded (``MAX_INBOUND_BYTES``: a peer sending more is disconnected
  by ZMQ; at most ``INBOUND_HWM`` wait per peer), and at most ``MAX_REPLAYS_PER_ROUND``
  requests are read between two looks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

import zmq

from tiercache.config.events import MAX_BATCH_BYTES, EventsConfig
from tiercache.errors import ServiceError
from tiercache.events import wire
from tiercache.link.namespaces import NAMESPACE_BYTES, KeyHasher, NamespaceInfo
from tiercache.events.peers import CHECK_INTERVAL_S, PeerTable
from tiercache.events.replay import Replays, ReplayBuffer, parse_request
from tiercache.events.sink import NodeEventSink, Taken
from tiercache.loglimit import LogLimiter
from tiercache.specs import Medium

log = logging.getLogger(__name__)

MAX_EVENTS_PER_BATCH = 1024  # and hashes per BlockRemoved
MAX_HASHES_PER_BATCH = 1024  # a BlockStored is one, a BlockRemoved one per hash it names
MAX_REPLAYS_PER_ROUND = 16
MAX_INBOUND_BYTES = 1024  # subscriptions (PUB) and replay requests (ROUTER) are tiny
INBOUND_HWM = 16  # of them waiting per peer: past it ZMQ stops reading that peer
# Replay batches sent between two looks at the sockets (~0.5 ms of the interpreter), and
# the wait between two sends while answers wait for room in their requesters' queues.
REPLAY_BUDGET = 64
REPLAY_WAIT_S = 0.002
START_TIMEOUT_S = 10.0


@dataclass
class PublisherStats:
    batches: int = 0
    events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (type, medium)
    replay_requests: int = 0
    bad_replay_requests: int = 0
    replayed_batches: int = 0
    resyncs: int = 0
    undescribed_keys: int = 0  # keys of namespaces no engine described: not published
    unreadable_keys: int = 0  # keys not of their namespace's engine's shape
    send_errors: int = 0
    next_seq: int = 0
    peers: dict[str, int] = field(default_factory=dict)  # connected now, by socket
    peers_dropped: Counter[tuple[str, str]] = field(default_factory=Counter)  # (socket, reason)


class _Namespace:
    """A namespace's publishing state within one round: its topic, hasher and events."""

    __slots__ = ("topic", "hasher", "media", "events")

    def __init__(self, info: NamespaceInfo, config: EventsConfig):
        self.topic = info.topic(config.topic)
        self.hasher: KeyHasher = info.hasher(config.hash_format)
        self.media = {m: info.medium_name(m) for m in Medium}  # as its engine names them
        self.events: list[Any] = []  # structs, and stored events already encoded (Raw)


class EventPublisher:
    """See the module docstring. ``start()`` binds (``ServiceError`` naming the endpoint if
    it cannot), ``close()`` stops; ``endpoint``/``replay_endpoint`` are the bound ones."""

    def __init__(self, config: EventsConfig, sink: NodeEventSink):
        self.config = config
        self._sink = sink
        self._stop = threading.Event()
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stats = PublisherStats()
        self._stats_lock = threading.Lock()
        self._buffer = ReplayBuffer(config.replay_batches)
        self._replays = Replays(self._buffer, config.max_peers)
        self._tables: dict[str, PeerTable] = {}  # by socket: "pub", "replay"
        self._warn = LogLimiter(log, 10.0)
        self._encoder = wire.BatchEncoder()
        self._namespaces: dict[bytes, _Namespace] = {}
        self._stored_encoders: dict[str, wire.StoredEncoder] = {}
        self._counts: Counter[tuple[str, str]] = Counter()  # this round's events, by kind
        self.endpoint = ""
        self.replay_endpoint = ""

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        if self._thread is not None:
            raise ServiceError("the event publisher was already started")
        self._thread = threading.Thread(target=self._run, name="tiercache-events", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            self._stop.set()
            raise ServiceError(f"the event publisher did not bind {self.config.endpoint} "
                               f"within {START_TIMEOUT_S} s")
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish what is left and ``AllBlocksCleared``, close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def stats(self) -> PublisherStats:
        with self._stats_lock:
            s = self._stats
            return PublisherStats(**{**vars(s), "events": Counter(s.events),
                                     "peers": dict(s.peers),
                                     "peers_dropped": Counter(s.peers_dropped)})

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        context = zmq.Context()
        pub = router = None
        try:
            try:
                pub, router = self._bind(context)
            except BaseException as e:
                self._failure = e
                return
            finally:
                self._started.set()
            self._count_peers()  # every socket's series from the start
            self._serve(pub, router)
        finally:
            for table in self._tables.values():
                table.close()
            for sock in (pub, router):
                if sock is not None:
                    sock.close(linger=0)
            context.term()

    def _bind(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        cfg = self.config
        pub = context.socket(zmq.PUB)
        sockets = [pub]
        try:
            self._bounded(pub)
            self._tables["pub"] = PeerTable(context, pub, cfg.max_peers, cfg.peer_timeout_s,
                                            limit_inbound=True)
            self.endpoint = _bind(pub, cfg.endpoint, "events.endpoint")
            self._tables["pub"].bound(_port(self.endpoint))
            router = None
            if cfg.replay_endpoint:
                router = context.socket(zmq.ROUTER)
                sockets.append(router)
                self._bounded(router)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue: Again, not a drop
                self._tables["replay"] = PeerTable(context, router, cfg.max_peers,
                                                   cfg.peer_timeout_s, limit_inbound=False)
                self.replay_endpoint = _bind(router, cfg.replay_endpoint,
                                             "events.replay_endpoint")
                self._tables["replay"].bound(_port(self.replay_endpoint))
            return pub, router
        except BaseException:
            for table in self._tables.values():
                table.close()
            self._tables.clear()
            for sock in sockets:
                sock.close(linger=0)
            raise

    def _bounded(self, sock: zmq.Socket) -> None:
        """What one peer of ``sock`` may hold, and how long it may take."""
        timeout_s = self.config.peer_timeout_s
        for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, self.config.hwm),
                              (zmq.RCVHWM, INBOUND_HWM), (zmq.MAXMSGSIZE, MAX_INBOUND_BYTES),
                              (zmq.HANDSHAKE_IVL, round(timeout_s * 1000)),
                              (zmq.TCP_KEEPALIVE, 1),
                              (zmq.TCP_KEEPALIVE_IDLE, max(1, round(timeout_s))),
                              (zmq.TCP_KEEPALIVE_INTVL, max(1, round(timeout_s))),
                              (zmq.TCP_KEEPALIVE_CNT, 3)):
            sock.setsockopt(option, value)

    def _serve(self, pub: zmq.Socket, router: zmq.Socket | None) -> None:
        interval = self.config.batch_interval_s
        poller = zmq.Poller()
        if router is not None:
            poller.register(router, zmq.POLLIN)
        for table in self._tables.values():
            poller.register(table.monitor, zmq.POLLIN)
        next_flush = time.monotonic() + interval
        next_check = time.monotonic() + CHECK_INTERVAL_S
        while not self._stop.is_set():
            wake = min(next_flush, next_check)
            if len(self._replays):
                wake = min(wake, time.monotonic() + REPLAY_WAIT_S)
            ready = dict(poller.poll(max(0, round((wake - time.monotonic()) * 1000))))
            now = time.monotonic()
            changed = [t for t in self._tables.values() if t.monitor in ready]
            for table in changed:
                table.read_events(now)
            if router is not None:
                if router in ready:
                    self._take_requests(router)
                if len(self._replays):
                    self._serve_replays(router)
            if now >= next_check:
                changed = list(self._tables.values())
                for table in changed:
                    table.check(now)
                next_check = now + CHECK_INTERVAL_S
            if changed:
                self._count_peers()
            if time.monotonic() >= next_flush:
                self._flush(pub)
                next_flush = time.monotonic() + interval
        self._flush(pub)
        self._clear(pub)

    def _count_peers(self) -> None:
        with self._stats_lock:
            self._stats.peers = {name: len(t) for name, t in self._tables.items()}
            self._stats.peers_dropped = Counter(
                {(name, reason.value): n for name, t in self._tables.items()
                 for reason, n in t.dropped.items()})

    # ------------------------------------------------------------------ publishing
    def _flush(self, pub: zmq.Socket) -> None:
        taken = self._sink.take()
        for digest in set(self._namespaces) - set(taken.namespaces):
            del self._namespaces[digest]  # forgotten by the sink
        if taken.resync:
            with self._stats_lock:
                self._stats.resyncs += 1
            self._clear(pub)
        self._counts.clear()
        rounds = self._events_of(taken)
        with self._stats_lock:  # counted before they go: a reader never sees more
            self._stats.events.update(self._counts)
        for ns in rounds:
            for events in _batches(ns.events):
                self._send(pub, ns.topic, events)
            ns.events = []

    def _events_of(self, taken: Taken) -> list[_Namespace]:
        """Per namespace, its events of this round: the announcements, then the changes."""
        cache = self._namespaces
        for digest, info in taken.namespaces.items():
            if digest not in cache:
                cache[digest] = _Namespace(info, self.config)
        touched: dict[bytes, _Namespace] = {}
        undescribed = unreadable = 0
        for held_in, info, keys in taken.announce:
            ns = touched.setdefault(info.digest, cache[info.digest])
            unreadable += self._stored(ns, keys, ns.media[held_in])
        for change in taken.changes:
            by_prefix: dict[bytes, list[bytes]] = {}
            for key in change.keys:
                by_prefix.setdefault(key[:NAMESPACE_BYTES], []).append(key)
            for prefix, keys in by_prefix.items():
                found = cache.get(prefix)
                if found is None:
                    undescribed += len(keys)
                    continue
                touched[prefix] = found
                medium = found.media[change.medium]
                unreadable += (self._removed(found, keys, medium) if change.removed
                               else self._stored(found, keys, medium))
        if undescribed or unreadable:
            with self._stats_lock:
                self._stats.undescribed_keys += undescribed
                self._stats.unreadable_keys += unreadable
        return list(touched.values())

    def _stored(self, ns: _Namespace, keys: list[bytes], medium: str) -> int:
        encoder = self._stored_encoders.get(medium)
        if encoder is None:
            encoder = self._stored_encoders[medium] = wire.StoredEncoder(medium)
        hasher, events, bad, before = ns.hasher, ns.events, 0, len(ns.events)
        for key in keys:
            hashed = hasher(key)
            if hashed is None:
                bad += 1
            elif hashed:  # not ANOTHER_SHARD
                events.append(encoder(*hashed))
        self._counts["BlockStored", medium] += len(events) - before
        return bad

    def _removed(self, ns: _Namespace, keys: list[bytes], medium: str) -> int:
        groups: dict[int, list[int | bytes]] = {}
        bad = 0
        for key in keys:
            hashed = ns.hasher(key)
            if hashed is None:
                bad += 1
            elif hashed:  # not ANOTHER_SHARD
                groups.setdefault(hashed[1], []).append(hashed[0])
        for group, hashes in groups.items():
            for i in range(0, len(hashes), MAX_EVENTS_PER_BATCH):
                ns.events.append(wire.removed(hashes[i:i + MAX_EVENTS_PER_BATCH], medium, group))
                self._counts["BlockRemoved", medium] += 1
        return bad

    def _clear(self, pub: zmq.Socket) -> None:
        with self._stats_lock:
            self._stats.events["AllBlocksCleared", ""] += 1
        self._send(pub, self.config.topic.encode(), [wire.AllBlocksCleared()])

    def _send(self, pub: zmq.Socket, topic: bytes, events: list[Any]) -> None:
        payload = self._encoder.encode(events)
        assert len(payload) <= MAX_BATCH_BYTES, "batches are cut by MAX_HASHES_PER_BATCH"
        frame = zmq.Frame(payload, copy=True)  # libzmq's own bytes, shared by every queue
        with self._stats_lock:
            seq = self._stats.next_seq
            self._stats.next_seq += 1
            self._stats.batches += 1
        self._buffer.append(seq, topic, frame, len(payload))
        try:
            pub.send_multipart([topic, wire.seq_bytes(seq), frame], flags=zmq.NOBLOCK,
                               copy=False)
        except zmq.ZMQError as e:  # PUB drops for slow subscribers; this is something else
            with self._stats_lock:
                self._stats.send_errors += 1
            self._warn.warn("send", "event publisher: sending batch %d failed: %s", seq, e)

    # ------------------------------------------------------------------ replay
    def _take_requests(self, router: zmq.Socket) -> None:
        for _ in range(MAX_REPLAYS_PER_ROUND):
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            request = parse_request(frames)
            with self._stats_lock:
                if request is None:
                    self._stats.bad_replay_requests += 1
                else:
                    self._stats.replay_requests += 1
            if request is None:
                self._warn.warn("replay", "event publisher: ignored a replay request of %d "
                                "frame(s); expected [identity, '', 8-byte sequence]",
                                len(frames))
                continue
            self._replays.request(*request)

    def _serve_replays(self, router: zmq.Socket) -> None:
        sent = self._replays.serve(router, REPLAY_BUDGET)
        if sent:
            with self._stats_lock:
                self._stats.replayed_batches += sent


def _batches(events: list[Any]) -> Iterator[list[Any]]:
    """``events`` cut into batches of at most ``MAX_HASHES_PER_BATCH`` block hashes."""
    batch: list[Any] = []
    weight = 0
    for event in events:
        hashes = len(event.block_hashes) if isinstance(event, wire.BlockRemoved) else 1
        if batch and weight + hashes > MAX_HASHES_PER_BATCH:
            yield batch
            batch, weight = [], 0
        batch.append(event)
        weight += hashes
    if batch:
        yield batch


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def _bind(sock: zmq.Socket, endpoint: str, key: str) -> str:
    """Bind ``endpoint``; the endpoint bound (a port 0 resolved)."""
    if "://[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise ServiceError(f"{key} = {endpoint!r}: cannot bind: {e}") from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
