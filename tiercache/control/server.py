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

* a connection must complete HELLO within ``hello_timeout_s``; one whose session holds no
  reservation and no pin and that sent nothing for ``idle_timeout_s`` is closed (its
  session detaches, as on any close, and its client resumes it on its next call); at most
  ``max_detached_sessions_per_peer`` closed sessions of one process are kept
  (``tiercache.control.upkeep`` runs these deadlines);
* at most ``max_connections`` connections, and ``max_connections_per_peer`` of one
  process; at the cap the connection quiet longest among those holding nothing and not
  mid-request makes room, and only when there is none is the newcomer refused, with an
  error naming the limit (``tiercache.control.admission``);
* a request frame is at most ``MAX_REQUEST_BYTES``, and requests held (partial, or whole
  and waiting their turn) across all connections at most ``max_buffered_bytes``. A read
  that would pass it closes the hogs, never the reader: the process holding the most
  bytes gives way, its connection holding the most first (of equals, the one quiet
  longest). The budget holds at least one whole request and one read past it
  (``MIN_BUFFERED_BYTES``), so a client sending one request always fits, whatever others
  hold;
* a request's work is bounded by keys and key lists, not bytes (``MAX_KEYS_PER_CALL``
  keys, ``MAX_LISTS_PER_BATCH`` lists in a LEASE_BATCH; more is refused with an error
  naming the bound, and the connection closed), and connections take fair turns by work
  (``tiercache.control.turns``): one request per connection waits at a time, the loop
  serves the waiting request with the smallest finish tag (its cost read from its frame)
  and, after ``WORK_PER_POLL`` units, looks for new arrivals before it serves more. A
  client streaming heavy requests (pipelined, or from many connections) delays another's
  small call by the request in progress, not by its streams;
* answers are not read past: while a connection's answers wait, it is not read from, nor
  is its next request served;
* each kind of complaint or close (bad frames, refused peers, accept failures, HELLO
  timeouts, idle closes, room made, hogs closed, sessions ended early) is logged at most
  once per ``log_interval_s`` with a count of the rest;
* out of file descriptors (EMFILE and the like) the listener is taken out of the loop for
  ``accept_backoff_s`` (the connections already open are served meanwhile); pending
  connections wait in the kernel's backlog (``listen_backlog``) and are accepted later.

Peers: a connection from a uid that is not trusted (``tiercache.link.sockets``) is answered
with an error and closed.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterable

