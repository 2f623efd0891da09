"""The control server's connection bounds (``tiercache.control.connections``) against real
processes and sockets: HELLO and idle deadlines, room made at the cap, the per-process cap,
and the hog that gives way over the partial-request budget. Every case is one the outside
tester found: a frozen process on every slot locked everyone out, and a few partial
requests made a live client's large lookup fail."""

from __future__ import annotations

import logging
import os
import signal
import time

import psutil
import pytest

from control_children import (
    hold_connections_and_stop, hold_partial_requests_and_stop, ping_and_report,
    send_a_request_in_two_parts,
)
from control_support import (
    SPAWN, START_TIMEOUT_S, STOP_TIMEOUT_S, closed_by_peer, is_open, raw_connection,
    raw_session, read_frame, request_header, unread_bytes, wait_for,
)
from index_scenarios import k, store
from tiercache.errors import ControlSocketError
from tiercache.link.client import Client
from tiercache.control.server import ControlOptions, ControlServer
from tiercache.index.manager import OffloadingManager
from tiercache.link.payloads import decode_error
from tiercache.link.protocol import (
    MAX_KEY_BYTES, MAX_KEYS_PER_CALL, PayloadReader, PayloadWriter, Status,
    Verb, frame,
)

MiB = 1 << 20
NEVER_S = 600.0  # a deadline that does not come within a test


def spawn(target, *args):
    child = SPAWN.Process(target=target, args=args, daemon=True)
    child.start()
    return child


def sigkill(child) -> None:
    """SIGKILL (a stopped child dies too) and reap."""
    if child.is_alive():
        os.kill(child.pid, signal.SIGKILL)
    child.join(STOP_TIMEOUT_S)


def wait_stopped(child) -> None:
    wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_STOPPED,
             "the child stops itself")


def test_a_frozen_process_on_every_slot_locks_nobody_out(servers, socket_path):
    """The outside tester's case: one process opens every connection (half never send
    HELLO, half HELLO and hold nothing) and is SIGSTOPped; new clients were all refused.
    Now each is served: a connection holding nothing makes room (no deadline helps here:
    they are all far off)."""
    servers(socket_path, options=ControlOptions(
        max_connections=16, hello_timeout_s=NEVER_S, idle_timeout_s=NEVER_S))
    ready = SPAWN.Event()
    child = spawn(hold_connections_and_stop, socket_path, 8, 8, ready)
    try:
        assert ready.wait(START_TIMEOUT_S), "the child did not open its connections"
        wait_stopped(child)
        for i in range(20):
            with Client(socket_path, name=f"newcomer {i}") as client:
                client.ping()
                assert client.lookup(k(1)) == 0
    finally:
        sigkill(child)


def test_at_the_cap_the_quietest_connection_holding_nothing_makes_room(servers, socket_path):
    """Without HELLO first, then the one quiet longest of those holding nothing; one that
    holds a pin is never closed, and when all hold something the newcomer is refused."""
    servers(socket_path, options=ControlOptions(
        max_connections=4, hello_timeout_s=NEVER_S, idle_timeout_s=NEVER_S))
    holder = Client(socket_path, name="holder")
    store(holder, 1)
    assert holder.lease(k(1)).num_hit == 1  # quiet longest of all, but it holds a pin
    quiet = raw_connection(socket_path)
    silent = raw_connection(socket_path, hello=False)
    fresh = raw_connection(socket_path)
    newcomers = [Client(socket_path, name=f"newcomer {i}") for i in range(4)]
    try:
        newcomers[0].ping()
        header, body = read_frame(silent)  # the one without HELLO went first, told why
        assert (header.status, header.request_id) == (Status.ERROR, 0)
        assert "control.max_connections" in str(decode_error(PayloadReader(body)))
        assert closed_by_peer(silent)
        assert is_open(quiet) and is_open(fresh)
        newcomers[1].ping()
        assert closed_by_peer(quiet)  # then the quietest holding nothing, not the holder
        assert is_open(fresh)
        holder.ping()  # still served on its connection (a closed one would raise here)
        newcomers[2].ping()
        assert closed_by_peer(fresh)
        for i, client in enumerate(newcomers[:3]):
            assert client.prepare_store(k(10 + i)) is not None  # now every one holds
        with pytest.raises(ControlSocketError, match="maximum of 4 control connections"):
            newcomers[3].ping()
        holder.release(k(1))
        newcomers[3].ping()  # the holder, holding nothing now, made room
    finally:
        for sock in (quiet, silent, fresh):
            sock.close()
        for client in [holder, *newcomers]:
            client.close()


def test_one_process_gets_at_most_its_share_of_connections(servers, socket_path):
    servers(socket_path, options=ControlOptions(max_connections=16, max_connections_per_peer=3))
    held = [raw_connection(socket_path) for _ in range(3)]
    answers = SPAWN.Queue()
    try:
        with pytest.raises(ControlSocketError,
                           match=r"has 3 control connections open.*max_connections_per_peer = 3"):
            Client(socket_path).ping()
        child = spawn(ping_and_report, socket_path, answers)
        result = answers.get(timeout=START_TIMEOUT_S)
        child.join(STOP_TIMEOUT_S)
        assert isinstance(result, float), f"another process was not served: {result}"
        assert all(is_open(sock) for sock in held)
        held.pop().close()
        wait_for(lambda: _pinged(socket_path), "a slot of its own frees when it closes one")
    finally:
        for sock in held:
            sock.close()


def _pinged(path: str) -> bool:
    try:
        with Client(path) as client:
            client.ping()
        return True
    except ControlSocketError:
        return False


