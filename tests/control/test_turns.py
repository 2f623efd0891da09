"""Fair turns between connections (``tiercache.control.turns``): narrated scenarios on
real connections (socket pairs), then the control server serving a heavy stream beside a
small call, in a real process."""

from __future__ import annotations

import os
import signal
import socket

import psutil
import pytest

from control_support import raw_connection, read_frame, wait_for
from tiercache.control.connections import Connection
from tiercache.link.payloads import (
    decode_error, decode_stats, encode_lease_batch_request, encode_store_request, request_size,
)
from tiercache.link.protocol import (
    HEADER_BYTES, MAX_KEYS_PER_CALL, MAX_LISTS_PER_BATCH, FrameHeader, PayloadReader,
    PayloadWriter, Status, Verb, frame,
)
from tiercache.control.turns import LIST_UNITS, Turns, request_units
from tiercache.errors import ProtocolError

HEAVY = request_units(MAX_KEYS_PER_CALL, 1)  # a lease of the most keys one request may carry
SMALL = request_units(1, 1)


@pytest.fixture
def conns():
    made: list[socket.socket] = []

    def make(n: int) -> list[Connection]:
        out = []
        for pid in range(n):
            a, b = socket.socketpair()
            made.extend((a, b))
            out.append(Connection(a, 1000 + pid, 0.0))
        return out

    yield make
    for sock in made:
        sock.close()


def serve(turns: Turns, units: dict[Connection, int], rounds: int,
          again: set[Connection]) -> list[Connection]:
    """Serve ``rounds`` requests; a connection in ``again`` sends its next request as soon
    as it is answered (a stream), the others send one and stop."""
    order = []
    for _ in range(rounds):
        turn = turns.next()
        if turn is None:
            break
        conn, _ = turn
        order.append(conn)
        if conn in again:
            turns.wait(conn, units[conn])
    return order


def test_a_small_call_waits_for_the_request_in_progress_not_for_a_heavy_stream(conns):
    heavy, small = conns(2)
    turns = Turns()
    turns.wait(heavy, HEAVY)
    assert turns.next() == (heavy, HEAVY)  # the stream's request is in progress ...
    turns.wait(heavy, HEAVY)  # ... its next one is already in ...
    turns.wait(small, SMALL)  # ... when the small call arrives
    assert turns.next() == (small, SMALL), "the small call goes before the stream's next"
    turns.wait(small, SMALL)
    assert turns.next() == (small, SMALL), "and so does its next one: it has used far less"


def test_behind_heavy_streams_in_lock_step_a_small_call_waits_for_one_request(conns):
    """Four heavy streams whose requests all start at one virtual time: a small call that
    arrives after the first of them is served next, not after the other three (as with
    start tags, where it would be later than all of theirs)."""
    *heavy, small = conns(5)
    turns = Turns()
    units = {conn: HEAVY for conn in heavy}
    for conn in heavy:
        turns.wait(conn, HEAVY)
    for _ in range(3):  # rounds of all four, then a small call after each round's first
        assert len(set(serve(turns, units, 1, again=set(heavy)))) == 1
        turns.wait(small, SMALL)
        assert turns.next() == (small, SMALL)
        serve(turns, units, 3, again=set(heavy))


def test_heavy_streams_share_the_loop_equally_and_small_calls_cut_in(conns):
    a, b, c, small = conns(4)
    turns = Turns()
    units = {a: HEAVY, b: HEAVY, c: HEAVY, small: SMALL}
    for conn in (a, b, c):
        turns.wait(conn, HEAVY)
    order = serve(turns, units, 9, again={a, b, c})
    assert [order.count(x) for x in (a, b, c)] == [3, 3, 3]
    turns.wait(small, SMALL)
    assert serve(turns, units, 1, again={a, b, c}) == [small]


def test_streams_share_by_work_not_by_requests(conns):
    big, little = conns(2)
    turns = Turns()
    units = {big: 1000, little: 100}
    turns.wait(big, 1000)
    turns.wait(little, 100)
    order = serve(turns, units, 110, again={big, little})
    assert 95 <= order.count(little) <= 101 and 9 <= order.count(big) <= 11


def test_a_connection_that_was_idle_earns_no_credit(conns):
    busy, idle = conns(2)
    turns = Turns()
    units = {busy: 100, idle: 100}
    turns.wait(busy, 100)
    serve(turns, units, 50, again={busy})  # idle sends nothing meanwhile
    turns.wait(idle, 100)
    order = serve(turns, units, 6, again={busy, idle})
    assert order.count(idle) <= order.count(busy) + 1, "no burst for the time it was idle"


def test_a_closed_connection_is_skipped_and_counted_out(conns):
    a, b = conns(2)
    turns = Turns()
    turns.wait(a, SMALL)
    turns.wait(b, SMALL)
    assert len(turns) == 2
    turns.forget(a)
    assert len(turns) == 1 and turns.next() == (b, SMALL) and turns.next() is None
    assert not turns


