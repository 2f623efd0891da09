"""The event ports against peers that never read (issue 39): a real ``tiercache serve`` whose
stream is kept busy, and against it replay DEALERs that ask and never read, SUBs (RCVHWM 1)
that never read, and hand-written ZMTP peers (``zmtp_peer.py``; another uid where the tests
run as root) that greet and stop, or subscribe, or ask for replays, and never read. The
coordinator's memory (VmRSS) stays within ``EventsConfig.peer_memory_bytes`` of what it was
before they came, the connections within ``max_peers`` a port, and every drop is counted.
The ports' bookkeeping (``tiercache.events.peers``) is also tested on its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import users
import zmq

from tiercache.config import EventsConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.events import NodeEventStream
from tiercache.link.namespaces import EngineFamily
from tiercache.events.peers import DropReason
from tiercache.service.process import CoordinatorProcess
from tiercache.specs import Medium

from e2e_support import metrics_url, sample, scrape
from event_support import WAIT_S, namespace, stream_endpoints, vllm_key

ZMTP_PEER = Path(__file__).resolve().parents[1] / "support" / "zmtp_peer.py"
NUM_BLOCKS = 4096
NAMESPACES = 8  # each round publishes a batch per namespace: small ones (pyzmq copied those)
STORE_KEYS = 512  # each store evicts as many: ~8 KiB batches
REPLAY_BATCHES = 1000  # ~8 MB buffered: what each replay request used to copy
HOLD_STORES_PER_S = 20.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _until(condition, what: str, wait_s: float = WAIT_S):
    deadline = time.monotonic() + wait_s
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {wait_s} s"
        time.sleep(0.05)
    return found


class Storer(threading.Thread):
    """Keeps the stream busy: stores of new keys into a full cache (each evicts as many),
    spread over ``NAMESPACES`` namespaces; as fast as it can until ``pace()``, then at
    ``HOLD_STORES_PER_S``."""

    def __init__(self, config):
        super().__init__(daemon=True)
        self.config = config
        self.halt = threading.Event()
        self.paced = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Client(self.config) as client:
                spaces = [namespace(f"m{i}") for i in range(NAMESPACES)]
                for ns in spaces:
                    client.describe(EngineFamily.VLLM, ns.description)
                n, paced, paced_at = 0, 0, 0.0
                while not self.halt.is_set():
                    keys = [vllm_key(spaces[k % NAMESPACES], k.to_bytes(32, "big"))
                            for k in range(n * STORE_KEYS, (n + 1) * STORE_KEYS)]
                    out = client.prepare_store(keys)
                    if out is not None:
                        client.complete_store(list(out.keys_to_store))
                    n += 1
                    if self.paced.is_set():
                        paced_at = paced_at or time.monotonic()
                        paced += 1
                        self.halt.wait(max(0.0, paced_at + paced / HOLD_STORES_PER_S
                                           - time.monotonic()))
        except BaseException as e:
            self.error = e


class Watch(threading.Thread):
    """Samples the coordinator's RSS; past ``limit`` it kills the coordinator (the machine
    is shared: a failing run must not take its memory) and says so."""

    def __init__(self, coordinator: CoordinatorProcess):
        super().__init__(daemon=True)
        self.coordinator = coordinator
        self.limit = 1 << 62
        self.peak = 0
        self.passed = False
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.02):
            try:
                now = rss_bytes(self.coordinator.pid)
            except (OSError, AssertionError):
                return
            self.peak = max(self.peak, now)
            if now > self.limit:
                self.passed = True
                self.coordinator.kill()
                return

    def window(self, seconds: float) -> int:
        """The peak over the next ``seconds``."""
        self.peak = 0
        time.sleep(seconds)
        return self.peak


@pytest.fixture(scope="module")
def peer_user():
    """Another uid for the raw peers where the tests run as root; else None (ours)."""
    if os.geteuid() != 0:
        yield None
        return
    yield from users.other_user()


def _start_raw_peers(user, events: str, replay: str) -> subprocess.Popen:
    argv = [user.python if user else sys.executable, "-c", ZMTP_PEER.read_text(), events,
            replay, "2", "3", "3", "4"]  # greeters, subscribers, requesters, requests each
    kwargs = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc = user.popen(argv, **kwargs) if user else subprocess.Popen(argv, **kwargs)
    assert proc.stdout.readline().startswith("ready")
    return proc


def _zmq_never_readers(context: zmq.Context, events: str, replay: str) -> list[zmq.Socket]:
    held = []
    for _ in range(6):
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.connect(replay)
        for _ in range(4):
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        held.append(dealer)
    for _ in range(6):
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(events)
        held.append(sub)
    return held


def _dropped(samples, socket_name: str, reason: DropReason) -> float:
    return sample(samples, "tiercache_events_peers_dropped_total", socket=socket_name,
                  reason=reason.value)


def test_peers_that_never_read_hold_no_more_than_the_bound_and_are_dropped(
        make_config, tmp_path, peer_user):
    events = EventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                          batch_interval_s=0.01, replay_batches=REPLAY_BATCHES,
                          peer_timeout_s=1.0)
    config = make_config(world_size=1, kv=KVGeometry(page_bytes=(256,)),
                         region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS,
                                             prefault_threads=1), events=events)
    bound = events.peer_memory_bytes
    with CoordinatorProcess(config, tmp_path) as coordinator:
        url = metrics_url(coordinator)
        endpoint, replay = stream_endpoints(coordinator)
        storer = Storer(config)
        storer.start()
        watch = Watch(coordinator)
        watch.start()
        context = zmq.Context()
        held: list[zmq.Socket] = []
        raw = None
        try:
            _until(lambda: storer.error or sample(scrape(url), "tiercache_events_batches_total")
                   > REPLAY_BATCHES, "the replay buffer full")
            assert storer.error is None, storer.error
            storer.paced.set()
            baseline = watch.window(1.0)  # the stream's own steady state
            watch.limit = baseline + bound
            held = _zmq_never_readers(context, endpoint, replay)
            raw = _start_raw_peers(peer_user, endpoint, replay)

            def every_kind_dropped():
                samples = scrape(url)
                for name in ("pub", "replay"):
                    connected = sample(samples, "tiercache_events_peers", socket=name)
                    assert connected <= events.max_peers, (name, connected)
                return all(_dropped(samples, name, reason) >= 1 for name in ("pub", "replay")
                           for reason in (DropReason.OVER_CAP, DropReason.STALLED))

            _until(lambda: watch.passed or every_kind_dropped(), "stalled and over-cap drops")
            peak = watch.window(2 * events.peer_timeout_s)  # what the peers hold, dropped
        finally:                                           # or coming back
            for sock in held:
                sock.close(linger=0)
            context.term()
            if raw is not None:
                raw.stdin.close()
                raw.wait(30)
            storer.halt.set()
            storer.join(30)
            watch.halt.set()
            watch.join(5)
        assert not watch.passed, (f"RSS passed {watch.limit >> 20} MiB (baseline "
                                  f"{baseline >> 20} MiB + bound {bound >> 20} MiB): killed")
        assert max(peak, watch.peak) - baseline <= bound
        assert storer.error is None, storer.error
        assert coordinator.proc.poll() is None


# ---------------------------------------------------------------------- the table alone
@pytest.fixture
def start_stream():
    streams = []

    def start(**overrides) -> NodeEventStream:
        fields = dict(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                      batch_interval_s=0.02, **overrides)
        stream = NodeEventStream(EventsConfig(**fields))
        stream.start()
        streams.append(stream)
        return stream

    yield start
    for stream in streams:
        stream.close()


def _connect(endpoint: str) -> socket.socket:
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=WAIT_S)


def _ended(sock: socket.socket) -> bool:
    """Whether the other end closed (after ZMQ's greeting, which comes first)."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


def _peers(stream: NodeEventStream, name: str) -> int:
    return stream.stats().publisher.peers.get(name, -1)


def test_a_connection_past_the_cap_is_closed_and_counted_and_a_freed_place_is_taken(
        start_stream):
    stream = start_stream(max_peers=2)
    endpoint = stream.publisher.endpoint
    first, second = _connect(endpoint), _connect(endpoint)
    _until(lambda: _peers(stream, "pub") == 2, "two peers")
    third = _connect(endpoint)
    third.settimeout(WAIT_S)
    assert _ended(third)  # closed by the coordinator
    _until(lambda: stream.stats().publisher.peers_dropped["pub", DropReason.OVER_CAP.value],
           "the drop counted")
    assert _peers(stream, "pub") == 2
    first.close()
    _until(lambda: _peers(stream, "pub") == 1, "the first gone")
    fourth = _connect(endpoint)
    _until(lambda: _peers(stream, "pub") == 2, "the fourth in its place")
    for sock in (second, third, fourth):
        sock.close()


def test_a_subscriber_that_stops_reading_is_dropped_one_that_reads_is_not(start_stream):
    stream = start_stream(hwm=2, peer_timeout_s=0.5)
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    with zmq.Context() as context:
        stalled, reader = context.socket(zmq.SUB), context.socket(zmq.SUB)
        for sub in (stalled, reader):
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.setsockopt(zmq.RECONNECT_IVL, -1)  # dropped stays dropped
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(stream.publisher.endpoint)
        _until(lambda: _peers(stream, "pub") == 2, "both connected")
        stop = threading.Event()
        received = []

        def read() -> None:
            while not stop.is_set():
                if reader.poll(50):
                    received.append(reader.recv_multipart())

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        n = 0
        while not stream.stats().publisher.peers_dropped["pub", DropReason.STALLED.value]:
            keys = [vllm_key(ns, k.to_bytes(32, "big")) for k in range(n, n + 1024)]
            stream.sink.stored(keys, Medium.CPU)  # ~128 KiB a batch, until it is dropped
            n += 1024
            assert n < 1 << 22, "no drop after 4 M keys"
            time.sleep(0.01)
        _until(lambda: _peers(stream, "pub") == 1, "the stalled one gone")
        stop.set()
        thread.join(10)
        assert received  # the reader was served all along, and is still connected
        assert stream.stats().publisher.peers_dropped["pub", DropReason.STALLED.value] == 1
        stalled.close()
        reader.close()


def test_a_subscriber_sending_more_than_subscriptions_need_is_dropped(start_stream):
    """(The PUB takes subscriptions in while it sends: the stream is kept busy.)"""
    stream = start_stream()
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    keys = (vllm_key(ns, k.to_bytes(32, "big")) for k in range(1 << 20))

    def dropped() -> int:
        stream.sink.stored([next(keys)], Medium.CPU)
        return stream.stats().publisher.peers_dropped["pub", DropReason.INBOUND.value]

    with zmq.Context() as context:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, -1)
        sub.connect(stream.publisher.endpoint)
        _until(lambda: _peers(stream, "pub") == 1, "connected")
        for i in range(200):  # 200 x 1000 bytes of subscriptions: each grows the PUB's trie
            sub.setsockopt(zmq.SUBSCRIBE, b"%04d" % i + b"x" * 996)
        _until(dropped, "the inbound drop")
        _until(lambda: _peers(stream, "pub") == 0, "gone")
        sub.close()