def test_a_connection_without_hello_in_time_is_closed_with_the_reason(servers, socket_path):
    servers(socket_path, options=ControlOptions(hello_timeout_s=1.0, idle_timeout_s=NEVER_S))
    greeted = raw_connection(socket_path)
    silent = raw_connection(socket_path, hello=False)
    silent.settimeout(10)
    try:
        header, body = read_frame(silent)
        assert (header.status, header.request_id) == (Status.ERROR, 0)
        assert "control.hello_timeout_s" in str(decode_error(PayloadReader(body)))
        assert closed_by_peer(silent)
        greeted.sendall(frame(Verb.PING, 2, b""))  # past its own HELLO deadline: served
        header, _ = read_frame(greeted)
        assert (header.verb, header.status) == (Verb.PING, Status.OK)
    finally:
        greeted.close()
        silent.close()


def test_an_idle_connection_holding_nothing_is_closed_and_its_session_kept(servers,
                                                                            socket_path):
    server = servers(socket_path, options=ControlOptions(
        idle_timeout_s=1.0, hello_timeout_s=NEVER_S, session_grace_s=NEVER_S))
    reserving = Client(socket_path, name="reserving")  # holds from its first call on
    assert reserving.prepare_store(k(1, 2)) is not None
    reserving.complete_store(k(1))
    pinning = Client(socket_path, name="pinning")
    assert pinning.lease(k(1)).num_hit == 1
    idler, token = raw_session(socket_path)  # active after both: its deadline comes last
    try:
        assert closed_by_peer(idler)
        reserving.ping()  # both still on their first connection (a closed one would raise)
        pinning.ping()
        proc = psutil.Process(server.proc.pid)
        cpu_before, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(2.5)  # two more idle deadlines of the holders: a loop spinning on them
        elapsed = time.monotonic() - t0  # would burn a core
        cpu = sum(proc.cpu_times()[:2]) - cpu_before
        assert cpu < 0.5 * elapsed, f"{cpu:.2f} s of CPU in {elapsed:.2f} s: spinning"
        with Client(socket_path, session_token=token) as heir:
            heir.connect()
            assert heir.resumed  # closed, not ended: its client would resume it
    finally:
        idler.close()
        reserving.close()
        pinning.close()


def test_a_large_request_fits_beside_partial_requests_filling_the_budget(servers,
                                                                          socket_path):
    """Another process's three stopped connections hold 3.9 MiB of a request each (11.7 of
    a 12 MiB budget); a live client's 4 MiB lookup used to fail with "coordinator went
    away". Now the hog quiet longest is closed, only as many as the lookup needs."""
    servers(socket_path, options=ControlOptions(max_buffered_bytes=12 * MiB))
    ready, report = SPAWN.Event(), SPAWN.Queue()
    child = spawn(hold_partial_requests_and_stop, socket_path, 3, 39 * MiB // 10, ready, report)
    try:
        with Client(socket_path) as client:
            store(client, 1)
            assert ready.wait(START_TIMEOUT_S), "the child did not send its partial requests"
            wait_stopped(child)
            keys = k(1) + [b"%0*d" % (MAX_KEY_BYTES, i) for i in range(MAX_KEYS_PER_CALL - 1)]
            assert client.lookup(keys) == 1
        os.kill(child.pid, signal.SIGCONT)
        assert report.get(timeout=START_TIMEOUT_S) == [True, False, False]
    finally:
        sigkill(child)


def test_over_the_budget_the_process_holding_most_gives_way(servers, socket_path):
    """Another process's single 2.5 MiB partial request is the largest one held, but this
    process holds more in all (nine of 1 MiB); its tenth goes over the 12 MiB budget. The
    oldest of its own gives way: not the reader (it was closed before), and not the other
    process's larger request (it was, had the largest connection been closed)."""
    servers(socket_path, options=ControlOptions(max_buffered_bytes=12 * MiB))
    keys = [b"%0*d" % (MAX_KEY_BYTES, i) for i in range(3 * MiB // MAX_KEY_BYTES)]
    request = frame(Verb.LOOKUP, 2, PayloadWriter().keys(keys).build())
    sent_first, go, answers = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    child = spawn(send_a_request_in_two_parts, socket_path, request, 5 * MiB // 2, sent_first,
                  go, answers)
    mine: list = []
    try:
        assert sent_first.wait(START_TIMEOUT_S), "the child did not send its first part"
        for _ in range(10):
            sock = raw_connection(socket_path)
            mine.append(sock)
            sock.sendall(request_header(Verb.LOOKUP, 2 * MiB) + b"x" * MiB)
            wait_for(lambda: unread_bytes(sock) == 0, "the server reads the partial request")
        assert not is_open(mine[0])
        assert all(is_open(sock) for sock in mine[1:])
        go.set()
        status, body = answers.get(timeout=START_TIMEOUT_S)
        assert (status, body) == ("OK", (0).to_bytes(4, "little")), body
    finally:
        go.set()
        for sock in mine:
            sock.close()
        sigkill(child)



def test_each_kind_of_close_is_logged_once_per_interval(socket_path, caplog):
    """Closes a local process can cause by the thousand (room made at the cap, HELLO
    timeouts) leave one line per kind and interval."""
    server = ControlServer(OffloadingManager(4), socket_path, ControlOptions(
        max_connections=2, hello_timeout_s=0.5, log_interval_s=600))
    server.start()
    silent = []
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache.control.server"):
            for _ in range(10):  # each newcomer at the cap closes the oldest without HELLO
                silent.append(raw_connection(socket_path, hello=False))
            for sock in silent:
                assert closed_by_peer(sock)  # eight made room, two ran out of time
        lines = [r.getMessage() for r in caplog.records]
        assert sum("at the maximum of 2" in line for line in lines) == 1, lines
        assert sum("no HELLO within" in line for line in lines) == 1, lines
    finally:
        for sock in silent:
            sock.close()
        server.close()
