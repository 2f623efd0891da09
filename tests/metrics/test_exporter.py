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
from tiercache.metrics.exporter import encode_text, start_exporter
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