def test_a_requests_size_is_read_from_its_list_heads():
    keys = [b"a", b"bb", b"c"]  # variable width: the lengths are read to find the next list
    assert request_size(Verb.LOOKUP, PayloadWriter().keys(keys).build()) == (3, 1)
    assert request_size(Verb.PREPARE_STORE, encode_store_request(keys, 2)) == (3, 1)
    complete = PayloadWriter().u8(1).keys(keys[:2]).build()
    assert request_size(Verb.COMPLETE_STORE, complete) == (2, 1)
    batch = encode_lease_batch_request([[b"a"], [], keys, [b"xyz"] * 5])
    assert request_size(Verb.LEASE_BATCH, batch) == (9, 4)
    assert request_size(Verb.PING, b"") == (0, 0)
    assert request_size(Verb.LOOKUP, b"\x01") == (0, 0)  # malformed: its decode refuses it
    forged = PayloadWriter().u32(1 << 30).build()  # claims more lists than it may carry
    assert request_size(Verb.LEASE_BATCH, forged) == (0, MAX_LISTS_PER_BATCH + 1)
    assert request_units(9, 4) == 1 + 9 + 4 * LIST_UNITS


# ---------------------------------------------------------------------- the server
class Answers:
    """Answers read off one connection in order (several may come in one read)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, bytearray()

    def next(self) -> tuple[FrameHeader, bytes]:
        while True:
            if len(self.buf) >= HEADER_BYTES:
                header = FrameHeader.unpack(self.buf)
                end = HEADER_BYTES + header.payload_bytes
                if len(self.buf) >= end:
                    body = bytes(self.buf[HEADER_BYTES:end])
                    del self.buf[:end]
                    return header, body
            chunk = self.sock.recv(1 << 16)
            assert chunk, "closed before a whole answer came"
            self.buf += chunk


def lookups(sock: socket.socket) -> int:
    """The index's lookup count, asked on ``sock`` (a STATS call)."""
    sock.sendall(frame(Verb.STATS, 99, b""))
    header, body = read_frame(sock)
    assert (header.verb, header.status, header.request_id) == (Verb.STATS, Status.OK, 99)
    return decode_stats(PayloadReader(body)).lookups


@pytest.mark.parametrize("heavy_connections", [1, 3])
def test_a_pipelined_heavy_stream_delays_a_small_call_by_one_request(servers, socket_path,
                                                                    heavy_connections):
    """Heavy LOOKUPs pipelined on one or more connections, and a small call from another,
    all in the socket before the server reads (it is stopped): the server used to answer
    every request a connection had sent before it looked at the next connection (3 and 9
    heavy ones before the small call). Now it is answered after at most the one heavy
    request in progress, however many connections stream."""
    server = servers(socket_path)
    heavy = [raw_connection(socket_path) for _ in range(heavy_connections)]
    victim = raw_connection(socket_path)
    per_connection = 8
    request = PayloadWriter().keys([b"k"] * MAX_KEYS_PER_CALL).build()  # 16 KiB, 16 Ki keys
    os.kill(server.proc.pid, signal.SIGSTOP)  # delivered asynchronously: wait till it holds
    stopped = psutil.Process(server.proc.pid)
    wait_for(lambda: stopped.status() == psutil.STATUS_STOPPED, "the server stopped")
    try:
        for sock in heavy:
            sock.sendall(b"".join(frame(Verb.LOOKUP, 2 + i, request)
                                  for i in range(per_connection)))
        victim.sendall(frame(Verb.STATS, 99, b""))  # the small call, after them all
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    header, body = read_frame(victim)
    assert header.status is Status.OK
    seen = decode_stats(PayloadReader(body)).lookups
    assert seen <= 1, f"{seen} heavy requests were served before the small call"
    for sock in heavy:  # and the stream is served whole after it
        answers = Answers(sock)
        for i in range(per_connection):
            header, _ = answers.next()
            assert (header.status, header.request_id) == (Status.OK, 2 + i)
    assert lookups(victim) == heavy_connections * per_connection
    for sock in heavy + [victim]:
        sock.close()


def test_a_lease_batch_of_too_many_lists_is_refused_naming_the_bound(servers, socket_path):
    """16 Ki empty lists cost the coordinator's loop 0.43 s in issue 33 (a valid request
    then): now a LEASE_BATCH carries at most MAX_LISTS_PER_BATCH lists."""
    servers(socket_path)
    ok = raw_connection(socket_path)
    ok.sendall(frame(Verb.LEASE_BATCH, 2, encode_lease_batch_request([[]] * MAX_LISTS_PER_BATCH)))
    header, _ = read_frame(ok)
    assert header.status is Status.OK
    over = PayloadWriter().u32(MAX_LISTS_PER_BATCH + 1)
    for _ in range(MAX_LISTS_PER_BATCH + 1):
        over.keys([])
    ok.sendall(frame(Verb.LEASE_BATCH, 3, over.build()))
    header, body = read_frame(ok)
    assert (header.status, header.request_id) == (Status.ERROR, 3)
    error = decode_error(PayloadReader(body))
    assert isinstance(error, ProtocolError) and f"at most {MAX_LISTS_PER_BATCH}" in str(error)
    assert ok.recv(1) == b"", "the connection is closed after the refusal"
    ok.close()
