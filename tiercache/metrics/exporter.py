"""The ``/metrics`` endpoint: Prometheus text format over HTTP, with bounded resources.

``start_exporter(config.exporter, collector)`` serves any ``Collector`` (the
coordinator's ``TiercacheCollector``) at the configured address and port;
``Exporter.close()`` stops serving and waits out scrapes in flight, so the coordinator
may unmap the region right after it. gzip when the scraper accepts it.

Any local user can connect, so nothing a client does may grow the coordinator or starve
its control socket. Threads: one loop thread (a selector over the listener and every
connection still sending its request) and ``scrape_workers`` threads that render a
scrape and write it, fixed at start. Bounds (``ExporterLimits``; the README's "Limits"
repeats the defaults):

* at most ``max_connections`` open connections; one more closes the connection that has
  waited longest for its request (a flood pushes out its own oldest, and a scraper's
  fresh connection still gets its turn), or the new one when all are being answered;
* a request (request line and headers, at most ``max_request_bytes``; no body) must be
  complete within ``request_timeout_s`` of connecting or of the previous answer on a
  kept-alive connection; an answer must be taken within ``write_timeout_s``;
* out of file descriptors, accepting pauses for ``ACCEPT_BACKOFF_S``; such errors and
  failed scrapes are logged at most once per ``LOG_INTERVAL_S``;
* a client that goes away is closed quietly (debug log), never a traceback.

HTTP/1.1 keep-alive (Prometheus reuses its connection) unless the client says
``Connection: close``; HTTP/1.0 closes after the answer. Only ``GET /metrics`` (and
``/``); other paths are a 404, other methods a 405.
"""

from __future__ import annotations

import collections
import gzip
import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from prometheus_client.registry import Collector

from tiercache.config import ExporterConfig
from tiercache.errors import ArgumentError, ConfigError, ServiceError
from tiercache.metrics.exposition import TEXT_CONTENT_TYPE, encode_text
from tiercache.metrics.http_messages import REASONS, Answer, Request, parse_request

log = logging.getLogger(__name__)

ACCEPT_BACKOFF_S = 0.1
LOG_INTERVAL_S = 60.0
CLOSE_TIMEOUT_S = 5.0  # how long close() waits for a scrape in flight
LISTEN_BACKLOG = 128
_ACCEPTS_PER_ROUND = 64  # then the loop looks at its other sockets again
_RECV_BYTES = 4096


@dataclass(frozen=True)
class ExporterLimits:
    """The exporter's bounds (see the module docstring); tests shrink them."""

    max_connections: int = 64
    scrape_workers: int = 2
    max_request_bytes: int = 8192
    request_timeout_s: float = 10.0
    write_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        counts = (self.max_connections, self.scrape_workers, self.max_request_bytes)
        if min(counts) < 1 or not min(self.request_timeout_s, self.write_timeout_s) > 0:
            raise ArgumentError(f"{self}: counts must be >= 1 and timeouts > 0")


DEFAULT_LIMITS = ExporterLimits()


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    deadline: float
    inbuf: bytearray = field(default_factory=bytearray)


