"""Client sessions over real sockets: what a SIGKILLed client held comes back after the
grace period; a client that reconnects with its token keeps it; leases through a real
coordinator."""

from __future__ import annotations

import os
import signal

import pytest

from control_children import reserve_pin_and_wait
from control_support import SPAWN, START_TIMEOUT_S, STOP_TIMEOUT_S, wait_for
from index_scenarios import k, store
from tiercache.config import RegionConfig
from tiercache.errors import CoordinatorGoneError, SessionLostError
from tiercache.link.client import Client
from tiercache.control.server import ControlOptions, ControlServer
from tiercache.index.manager import LeaseResult, OffloadingManager
from tiercache.control.sessions import SessionTable

LONG_GRACE = ControlOptions(session_grace_s=600)  # never runs out within a test
SHORT_GRACE = ControlOptions(session_grace_s=0.2)


def spawn_holder(path: str, store_keys, lease_keys=(), load_keys=()):
    """A client process that reserves, leases and loads, then waits; returns it and its token."""
    tokens, holding = SPAWN.Queue(), SPAWN.Event()
    child = SPAWN.Process(target=reserve_pin_and_wait, daemon=True, args=(
        path, list(store_keys), list(lease_keys), list(load_keys), tokens, holding))
    child.start()
    assert holding.wait(START_TIMEOUT_S), "the holder did not get its resources"
    return child, tokens.get(timeout=START_TIMEOUT_S)


