"""The control server: the coordinator's cache index, served over a Unix socket.

One thread runs a selector loop over the listening socket and every connection.
Calls are tens of microseconds and all go through the manager's single lock, so
more threads would add GIL hand-offs, not parallelism. A connection that sends a
frame the protocol cannot trust (bad magic or version, oversized, malformed
payload) is closed; the loop and every other connection carry on.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from tiercache.errors import ConfigError, ControlSocketError, ProtocolError, TiercacheError
from tiercache.index.manager import ManagerStats, OffloadingManager
from tiercache.index.protocol import (
    HEADER_BYTES, MAX_KEYS_PER_CALL, MAX_SOCKET_PATH_BYTES, FrameHeader, PayloadReader,
    PayloadWriter, Status, Verb, encode_error, encode_events, encode_stats, encode_store_output,
    frame,
)

log = logging.getLogger(__name__)

RECV_BYTES = 64 << 10  # below malloc's mmap threshold: no mmap per call
LISTEN_BACKLOG = 128
CLOSE_TIMEOUT_S = 10.0
# After serving, keep polling this long before sleeping in epoll_wait: a sleeping core
# takes ~50 µs to wake on the 2-core VM we measured (a 16-byte echo between two processes:
# 108 µs p50 blocking, 13 µs with this poll). It costs CPU only while calls keep coming.
POLL_BEFORE_SLEEP_S = 50e-6

Handler = Callable[[OffloadingManager, PayloadReader], bytes]
_EMPTY = b""
_U32 = struct.Struct("<I")


def _keys_then(reader: PayloadReader) -> list[bytes]:
    keys = reader.keys()
    reader.done()
    return keys


def _lookup(m: OffloadingManager, r: PayloadReader) -> bytes:
    return _U32.pack(m.lookup(_keys_then(r)))


def _prepare_load(m: OffloadingManager, r: PayloadReader) -> bytes:
    return PayloadWriter().ids(m.prepare_load(_keys_then(r)).block_ids).build()


def _touch(m: OffloadingManager, r: PayloadReader) -> bytes:
    m.touch(_keys_then(r))
    return _EMPTY


def _complete_load(m: OffloadingManager, r: PayloadReader) -> bytes:
    m.complete_load(_keys_then(r))
    return _EMPTY


def _prepare_store(m: OffloadingManager, r: PayloadReader) -> bytes:
    return encode_store_output(m.prepare_store(_keys_then(r)))


def _complete_store(m: OffloadingManager, r: PayloadReader) -> bytes:
    success = r.u8()
    if success not in (0, 1):
        raise ProtocolError(f"complete_store success flag {success}; expected 0 or 1")
    m.complete_store(_keys_then(r), success=bool(success))
    return _EMPTY


def _no_args(call: Callable[[OffloadingManager], bytes]) -> Handler:
    def handler(m: OffloadingManager, r: PayloadReader) -> bytes:
        r.done()
        return call(m)
    return handler


def _reset(m: OffloadingManager) -> bytes:
    m.reset()
    return _EMPTY


HANDLERS: dict[Verb, Handler] = {
    Verb.LOOKUP: _lookup,
    Verb.PREPARE_LOAD: _prepare_load,
    Verb.TOUCH: _touch,
    Verb.COMPLETE_LOAD: _complete_load,
    Verb.PREPARE_STORE: _prepare_store,
    Verb.COMPLETE_STORE: _complete_store,
    Verb.TAKE_EVENTS: _no_args(lambda m: encode_events(m.take_events(max_keys=MAX_KEYS_PER_CALL))),
    Verb.RESET: _no_args(_reset),
    Verb.STATS: _no_args(lambda m: encode_stats(m.stats())),
    Verb.PING: _no_args(lambda m: _EMPTY),
}
assert set(HANDLERS) == set(Verb), "every verb needs a handler"


class _Connection:
    __slots__ = ("sock", "inbuf", "need_bytes", "outbuf", "events")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()  # the start of a frame still incomplete
        self.need_bytes = 0  # how long inbuf must get before it is worth parsing again
        self.outbuf = bytearray()
        self.events = selectors.EVENT_READ  # what the selector watches for


class ControlServer:
    """Serves ``manager`` on the Unix socket ``socket_path`` (mode 0600) until ``close()``."""

    def __init__(self, manager: OffloadingManager, socket_path: str | os.PathLike[str],
                 poll_before_sleep_s: float = POLL_BEFORE_SLEEP_S):
        if not 0 <= poll_before_sleep_s <= 0.01:
            raise ConfigError(
                f"poll_before_sleep_s = {poll_before_sleep_s!r}: allowed 0 .. 0.01 s")
        self._manager = manager
        self._path = os.fspath(socket_path)
        self._poll_before_sleep_s = poll_before_sleep_s
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._inode: tuple[int, int] | None = None

    @property
    def socket_path(self) -> str:
        return self._path

    def stats(self) -> ManagerStats:
        """The served index's stats (safe from any thread: the manager holds its own lock)."""
        return self._manager.stats()

    def start(self) -> None:
        """Bind and listen (clients may connect once this returns), then serve in a thread."""
        if self._thread is not None:
            raise ControlSocketError(f"control server on {self._path} was already started")
        self._listener = self._bind()
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

    def close(self) -> None:
        """Stop serving, close every connection and unlink the socket. Idempotent."""
        if self._thread is not None and self._wake_w is not None:
            self._wake_w.send(b"x")
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                try:  # the thread may still use its sockets; the path at least must go
                    os.unlink(self._path)
                except FileNotFoundError:
                    pass
                raise ControlSocketError(
                    f"control server thread did not stop within {CLOSE_TIMEOUT_S} s"
                )
        self._release()

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ socket setup

    def _bind(self) -> socket.socket:
        path = self._path
        if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise ControlSocketError(
                f"control socket path {path!r} is {len(os.fsencode(path))} bytes; "
                f"Unix sockets allow at most {MAX_SOCKET_PATH_BYTES}"
            )
        self._remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Nobody can connect before listen(), so the mode is owner-only from the first connect.
            os.chmod(path, 0o600)
            st = os.stat(path)
            self._inode = (st.st_dev, st.st_ino)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise ControlSocketError(f"cannot serve the control socket {path!r}: {e}") from e
        return sock

    @staticmethod
    def _remove_stale_socket(path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketError(f"control socket path {path!r} exists and is not a socket; "
                                     "remove it or choose another control.socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale control socket %s", path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        finally:
            probe.close()
        raise ControlSocketError(f"control socket {path!r} is served by a live process; "
                                 "is another coordinator running with this config?")

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
        if self._inode is not None:
            try:
                st = os.stat(self._path)
                if (st.st_dev, st.st_ino) == self._inode:  # never unlink a successor's socket
                    os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._inode = None

    # ------------------------------------------------------------------ the loop

    def _wait(self, selector: selectors.BaseSelector) -> list[tuple[selectors.SelectorKey, int]]:
        """Poll for up to ``poll_before_sleep_s``, then sleep in the kernel (why: see
        ``POLL_BEFORE_SLEEP_S``)."""
        ready = selector.select(0)
        if not ready and self._poll_before_sleep_s > 0:
            deadline = time.perf_counter() + self._poll_before_sleep_s
            while not ready and time.perf_counter() < deadline:
                ready = selector.select(0)
        return ready or selector.select()

    def _serve(self) -> None:
        selector = self._selector
        assert selector is not None
        while True:
            for key, mask in self._wait(selector):
                source = key.data
                if source is self._wake_r:
                    return
                if source is self._listener:
                    self._accept(selector)
                    continue
                if mask & selectors.EVENT_READ:
                    self._on_readable(selector, source)
                if mask & selectors.EVENT_WRITE and source.sock.fileno() >= 0:
                    self._flush(selector, source)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # e.g. EMFILE: keep serving the connections we have
                log.warning("control server cannot accept a connection: %s", e)
                return
            sock.setblocking(False)
            conn = _Connection(sock)
            selector.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, selector: selectors.BaseSelector, conn: _Connection, why: str) -> None:
        log.debug("closing control connection: %s", why)
        selector.unregister(conn.sock)
        conn.sock.close()

    def _on_readable(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
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
        if conn.inbuf:  # the rest of a frame that arrives in pieces
            conn.inbuf += data
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
            except ProtocolError as e:
                log.warning("control connection sent a bad frame header, closing it: %s", e)
                self._drop(selector, conn, str(e))
                return
            end = consumed + hsize + header.payload_bytes
            if len(view) < end:
                conn.need_bytes = end - consumed
                break
            response, trusted = self._dispatch(header, view[consumed + hsize:end])
            responses.append(response)
            consumed = end
        if len(view) - consumed < hsize:
            conn.need_bytes = hsize
        conn.inbuf = bytearray(view[consumed:]) if trusted else bytearray()
        conn.outbuf += b"".join(responses)
        self._flush(selector, conn)
        if not trusted and conn.sock.fileno() >= 0:
            self._drop(selector, conn, "malformed payload")

    def _dispatch(self, header: FrameHeader, payload: memoryview) -> tuple[bytes, bool]:
        """The response frame, and whether the stream can still be trusted."""
        try:
            body = HANDLERS[header.verb](self._manager, PayloadReader(payload))
        except ProtocolError as e:
            log.warning("control connection sent a malformed %s payload, closing it: %s",
                        header.verb.name, e)
            return frame(header.verb, header.request_id, encode_error(e), Status.ERROR), False
        except TiercacheError as e:
            return frame(header.verb, header.request_id, encode_error(e), Status.ERROR), True
        except Exception as e:  # a bug: report it to the caller and keep serving the others
            log.exception("control server failed on %s", header.verb.name)
            return frame(header.verb, header.request_id, encode_error(e), Status.ERROR), True
        return frame(header.verb, header.request_id, body), True

    def _flush(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
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
        # While answers are queued, read nothing more: a client that never reads cannot grow us.
        events = selectors.EVENT_WRITE if out else selectors.EVENT_READ
        if conn.events != events:
            selector.modify(conn.sock, events, conn)
            conn.events = events


def serve_forever(socket_path: str, num_blocks: int, policy: str = "lru",
                  ready_event: Any = None, enable_events: bool = False) -> None:
    """Serve a fresh manager until SIGTERM or SIGINT (entry point for a separate process).

    ``ready_event`` (e.g. a ``multiprocessing.Event``) is set once clients may connect.
    """
    stop = threading.Event()
    # A Python-level handler runs in the main thread whichever thread the kernel picked
    # (numpy's BLAS threads exist before we could block signals for sigwait).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    server = ControlServer(OffloadingManager(num_blocks, policy, enable_events), socket_path)
    server.start()
    try:
        if ready_event is not None:
            ready_event.set()
        stop.wait()
    finally:
        server.close()