class _RateLimitedLog:
    """One log line per key and interval; the lines held back are counted in the next."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, key: str, level: int, message: str, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self._interval_s) < self._interval_s:
                self._held[key] += 1
                return
            self._last[key], held = now, self._held.pop(key, 0)
        more = f" ({held} more like it since the last report)" if held else ""
        log.log(level, "%s%s", message, more, exc_info=exc_info)


_LISTENER, _WAKE = object(), object()  # selector data of the two non-connection sockets


class _Server:
    """The loop thread and the scrape workers (see the module docstring). Connections
    waiting for their request belong to the loop; a complete request hands its
    connection to a worker, which answers and hands it back (or to be closed)."""

    def __init__(self, listener: socket.socket, collector: Collector, limits: ExporterLimits):
        self._limits = limits
        self.listener = listener
        self.port: int = self.listener.getsockname()[1]
        self._collector = collector
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._idle: collections.OrderedDict[_Conn, None] = collections.OrderedDict()  # by deadline
        self._open = 0  # connections open, wherever they are (loop thread only)
        self._work: queue.SimpleQueue[tuple[_Conn, bytes | int] | None] = queue.SimpleQueue()
        self._returned: collections.deque[tuple[_Conn, bool]] = collections.deque()
        self._closing = False
        self._accept_paused_until = 0.0
        self._log = _RateLimitedLog()
        self._threads = [threading.Thread(target=self._loop, daemon=True,
                                          name=f"tiercache-exporter-{self.port}")]
        self._threads += [threading.Thread(target=self._work_loop, daemon=True,
                                           name=f"tiercache-scrape-{self.port}-{i}")
                          for i in range(limits.scrape_workers)]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        try:
            while not self._closing:
                for key, _ in self._selector.select(self._timeout()):
                    if key.data is _LISTENER:
                        self._accept()
                    elif key.data is _WAKE:
                        self._on_wake()
                    else:
                        self._on_readable(key.data)
                self._expire(time.monotonic())
                if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    self._selector.register(self.listener, selectors.EVENT_READ, _LISTENER)
        finally:
            for conn in list(self._idle):
                self._close(conn)
            self._selector.close()
            self.listener.close()

    def _timeout(self) -> float | None:
        deadlines = [next(iter(self._idle)).deadline] if self._idle else []
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: keep serving what we have
                self._selector.unregister(self.listener)
                self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_S
                self._log("accept", logging.WARNING, f"metrics exporter cannot accept a "
                          f"connection ({e}); not accepting for {ACCEPT_BACKOFF_S} s")
                return
            if self._open >= self._limits.max_connections:
                if not self._idle:  # every connection is being answered: refuse this one
                    sock.close()
                    continue
                self._close(next(iter(self._idle)))  # the one waiting longest
            sock.setblocking(False)
            # one sendall per answer, and no Nagle wait for a kept-alive scraper's ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._open += 1
            self._watch(_Conn(sock, time.monotonic() + self._limits.request_timeout_s))

    def _watch(self, conn: _Conn) -> None:
        self._idle[conn] = None
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _unwatch(self, conn: _Conn) -> None:
        del self._idle[conn]
        self._selector.unregister(conn.sock)

    def _close(self, conn: _Conn) -> None:
        if conn in self._idle:
            self._unwatch(conn)
        conn.sock.close()
        self._open -= 1

    def _on_readable(self, conn: _Conn) -> None:
        if conn not in self._idle:  # closed earlier in this round (pushed out by an accept)
            return
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError as e:
            log.debug("metrics client went away: %s", e)
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        conn.inbuf += data
        self._dispatch(conn)

    def _dispatch(self, conn: _Conn) -> None:
        """Hand a complete request to the workers (an oversized one gets a 431)."""
        limit = self._limits.max_request_bytes
        end = conn.inbuf.find(b"\r\n\r\n", 0, limit + 4)
        if end < 0:
            if len(conn.inbuf) > limit:
                self._unwatch(conn)
                self._work.put((conn, 431))
            return
        head = bytes(conn.inbuf[:end])
        del conn.inbuf[:end + 4]
        self._unwatch(conn)
        self._work.put((conn, head))

    def _on_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._returned:
            conn, keep_alive = self._returned.popleft()
            if not keep_alive or self._closing:
                self._close(conn)
                continue
            conn.deadline = time.monotonic() + self._limits.request_timeout_s
            self._watch(conn)
            self._dispatch(conn)  # a pipelined request may be there already

    def _expire(self, now: float) -> None:
        while self._idle:
            conn = next(iter(self._idle))
            if conn.deadline > now:
                return
            log.debug("closing a metrics connection without a complete request in %.1f s",
                      self._limits.request_timeout_s)
            self._close(conn)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except BlockingIOError:
            pass  # a wake-up is pending already

    # ------------------------------------------------------------ the workers
    def _work_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            conn, head = item
            if self._closing:
                conn.sock.close()
                continue
            self._returned.append((conn, self._answer(conn, head)))
            self._wake()

    def _answer(self, conn: _Conn, head: bytes | int) -> bool:
        """Answer one request; whether to keep the connection."""
        answer = self._answer_for(parse_request(head) if isinstance(head, bytes) else head)
        conn.sock.settimeout(self._limits.write_timeout_s)
        try:
            conn.sock.sendall(answer.encode())
        except OSError as e:  # the timeout included
            log.debug("metrics client went away: %s", e)
            return False
        finally:
            conn.sock.setblocking(False)
        return answer.keep_alive

    def _answer_for(self, request: Request | int) -> Answer:
        if isinstance(request, int):
            return Answer(request, f"{REASONS[request]}\n".encode(), keep_alive=False)
        if request.method != "GET":
            return Answer(405, b"tiercache serves GET /metrics only\n", keep_alive=False)
        if request.path not in ("/metrics", "/"):
            return Answer(404, b"tiercache serves /metrics only\n", request.keep_alive)
        try:
            body = encode_text(self._collector.collect())
        except Exception as e:  # answered as a 500, logged with its traceback
            self._log("scrape", logging.ERROR, "metrics scrape failed", exc_info=True)
            return Answer(500, f"tiercache metrics scrape failed: {e}\n".encode(),
                           request.keep_alive)
        if request.gzip:
            body = gzip.compress(body, compresslevel=1)
        return Answer(200, body, request.keep_alive, TEXT_CONTENT_TYPE, request.gzip)

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop accepting, close every connection, wait for scrapes in flight."""
        self._closing = True
        self._wake()
        loop, *workers = self._threads
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        loop.join(CLOSE_TIMEOUT_S)
        for _ in workers:
            self._work.put(None)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        while self._returned:
            self._returned.popleft()[0].sock.close()
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            raise ServiceError(f"metrics exporter threads {stuck} still ran after "
                               f"{CLOSE_TIMEOUT_S} s (a scrape did not finish)")
        while True:  # requests queued behind the stop markers
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].sock.close()
        self._wake_r.close()
        self._wake_w.close()