def sigkill(child) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.join(STOP_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL


def test_a_sigkilled_client_gives_back_every_slot_and_pin(servers, socket_path):
    """The issue's case: a client reserved 60 of 64 slots and died; they came back never."""
    servers(socket_path, num_blocks=64, options=SHORT_GRACE)
    survivor = Client(socket_path, name="survivor")
    store(survivor, 0, 1, 2, 3)
    child, _ = spawn_holder(socket_path, k(*range(100, 160)), lease_keys=k(0, 1),
                            load_keys=k(2, 3))
    s = survivor.stats()
    assert (s.free_blocks, s.writing_blocks, s.loading_blocks) == (0, 60, 4)
    assert survivor.prepare_store(k(200)) is None  # the cache is stuck while it lives
    sigkill(child)
    s = wait_for(lambda: (lambda s: s if s.writing_blocks == 0 and s.loading_blocks == 0
                          else None)(survivor.stats()), "the dead client's slots come back")
    assert (s.free_blocks, s.ready_blocks) == (60, 4)
    assert (s.sessions_ended, s.released_writing_blocks, s.released_pins) == (1, 60, 4)
    out = survivor.prepare_store(k(*range(300, 364)))  # the whole capacity, evicting 0..3
    assert out is not None and len(out.keys_to_store) == 64
    survivor.close()


def test_a_client_that_reconnects_with_its_token_keeps_what_it_held(servers, socket_path):
    servers(socket_path, num_blocks=8, options=LONG_GRACE)
    with Client(socket_path) as other:
        store(other, 1)
        child, token = spawn_holder(socket_path, k(5, 6), load_keys=k(1))
        sigkill(child)  # a crash of the client library's process, say; its engine goes on
        other.complete_store(k(5, 6))  # not other's reservation: ignored
        assert other.stats().writing_blocks == 2
        with Client(socket_path, session_token=token, name="successor") as heir:
            heir.connect()
            assert heir.resumed and heir.session_token == token and heir.grace_s == 600
            heir.complete_store(k(5, 6))  # its reservations, intact
            heir.complete_load(k(1))  # and its pin
            s = heir.stats()
            assert (s.ready_blocks, s.writing_blocks, s.loading_blocks) == (3, 0, 0)
            assert s.sessions_ended == 0


def test_after_the_grace_period_the_token_opens_a_new_session(servers, socket_path):
    servers(socket_path, num_blocks=8, options=SHORT_GRACE)
    client = Client(socket_path)
    assert client.session_token is None  # not connected yet
    client.connect()
    assert len(client.session_token) == 16 and not client.resumed
    assert client.prepare_store(k(1, 2)) is not None
    token = client.session_token
    client.close()
    with Client(socket_path) as watcher:
        wait_for(lambda: watcher.stats().sessions_ended == 1, "the closed session ends")
        assert watcher.stats().free_blocks == 8
    late = Client(socket_path, session_token=token)
    late.complete_store(k(1, 2))  # nothing of it is left: ignored
    assert not late.resumed and late.session_token != token
    assert late.lookup(k(1, 2)) == 0 and late.stats().writing_blocks == 0
    late.close()


def test_a_resumed_session_moves_to_the_new_connection(servers, socket_path):
    servers(socket_path, num_blocks=8, options=LONG_GRACE)
    first = Client(socket_path)
    first.prepare_store(k(1))
    second = Client(socket_path, session_token=first.session_token)
    second.ping()
    assert second.resumed
    second.complete_store(k(1))
    assert second.lookup(k(1)) == 1
    # The server closed the connection the session left; first's next call finds it closed
    # before sending, reconnects with the token, and the session comes back to it.
    first.ping()
    assert first.resumed
    for client in (first, second):
        client.close()


def test_one_process_keeps_a_bounded_number_of_closed_sessions(socket_path):
    """A process that connects, HELLOs and closes in a loop (12k/s were measured) grew the
    table by a session per close for a whole grace period. Now at most
    ``max_detached_sessions_per_peer`` of its closed sessions are kept: the oldest are ended
    at once (counted, and what they held released), and the kept ones still resume."""
    server = ControlServer(OffloadingManager(8), socket_path, ControlOptions(
        session_grace_s=600, max_detached_sessions_per_peer=8))
    server.start()
    try:
        oldest = Client(socket_path)
        assert oldest.prepare_store(k(1)) is not None
        oldest.close()
        for _ in range(100):
            with Client(socket_path) as client:
                client.connect()
        newest = Client(socket_path)
        assert newest.prepare_store(k(2)) is not None
        newest.close()
        wait_for(lambda: server.stats().sessions_ended == 102 - 8,
                 "every closed session beyond the newest eight ends")
        assert server.num_detached_sessions == 8
        s = server.stats()
        assert (s.released_writing_blocks, s.writing_blocks) == (1, 1)  # the oldest's went
        with Client(socket_path, session_token=newest.session_token) as heir:
            heir.complete_store(k(2))  # its reservation, intact
            assert heir.resumed and heir.lookup(k(2)) == 1
        with Client(socket_path, session_token=oldest.session_token) as late:
            late.connect()
            assert not late.resumed
    finally:
        server.close()


def test_the_bound_counts_only_a_process_s_detached_sessions():
    """The table's side of the bound: a resumed session leaves its process's count, another
    process's sessions are not touched."""
    table = SessionTable(OffloadingManager(4), grace_s=600)
    sessions = []
    for conn, pid in ((1, 7), (2, 7), (3, 7), (4, 9)):
        session = table.hello(conn, b"", "", pid)[0]
        sessions.append(session)
    for conn, session in enumerate(sessions, 1):
        table.detach(session, conn, now=0.0)
    assert [s.owner for s, _ in table.end_detached_beyond(7, keep=2)] == [sessions[0].owner]
    resumed, hello, _ = table.hello(5, sessions[1].token, "")
    assert hello.resumed and resumed is sessions[1]
    assert table.end_detached_beyond(7, keep=1) == []  # only sessions[2] is detached of 7
    assert [s.owner for s, _ in table.end_detached_beyond(7, keep=0)] == [sessions[2].owner]
    assert table.num_detached == 1 and table.num_attached == 1  # pid 9's, and the resumed one
    assert [s.owner for s, _ in table.expire(now=601.0)] == [sessions[3].owner]


def test_a_restarted_server_knows_no_token(servers, socket_path):
    server = servers(socket_path, options=LONG_GRACE)
    client = Client(socket_path)
    client.prepare_store(k(1))
    server.kill()
    with pytest.raises(CoordinatorGoneError):
        client.ping()
    servers(socket_path, options=LONG_GRACE)
    with pytest.raises(SessionLostError, match="no longer knows"):
        client.ping()  # a server without a region keeps no session: said once
    client.ping()
    assert not client.resumed  # a new session: the old one died with its server
    assert client.stats().writing_blocks == 0
    client.close()


def test_leases_through_a_real_coordinator(make_config, tmp_path):
    from tiercache.service.process import CoordinatorProcess

    config = make_config(region=RegionConfig(capacity_bytes=None, num_blocks=4,
                                             prefault_threads=1), index_session_grace_s=0.2)
    with CoordinatorProcess(config, tmp_path) as coordinator, Client(config) as scheduler:
        store(scheduler, 1, 2, 3)
        with Client(config) as writer:
            writer.prepare_store(k(4))
            leases = scheduler.lease_batch([k(1, 2, 9), k(3, 4), k(4), []])
            assert leases == [LeaseResult(2, False), LeaseResult(1, True), LeaseResult(0, True),
                              LeaseResult(0, False)]
            writer.complete_store(k(4))
        assert scheduler.lease(k(4)) == LeaseResult(1, False)  # written now: a hit
        # Everything readable is leased: a store finds nothing to evict.
        assert scheduler.prepare_store(k(5)) is None
        assert scheduler.release(k(1, 2, 3, 4)) == 4
        # each lease is an access (keys[0] most recent): 2 was leased least recently
        assert scheduler.prepare_store(k(5)).evicted_keys == tuple(k(2))
        s = scheduler.stats()
        assert (s.leased_blocks, s.loading_blocks) == (4, 0)
        assert "control socket" in coordinator.output()