from tiercache.errors import ControlSocketError, ProtocolError, ProtocolVersionError, TiercacheError
from tiercache.control.admission import Admission, refuse
from tiercache.control.connections import Connection, ConnectionTable
from tiercache.control.options import ControlOptions, RECV_BYTES
from tiercache.control.turns import Turns, request_units
from tiercache.control.upkeep import Upkeep
from tiercache.link.versions import check_verb
from tiercache.control.verbs import HANDLERS, store_verbs
from tiercache.loglimit import LogLimiter
from tiercache.index.manager import ManagerStats, OffloadingManager
from tiercache.link.sockets import SocketFile, trusted_uids
from tiercache.link.payloads import (
    decode_hello_request, encode_error, encode_hello, request_size,
)
from tiercache.link.protocol import HEADER_BYTES, FrameHeader, PayloadReader, Status, Verb, frame
from tiercache.control.namespaces import Describer, describer, store_check
from tiercache.control.sessions import SessionTable
from tiercache.region.sessions import SessionLedger, SessionRecord

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
# Work (``tiercache.control.turns`` units) the loop serves before it looks for arrivals:
# a few hundred small calls, or one heavy request.
WORK_PER_POLL = 256
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class ControlServer:
    """Serves ``manager`` on the Unix socket ``socket_path`` (mode 0600) until ``close()``."""

    def __init__(self, manager: OffloadingManager, socket_path: str | os.PathLike[str],
                 options: ControlOptions | None = None, *,
                 session_store: SessionLedger | None = None,
                 restored: Iterable[SessionRecord] = (), events: Describer | None = None):
        self._manager = manager
        # the event stream's: DESCRIBE, and which session may store under which namespace
        self._handlers = {**HANDLERS, **store_verbs(store_check(events)),
                          Verb.DESCRIBE: describer(events)}
        self._path = os.fspath(socket_path)
        self.options = options or ControlOptions()
        self._trusted = trusted_uids(self.options.trusted_uid)
        opts = self.options
        self._sessions = SessionTable(manager, opts.session_grace_s,
                                      timeout_s=opts.session_timeout_s, store=session_store,
                                      restored=restored, now=time.monotonic(),
                                      on_end=events.session_ended if events else None)
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
                                    self._drop)
        self._upkeep = Upkeep(self.options, manager, self._sessions, self._connections,
                              self._warn, self._drop, time.monotonic())
        self._turns = Turns()
        self._buffered_bytes = 0  # requests held (partial or waiting), all connections together
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
                key.fileobj.close()  # type: ignore[union-attr]  # only sockets are registered
            self._selector.close()
            self._selector = None
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._listener = self._wake_r = self._wake_w = None
        for conn in self._connections:  # those waiting their turn are in no selector
            conn.sock.close()
        self._connections.clear()
        self._socket_file.unlink()

    # ------------------------------------------------------------------ the loop

    def _wait(self, selector: selectors.BaseSelector, timeout: float | None
              ) -> list[tuple[selectors.SelectorKey, int]]:
        """Poll for up to ``poll_before_sleep_s``, then sleep in the kernel (why: see
        ``POLL_BEFORE_SLEEP_S``) until an event or ``timeout`` (0: requests wait their
        turn, so only look)."""
        ready = selector.select(0)
        if ready or timeout == 0:
            return ready
        poll_s = self.options.poll_before_sleep_s
        if poll_s > 0:
            deadline = time.perf_counter() + poll_s
            while not ready and time.perf_counter() < deadline:
                ready = selector.select(0)
        return ready or selector.select(timeout)

    def _serve(self) -> None:
        selector = self._selector
        assert selector is not None
        while True:
            for key, mask in self._wait(selector, 0.0 if self._turns else self._timeout()):
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
                if mask & selectors.EVENT_WRITE and source in self._connections:
                    self._flush(selector, source)
            self._serve_turns(selector)
            self._on_time(selector)

    def _timeout(self) -> float | None:
        """Seconds until the next session expiry, tick, accept resumption, HELLO or idle
        deadline (None: none due)."""
        due = [t for t in (self._upkeep.next_deadline(), self._accept_resume_at)
               if t is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _on_time(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        if self._accept_resume_at is not None and now >= self._accept_resume_at:
            self._accept_resume_at = None
            assert self._listener is not None
            selector.register(self._listener, selectors.EVENT_READ, self._listener)
        self._upkeep.run(now)

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

    def _drop(self, conn: Connection, why: str, tell: Exception | None = None) -> None:
        """Close ``conn`` (first answering no request with ``tell``, if given: only for a
        connection without HELLO, whose stream carries no answers) and detach its session.
        On the loop's thread (the admission and upkeep helpers call it too)."""
        log.debug("closing control connection of %s: %s", conn.peer, why)
        if not self._connections.remove(conn):
            return
        self._turns.forget(conn)
        self._buffered_bytes -= len(conn.inbuf)
        conn.inbuf = bytearray()
        if conn.events and self._selector is not None:
            self._selector.unregister(conn.sock)
        if tell is not None:
            refuse(conn.sock, tell, conn.answer_version)
        else:
            conn.sock.close()
        if conn.session is not None:
            self._sessions.detach(conn.session, conn, time.monotonic())
            self._upkeep.bound_detached(conn.session.pid)

    def _on_readable(self, selector: selectors.BaseSelector, conn: Connection) -> None:
        try:
            data = conn.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError as e:
            self._drop(conn, f"receive failed: {e}")
            return
        if not data:
            self._drop(conn, "peer closed")
            return
        self._connections.touch(conn, time.monotonic())
        if self._buffered_bytes + len(data) > self.options.max_buffered_bytes:
            if not self._make_buffer_room(selector, conn, len(data)):
                return
        conn.inbuf += data
        self._buffered_bytes += len(data)
        self._next_request(selector, conn)

    def _next_request(self, selector: selectors.BaseSelector, conn: Connection) -> None:
        """``conn`` has no request waiting and no answer queued: if its next request is in,
        it waits its turn (and nothing more is read from it meanwhile), else read on."""
        try:
            header = conn.request()
        except ProtocolVersionError as e:  # its first frame: answered in its version
            self._warn.warn("version", "control connection of %s refused: %s", conn.peer, e)
            self._drop(conn, str(e), tell=e)
            return
        except ProtocolError as e:
            self._warn.warn("bad_frame", "control connection of %s sent a bad frame header, "
                            "closing it: %s", conn.peer, e)
            self._drop(conn, str(e))
            return
        if header is None:
            conn.watch(selector, selectors.EVENT_READ)
            return
        conn.watch(selector, 0)
        view = memoryview(conn.inbuf)
        try:
            keys, lists = request_size(header.verb, view[HEADER_BYTES:conn.need_bytes])
        finally:
            view.release()
        self._turns.wait(conn, request_units(keys, lists))

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
                                "requests held past %d bytes; closing it", reader.peer, limit)
                self._drop(reader, "buffer budget")
                return False
            self._warn.warn("budget_hog", "requests held would pass %d bytes (all "
                            "connections together): closing the control connection of %s, "
                            "which holds %d bytes (its process holds the most)",
                            limit, hog.peer, len(hog.inbuf))
            self._drop(hog, "buffer budget: a hog")
        return True

    def _serve_turns(self, selector: selectors.BaseSelector) -> None:
        """Serve waiting requests in their turns until none waits or ``WORK_PER_POLL``
        units are spent (then the loop looks for new arrivals first)."""
        spent = 0
        while spent < WORK_PER_POLL:
            turn = self._turns.next()
            if turn is None:
                return
            conn, units = turn
            self._serve_request(selector, conn)
            spent += units

    def _serve_request(self, selector: selectors.BaseSelector, conn: Connection) -> None:
        """Answer ``conn``'s first request."""
        header, payload = conn.take_request()
        self._buffered_bytes -= HEADER_BYTES + header.payload_bytes
        response, trusted = self._dispatch(selector, conn, header, PayloadReader(payload))
        conn.outbuf += response
        if not trusted:  # nothing after it is read: the error is sent, then the close
            self._buffered_bytes -= len(conn.inbuf)
            conn.inbuf = bytearray()
        self._flush(selector, conn)
        if not trusted:
            self._drop(conn, "malformed payload")

    def _dispatch(self, selector: selectors.BaseSelector, conn: Connection,
                  header: FrameHeader, reader: PayloadReader) -> tuple[bytes, bool]:
        """The response frame (in the request's version); whether the stream is trusted."""
        verb = header.verb
        try:
            check_verb(verb, header.version)
            if verb is Verb.HELLO:
                body = self._hello(selector, conn, reader)
            elif conn.session is None:
                raise ProtocolError(f"{verb.name} before HELLO: a connection's first request "
                                    "must be HELLO (open or resume a session)")
            else:
                conn.session.last_seen = time.monotonic()
                body = self._handlers[verb](self._manager, reader, conn.session.owner)
        except ProtocolVersionError as e:  # a verb its version lacks: answered, kept open
            return self._error(header, e), True
        except ProtocolError as e:
            self._warn.warn("malformed", "control connection of %s sent a malformed %s, closing "
                            "it: %s", conn.peer, verb.name, e)
            return self._error(header, e), False
        except TiercacheError as e:
            return self._error(header, e), True
        except Exception as e:  # a bug: report it to the caller and keep serving the others
            log.exception("control server failed on %s", verb.name)
            return self._error(header, e), True
        return frame(verb, header.request_id, body, Status.OK, header.version), True

    @staticmethod
    def _error(header: FrameHeader, e: Exception) -> bytes:
        return frame(header.verb, header.request_id, encode_error(e, header.version),
                     Status.ERROR, header.version)

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
            self._drop(displaced, f"session {session.owner} resumed elsewhere")
        log.debug("control session %d (%r, %s) %s", session.owner, name, conn.peer,
                  "resumed" if hello.resumed else "opened")
        return encode_hello(hello)

    def _flush(self, selector: selectors.BaseSelector, conn: Connection) -> None:
        """Send what answers are queued; once none are, the next request (or reading)."""
        out = conn.outbuf
        if out:
            try:
                sent = conn.sock.send(out)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._drop(conn, f"send failed: {e}")
                return
            del out[:sent]
            if sent and conn.events == selectors.EVENT_WRITE:  # it reads answers that waited
                self._connections.touch(conn, time.monotonic())
        if out:  # read nothing more, serve nothing more: a client that never reads cannot grow us
            conn.watch(selector, selectors.EVENT_WRITE)
        elif conn.turn is None and conn in self._connections:
            self._next_request(selector, conn)