def bind_listener(config: ExporterConfig) -> socket.socket:
    """The exporter's listening socket at ``config.address:config.port``, non-blocking;
    ``ConfigError`` naming both when it cannot listen there. The coordinator binds it
    before it allocates anything and hands it to ``start_exporter`` (scrapers that
    connect meanwhile wait in the backlog)."""
    family = socket.AF_INET6 if ":" in config.address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((config.address, config.port))
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except OSError as e:
        listener.close()
        raise ConfigError(f"exporter.address/exporter.port = {config.address}:{config.port}: "
                          f"cannot listen there ({e.strerror or e}); give a free port, or "
                          "exporter.port = 0 for any free one") from e
    return listener


class Exporter:
    """A running ``/metrics`` endpoint (``port`` is the bound one when 0 was asked for).
    It serves on ``listener`` when given (``bind_listener``'s, now owned by the exporter),
    else binds its own."""

    def __init__(self, config: ExporterConfig, collector: Collector,
                 limits: ExporterLimits = DEFAULT_LIMITS, listener: socket.socket | None = None):
        if listener is None:
            listener = bind_listener(config)
        try:
            self._server: _Server | None = _Server(listener, collector, limits)
        except BaseException:
            listener.close()
            raise
        self.address = config.address
        self.port: int = self._server.port

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, wait for scrapes in flight, free the port. Idempotent; raises
        ``ServiceError`` if a scrape did not finish (the region must then stay mapped)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()


def start_exporter(config: ExporterConfig, collector: Collector,
                   limits: ExporterLimits = DEFAULT_LIMITS,
                   listener: socket.socket | None = None) -> Exporter:
    """Serve ``collector`` at ``config.address:config.port`` (port 0: any free port), in
    Prometheus text format, on ``listener`` if given (``bind_listener``). The caller checks
    ``config.enabled``."""
    return Exporter(config, collector, limits, listener)


__all__ = ["DEFAULT_LIMITS", "Exporter", "ExporterLimits", "bind_listener", "start_exporter"]
