"""The control server under abuse by a local user: bounded connections, bounded buffers,
bounded logs, no spinning without file descriptors, and a full backlog that clients wait
out instead of calling the coordinator dead."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import struct
import threading
import time

import psutil
import pytest

from control_children import serve_with_fd_limit
from control_support import (
    SPAWN, START_TIMEOUT_S, STOP_TIMEOUT_S, closed_by_peer, is_open, raw_connection,
    stop_process, unread_bytes, wait_for,
)
from index_scenarios import k, store
from tiercache.config import config_from_dict
from tiercache.errors import ConfigError, ControlSocketError
from tiercache.link.client import Client
from tiercache.control.server import ControlOptions, ControlServer
from tiercache.index.manager import OffloadingManager
from tiercache.link.protocol import MAX_REQUEST_BYTES, PROTOCOL_VERSION, MAGIC, Verb

MiB = 1 << 20


def lookup_header(payload_bytes: int) -> bytes:
    return struct.pack("<4sBBBBII", MAGIC, PROTOCOL_VERSION, Verb.LOOKUP, 0, 0, 1, payload_bytes)


def test_connections_beyond_the_limit_are_refused_with_a_reason(servers, socket_path):
    """When every connection holds a reservation, one more is refused (one holding nothing
    would make room: tests/index/test_connections.py)."""
    servers(socket_path, options=ControlOptions(max_connections=3))
    held = [Client(socket_path) for _ in range(3)]
    for i, client in enumerate(held):
        assert client.prepare_store(k(i)) is not None
    with pytest.raises(ControlSocketError, match="maximum of 3 control connections"):
        Client(socket_path).ping()
    held.pop().close()
    client = wait_for(lambda: _pinged(socket_path), "a slot frees up when a connection closes")
    client.close()
    for client in held:
        client.close()


def _pinged(path: str) -> Client | None:
    client = Client(path)
    try:
        client.ping()
        return client
    except ControlSocketError:
        client.close()
        return None


def test_a_request_larger_than_the_bound_is_closed_at_its_header(servers, socket_path):
    servers(socket_path)
    sock = raw_connection(socket_path)
    sock.sendall(lookup_header(MAX_REQUEST_BYTES + 1))  # was: buffered up to 16 MiB
    assert closed_by_peer(sock)
    sock.close()


def test_partial_requests_are_held_within_one_budget_for_all_connections(servers, socket_path):
    """Ten connections each send 1.5 MiB of a 4 MiB request and stop; a 6 MiB budget holds
    at most four of them: the oldest are closed to make room for each newer one, and the
    server's memory grows by the budget at most."""
    server = servers(socket_path, options=ControlOptions(max_buffered_bytes=6 * MiB))
    proc = psutil.Process(server.proc.pid)
    with Client(socket_path) as bystander:
        store(bystander, 1)
        rss_before = proc.memory_info().rss
        attackers = []
        for _ in range(10):
            sock = raw_connection(socket_path)
            attackers.append(sock)
            sock.sendall(lookup_header(4 * MiB) + b"x" * (3 * MiB // 2))
            wait_for(lambda: unread_bytes(sock) == 0, "the server reads the partial request")
        held = [is_open(sock) for sock in attackers]
        assert held[-1] and sum(held) <= 4, held
        assert not any(held[:6]), held
        assert bystander.lookup(k(1)) == 1
        grown = proc.memory_info().rss - rss_before
        assert grown < 6 * MiB + 8 * MiB, f"server grew by {grown / MiB:.1f} MiB"
        for sock in attackers:
            sock.close()


def test_bad_frame_warnings_are_rate_limited(socket_path, caplog):
    server = ControlServer(OffloadingManager(4), socket_path, ControlOptions(log_interval_s=600))
    server.start()
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache.control.server"):
            for _ in range(100):
                sock = raw_connection(socket_path)
                sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                assert closed_by_peer(sock)
                sock.close()
            with Client(socket_path) as client:
                client.ping()
        bad = [r for r in caplog.records if "bad frame" in r.getMessage()]
        assert len(bad) == 1, [r.getMessage() for r in bad]
    finally:
        server.close()


def test_out_of_file_descriptors_the_server_backs_off_and_serves_its_connections(
        socket_path, tmp_path):
    log_path = tmp_path / "server.log"
    ready = SPAWN.Event()
    options = ControlOptions(accept_backoff_s=0.05, log_interval_s=600)
    proc = SPAWN.Process(target=serve_with_fd_limit, daemon=True,
                         args=(socket_path, 3, ready, str(log_path), options))
    proc.start()
    flood: list[socket.socket] = []
    try:
        assert ready.wait(START_TIMEOUT_S)
        existing = Client(socket_path)
        existing.ping()  # one of the three spare descriptors
        for _ in range(10):  # two more are accepted; the rest wait in the backlog
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(socket_path)
            flood.append(sock)
        wait_for(lambda: "cannot accept connections" in log_path.read_text(),
                 "the server runs out of descriptors")
        server = psutil.Process(proc.pid)
        cpu_before, t0 = sum(server.cpu_times()[:2]), time.monotonic()
        for _ in range(50):
            existing.ping()  # served all along
        time.sleep(1.0)  # a window in which a spinning accept loop would burn a core
        elapsed = time.monotonic() - t0
        cpu = sum(server.cpu_times()[:2]) - cpu_before
        assert cpu < 0.5 * elapsed, f"{cpu:.2f} s of CPU in {elapsed:.2f} s: spinning"
        lines = log_path.read_text().count("cannot accept connections")
        assert lines == 1, f"{lines} lines (was: ~50 MB of log in seconds)"
        for sock in flood:
            sock.close()
        flood.clear()
        with Client(socket_path) as newcomer:  # descriptors are back: accepted again
            newcomer.ping()
        existing.close()
    finally:
        for sock in flood:
            sock.close()
        proc.terminate()
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_TIMEOUT_S)
    assert proc.exitcode == 0


class _Seen(logging.Handler):
    def __init__(self, text: str):
        super().__init__(logging.DEBUG)
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def test_a_full_backlog_is_waited_out_not_taken_for_a_dead_coordinator(servers, socket_path):
    """A burst of clients fills the listen backlog (here: 2, the server stopped); a client
    that finds it full retries until the server accepts (it used to say "no coordinator")."""
    server = servers(socket_path, options=ControlOptions(listen_backlog=2))
    stop_process(server.proc.pid)
    burst: list[socket.socket] = []
    seen = _Seen("listen backlog full")
    client_log = logging.getLogger("tiercache.link.client")
    client_log.addHandler(seen)
    old_level = client_log.level
    client_log.setLevel(logging.DEBUG)
    results: list[object] = []
    try:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(socket_path)
            except BlockingIOError:
                sock.close()
                break
            burst.append(sock)
        late = threading.Thread(target=lambda: results.append(_ping_or_error(socket_path)))
        late.start()
        assert seen.event.wait(START_TIMEOUT_S), "the client never found the backlog full"
        os.kill(server.proc.pid, signal.SIGCONT)
        late.join(START_TIMEOUT_S)
        assert results and isinstance(results[0], float), results
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        client_log.removeHandler(seen)
        client_log.setLevel(old_level)
        for sock in burst:
            sock.close()


def _ping_or_error(path: str) -> float | Exception:
    try:
        with Client(path, timeout_s=START_TIMEOUT_S) as client:
            return client.ping()
    except Exception as e:  # returned to the test thread, which asserts on it
        return e


@pytest.mark.parametrize(("field", "value"), [
    ("max_connections", 0), ("max_buffered_bytes", 8), ("listen_backlog", 0),
    ("accept_backoff_s", 0), ("session_grace_s", -1), ("trusted_uid", -2),
    ("hello_timeout_s", 0), ("idle_timeout_s", 0), ("max_connections_per_peer", 0),
    ("max_detached_sessions_per_peer", -1), ("max_buffered_bytes", MAX_REQUEST_BYTES),
])
def test_bounds_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"{field} = {value}"):
        ControlOptions(**{field: value})


