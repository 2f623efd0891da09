"""What loads, per process (``process_loads``): a real ``tiercache serve`` with every part a
node runs (disk tier, event stream, exporter) loads no torch and nothing of the worker
wing or the engines' adapters; an engine's control client loads nothing of the
coordinator (no index, no event publisher, no zmq); ``attach`` loads neither the control
plane nor the coordinator. The engines' own processes: tests/vllm/test_vllm_loads.py and
tests/sglang/test_sglang_loads.py."""

from __future__ import annotations

import re
import urllib.request

from process_loads import (
    COORDINATOR, ENGINE_CLIENT, WORKER, Process, loaded, loaded_from_log,
)
from tiercache.config import DiskConfig, EventsConfig
from tiercache.link.client import Client
from tiercache.service.process import CoordinatorProcess


def test_the_coordinator_loads_no_torch_and_nothing_of_the_worker_wing(make_config, tmp_path,
                                                                       monkeypatch):
    """Every import of the serve process (PYTHONPROFILEIMPORTTIME: each import it made is
    on its stderr), through start-up, a store, a lookup, a tier's stats and a scrape."""
    (tmp_path / "disk").mkdir()
    config = make_config(disk=DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=1 << 20),
                         events=EventsConfig(endpoint="tcp://127.0.0.1:0"))
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    with CoordinatorProcess(config, workdir=tmp_path / "coordinator") as coordinator:
        monkeypatch.delenv("PYTHONPROFILEIMPORTTIME")
        client = Client(config)
        try:
            keys = [b"k%d" % i for i in range(4)]
            client.prepare_store(keys)
            client.complete_store(keys)
            assert client.lookup(keys) == 4
            assert "disk" in client.tier_stats()
        finally:
            client.close()
        url = re.search(r"metrics: http://(\S+)/metrics", coordinator.output())
        assert url, coordinator.output()
        with urllib.request.urlopen(f"http://{url.group(1)}/metrics", timeout=30) as answer:
            assert b"tiercache_tier_" in answer.read()
        log = coordinator.output()
    found = loaded_from_log(log)
    # the serve process did load the parts a node runs, or the check proves nothing
    assert {"tiercache.index.manager", "tiercache.control.server", "tiercache.tiers.disk",
            "tiercache.events.publisher", "tiercache.metrics.collector"} <= found.tiercache
    assert not COORDINATOR.breaches(found)


def test_an_engine_s_control_client_loads_nothing_of_the_coordinator():
    found = loaded(["tiercache.link.client"])
    assert "tiercache.link.client" in found.tiercache
    assert not ENGINE_CLIENT.breaches(found)
    assert not [m for m in found.tiercache if m.startswith(("tiercache.control",
                                                             "tiercache.events"))]


def test_the_package_root_loads_nothing_until_a_name_is_taken():
    assert loaded(["tiercache"]).tiercache == {"tiercache"}
    assert not ENGINE_CLIENT.breaches(loaded(["tiercache:Client"]))
    assert not WORKER.breaches(loaded(["tiercache:attach"]))


def test_attach_loads_neither_the_control_plane_nor_the_coordinator():
    found = loaded(["tiercache.transfer.worker"])
    assert "tiercache.transfer.worker" in found.tiercache
    assert not WORKER.breaches(found)


def test_a_breach_is_named():
    """The check can fail: the coordinator's index in a client's process is a breach."""
    found = loaded(["tiercache.link.client", "tiercache.index.manager"])
    assert "an engine's control client loads tiercache.index.manager" in \
        ENGINE_CLIENT.breaches(found)
    found = loaded(["tiercache.link.client", "tiercache.control.server"])
    assert "an engine's control client loads tiercache.control.server" in \
        ENGINE_CLIENT.breaches(found)
    assert Process("x", frozenset(), forbidden_packages=frozenset({"zmq"})).breaches(
        loaded(["tiercache.events.publisher"]))
