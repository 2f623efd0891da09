"""The ``/metrics`` endpoint: Prometheus text format over HTTP, in a daemon thread.

``start_exporter(config.exporter, collector)`` serves any ``Collector`` (the
coordinator's ``TiercacheCollector``) at the configured address and port;
``Exporter.close()`` stops serving and waits out scrapes in flight, so the coordinator
may unmap the region right after it. Text format 0.0.4 only (Prometheus accepts it
whatever it asks for), gzip when the scraper accepts it.
"""

from __future__ import annotations

import gzip
import logging
import math
import socket
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tiercache.config import ExporterConfig
from tiercache.errors import ConfigError

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # how long close() waits for a scrape in flight
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# ---------------------------------------------------------------- exposition

def encode_text(metrics: Iterable[Metric]) -> bytes:
    """Prometheus text format 0.0.4 of counter, gauge and histogram families.

    Equivalent to ``prometheus_client.generate_latest`` for these types (a test checks
    it) at a fraction of the cost: the scrape of 8 ranks (~800 samples) must stay
    within 20 ms on a busy 2-core host, and generic escaping of every name and label
    took most of that.
    """
    out: list[str] = []
    for m in metrics:
        if m.type not in _TEXT_TYPES:
            raise ValueError(f"metric {m.name}: type {m.type!r} is not exported by tiercache")
        name = m.name + "_total" if m.type == "counter" else m.name
        doc = m.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {m.type}\n")
        for s in m.samples:
            if s.labels:
                labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in s.labels.items())
                out.append(f"{s.name}{{{labels}}} {_number(s.value)}\n")
            else:
                out.append(f"{s.name} {_number(s.value)}\n")
    return "".join(out).encode()


_TEXT_TYPES = frozenset({"counter", "gauge", "histogram"})


def _escape_label(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace('"', r'\"').replace("\n", r"\n")
    return value


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value):
        return repr(value)
    return floatToGoString(value)  # +Inf, -Inf, NaN


# ---------------------------------------------------------------- HTTP endpoint

class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection
    disable_nagle_algorithm = True  # headers and body go out as separate writes

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "tiercache serves /metrics only")
            return
        try:
            body = self.server.render()
        except Exception as e:  # answered as a 500, logged with its traceback
            log.exception("metrics scrape failed")
            self.send_error(500, f"tiercache metrics scrape failed: {e}")
            return
        gzipped = "gzip" in self.headers.get("Accept-Encoding", "")
        if gzipped:
            body = gzip.compress(body, compresslevel=1)
        self.send_response(200)
        self.send_header("Content-Type", TEXT_CONTENT_TYPE)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # one line per scrape is noise
        pass


class _Server(ThreadingHTTPServer):
    """Serves one collector; ``render`` counts scrapes in flight so ``close`` can wait
    them out (request threads are daemons that ``server_close`` does not join, and a
    scrape still reading the region after the coordinator unmaps it would crash it)."""

    def __init__(self, address: tuple[str, int], collector: Collector):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        self.collector = collector
        self._cond = threading.Condition()
        self._in_flight = 0
        self._closing = False

    def render(self) -> bytes:
        with self._cond:
            if self._closing:
                raise RuntimeError("the exporter is closing")
            self._in_flight += 1
        try:
            return encode_text(self.collector.collect())
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def drain(self, timeout_s: float) -> None:
        with self._cond:
            self._closing = True
            if not self._cond.wait_for(lambda: self._in_flight == 0, timeout_s):
                raise TimeoutError(f"a metrics scrape was still running after {timeout_s} s")


class Exporter:
    """A running ``/metrics`` endpoint (``port`` is the bound one when 0 was asked for)."""

    def __init__(self, config: ExporterConfig, collector: Collector):
        try:
            self._server: _Server | None = _Server((config.address, config.port), collector)
        except OSError as e:
            raise ConfigError(f"exporter.address/exporter.port = {config.address}:{config.port}: "
                              f"cannot listen there ({e.strerror or e})") from e
        self.address = config.address
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name=f"tiercache-exporter-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, wait for scrapes in flight, free the port. Idempotent."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.shutdown()
        self._thread.join(CLOSE_TIMEOUT_S)
        try:
            server.drain(CLOSE_TIMEOUT_S)
        finally:
            server.server_close()


def start_exporter(config: ExporterConfig, collector: Collector) -> Exporter:
    """Serve ``collector`` at ``config.address:config.port`` (port 0: any free port)
    from a daemon thread, in Prometheus text format. The caller checks ``config.enabled``."""
    return Exporter(config, collector)


__all__ = ["Exporter", "TEXT_CONTENT_TYPE", "encode_text", "start_exporter"]
