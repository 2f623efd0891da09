"""The control plane end to end: a server in a real separate process (spawn), ``Client``
calls, and a socket that misbehaving peers cannot break."""

from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import threading

import pytest

import index_scenarios as sc
from control_support import (
    SPAWN, START_TIMEOUT_S, STOP_TIMEOUT_S, closed_by_peer, keys_payload, raw_connection,
    read_frame,
)
from tiercache.config import RegionConfig
from tiercache.errors import (
    ConfigError, ControlSocketError, CoordinatorGoneError, ProtocolError, SessionLostError,
)
from tiercache.link.client import Client
from tiercache.control.server import ControlOptions, ControlServer
from tiercache.index.manager import OffloadingManager
from tiercache.link.payloads import decode_error
from tiercache.link.protocol import (
    HEADER_BYTES, MAGIC, MAX_FRAME_BYTES, MAX_KEYS_PER_CALL, MAX_LISTS_PER_BATCH,
    PROTOCOL_VERSION, PayloadReader, Status, Verb, frame,
)

# ---------------------------------------------------------------- the scenarios, remotely

@pytest.mark.parametrize(("policy", "name"), sc.CASES)
def test_scenario_through_client(servers, socket_path, policy, name):
    servers(socket_path, policy=policy)
    with Client(socket_path) as client:
        sc.run(client, policy, name)


EVENTLESS = [(p, n) for p, n in sc.CASES if n not in sc.USES_EVENTS]


@pytest.mark.parametrize(("policy", "name"), EVENTLESS)
def test_scenario_against_a_real_coordinator(make_config, policy, name):
    from tiercache.service.process import CoordinatorProcess

    config = make_config(
        region=RegionConfig(capacity_bytes=None, num_blocks=sc.CAPACITY_BLOCKS, prefault_threads=1),
        index_policy=policy,
    )
    with CoordinatorProcess(config):
        with Client(config) as client:
            assert client.stats().capacity_blocks == sc.CAPACITY_BLOCKS
            sc.run(client, policy, name)


# ---------------------------------------------------------------- the socket itself

def test_socket_is_owner_only_and_removed_on_clean_stop(servers, socket_path):
    server = servers(socket_path)
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    server.stop()  # asserts exit code 0 and no socket left


def test_a_live_socket_is_not_taken_over(servers, socket_path, tmp_path):
    servers(socket_path)
    with pytest.raises(ControlSocketError, match="served by a live process"):
        ControlServer(OffloadingManager(4), socket_path).start()
    with Client(socket_path) as client:
        client.ping()  # the live server was left alone
    regular = tmp_path / "not-a-socket"
    regular.write_text("keep me")
    with pytest.raises(ControlSocketError, match="is not a socket"):
        ControlServer(OffloadingManager(4), str(regular)).start()
    assert regular.read_text() == "keep me"
    too_long = "/tmp/" + "x" * 120
    with pytest.raises(ControlSocketError, match="at most 107"):
        ControlServer(OffloadingManager(4), too_long).start()
    with pytest.raises(ControlSocketError, match="at most 107"):
        Client(too_long)


def test_in_process_server_closes_cleanly(socket_path):
    with pytest.raises(ConfigError, match="poll_before_sleep_s = 1"):
        ControlOptions(poll_before_sleep_s=1)
    server = ControlServer(OffloadingManager(4), socket_path, ControlOptions(poll_before_sleep_s=0))
    server.start()
    client = Client(socket_path)
    client.ping()
    server.close()
    assert not os.path.exists(socket_path)
    assert not [t for t in threading.enumerate() if t.name == "tiercache-control"]
    with pytest.raises(CoordinatorGoneError):
        client.ping()
    server.close()  # idempotent
    client.close()


# ---------------------------------------------------------------- misbehaving peers

