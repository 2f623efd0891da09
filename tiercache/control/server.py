"""The control server: the coordinator's cache index, served over a Unix socket.

One thread runs a selector loop over the listening socket and every connection.
Calls are tens of microseconds and all go through the manager's single lock, so
more threads would add GIL hand-offs, not parallelism. A connection that sends a
frame the protocol cannot trust (bad magic or version, oversized, malformed
payload) is closed; the loop and every other connection carry on.

Every connection is a client session (``tiercache.control.sessions``): its first frame
must be HELLO, and what it reserves or pins is given back when it is gone for longer
than the grace period.

Bounds (``ControlOptions``; the README lists them), so that no local user can grow the
coordinator or starve its other clients:

* a connection must complete HELLO within ``hello_timeout_s``, or it is closed;
* a connection whose session holds no reservation and no pin (``manager.holds``) and that
  sent nothing for ``idle_timeout_s`` is closed (its session detaches, as on any close: its
  client reconnects on its next call and resumes it);
* at most ``max_connections`` connections, and at most ``max_connections_per_peer`` of one
  process (``SO_PEERCRED`` pid; one more is answered with an error naming the limit and
  closed). At ``max_connections`` a newcomer is still served: the connection that has been
  quiet longest among those holding nothing makes room (one without HELLO first). One
  holding reservations or pins is never closed, nor one mid-request (part of a request
  read, or answers waiting, and bytes received within ``hello_timeout_s``: once a frame is
  started it should not stall longer than a HELLO may take); when every connection is such
  a one, the newcomer is refused with an error naming the limit;
* a request frame is at most ``MAX_REQUEST_BYTES``, and partial requests held across all
  connections at most ``max_buffered_bytes``. A read that would pass it closes the hogs,
  never the reader: the process holding the most partial bytes gives way, its connection
  holding the most first (of equals, the one quiet longest). The budget holds at least one
  whole request and one read past it (``MIN_BUFFERED_BYTES``), so a client sending one
  request always fits, whatever others hold;
* answers are not read past: while a connection's answers wait, it is not read from;
* at most ``max_detached_sessions_per_peer`` closed sessions of one process are kept for
  it to resume (``SessionTable.end_detached_beyond``);
* each kind of complaint or close (bad frames, refused peers, accept failures, HELLO
  timeouts, idle closes, room made, hogs closed, sessions ended early) is logged at most
  once per ``log_interval_s`` with a count of the rest;
* out of file descriptors (EMFILE and the like) the listener is taken out of the loop for
  ``accept_backoff_s`` (the connections already open are served meanwhile); pending
  connections wait in the kernel's backlog (``listen_backlog``) and are accepted later.

Peers: a connection from a uid that is not trusted (``tiercache.control.sockets``) is answered
with an error and closed.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from tiercache.errors import ControlSocketError, ProtocolError, TiercacheError
from tiercache.control.admission import Admission, refuse
from tiercache.control.connections import Connection, ConnectionTable
from tiercache.control.options import ControlOptions, RECV_BYTES
from tiercache.control.verbs import HANDLERS
from tiercache.loglimit import LogLimiter
from tiercache.index.manager import ManagerStats, OffloadingManager
from tiercache.control.sockets import SocketFile, trusted_uids
from tiercache.control.payloads import decode_hello_request, encode_error, encode_hello
from tiercache.control.protocol import (
    HEADER_BYTES, MAX_REQUEST_BYTES, FrameHeader, PayloadReader, Status,
    Verb, frame,
)
from tiercache.control.sessions import Session, SessionTable
from tiercache.region.sessions import SessionLedger, SessionRecord

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class ControlServer:
    """Serves ``manager`` on the Unix socket ``socket_path`` (mode 0600) until ``close()``."""

    def __init__(self, manager: OffloadingManager, socket_path: str | os.PathLike[str],
                 options: ControlOptions | None = None, *,
                 session_store: SessionLedger | None = None,
                 restored: Iterable[SessionRecord] = ()):
        self._manager = manager
        self._path = os.fspath(socket_path)
        self.options = options or ControlOptions()
        self._trusted = trusted_uids(self.options.trusted_uid)
        opts = self.options
        self._sessions = SessionTable(manager, opts.session_grace_s,
                                      timeout_s=opts.session_timeout_s, store=session_store,
                                      restored=restored, now=time.monotonic())
        self._next_tick = time.monotonic() + opts.tick_s
        self._warn = LogLimiter(log, self.options.log_interval_s)
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._socket_file = SocketFile(self._path, self._trusted, self.options.listen_backlog)
        self._connections = ConnectionTable(self.options.hello_timeout_s,
                                            self.options.idle_timeout_s, self._holds)
        self._admission = Admission(self.options, self._connections, self._trusted, self._warn,
                                    lambda conn, why, tell: self._drop(self._selector, conn,
                                                                       why, tell))
        self._buffered_bytes = 0  # partial requests held, all connections together
        self._accept_resume_at: float | None = None  # while the listener is paused

    @property
    def socket_path(self) -> str:
        return self._path

    def stats(self) -> ManagerStats:
        """The served index's stats (safe from any thread: the manager holds its own lock)."""
        return self._manager.stats()

    @property
    def num_detached_sessions(self) -> int:
        """Sessions whose connection closed, kept for their clients to resume (read-only)."""
        return self._sessions.num_detached

    def start(self) -> None:
        """Bind and listen (clients may connect once this returns), then serve in a thread."""
        if self._thread is not None:
            raise ControlSocketError(f"control server on {self._path} was already started")
        self._listener = self._socket_file.bind()
        try:
            self._wake_r, self._wake_w = socket.socketpair()
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._listener, selectors.EVENT_READ, self._listener)
            self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
            self._thread = threading.Thread(target=self._serve, name="tiercache-control",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self._release()
            raise
        log.info("control server listening on %s", self._path)

    def close(self, end_sessions: bool = True) -> None:
        """Stop serving, close every connection, end every session (``end_sessions``;
        False keeps them, with what they hold, in the region's session table for the next
        coordinator to restore) and unlink the socket. Idempotent."""
        if self._thread is not None and self._wake_w is not None:
            self._wake_w.send(b"x")
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                self._socket_file.unlink()  # the thread may still use its sockets; the path goes
                raise ControlSocketError(
                    f"control server thread did not stop within {CLOSE_TIMEOUT_S} s"
                )
            if end_sessions:
                self._sessions.end_all()
            self._thread = None
        self._release()

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self) -> None:
        if self._selector is not None:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._selector = None
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._listener = self._wake_r = self._wake_w = None
        self._connections.clear()
        self._socket_file.unlink()

    # ------------------------------------------------------------------ the loop

    def _wait(self, selector: selectors.BaseSelector, timeout: float | None
              ) -> list[tuple[selectors.SelectorKey, int]]:
        """Poll for up to ``poll_before_sleep_s``, then sleep in the kernel (why: see
        ``POLL_BEFORE_SLEEP_S``) until an event or ``timeout``."""
        ready = selector.select(0)
        poll_s = self.options.poll_before_sleep_s
        if not ready and poll_s > 0:
            deadline = time.perf_counter() + poll_s
            while not ready and time.perf_counter() < deadline:
                ready = selector.select(0)
        return ready or selector.select(timeout)

    def _serve(self) -> None:
        selector = self._selector
        assert selector is not None
        while True:
            for key, mask in self._wait(selector, self._timeout()):
                source = key.data
                if source is self._wake_r:
                    return
                if source is self._listener:
                    self._accept(selector)
                    continue
                if source not in self._connections:  # closed by an earlier event of this batch
                    continue
                if mask & selectors.EVENT_READ:
                    self._on_readable(selector, source)
                if mask & selectors.EVENT_WRITE and source.sock.fileno() >= 0:
                    self._flush(selector, source)
            self._on_time(selector)

    def _timeout(self) -> float | None:
        """Seconds until the next session expiry, tick, accept resumption, HELLO or idle
        deadline (None: none due)."""
        due = [t for t in (self._sessions.next_deadline(), self._accept_resume_at,
                           self._tick_due(), self._connections.next_deadline())
               if t is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _tick_due(self) -> float | None:
        """When the next liveness tick is due; None when there is nothing to check."""
        opts = self.options
        if opts.session_timeout_s or opts.reservation_timeout_s or self._sessions.num_restored:
            return self._next_tick
        return None

    def _on_time(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        if self._accept_resume_at is not None and now >= self._accept_resume_at:
            self._accept_resume_at = None
            selector.register(self._listener, selectors.EVENT_READ, self._listener)
        for session, released in self._sessions.expire(now):
            self._log_end(session, released, f"gone for {self._sessions.grace_s:.1f} s")
        self._close_overdue(selector, now)
        if now >= self._next_tick:
            self._next_tick = now + self.options.tick_s
            self._tick(selector, now)

    def _tick(self, selector: selectors.BaseSelector, now: float) -> None:
        """Liveness: restored sessions whose process is gone or that did not come back,
        silent sessions (declared dead: their connection is closed), stale reservations."""
        for session, released in self._sessions.expire_restored(now):
            self._log_end(session, released, "restored from the region but its process is "
                          "gone or it did not come back")
        for session in self._sessions.silent(now):
            conn = session.conn
            released = self._sessions.end(session)
            if isinstance(conn, Connection):
                conn.session = None
                self._drop(selector, conn, "session declared dead")
            self._warn.warn("silent", "client session %d (%r, %s) sent nothing for %.1f s "
                            "(index.session_timeout_s) while holding %d reserved slot(s) and "
                            "%d pin(s): declared dead, its holdings given back", session.owner,
                            session.name, getattr(conn, "peer", "?"), now - session.last_seen,
                            released.freed_writing, released.dropped_pins)
        if self.options.reservation_timeout_s:
            expired = self._manager.expire_reservations(self.options.reservation_timeout_s)
            if expired:
                self._warn.warn("reservations", "%d reservation(s) not completed within %.0f s "
                                "(index.reservation_timeout_s) were freed", expired,
                                self.options.reservation_timeout_s)

    def _log_end(self, session: Session, released, why: str) -> None:
        if released.freed_writing or released.dropped_pins:
            self._warn.log(logging.INFO, "session_end",
                           "client session %d (%r) %s: freed %d reserved slot(s), dropped %d "
                           "pin(s)", session.owner, session.name, why, released.freed_writing,
                           released.dropped_pins)

    def _close_overdue(self, selector: selectors.BaseSelector, now: float) -> None:
        """Close the connections past their HELLO deadline, and the idle ones holding
        nothing."""
        late, idle = self._connections.overdue(now)
        hello_s, idle_s = self.options.hello_timeout_s, self.options.idle_timeout_s
        for conn in late:
            why = ControlSocketError(f"no HELLO within {hello_s} s (control.hello_timeout_s); "
                                     "a connection's first request must be HELLO")
            self._warn.warn("hello_timeout", "closing the control connection of %s: %s",
                            conn.peer, why)
            self._drop(selector, conn, str(why), tell=why)
        for conn in idle:
            self._warn.log(logging.INFO, "idle", "closing the control connection of %s: it "
                           "held nothing and sent nothing for %.0f s (control.idle_timeout_s); "
                           "its client reconnects on its next call", conn.peer, idle_s)
            self._drop(selector, conn, "idle")

    def _holds(self, conn: Connection) -> bool:
        """Whether ``conn``'s session holds reservations or pins."""
        return conn.session is not None and self._manager.holds(conn.session.owner)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _OUT_OF_RESOURCES:  # keep serving the connections we have
                    selector.unregister(self._listener)
                    self._accept_resume_at = time.monotonic() + self.options.accept_backoff_s
                    self._warn.warn("accept", "control server cannot accept connections (%s); "
                                    "retrying every %.2f s, serving the %d open ones",
                                    e, self.options.accept_backoff_s, len(self._connections))
                else:
                    self._warn.warn("accept_error", "control server accept failed: %s", e)
                return
            conn = self._admission.admit(sock, time.monotonic())
            if conn is not None:
                selector.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, selector: selectors.BaseSelector, conn: Connection, why: str,
              tell: Exception | None = None) -> None:
        """Close ``conn`` (first answering no request with ``tell``, if given: only for a
        connection without HELLO, whose stream carries no answers) and detach its session."""
        log.debug("closing control connection of %s: %s", conn.peer, why)
        if not self._connections.remove(conn):
            return
        self._buffered_bytes -= len(conn.inbuf)
        conn.inbuf = bytearray()
        selector.unregister(conn.sock)
        if tell is not None:
            refuse(conn.sock, tell)
        else:
            conn.sock.close()
        if conn.session is not None:
            self._sessions.detach(conn.session, conn, time.monotonic())
            self._bound_detached(conn.session.pid)

    def _bound_detached(self, pid: int) -> None:
        keep = self.options.max_detached_sessions_per_peer
        for session, released in self._sessions.end_detached_beyond(pid, keep):
            self._warn.warn("detached_bound", "pid %d closed more than %d client sessions "
                            "within the grace period (control.max_detached_sessions_per_peer): "
                            "ended its oldest, %d (%r), at once: freed %d reserved slot(s), "
                            "dropped %d pin(s)", pid, keep, session.owner, session.name,
                            released.freed_writing, released.dropped_pins)

    def _on_readable(self, selector: selectors.BaseSelector, conn: Connection) -> None:
        try:
            data = conn.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError as e:
            self._drop(selector, conn, f"receive failed: {e}")
            return
        if not data:
            self._drop(selector, conn, "peer closed")
            return
        self._connections.touch(conn, time.monotonic())
        if conn.inbuf:  # the rest of a frame that arrives in pieces
            if self._buffered_bytes + len(data) > self.options.max_buffered_bytes:
                if not self._make_buffer_room(selector, conn, len(data)):
                    return
            conn.inbuf += data
            self._buffered_bytes += len(data)
            if len(conn.inbuf) < conn.need_bytes:
                return
            data = bytes(conn.inbuf)
        view = memoryview(data)
        hsize = HEADER_BYTES
        consumed = 0
        responses: list[bytes] = []
        trusted = True
        while trusted and len(view) - consumed >= hsize:
            try:
                header = FrameHeader.unpack(view[consumed:consumed + hsize])
                if header.status is not Status.OK:
                    raise ProtocolError(f"a request frame with status {header.status.name}")
                if header.payload_bytes > MAX_REQUEST_BYTES:
                    raise ProtocolError(f"a request of {header.payload_bytes} bytes; requests "
                                        f"are at most {MAX_REQUEST_BYTES}")
            except ProtocolError as e:
                self._warn.warn("bad_frame", "control connection of %s sent a bad frame header, "
                                "closing it: %s", conn.peer, e)
                self._drop(selector, conn, str(e))
                return
            end = consumed + hsize + header.payload_bytes
            if len(view) < end:
                conn.need_bytes = end - consumed
                break
            response, trusted = self._dispatch(selector, conn, header,
                                               view[consumed + hsize:end])
            responses.append(response)
            consumed = end
        if len(view) - consumed < hsize:
            conn.need_bytes = hsize
        rest = bytearray(view[consumed:]) if trusted else bytearray()
        self._buffered_bytes += len(rest) - len(conn.inbuf)
        conn.inbuf = rest
        conn.outbuf += b"".join(responses)
        self._flush(selector, conn)
        if conn not in self._connections:
            return
        if not trusted:
            self._drop(selector, conn, "malformed payload")
        elif self._buffered_bytes > self.options.max_buffered_bytes:
            self._make_buffer_room(selector, conn, 0)

    def _make_buffer_room(self, selector: selectors.BaseSelector, reader: Connection,
                          incoming: int) -> bool:
        """Close hogs until ``incoming`` more bytes for ``reader`` fit the budget (see the
        module docstring). False if ``reader`` had to be closed instead: with the budget at
        least ``MIN_BUFFERED_BYTES`` that takes a reader holding more than one request."""
        limit = self.options.max_buffered_bytes
        while self._buffered_bytes + incoming > limit:
            hog = self._connections.hog(reader, incoming)
            if hog is None:
                self._warn.warn("budget", "control connection of %s alone would take the "
                                "partial requests held past %d bytes; closing it",
                                reader.peer, limit)
                self._drop(selector, reader, "buffer budget")
                return False
            self._warn.warn("budget_hog", "partial requests would pass %d bytes (all "
                            "connections together): closing the control connection of %s, "
                            "which holds %d bytes of one (its process holds the most)",
                            limit, hog.peer, len(hog.inbuf))
            self._drop(selector, hog, "buffer budget: a hog")
        return True

    def _dispatch(self, selector: selectors.BaseSelector, conn: Connection,
                  header: FrameHeader, payload: memoryview) -> tuple[bytes, bool]:
        """The response frame, and whether the stream can still be trusted."""
        verb = header.verb
        try:
            if verb is Verb.HELLO:
                body = self._hello(selector, conn, PayloadReader(payload))
            elif conn.session is None:
                raise ProtocolError(f"{verb.name} before HELLO: a connection's first request "
                                    "must be HELLO (open or resume a session)")
            else:
                conn.session.last_seen = time.monotonic()
                body = HANDLERS[verb](self._manager, PayloadReader(payload), conn.session.owner)
        except ProtocolError as e:
            self._warn.warn("malformed", "control connection of %s sent a malformed %s, closing "
                            "it: %s", conn.peer, verb.name, e)
            return frame(verb, header.request_id, encode_error(e), Status.ERROR), False
        except TiercacheError as e:
            return frame(verb, header.request_id, encode_error(e), Status.ERROR), True
        except Exception as e:  # a bug: report it to the caller and keep serving the others
            log.exception("control server failed on %s", verb.name)
            return frame(verb, header.request_id, encode_error(e), Status.ERROR), True
        return frame(verb, header.request_id, body), True

    def _hello(self, selector: selectors.BaseSelector, conn: Connection,
               reader: PayloadReader) -> bytes:
        if conn.session is not None:
            raise ProtocolError("a second HELLO on one connection")
        token, name = decode_hello_request(reader)
        session, hello, displaced = self._sessions.hello(conn, token, name, conn.pid,
                                                         time.monotonic())
        conn.session = session
        self._connections.greeted(conn)
        if isinstance(displaced, Connection):
            displaced.session = None  # its close must not detach the session it lost
            self._drop(selector, displaced, f"session {session.owner} resumed elsewhere")
        log.debug("control session %d (%r, %s) %s", session.owner, name, conn.peer,
                  "resumed" if hello.resumed else "opened")
        return encode_hello(hello)

    def _flush(self, selector: selectors.BaseSelector, conn: Connection) -> None:
        out = conn.outbuf
        if out:
            try:
                sent = conn.sock.send(out)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._drop(selector, conn, f"send failed: {e}")
                return
            del out[:sent]
            if sent and conn.events == selectors.EVENT_WRITE:  # it reads answers that waited
                self._connections.touch(conn, time.monotonic())
        # While answers are queued, read nothing more: a client that never reads cannot grow us.
        events = selectors.EVENT_WRITE if out else selectors.EVENT_READ
        if conn.events != events and conn in self._connections:
            selector.modify(conn.sock, events, conn)
            conn.events = events


def serve_forever(socket_path: str, num_blocks: int, policy: str = "lru",
                  ready_event: Any = None, enable_events: bool = False,
                  options: ControlOptions | None = None) -> None:
    """Serve a fresh manager until SIGTERM or SIGINT (entry point for a separate process).

    ``ready_event`` (e.g. a ``multiprocessing.Event``) is set once clients may connect.
    """
    stop = threading.Event()
    # A Python-level handler runs in the main thread whichever thread the kernel picked
    # (numpy's BLAS threads exist before we could block signals for sigwait).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    server = ControlServer(OffloadingManager(num_blocks, policy, enable_events), socket_path,
                           options)
    server.start()
    try:
        if ready_event is not None:
            ready_event.set()
        stop.wait()
    finally:
        server.close()
