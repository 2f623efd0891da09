"""A HIT loads exactly the bytes stored under its key, whatever happens to the coordinator
in between: a clean restart under running engines, a replaced region, a crash with a load
in flight, a frozen engine. Engines are real processes with the real handlers (CPU tensors
as their 'GPU', the ``cpu`` backend); every loaded byte is compared with its key's pattern.
"""

from __future__ import annotations

import pytest

from control_support import wait_for
from engine_child import EngineProcess
from tiercache.config import KVGeometry, RegionConfig, config_to_toml
from tiercache.link.client import Client
from tiercache.region.shared import named_region_info
from tiercache.region.stale import remove_stale
from tiercache.service.process import CoordinatorProcess


def keys(tag: str, n: int, start: int = 0) -> list[bytes]:
    return [b"%s-%d" % (tag.encode(), i) for i in range(start, start + n)]


@pytest.fixture
def config(make_config):
    return make_config(kv=KVGeometry(page_bytes=(4096, 2048)),
                       region=RegionConfig(capacity_bytes=None, num_blocks=64,
                                           prefault_threads=1),
                       index_session_grace_s=2.0)


@pytest.fixture
def engines():
    started: list[EngineProcess] = []

    def start(config) -> EngineProcess:
        engine = EngineProcess(config_to_toml(config))
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.kill()


def test_a_clean_restart_under_running_engines_keeps_the_cache_and_serves_exact_bytes(
        config, engines, tmp_path):
    """The issue's `systemctl restart`: engine 1 attached, SIGTERM + serve, engine 1 stores
    through its mapping, engine 2 attaches: every HIT exact, both ways (was: 16/16 HITs,
    16/16 blocks wrong: the first engine mapped the old, unlinked region)."""
    first = CoordinatorProcess(config, tmp_path / "c1")
    try:
        one = engines(config)
        assert one.store(keys("warm", 8))["stored"] == 8
        region_id = named_region_info(config.name).region_id
        assert first.stop() == 0
        assert "kept region" in first.output() and "worker attachment(s)" in first.output()
        with CoordinatorProcess(config, tmp_path / "c2") as second:
            assert "re-adopted stale region" in second.output()
            assert named_region_info(config.name).region_id == region_id  # the same region
            assert one.store(keys("a", 16)) == {"stored": 16, "refused": False, "ok": True}
            two = engines(config)
            assert two.load(keys("a", 16)) == {"hits": 16, "wrong_bytes": 0, "ok": True}
            assert two.load(keys("warm", 8)) == {"hits": 8, "wrong_bytes": 0, "ok": True}
            assert two.store(keys("b", 16))["stored"] == 16
            assert one.load(keys("b", 16)) == {"hits": 16, "wrong_bytes": 0, "ok": True}
            one.stop()
            two.stop()
    finally:
        first.cleanup()


def test_a_stop_with_no_worker_attached_removes_the_region(config, tmp_path):
    with CoordinatorProcess(config, tmp_path) as coordinator:
        assert named_region_info(config.name) is not None
        assert coordinator.stop() == 0
        assert "removed region" in coordinator.output()
        assert named_region_info(config.name) is None


def test_a_replaced_region_makes_an_attached_worker_reattach_before_it_copies(
        config, engines, tmp_path):
    """The coordinator dies and its region is cleaned away while engine 1 still maps it; a
    new coordinator creates a new region. Engine 1's next store carries the new region's
    identity: its workers re-attach, then copy; engine 2 loads exact bytes."""
    first = CoordinatorProcess(config, tmp_path / "c1")
    one = engines(config)
    assert one.store(keys("old", 4))["stored"] == 4
    old_id = named_region_info(config.name).region_id
    first.kill()
    assert [r.name for r in remove_stale(names=[config.name])] == [config.name]
    with CoordinatorProcess(config, tmp_path / "c2"):
        assert named_region_info(config.name).region_id != old_id
        with pytest.raises(RuntimeError, match="SessionLostError"):
            one.store(keys("new", 16))  # said once: the new region knows no old session
        assert one.store(keys("new", 16)) == {"stored": 16, "refused": False, "ok": True}
        two = engines(config)
        assert two.load(keys("new", 16)) == {"hits": 16, "wrong_bytes": 0, "ok": True}
        assert two.load(keys("old", 4))["hits"] == 0  # that cache went with its region
        one.stop()
        two.stop()
    first.cleanup()


def test_a_load_in_flight_across_a_coordinator_sigkill_keeps_its_slots(config, engines,
                                                                     tmp_path):
    """Engine A prepares 32 loads; the coordinator is SIGKILLed and restarted; engine B
    stores as much as fits; A's copies run after: exact (was: 16/32 blocks wrong, the
    restarted coordinator had forgotten A's pins and gave the slots to B)."""
    coordinator = CoordinatorProcess(config, tmp_path / "c1")
    try:
        a = engines(config)
        assert a.store(keys("a", 32))["stored"] == 32
        assert a.hold_load(keys("a", 32)) == {"hits": 32}
        coordinator.kill()
        coordinator = CoordinatorProcess(config, tmp_path / "c2")
        assert "(1 holding reservations or pins)" in coordinator.output()
        with Client(config) as client:
            assert client.stats().loading_blocks == 32  # A's pins came back with the index
        b = engines(config)
        results = [b.store(keys("b", 16, start)) for start in (0, 16, 32)]
        assert [r["stored"] for r in results] == [16, 16, 16]  # the last evicts B's own first
        assert a.finish_load() == {"hits": 32, "wrong_bytes": 0, "ok": True}
        assert b.load(keys("b", 32, 16)) == {"hits": 32, "wrong_bytes": 0, "ok": True}
        a.stop()
        b.stop()
        with Client(config) as client:  # what A held is back
            assert client.stats().loading_blocks == 0
    finally:
        coordinator.cleanup()


def test_a_frozen_engine_loses_its_pins_to_the_others_and_never_loads_a_wrong_byte(
        make_config, engines, tmp_path):
    """Engine A leases the whole cache and is frozen (SIGSTOP): once it has been silent for
    index.session_timeout_s its session is declared dead and B can store again (was: every
    other store rejected for as long as A stayed frozen). Thawed, A's copies are refused
    for the slots given away (its transfer fails: nothing wrong is loaded) and its next
    call says its session is lost."""
    config = make_config(kv=KVGeometry(page_bytes=(4096,)),
                         region=RegionConfig(capacity_bytes=None, num_blocks=16,
                                             prefault_threads=1),
                         index_session_timeout_s=1.0)
    with CoordinatorProcess(config, tmp_path):
        a, b = engines(config), engines(config)
        assert a.store(keys("a", 16))["stored"] == 16
        assert a.hold_load(keys("a", 16)) == {"hits": 16}
        assert b.store(keys("b", 4))["refused"]  # every slot is pinned by A
        a.freeze()
        wait_for(lambda: b.store(keys("b", 8))["stored"] == 8, "B stores once A is declared dead",
                 timeout_s=30)
        a.thaw()
        with pytest.raises(RuntimeError) as lost:
            a.finish_load()
        assert "SessionLostError" in str(lost.value)
        assert b.load(keys("b", 8)) == {"hits": 8, "wrong_bytes": 0, "ok": True}
        with Client(config) as client:
            assert client.stats().sessions_ended >= 1
        b.stop()
