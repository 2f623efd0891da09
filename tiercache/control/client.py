"""``Client``: the cache index of a running coordinator, with the manager's methods.

One connection, one call at a time (a lock serialises threads). When the
coordinator is gone a call raises ``CoordinatorGoneError``; the next call connects
again. A call interrupted that way may or may not have taken effect on the
coordinator (the request may have arrived before the connection broke), so the
client never retries a call on its own. But before it sends, a call checks that the
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
``control.socket``, the client asks the region header where the coordinator serves
(it recorded the path when it started, so the caller's ``XDG_RUNTIME_DIR`` does not
matter) and falls back to the config's default path. Before talking it checks the
socket's directory and owner and, once connected, the server's uid (``SO_PEERCRED``):
a coordinator of another user is refused with ``ControlSocketError``
(``tiercache.control.sockets`` has the rules). A full listen backlog (``EAGAIN`` on
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
from collections.abc import Sequence

from tiercache.config import Config
from tiercache.errors import (
    ConfigError, ControlSocketError, CoordinatorGoneError, ProtocolError, SessionLostError,
    StateError,
)
from tiercache.control.namespaces import Described, decode_described, encode_describe_request
from tiercache.control.sockets import check_directory, check_peer, check_socket_file, trusted_uids
from tiercache.control.payloads import (
    Hello, decode_error, decode_events, decode_hello, decode_leases, decode_stats,
    decode_tier_stats,
    decode_store_output, encode_hello_request, encode_lease_batch_request, encode_store_request,
)
from tiercache.control.protocol import (
    HEADER_BYTES, MAX_KEYS_PER_CALL, MAX_SOCKET_PATH_BYTES, FrameHeader, PayloadReader,
    PayloadWriter, Status, Verb, frame,
)
from tiercache.index.results import (
    LeaseResult, ManagerStats, OffloadingEvent, PrepareStoreOutput, TierStats,
)
from tiercache.specs import CPULoadStoreSpec

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
_RECV_BYTES = 64 << 10  # below malloc's mmap threshold: no mmap per call
_REQUEST_ID_MOD = 1 << 32  # ids run 1 .. 2**32-1; 0 marks the server's refusal of a connection
_BACKLOG_RETRY_S = (0.001, 0.05)  # first and longest wait between connects on a full backlog


def resolve_socket_path(config: Config) -> str:
    """Where the coordinator of ``config`` serves: ``control.socket`` if set, else the path
    its region header records, else the default derived from the environment."""
    if config.control_socket:
        return config.control_socket
    from tiercache.region.shared import recorded_socket_path

    return recorded_socket_path(config.name) or config.socket_path


class Client:
    """Talks to the coordinator serving ``config_or_socket_path`` (a ``Config`` or a path).

    ``session_token``: resume that session on connect (see the module docstring);
    ``name``: shown in the coordinator's logs; ``trusted_uid``: a uid trusted besides our
    own (default: the config's ``control.trusted_uid``).
    """

    def __init__(self, config_or_socket_path: Config | str | os.PathLike[str],
                 timeout_s: float = DEFAULT_TIMEOUT_S, *, session_token: bytes | None = None,
                 name: str = "", trusted_uid: int | None = None, heartbeat: bool = True):
        self._config: Config | None = None
        if isinstance(config_or_socket_path, Config):
            self._config = config_or_socket_path
            self._path = resolve_socket_path(self._config)
            if trusted_uid is None and self._config.control_trusted_uid >= 0:
                trusted_uid = self._config.control_trusted_uid
        else:
            self._path = os.fspath(config_or_socket_path)
        self._check_path_length(self._path)
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s = {timeout_s!r}: must be > 0")
        encode_hello_request(session_token, name)  # refuses a malformed token or name now
        self._timeout_s = float(timeout_s)
        self._trusted = trusted_uids(trusted_uid)
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
        self._description: bytes | None = None  # DESCRIBE's request, sent on every connect
        self.described: Described | None = None  # its last answer

    @staticmethod
    def _check_path_length(path: str) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise ControlSocketError(
                f"control socket path {path!r} is {len(os.fsencode(path))} bytes; "
                f"Unix sockets allow at most {MAX_SOCKET_PATH_BYTES}"
            )

    @property
    def socket_path(self) -> str:
        return self._path

    def connect(self) -> None:
        """Connect and open (or resume) the session now, rather than at the first call;
        a no-op while connected. Raises what a call would (``CoordinatorGoneError``...)."""
        with self._lock:
            if self._sock is None:
                self._connect()

    @property
    def session_token(self) -> bytes | None:
        """The token of this client's session: None before the first connect (``connect()``
        or any call), unless one was given to resume."""
        return self._hello.token if self._hello else None

    @property
    def resumed(self) -> bool:
        """Whether the latest connect resumed the session (False for a new one)."""
        return self._hello.resumed if self._hello else False

    @property
    def grace_s(self) -> float:
        """How long the coordinator keeps this session after its connection closes."""
        return self._hello.grace_s if self._hello else 0.0

    # ------------------------------------------------------------------ the manager's verbs

    def lookup(self, keys: Sequence[bytes]) -> int:
        reader = self._call(Verb.LOOKUP, PayloadWriter().keys(keys).build())
        hits = reader.u32()
        reader.done()
        return hits

    def prepare_load(self, keys: Sequence[bytes]) -> CPULoadStoreSpec:
        reader = self._call(Verb.PREPARE_LOAD, PayloadWriter().keys(keys).build())
        spec = reader.spec()
        reader.done()
        if len(spec) != len(keys):
            raise ProtocolError(
                f"prepare_load: asked for {len(keys)} keys, got {len(spec)} slot ids")
        return spec

    def touch(self, keys: Sequence[bytes]) -> None:
        self._call(Verb.TOUCH, PayloadWriter().keys(keys).build()).done()

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self._call(Verb.COMPLETE_LOAD, PayloadWriter().keys(keys).build()).done()

    def prepare_store(self, keys: Sequence[bytes], *, max_evictions: int | None = None
                      ) -> PrepareStoreOutput | None:
        """With ``max_evictions``: reserve ahead of a store that may not happen, from free
        slots and at most that many evictions, never ``None`` (see the index's
        ``prepare_store``)."""
        reader = self._call(Verb.PREPARE_STORE, encode_store_request(keys, max_evictions))
        out = decode_store_output(reader)
        reader.done()
        return out

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        payload = PayloadWriter().u8(1 if success else 0).keys(keys).build()
        self._call(Verb.COMPLETE_STORE, payload).done()

    def lease_batch(self, key_lists: Sequence[Sequence[bytes]]) -> list[LeaseResult]:
        """One lease per list, in one call (each list atomically): its leading run of
        readable keys is pinned for this session until ``release``, and its slots come
        back as a fenced spec (``LeaseResult.spec``) to load from without ``prepare_load``."""
        reader = self._call(Verb.LEASE_BATCH, encode_lease_batch_request(key_lists))
        results = decode_leases(reader)
        if len(results) != len(key_lists):
            raise ProtocolError(f"lease_batch: asked for {len(key_lists)} leases, got "
                                f"{len(results)}")
        return results

    def lease(self, keys: Sequence[bytes]) -> LeaseResult:
        """``lease_batch([keys])[0]``."""
        return self.lease_batch([keys])[0]

    def release(self, keys: Sequence[bytes]) -> int:
        """Drop every pin this session holds on ``keys``; returns how many were dropped."""
        reader = self._call(Verb.RELEASE, PayloadWriter().keys(keys).build())
        dropped = reader.u32()
        reader.done()
        return dropped

    def tier_stats(self) -> dict[str, TierStats]:
        """The figures of the tiers below host memory, by name (``{}``: host memory only)."""
        reader = self._call(Verb.TIER_STATS, b"")
        tiers = decode_tier_stats(reader)
        reader.done()
        return tiers

    def take_events(self) -> list[OffloadingEvent]:
        """Every pending event, fetched in as many calls as the frame bound needs."""
        events: list[OffloadingEvent] = []
        while True:
            reader = self._call(Verb.TAKE_EVENTS, b"")
            batch = decode_events(reader)
            reader.done()
            events.extend(batch)
            if sum(len(e.keys) for e in batch) < MAX_KEYS_PER_CALL:
                return events

    def describe(self, family: int, text: str) -> Described:
        """Tell the coordinator what this client's key namespace is (DESCRIBE,
        ``tiercache.control.namespaces``), now and again on every reconnect (a restarted
        coordinator learns it back). The answer says whether the node's event stream runs."""
        self._description = encode_describe_request(family, text)
        self.described = decode_described(self._call(Verb.DESCRIBE, self._description))
        return self.described

    def reset(self) -> None:
        self._call(Verb.RESET, b"").done()

    def stats(self) -> ManagerStats:
        reader = self._call(Verb.STATS, b"")
        stats = decode_stats(reader)
        reader.done()
        return stats

    def ping(self) -> float:
        """Round-trip time in seconds; raises ``CoordinatorGoneError`` if nobody answers."""
        start = time.perf_counter()
        self._call(Verb.PING, b"").done()
        return time.perf_counter() - start

    def close(self) -> None:
        self._stop_heartbeat()
        with self._lock:
            self._disconnect()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _call(self, verb: Verb, payload: bytes) -> PayloadReader:
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
        if thread is not None:
            self._beat_stop.set()
            if thread is not threading.current_thread():
                thread.join()

    def _beat(self, interval_s: float) -> None:
        stop = self._beat_stop
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
                f"{e or type(e).__name__}"
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
            self._check_path_length(self._path)
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
        if self._description is not None:
            try:
                self.described = decode_described(self._exchange(Verb.DESCRIBE,
                                                                 self._description))
            except (ConfigError, StateError) as e:  # calls go on; its blocks go unpublished
                log.warning("tiercache: the coordinator on %s did not take this client's "
                            "namespace description: %s", self._path, e)

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
