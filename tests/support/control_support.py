"""Helpers for the control-plane tests: a ``serve_forever`` child process, its fixtures,
and raw sockets for speaking (or abusing) the wire protocol by hand."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import socket
import struct
import termios
import time
from collections.abc import Callable

import index_scenarios as sc
from tiercache.control.server import ControlOptions
from tiercache.control.standalone import serve_forever
from tiercache.link.payloads import decode_hello, encode_hello_request
from tiercache.link.protocol import (
    HEADER_BYTES, MAGIC, PROTOCOL_VERSION, FrameHeader, PayloadReader, PayloadWriter, Status,
    Verb, frame,
)

SPAWN = mp.get_context("spawn")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
SOCKET_TIMEOUT_S = 30.0


class ServerProcess:
    """``serve_forever`` in a spawned child."""

    def __init__(self, path: str, num_blocks: int = sc.CAPACITY_BLOCKS, policy: str = "lru",
                 events: bool = True, options: ControlOptions | None = None):
        self.path = path
        ready = SPAWN.Event()
        self.proc = SPAWN.Process(target=serve_forever,
                                  args=(path, num_blocks, policy, ready, events, options),
                                  daemon=True)
        self.proc.start()
        if not ready.wait(START_TIMEOUT_S):
            self.kill()
            raise TimeoutError(f"control server did not start within {START_TIMEOUT_S} s")

    def stop(self) -> None:
        """SIGTERM; the server must exit cleanly and remove its socket."""
        self.proc.terminate()
        self.proc.join(STOP_TIMEOUT_S)
        assert self.proc.exitcode == 0, f"server exited with {self.proc.exitcode}"
        assert not os.path.exists(self.path)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(STOP_TIMEOUT_S)


def read_frame(sock: socket.socket) -> tuple[FrameHeader, bytes]:
    reply = b""
    while len(reply) < HEADER_BYTES:
        chunk = sock.recv(1 << 16)
        assert chunk, "connection closed before a whole frame came"
        reply += chunk
    header = FrameHeader.unpack(reply)
    while len(reply) < HEADER_BYTES + header.payload_bytes:
        reply += sock.recv(1 << 16)
    return header, reply[HEADER_BYTES:]


def raw_connection(path: str, hello: bool = True) -> socket.socket:
    """A bare socket; with ``hello``, past the session handshake every client starts with."""
    return raw_session(path)[0] if hello else _connected(path)


def raw_session(path: str) -> tuple[socket.socket, bytes]:
    """A bare socket past HELLO, and its session's token."""
    sock = _connected(path)
    sock.sendall(frame(Verb.HELLO, 1, encode_hello_request(None, "raw")))
    header, body = read_frame(sock)
    assert (header.verb, header.status) == (Verb.HELLO, Status.OK)
    return sock, decode_hello(PayloadReader(body)).token


def _connected(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(SOCKET_TIMEOUT_S)
    sock.connect(path)
    return sock


def request_header(verb: Verb, payload_bytes: int, request_id: int = 1) -> bytes:
    """The header of a request frame announcing ``payload_bytes``."""
    return struct.pack("<4sBBBBII", MAGIC, PROTOCOL_VERSION, verb, 0, 0, request_id,
                       payload_bytes)


def is_open(sock: socket.socket) -> bool:
    """Whether the peer has not closed ``sock`` (looked at without blocking; data waiting
    counts as open)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.settimeout(timeout)


def unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that the peer has not read yet (SIOCOUTQ; for a Unix socket
    it includes buffer overhead, and is 0 once the peer read everything)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def closed_by_peer(sock: socket.socket) -> bool:
    """Read until EOF; True if the peer closed (a reset counts), False on stray data."""
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return True
    except ConnectionResetError:
        return True


def keys_payload(keys: list[bytes]) -> bytes:
    return PayloadWriter().keys(keys).build()




def wait_for(condition: Callable[[], object], what: str, timeout_s: float = START_TIMEOUT_S):
    """Poll ``condition`` until it is truthy (and return it); fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def child_answer(conn, proc, what: str):
    """The next message ``proc`` (a multiprocessing child) sends on ``conn``, however long a
    loaded machine makes it take: the wait ends when it answers or when it dies (then the
    test fails at once, naming its exit code); the test's own timeout (pytest-timeout) is
    the backstop for a child that hangs alive."""
    while not conn.poll(0.5):
        if not proc.is_alive() and not conn.poll(0):
            raise AssertionError(f"{what}: process {proc.pid} exited with {proc.exitcode} "
                                 "without answering")
    return conn.recv()


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped: the signal is delivered asynchronously,
    and a process that runs on for a moment (a loaded machine) may still accept a
    connection, answer a call or write a log line."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    wait_for(stopped, f"process {pid} stopped")


def drained_stats(config):
    """The index's stats of ``config``'s coordinator once nothing is WRITING or LOADING,
    else None (a ``wait_for`` condition: a dead client's session ends after its grace)."""
    from tiercache.link.client import Client

    with Client(config) as client:
        stats = client.stats()
    return stats if (stats.loading_blocks, stats.writing_blocks) == (0, 0) else None


def kill_all(procs) -> None:
    """SIGKILL every spawned process still alive, then reap them all."""
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.join(STOP_TIMEOUT_S)


class ClientProcess:
    """A ``Client`` in a process of its own (another engine, as the index sees it: sessions
    of one process do not contend with each other for the cache): ``call(verb, *args)``."""

    def __init__(self, config):
        from tiercache.config import config_to_toml

        self._conn, child = mp.get_context("spawn").Pipe()
        self._proc = mp.get_context("spawn").Process(
            target=_client_calls, args=(config_to_toml(config), child), daemon=True)
        self._proc.start()

    def call(self, verb: str, *args):
        self._conn.send((verb, args))
        status, result = self._conn.recv()
        if status != "ok":
            raise AssertionError(f"{verb} in the child: {result}")
        return result

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _client_calls(config_toml: str, conn) -> None:
    from control_children import client_calls

    client_calls(config_toml, conn)
