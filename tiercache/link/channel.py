"""A ``Client``'s connection to its coordinator: finding and trusting it, HELLO, the
heartbeat, one request at a time (``tiercache.link.client`` has the verbs).

One connection, one call at a time (a lock serialises threads). When the
coordinator is gone a call raises ``CoordinatorGoneError``; the next call connects
again. A call interrupted that way may or may not have taken effect on the
coordinator (the request may have arrived before the connection broke), so the
channel never retries a call on its own. But before it sends, a call checks that the
coordinator has not closed the connection meanwhile (it restarted, or closed an idle
connection): then nothing was sent on it, so the call connects again (resuming the
session) and goes ahead — an idle client does not fail its first call after a restart.

Liveness: while connected, a background thread sends a PING whenever the client made no
call for a quarter of the session's deadline (``Hello.timeout_s``), so the coordinator
sees the process alive; a frozen or stopped process goes silent and, if it holds
reservations or pins, is declared dead. A call that finds its session gone (declared
dead, or the region replaced) raises ``SessionLostError`` once: the client is connected
again with a new session, and what the old one held is gone.

Sessions: each connection starts with HELLO. The first opens a session; every
reconnect sends the session's token, so a client that reconnects within the
coordinator's grace period (``grace_s``) keeps its reservations and pins
(``resumed`` is True). After a coordinator restart the token is unknown: a new session
(``resumed`` False), and whatever the old one had reserved or pinned is gone. A
process that takes over from another may pass ``session_token`` to resume its session.

Finding and trusting the coordinator: built from a ``Config`` without
``control.socket``, the channel asks the region header where the coordinator serves
(it recorded the path when it started, so the caller's ``XDG_RUNTIME_DIR`` does not
matter) and falls back to the config's default path. Before talking it checks the
socket's directory and owner and, once connected, the server's uid (``SO_PEERCRED``):
a coordinator of another user is refused with ``ControlSocketError``
(``tiercache.link.sockets`` has the rules). A full listen backlog (``EAGAIN`` on
connect: a burst of clients) is retried until ``timeout_s``, not taken for a dead
coordinator.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from tiercache.config import Config
from tiercache.errors import (
    ControlSocketError, CoordinatorGoneError, ProtocolError, SessionLostError,
)
from tiercache.link.sockets import check_directory, check_peer, check_socket_file
from tiercache.link.payloads import Hello, decode_error, decode_hello, encode_hello_request
from tiercache.link.protocol import (
    HEADER_BYTES, MAX_SOCKET_PATH_BYTES, PROTOCOL_VERSION, FrameHeader, PayloadReader, Status,
    Verb, frame,
)

# The client's logger: its records kept their name when the channel moved out of client.py.
log = logging.getLogger("tiercache.link.client")

_RECV_BYTES = 64 << 10  # below malloc's mmap threshold: no mmap per call
_REQUEST_ID_MOD = 1 << 32  # ids run 1 .. 2**32-1; 0 marks the server's refusal of a connection
_BACKLOG_RETRY_S = (0.001, 0.05)  # first and longest wait between connects on a full backlog
# A coordinator refuses a protocol version it does not serve in one line (``tiercache.
# control.versions``); one from before that rule closed the connection without a word.
_AT_HELLO = (f" (at HELLO: if it stays so, the coordinator may predate versioned refusals "
             f"and not serve this engine's control protocol {PROTOCOL_VERSION})")


def resolve_socket_path(config: Config) -> str:
    """Where the coordinator of ``config`` serves: ``control.socket`` if set, else the path
    its region header records, else the default derived from the environment."""
    if config.control_socket:
        return config.control_socket
    from tiercache.region.shared import recorded_socket_path

    return recorded_socket_path(config.name) or config.socket_path


def check_path_length(path: str) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ControlSocketError(
            f"control socket path {path!r} is {len(os.fsencode(path))} bytes; "
            f"Unix sockets allow at most {MAX_SOCKET_PATH_BYTES}"
        )


class Channel:
    """The connection of one ``Client`` (see the module docstring): ``config`` (re-read
    for the socket path at each connect) or a fixed ``path``."""

    def __init__(self, config: Config | None, path: str, timeout_s: float,
                 trusted: frozenset[int], name: str, session_token: bytes | None,
                 heartbeat: bool):
        self._config = config
        self._path = path
        self._timeout_s = timeout_s
        self._trusted = trusted
        self._name = name
        self._hello = Hello(session_token, False, 0.0) if session_token else None
        self._sock: socket.socket | None = None
        self._inbuf = bytearray()
        self._next_id = 1
        self._lock = threading.Lock()
        self._had_session = False  # a HELLO of ours was answered: a later new session is a loss
        self._lost = False  # a heartbeat found the session gone: the next call says so
        self._last_call = 0.0
        self._heartbeat = heartbeat
        self._beat_stop: threading.Event | None = None
        self._beat_thread: threading.Thread | None = None
        # called with the exchange after every HELLO (a request the session makes again)
        self.after_hello: Callable[[Callable[[Verb, bytes], PayloadReader]], None] | None = None

    @property
    def path(self) -> str:
        return self._path

    @property
    def hello(self) -> Hello | None:
        """The latest HELLO answer (None before the first connect, unless resuming)."""
        return self._hello

    def connect(self) -> None:
        """Connect and open (or resume) the session now; a no-op while connected."""
        with self._lock:
            if self._sock is None:
                self._connect()

    def close(self) -> None:
        self._stop_heartbeat()
        with self._lock:
            self._disconnect()

    def call(self, verb: Verb, payload: bytes) -> PayloadReader:
        """One request and its answer (see the module docstring for what is retried)."""
        with self._lock:
            if self._sock is not None and self._closed_by_peer():
                self._disconnect()  # nothing was sent on it: connecting again is safe
            if self._sock is None:
                self._connect()
            if self._lost:
                self._lost = False
                raise SessionLostError(
                    f"the coordinator on {self._path} no longer knows this client's session "
                    "(declared dead after index.session_timeout_s of silence, or its region "
                    "was replaced): what it reserved or pinned is gone; this client now has a "
                    "new session")
            self._last_call = time.monotonic()
            return self._exchange(verb, payload)

    def _closed_by_peer(self) -> bool:
        """Whether the coordinator closed our idle connection (EOF, or a refusal frame
        waiting where no answer is due)."""
        sock = self._sock
        if sock is None:
            return True
        try:
            ready, _, _ = select.select([sock], [], [], 0)
            if not ready:
                return False
            return True  # an idle connection has nothing to read but an EOF or an error
        except (OSError, ValueError):
            return True

    # ------------------------------------------------------------------ liveness
    def _start_heartbeat(self, interval_s: float) -> None:
        if not self._heartbeat or interval_s <= 0 or self._beat_thread is not None:
            return
        self._beat_stop = threading.Event()
        self._beat_thread = threading.Thread(target=self._beat, args=(interval_s,),
                                             name="tiercache-heartbeat", daemon=True)
        self._beat_thread.start()

    def _stop_heartbeat(self) -> None:
        thread, self._beat_thread = self._beat_thread, None
        if thread is not None and self._beat_stop is not None:
            self._beat_stop.set()
            if thread is not threading.current_thread():
                thread.join()

    def _beat(self, interval_s: float) -> None:
        stop = self._beat_stop
        assert stop is not None  # set before the thread starts
        while not stop.wait(interval_s):
            if time.monotonic() - self._last_call < interval_s:
                continue  # calls prove it already
            if not self._lock.acquire(blocking=False):
                continue  # a call is in progress: that proves it
            try:
                if self._sock is None:
                    continue  # a disconnected client is not heartbeating (its next call connects)
                if self._closed_by_peer():
                    self._disconnect()
                    self._connect()  # resume now, so a restarted coordinator sees us
                self._last_call = time.monotonic()
                self._exchange(Verb.PING, b"").done()
            except (CoordinatorGoneError, ProtocolError, ControlSocketError) as e:
                log.debug("tiercache heartbeat to %s: %s", self._path, e)
            finally:
                self._lock.release()

    def _exchange(self, verb: Verb, payload: bytes) -> PayloadReader:
        """One request and its answer on the open connection (the lock is held)."""
        request_id = self._next_id
        self._next_id = request_id % (_REQUEST_ID_MOD - 1) + 1
        sock = self._sock
        assert sock is not None
        try:
            sock.sendall(frame(verb, request_id, payload))
            header, body = self._read_frame(sock)
        except (OSError, EOFError) as e:  # timeouts included: the stream is out of step
            refusal = self._refusal(sock) if verb is Verb.HELLO else None
            self._disconnect()
            if refusal is not None:
                raise refusal from e
            raise CoordinatorGoneError(
                f"coordinator on {self._path} went away during {verb.name}: "
                f"{e or type(e).__name__}{_AT_HELLO if verb is Verb.HELLO else ''}"
            ) from e
        except ProtocolError:
            self._disconnect()
            raise
        if header.status is Status.ERROR and header.request_id == 0:  # refused outright
            self._disconnect()
            raise decode_error(PayloadReader(body))
        if header.verb is not verb or header.request_id != request_id:
            self._disconnect()
            raise ProtocolError(
                f"answer for {header.verb.name} #{header.request_id} to request "
                f"{verb.name} #{request_id}"
            )
        reader = PayloadReader(body)
        if header.status is Status.ERROR:
            error = decode_error(reader)
            raise error
        return reader

    def _refusal(self, sock: socket.socket) -> Exception | None:
        """The error a server sent before closing a connection it refused (it may close
        before our HELLO is out), if it is waiting to be read."""
        try:
            sock.settimeout(0)
            header, body = self._read_frame(sock)
        except (OSError, EOFError, ProtocolError):
            return None
        if header.status is not Status.ERROR or header.request_id != 0:
            return None
        return decode_error(PayloadReader(body))

    def _connect(self) -> None:
        """Find, check and connect to the coordinator, then open or resume the session."""
        if self._config is not None:
            self._path = resolve_socket_path(self._config)
            check_path_length(self._path)
        try:
            check_directory(os.path.dirname(os.path.abspath(self._path)), self._trusted)
            check_socket_file(self._path, self._trusted)
        except FileNotFoundError as e:
            raise CoordinatorGoneError(
                f"no coordinator on {self._path} ({e.strerror}); start one with "
                "`tiercache serve --config FILE`") from e
        sock = self._connect_socket()
        try:
            check_peer(sock, self._trusted, f"the coordinator on {self._path}")
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._inbuf = bytearray()
        token = self._hello.token if self._hello else None
        reader = self._exchange(Verb.HELLO, encode_hello_request(token, self._name))
        self._hello = decode_hello(reader)
        if self._had_session and not self._hello.resumed:
            self._lost = True
        self._had_session = True
        self._start_heartbeat(self._hello.timeout_s / 4)
        if self.after_hello is not None:  # e.g. DESCRIBE again: a new coordinator learns it
            self.after_hello(self._exchange)

    def _connect_socket(self) -> socket.socket:
        """A connected socket; a full backlog (EAGAIN) is retried until ``timeout_s``."""
        deadline = time.monotonic() + self._timeout_s
        wait_s = _BACKLOG_RETRY_S[0]
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(self._path)
                return sock
            except BlockingIOError as e:
                sock.close()
                if e.errno != errno.EAGAIN or time.monotonic() + wait_s > deadline:
                    raise CoordinatorGoneError(
                        f"the coordinator on {self._path} did not take the connection within "
                        f"{self._timeout_s} s (its listen backlog stayed full)") from e
                log.debug("control socket %s: listen backlog full; retrying in %.3f s",
                          self._path, wait_s)
                time.sleep(wait_s)
                wait_s = min(2 * wait_s, _BACKLOG_RETRY_S[1])
            except OSError as e:
                sock.close()
                raise CoordinatorGoneError(
                    f"no coordinator on {self._path} ({e.strerror or e}); start one with "
                    "`tiercache serve --config FILE`"
                ) from e

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._inbuf = bytearray()

    def _read_frame(self, sock: socket.socket) -> tuple[FrameHeader, bytes | memoryview]:
        buf = self._inbuf
        if not buf:  # usual case: the whole answer arrives in one piece
            chunk = sock.recv(_RECV_BYTES)
            if not chunk:
                raise EOFError("connection closed by the coordinator")
            if len(chunk) >= HEADER_BYTES:
                header = FrameHeader.unpack(chunk)
                if len(chunk) == HEADER_BYTES + header.payload_bytes:
                    return header, memoryview(chunk)[HEADER_BYTES:]
            buf += chunk
        while True:
            need_bytes = HEADER_BYTES
            if len(buf) >= HEADER_BYTES:
                header = FrameHeader.unpack(buf)
                need_bytes = HEADER_BYTES + header.payload_bytes
                if len(buf) >= need_bytes:
                    body = bytes(buf[HEADER_BYTES:need_bytes])
                    del buf[:need_bytes]
                    return header, body
            chunk = sock.recv(max(_RECV_BYTES, need_bytes - len(buf)))
            if not chunk:
                raise EOFError("connection closed by the coordinator")
            buf += chunk
