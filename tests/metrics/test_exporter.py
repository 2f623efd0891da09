"""The /metrics endpoint: text encoding equal to prometheus_client's, HTTP behaviour
(gzip, 404, 500 on a failing collect), closing and the port."""

from __future__ import annotations

import gzip
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiercache.config import ExporterConfig
from tiercache.errors import ConfigError
from tiercache.metrics.exporter import start_exporter
from tiercache.metrics.exposition import encode_text
from tiercache.metrics.collector import TiercacheCollector
from tiercache.region.stats import PinState
from tiercache.specs import Direction

from metrics_support import (
    sample_manager_stats, FakeRegion, attach_self, promtool_check, registry_of,
)

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU


def _families(text: str) -> list[tuple]:
    return [(f.name, f.type, f.documentation,
             sorted((s.name, sorted(s.labels.items()), s.value) for s in f.samples))
            for f in text_string_to_metric_families(text)]


def test_encode_text_matches_prometheus_client():
    region = FakeRegion(world_size=2)
    view = attach_self(region, 1)
    view.set_pin(PinState.PINNED, 1 << 30, 1.5)
    view.record_transfer(C2G, 123456, 0.0123, success=True)
    collector = TiercacheCollector(region, manager_stats=sample_manager_stats)
    ours = encode_text(collector.collect()).decode()
    theirs = generate_latest(registry_of(collector)).decode()
    assert _families(ours) == _families(theirs)


def test_exporter_serves_and_closes():
    region = FakeRegion(world_size=2)
    attach_self(region, 0).record_transfer(G2C, 4096, 1e-3, success=True)
    exporter = start_exporter(ExporterConfig(port=0), TiercacheCollector(region, sample_manager_stats))
    try:
        assert exporter.port > 0
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = resp.read()
        promtool_check(body)
        sample = 'tiercache_transfer_bytes_total{rank="0",direction="gpu_to_cpu"} 4096'
        assert sample in body.decode()
        request = urllib.request.Request(exporter.url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(resp.read()).startswith(b"# HELP tiercache_build_info")
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(exporter.url.replace("/metrics", "/nope"), timeout=10)
        assert missing.value.code == 404
    finally:
        exporter.close()
    exporter.close()  # idempotent
    with socket.socket() as s:  # the listener is gone (client connections may linger)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((exporter.address, exporter.port))


def test_failing_scrape_is_a_500_and_the_exporter_keeps_serving():
    region = FakeRegion()
    broken = {"on": True}

    def manager_stats() -> sample_manager_stats:
        if broken["on"]:
            raise RuntimeError("index unavailable")
        return sample_manager_stats()

    exporter = start_exporter(ExporterConfig(port=0), TiercacheCollector(region, manager_stats))
    try:
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(exporter.url, timeout=10)
        assert failed.value.code == 500
        broken["on"] = False
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:
            assert b"tiercache_index_lookups_total 7" in resp.read()
    finally:
        exporter.close()


def test_port_in_use_is_a_config_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
            start_exporter(ExporterConfig(port=port), TiercacheCollector(FakeRegion()))


# ---------------------------------------------------------------- HTTP behaviour, raw sockets

def _exporter(limits=None):
    from tiercache.metrics.exporter import DEFAULT_LIMITS

    region = FakeRegion()
    return start_exporter(ExporterConfig(port=0), TiercacheCollector(region, sample_manager_stats),
                          limits or DEFAULT_LIMITS)


class _Answers:
    """Reads HTTP answers (status, lower-cased headers, body) off a blocking socket."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def next(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed after {self.buf!r}"
            self.buf += chunk
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        length = int(headers["content-length"])
        while len(rest) < length:
            rest += self.sock.recv(65536)
        self.buf = rest[length:]
        return int(lines[0].split(" ")[1]), headers, rest[:length]


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    exporter = _exporter()
    try:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as sock:
            answers = _Answers(sock)
            sock.sendall(GET)
            status, headers, body = answers.next()
            assert status == 200 and "connection" not in headers
            assert b"tiercache_index_lookups_total 7" in body
            sock.sendall(GET + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n" + GET)  # pipelined
            assert [answers.next()[0] for _ in range(3)] == [200, 404, 200]
            sock.sendall(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
            status, headers, _ = answers.next()
            assert status == 200 and headers["connection"] == "close"
            assert _closed_by_peer(sock)
    finally:
        exporter.close()


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
    (b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 400),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10000, 431),
])
def test_requests_it_does_not_serve_are_answered_and_closed(request_bytes, status):
    exporter = _exporter()
    try:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as sock:
            sock.sendall(request_bytes)
            got, headers, _ = _Answers(sock).next()
            assert (got, headers["connection"]) == (status, "close")
            assert _closed_by_peer(sock)
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:
            assert resp.status == 200  # and it goes on serving
    finally:
        exporter.close()


def test_a_request_not_complete_in_time_is_closed():
    from tiercache.metrics.exporter import ExporterLimits

    exporter = _exporter(ExporterLimits(request_timeout_s=0.2))
    try:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=30) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            assert _closed_by_peer(sock)  # the socket timeout is 30 s: this is the exporter's
    finally:
        exporter.close()


def test_at_the_connection_cap_the_longest_waiting_connection_makes_room():
    from tiercache.metrics.exporter import ExporterLimits

    exporter = _exporter(ExporterLimits(max_connections=4))
    try:
        idle = [socket.create_connection(("127.0.0.1", exporter.port), timeout=10)
                for _ in range(4)]
        for sock in idle:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request each
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as fresh:
            fresh.sendall(GET)
            assert _Answers(fresh).next()[0] == 200  # a scraper still gets its answer ...
        assert _closed_by_peer(idle[0])  # ... and the oldest waiting one made room for it
        idle[1].sendall(b"\r\n")  # the others are still served
        assert _Answers(idle[1]).next()[0] == 200
        for sock in idle:
            sock.close()
    finally:
        exporter.close()


def test_clients_that_go_away_are_not_logged_above_debug(caplog):
    import logging
    import os
    import struct
    import time

    exporter = _exporter()
    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        with caplog.at_level(logging.DEBUG, logger="tiercache.metrics.exporter"):
            for request in (b"GET /metrics HTTP/1.1\r\n", GET):
                sock = socket.create_connection(("127.0.0.1", exporter.port), timeout=10)
                sock.sendall(request)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()  # a reset, mid-request or before reading the answer
            deadline = time.monotonic() + 30
            while len(os.listdir("/proc/self/fd")) > fds_before:  # the exporter closed both
                assert time.monotonic() < deadline, "the exporter kept reset connections open"
                time.sleep(0.01)
            with urllib.request.urlopen(exporter.url, timeout=10) as resp:
                assert resp.status == 200
    finally:
        exporter.close()
    assert [r for r in caplog.records if r.levelno > logging.DEBUG] == []


def test_limits_are_validated():
    from tiercache.errors import ArgumentError
    from tiercache.metrics.exporter import ExporterLimits

    with pytest.raises(ArgumentError, match="max_connections=0"):
        ExporterLimits(max_connections=0)
    with pytest.raises(ArgumentError, match="request_timeout_s=0"):
        ExporterLimits(request_timeout_s=0)