@pytest.mark.parametrize("bad_bytes", [
    pytest.param(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", id="garbage"),
    pytest.param(struct.pack("<4sBBBBII", MAGIC, PROTOCOL_VERSION, Verb.LOOKUP, 0, 0, 1,
                             MAX_FRAME_BYTES + 1), id="oversized"),
    pytest.param(struct.pack("<4sBBBBII", MAGIC, PROTOCOL_VERSION + 1, Verb.PING, 0, 0, 1, 0),
                 id="other-version"),
    pytest.param(struct.pack("<4sBBBBII", MAGIC, PROTOCOL_VERSION, 99, 0, 0, 1, 0),
                 id="unknown-verb"),
    pytest.param(struct.pack("<4sBBBBII", MAGIC, PROTOCOL_VERSION, Verb.PING, Status.ERROR,
                             0, 1, 0), id="response-as-request"),
])
def test_bad_frame_closes_only_that_connection(servers, socket_path, bad_bytes):
    servers(socket_path)
    with Client(socket_path) as bystander:
        sc.store(bystander, 1)
        bad = raw_connection(socket_path)
        bad.sendall(bad_bytes)
        assert closed_by_peer(bad)
        bad.close()
        assert bystander.lookup(sc.k(1)) == 1
    with Client(socket_path) as newcomer:
        assert newcomer.lookup(sc.k(1)) == 1


def test_malformed_payload_is_answered_with_an_error_then_closed(servers, socket_path):
    servers(socket_path)
    sock = raw_connection(socket_path)
    payload = struct.pack("<IH", 2, 1) + b"a"  # two 1-byte keys announced, one byte sent
    sock.sendall(frame(Verb.LOOKUP, 42, payload))
    header, body = read_frame(sock)
    assert (header.verb, header.status, header.request_id) == (Verb.LOOKUP, Status.ERROR, 42)
    error = decode_error(PayloadReader(body))
    assert isinstance(error, ProtocolError) and "truncated" in str(error)
    assert closed_by_peer(sock)
    sock.close()


def test_a_request_before_hello_is_refused_and_closed(servers, socket_path):
    servers(socket_path)
    sock = raw_connection(socket_path, hello=False)
    sock.sendall(frame(Verb.PREPARE_STORE, 7, keys_payload(sc.k(1))))
    header, body = read_frame(sock)
    assert (header.verb, header.status, header.request_id) == (Verb.PREPARE_STORE, Status.ERROR, 7)
    assert "first request must be HELLO" in str(decode_error(PayloadReader(body)))
    assert closed_by_peer(sock)
    sock.close()
    with Client(socket_path) as client:
        assert client.stats().writing_blocks == 0  # the refused store reserved nothing


def test_truncated_frame_held_open_does_not_stall_others(servers, socket_path):
    servers(socket_path)
    stalled = raw_connection(socket_path)
    whole = frame(Verb.LOOKUP, 1, keys_payload(sc.k(1, 2, 3)))
    stalled.sendall(whole[:HEADER_BYTES + 5])  # the rest never comes
    with Client(socket_path) as other:
        sc.store(other, 1)
        assert other.lookup(sc.k(1)) == 1
        stalled.close()  # gone mid-frame
        assert other.lookup(sc.k(1)) == 1


def test_a_client_that_never_reads_does_not_stall_others(servers, socket_path):
    servers(socket_path)
    greedy = raw_connection(socket_path)
    greedy.setblocking(False)
    pings = frame(Verb.PING, 1, b"") * 50_000
    sent = 0
    try:
        while sent < len(pings):
            sent += greedy.send(pings[sent:])
    except BlockingIOError:  # its buffers are full: the server stopped reading from it
        pass
    with Client(socket_path) as other:
        sc.store(other, 1)
        assert other.lookup(sc.k(1)) == 1
    greedy.close()


def hammer(path: str, base: int, running) -> None:
    """Child: store and look up its own keys forever (until SIGKILLed)."""
    with Client(path) as client:
        i = 0
        while True:
            keys = [b"%d" % (base + i % 10 + j) for j in range(8)]  # 17 keys in all
            out = client.prepare_store(keys)
            if out is not None:
                client.complete_store(list(out.keys_to_store))
            client.lookup(keys)
            i += 1
            if i == 20:
                running.set()


def send_half_a_frame_and_wait(path: str, sent, release) -> None:
    """Child: send part of a frame, then hang (to be SIGKILLed mid-call)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(frame(Verb.PREPARE_STORE, 1, keys_payload([b"x"] * 100))[:40])
    sent.set()
    release.wait(START_TIMEOUT_S)


def test_clients_killed_mid_call_do_not_disturb_others(servers, socket_path):
    servers(socket_path, num_blocks=64)
    flags = [SPAWN.Event() for _ in range(3)]
    release = SPAWN.Event()
    children = [
        SPAWN.Process(target=hammer, args=(socket_path, 1000, flags[0]), daemon=True),
        SPAWN.Process(target=hammer, args=(socket_path, 2000, flags[1]), daemon=True),
        SPAWN.Process(target=send_half_a_frame_and_wait, args=(socket_path, flags[2], release),
                      daemon=True),
    ]
    try:
        for child in children:
            child.start()
        with Client(socket_path) as survivor:
            sc.store(survivor, 1)
            for flag in flags:
                assert flag.wait(START_TIMEOUT_S)
            for child in children:
                os.kill(child.pid, signal.SIGKILL)
            for child in children:
                child.join(STOP_TIMEOUT_S)
                assert child.exitcode == -signal.SIGKILL
            assert survivor.lookup(sc.k(1)) == 1
            s = survivor.stats()
            assert s.free_blocks + s.writing_blocks + s.ready_blocks + s.loading_blocks == 64
            # Killed clients' reservations stay WRITING until their sessions' grace period
            # ends (tests/index/test_sessions.py); the index stays consistent meanwhile.
            assert survivor.prepare_store(sc.k(2)) is not None
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
            child.join(STOP_TIMEOUT_S)


def store_and_check(path: str, base: int, rounds: int) -> None:
    """Child: store its own keys in rounds; asserts what it reads back."""
    with Client(path) as client:
        for r in range(rounds):
            keys = [b"%d-%d-%d" % (base, r, j) for j in range(4)]
            out = client.prepare_store(keys)
            assert out is not None and out.keys_to_store == tuple(keys)
            client.complete_store(keys)
            assert client.lookup(keys) == 4
            client.prepare_load(keys)
            client.complete_load(keys)


def test_many_concurrent_clients(servers, socket_path):
    servers(socket_path, num_blocks=4096)
    children = [SPAWN.Process(target=store_and_check, args=(socket_path, b, 50), daemon=True)
                for b in range(6)]
    for child in children:
        child.start()
    for child in children:
        child.join(START_TIMEOUT_S)
    assert [c.exitcode for c in children] == [0] * 6
    with Client(socket_path) as client:
        s = client.stats()
        assert (s.stored_blocks, s.loaded_blocks, s.ready_blocks) == (1200, 1200, 1200)


# ---------------------------------------------------------------- the client's side

def test_coordinator_killed_then_restarted(servers, socket_path):
    first = servers(socket_path)
    client = Client(socket_path)
    sc.store(client, 1)
    first.kill()  # SIGKILL: the socket file stays behind, nobody listens
    with pytest.raises(CoordinatorGoneError, match="went away|no coordinator"):
        client.lookup(sc.k(1))
    with pytest.raises(CoordinatorGoneError, match="no coordinator"):
        client.lookup(sc.k(1))
    servers(socket_path)  # takes over the stale socket
    with pytest.raises(SessionLostError, match="no longer knows this client's session"):
        client.lookup(sc.k(1))  # a server without a region keeps no sessions: said once
    assert not client.resumed
    assert client.lookup(sc.k(1)) == 0  # reconnected; a fresh index
    sc.store(client, 1)
    assert client.lookup(sc.k(1)) == 1
    client.close()


def test_no_coordinator_yet_then_one(servers, socket_path):
    client = Client(socket_path)
    with pytest.raises(CoordinatorGoneError, match=socket_path):
        client.ping()
    servers(socket_path)
    assert client.ping() > 0
    client.close()


def test_a_silent_coordinator_times_out(socket_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(1)
    try:
        client = Client(socket_path, timeout_s=0.2)
        with pytest.raises(CoordinatorGoneError, match="went away during HELLO"):  # the handshake
            client.ping()
        client.close()
    finally:
        listener.close()
        os.unlink(socket_path)


def test_too_many_keys_are_refused_before_sending(servers, socket_path):
    servers(socket_path)
    with Client(socket_path) as client:
        with pytest.raises(ProtocolError, match=f"at most {MAX_KEYS_PER_CALL}"):
            client.lookup([b"k"] * (MAX_KEYS_PER_CALL + 1))
        assert client.lookup([b"k"]) == 0  # the connection is still in step


def test_take_events_spans_several_frames(servers, socket_path):
    total = MAX_KEYS_PER_CALL + 100
    servers(socket_path, num_blocks=total)
    keys = [b"%08d" % i for i in range(total)]
    with Client(socket_path) as client:
        for batch in (keys[:MAX_KEYS_PER_CALL], keys[MAX_KEYS_PER_CALL:]):
            out = client.prepare_store(batch)
            client.complete_store(list(out.keys_to_store))
        events = client.take_events()
        assert [len(e.keys) for e in events] == [MAX_KEYS_PER_CALL, 100]
        assert [key for e in events for key in e.keys] == keys
        assert client.take_events() == []


def test_a_lease_batch_past_one_requests_bounds_is_sent_as_several(servers, socket_path):
    """An engine's step may probe more requests than one LEASE_BATCH may carry (lists or
    keys): the client sends them as several requests, each list still leased whole, so
    an engine never meets the coordinator's bound. A single list longer than one request
    allows is refused before anything is sent."""
    servers(socket_path, num_blocks=64)
    with Client(socket_path) as client:
        sc.store(client, *range(40))
        lists = [sc.k(i % 50, i % 50 + 1) for i in range(3 * MAX_LISTS_PER_BATCH)]  # 3 requests
        results = client.lease_batch(lists)
        assert [r.num_hit for r in results] == [2 if i % 50 < 39 else int(i % 50 == 39)
                                                for i in range(len(lists))]
        assert all(len(r.spec) == r.num_hit for r in results)
        long_lists = [sc.k(*range(40)) + [b"x%d" % i for i in range(10_000)] for _ in range(2)]
        assert [r.num_hit for r in client.lease_batch(long_lists)] == [40, 40]  # 2 requests
        held = sum(r.num_hit for r in results) + 80
        assert client.release(sc.k(*range(40))) == held
        with pytest.raises(ProtocolError, match=f"at most {MAX_KEYS_PER_CALL} keys per list"):
            client.lease_batch([sc.k(1), [b"y"] * (MAX_KEYS_PER_CALL + 1)])
        assert client.stats().loading_blocks == 0  # nothing was sent, nothing is held