@pytest.mark.parametrize(("key", "value", "message"), [
    ("index", {"session_grace_s": -1}, "index.session_grace_s = -1"),
    ("index", {"session_grace_s": "5s"}, "index.session_grace_s = '5s': expected an integer or a number"),
    ("control", {"max_connections": 0}, "control.max_connections = 0"),
    ("control", {"trusted_uid": -5}, "control.trusted_uid = -5"),
    ("control", {"hello_timeout_s": 0}, "control.hello_timeout_s = 0"),
    ("control", {"idle_timeout_s": -1.5}, "control.idle_timeout_s = -1.5"),
    ("control", {"idle_timeout_s": "5m"}, "control.idle_timeout_s = '5m': expected an integer or a number"),
    ("control", {"max_connections_per_peer": 0}, "control.max_connections_per_peer = 0"),
    ("control", {"max_detached_sessions_per_peer": -1},
     "control.max_detached_sessions_per_peer = -1"),
])
def test_config_keys_of_the_control_plane_are_validated(key, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({key: value})
    config = config_from_dict({"index": {"session_grace_s": 2}, "control": {"trusted_uid": 0}})
    assert (config.index_session_grace_s, config.control_trusted_uid) == (2.0, 0)


def test_the_control_keys_reach_the_control_server():
    from tiercache.service.coordinator import control_options

    options = control_options(config_from_dict({"control": {
        "max_connections": 32, "max_connections_per_peer": 8, "hello_timeout_s": 2,
        "idle_timeout_s": 60.5, "max_detached_sessions_per_peer": 4}}))
    assert (options.max_connections, options.max_connections_per_peer, options.hello_timeout_s,
            options.idle_timeout_s, options.max_detached_sessions_per_peer) == (32, 8, 2, 60.5, 4)
    assert control_options(config_from_dict({})) == ControlOptions()