def test_replay_answers_wait_for_room_and_a_flood_of_requests_queues_no_more(start_stream):
    """A requester that does not read gets what its queue (``hwm``) and the kernel's
    buffers take, however many requests it sends (each used to queue a whole replay);
    once it reads, it gets the last request's answer to the end."""
    stream = start_stream(hwm=4)
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    for i in range(100):  # 100 batches of 1024 events: ~13 MB, more than the kernel holds
        before = stream.stats().publisher.batches
        stream.sink.stored([vllm_key(ns, k.to_bytes(32, "big"))
                            for k in range(i * 1024, (i + 1) * 1024)], Medium.CPU)
        _until(lambda: stream.stats().publisher.batches > before, "a batch out")
    with zmq.Context() as context:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.connect(stream.publisher.replay_endpoint)
        for _ in range(50):
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        _until(lambda: stream.stats().publisher.replay_requests == 50, "requests read")
        sent = stream.stats().publisher.replayed_batches
        assert sent < 100  # not one whole replay, let alone 50
        seqs = []
        while True:
            assert dealer.poll(WAIT_S * 1000)
            _, topic, seq, _ = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            seqs.append(int.from_bytes(seq, "big"))
        last = len(seqs) - 1 - seqs[::-1].index(0)  # the last request's answer starts here
        assert seqs[last:] == list(range(len(seqs) - last)) and len(seqs) - last >= 100
        dealer.close()
