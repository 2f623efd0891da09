"""The key presence map (``tiercache.region.presence``): what engines read to answer a
definite miss without asking. Real shared memory; a real coordinator for the wiring."""

from __future__ import annotations

import fcntl
import os
import zlib

import pytest

from tiercache.config import DiskConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.region.presence import (
    BULK_KEYS, HEADER_BYTES, PresenceMap, PresenceView, num_counters_for, presence_path,
)
from tiercache.region.stale import remove_stale
from tiercache.service.process import CoordinatorProcess
from tiercache.tiers.disk_file import HEADER_BYTES as DISK_HEADER_BYTES

from control_support import wait_for


def colliding(n: int, counters: int, tag: bytes) -> list[bytes]:
    """``n`` distinct keys that share one counter of a map of ``counters``."""
    want, found = None, []
    for i in range(10_000_000):
        key = tag + b"%d" % i
        slot = zlib.crc32(key) & (counters - 1)
        want = slot if want is None else want
        if slot == want:
            found.append(key)
            if len(found) == n:
                return found
    raise AssertionError("no collision found")


@pytest.fixture
def presence(instance_name):
    made = []

    def make(num_keys=100, region_id=7):
        made.append(PresenceMap(instance_name, num_keys, region_id))
        return made[-1]

    yield make
    for m in made:
        m.close()


def test_keys_are_counted_in_and_out_and_a_zero_is_a_definite_miss(presence, instance_name):
    m = presence()
    assert os.stat(m.path).st_mode & 0o777 == 0o600
    view = PresenceView(instance_name)
    try:
        assert view.mapped and view.exact() and view.problem is None
        assert not view.maybe_held(b"k1")
        m.update([b"k1"], removed=False)
        assert view.maybe_held(b"k1") and m.maybe_held(b"k1")
        m.update([b"k1"], removed=True)
        assert not view.maybe_held(b"k1")
        # two keys on one counter: one leaving keeps the other "maybe"
        a, b = colliding(2, m.num_counters, b"c")
        m.update([a, b], removed=False)
        m.update([a], removed=True)
        assert view.maybe_held(a) and view.maybe_held(b)  # a: a false "maybe", never a miss of b
        m.update([b], removed=True)
        assert not view.maybe_held(a) and not view.maybe_held(b)
    finally:
        view.close()


def test_a_view_with_a_namespace_prefix_reads_the_wire_keys_counter(presence, instance_name):
    m = presence()
    m.update([b"NS01" + b"key"], removed=False)
    view = PresenceView(instance_name, prefix=b"NS01")
    try:
        assert view.maybe_held(b"key")
        view.set_prefix(b"NS02")  # after a reset: another namespace, nothing held
        assert not view.maybe_held(b"key")
    finally:
        view.close()


def test_a_saturated_counter_stays_maybe_for_good(presence, instance_name):
    m = presence()
    m.update([b"hot"] * 300, removed=False)
    m.update([b"hot"] * 300, removed=True)
    assert m.maybe_held(b"hot")  # 255 is sticky: a "maybe" too many, never a wrong miss


def test_a_batch_counted_in_bulk_counts_as_one_key_at_a_time(presence, instance_name):
    """A restart tells the map every key it recovered in one batch (``BULK_KEYS`` or
    more: numpy); the counts are those of the same keys told one at a time."""
    bulk, single = presence(num_keys=10), PresenceMap(instance_name + "b", 10, 8)
    try:
        hot = [b"hot"] * 300  # saturates: sticky at 255
        pair = colliding(2, bulk.num_counters, b"p")  # two keys, one counter
        keys = hot + pair * 3 + [b"k%d" % i for i in range(BULK_KEYS)]
        bulk.update(keys, removed=False)
        for key in keys:
            single.update([key], removed=False)
        assert _counts(bulk) == _counts(single)
        gone = keys[:-10] + pair  # a counter taken below zero stays at zero
        bulk.update(gone, removed=True)
        for key in gone:
            single.update([key], removed=True)
        assert _counts(bulk) == _counts(single)
        assert bulk.maybe_held(b"hot") and bulk.maybe_held(keys[-1])
        assert not bulk.maybe_held(keys[-11]) and not bulk.maybe_held(pair[0])
    finally:
        single.close()


def _counts(m: PresenceMap) -> bytes:
    with open(m.path, "rb") as f:
        return f.read()[HEADER_BYTES:]


def test_sizing_is_a_power_of_two_with_room_per_key():
    for keys in (1, 1000, 100_000, 3_000_000):
        n = num_counters_for(keys)
        assert n & (n - 1) == 0 and n >= 16 * keys and n >= 1 << 16


def test_a_closed_map_is_not_trusted_and_the_view_finds_the_next_one(presence, instance_name):
    first = PresenceMap(instance_name, 100, 1)
    first.update([b"old"], removed=False)
    view = PresenceView(instance_name)
    try:
        first.close()
        assert not os.path.exists(presence_path(instance_name))
        assert not view.exact() and view.maybe_held(b"anything")  # retired: every key maybe
        assert not view.refresh() and "not running" in view.problem
        assert view.maybe_held(b"anything")
        second = presence(region_id=2)
        assert view.refresh() and view.exact()
        assert not view.maybe_held(b"old")
        second.update([b"new"], removed=False)
        assert view.maybe_held(b"new")
    finally:
        view.close()


def test_a_map_a_killed_coordinator_left_is_retired_by_the_next(presence, instance_name):
    killed = PresenceMap(instance_name, 100, 1)  # never closed, as after SIGKILL ...
    fcntl.flock(killed._entry.fd, fcntl.LOCK_UN)  # ... whose lock the kernel dropped
    view = PresenceView(instance_name)
    try:
        assert view.exact()
        nxt = presence(region_id=2)
        assert not view.exact(), "the new coordinator cleared EXACT in the old map"
        assert view.refresh() and view.exact()
        nxt.update([b"k"], removed=False)
        assert view.maybe_held(b"k")
        killed.close()  # the killed one's name now belongs to the next: left alone
        assert os.path.exists(nxt.path) and view.refresh()
    finally:
        view.close()


def test_a_file_that_is_not_a_map_of_ours_is_ignored(instance_name):
    path = presence_path(instance_name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"\0" * 4096)
        view = PresenceView(instance_name)
        assert not view.mapped and "not a key presence map" in view.problem
        assert view.maybe_held(b"x")  # no map: every key maybe (the coordinator is asked)
        os.fchmod(fd, 0o600)  # ours now, but no magic
        assert not view.refresh() and "format" in view.problem
    finally:
        os.close(fd)
        os.unlink(path)


# ---------------------------------------------------------------------- a real coordinator
@pytest.fixture
def config(make_config):
    return make_config(kv=KVGeometry(page_bytes=(4096,)), world_size=1,
                       region=RegionConfig(capacity_bytes=None, num_blocks=8, prefault_threads=1))


def test_the_coordinators_map_follows_reservations_stores_evictions_and_restarts(config,
                                                                                  tmp_path):
    with CoordinatorProcess(config, tmp_path / "c1") as first:
        view = PresenceView(config.name)
        try:
            with Client(config) as client:
                out = client.prepare_store([b"w0"])
                assert view.maybe_held(b"w0"), "a reservation: another engine waits, not computes"
                client.complete_store([b"w0"], False)
                assert not view.maybe_held(b"w0"), "a failed store leaves nothing"
                keys = [b"k%d" % i for i in range(8)]
                client.complete_store(list(client.prepare_store(keys).keys_to_store))
                assert all(view.maybe_held(k) for k in keys)
                more = [b"m%d" % i for i in range(4)]
                out = client.prepare_store(more)  # evicts four
                client.complete_store(list(out.keys_to_store))
                evicted = set(out.evicted_keys)
                assert len(evicted) == 4
                assert not any(view.maybe_held(k) for k in evicted)
                assert all(view.maybe_held(k) for k in keys if k not in evicted)
            first.kill()
            assert view.exact(), "a SIGKILL cannot retire the map"
            with CoordinatorProcess(config, tmp_path / "c2") as second:
                assert "re-adopted stale region" in second.output()
                assert not view.exact(), "the next coordinator retired the old map"
                assert view.refresh()
                held = [k for k in keys + more if k not in evicted]
                assert all(view.maybe_held(k) for k in held), "rebuilt from the recovered index"
                assert not any(view.maybe_held(k) for k in evicted)
                assert second.stop() == 0
            assert not os.path.exists(presence_path(config.name))
        finally:
            view.close()
            first.cleanup()


def test_remove_stale_takes_a_killed_coordinators_map_with_its_region(config, tmp_path):
    coordinator = CoordinatorProcess(config, tmp_path)
    try:
        coordinator.kill()
        assert os.path.exists(presence_path(config.name))
        assert [r.name for r in remove_stale(names=[config.name])] == [config.name]
        assert not os.path.exists(presence_path(config.name))
    finally:
        coordinator.cleanup()


def test_a_block_on_the_disk_tier_stays_maybe_after_host_memory_evicts_it(make_config,
                                                                           tmp_path):
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    config = make_config(kv=KVGeometry(page_bytes=(4096,)), world_size=1,
                         region=RegionConfig(capacity_bytes=None, num_blocks=8,
                                             prefault_threads=1),
                         disk=DiskConfig(path=str(disk_dir),
                                         capacity_bytes=64 * (DISK_HEADER_BYTES + 4096),
                                         low_watermark=0.5))
    with CoordinatorProcess(config, tmp_path / "c") as coordinator:
        view = PresenceView(config.name)
        try:
            with Client(config) as client:
                for i in range(6):  # paced: the tier demotes ahead of eviction
                    batch = [b"d%d-%d" % (i, j) for j in range(4)]
                    client.complete_store(list(client.prepare_store(batch).keys_to_store))
                    wait_for(lambda: client.tier_stats()["disk"].demotions >= 4 * i, "demotions", 10)
                stats = client.stats()
            first = [b"d0-%d" % j for j in range(4)]
            assert stats.evicted_blocks >= 8
            assert all(view.maybe_held(k) for k in first), "held on disk: promotable"
            assert not view.maybe_held(b"never-stored")
        finally:
            view.close()
        assert coordinator.stop() == 0


def test_a_map_cut_short_under_its_readers_is_maybe_not_a_sigbus(config, tmp_path):
    """Another process of the service user truncates the map under a running scheduler
    and the coordinator: reads past its end used to kill the scheduler (and the next
    count the coordinator) with SIGBUS. Now the reader answers "maybe", drops the map
    with a reason, and the coordinator stops counting into it, says so, and serves on."""
    import subprocess

    from presence_reader import PresenceReader

    with CoordinatorProcess(config, tmp_path / "c") as coordinator:
        reader = PresenceReader(config.name)
        try:
            with Client(config) as client:
                keys = [b"k%d" % i for i in range(4)]
                client.complete_store(list(client.prepare_store(keys).keys_to_store))
                assert reader.ask("maybe " + keys[0].hex()) == "maybe True"
                assert reader.ask("maybe " + b"never".hex()) == "maybe False"
                path = presence_path(config.name)
                cut = subprocess.run(["truncate", "-s", "0", path], capture_output=True)
                assert cut.returncode == 0, cut.stderr
                assert reader.ask("maybe " + b"never".hex()) == "maybe True"  # no SIGBUS
                assert reader.ask("exact") == "exact False"
                answer = reader.ask("refresh")
                assert answer.startswith(f"refresh False {path} was cut short to 0 bytes"), answer
                more = [b"m%d" % i for i in range(4)]  # the coordinator counts them: no SIGBUS
                client.complete_store(list(client.prepare_store(more).keys_to_store))
                assert client.lookup(more) == 4
        finally:
            assert reader.close() == 0  # -7 was SIGBUS
        assert coordinator.stop() == 0
        assert f"the key presence map {path} was cut short to 0 bytes" in coordinator.output()


def test_clean_removes_a_map_whose_coordinator_was_killed_and_region_removed(config, tmp_path):
    """After a SIGKILL and the region's removal the map stayed and `clean` said "no
    regions". A map whose lock nobody holds is its dead coordinator's: clean removes it,
    and never a live coordinator's."""
    import subprocess
    import sys

    def tiercache(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tiercache", *args, "--name", config.name],
                              capture_output=True, text=True)

    path = presence_path(config.name)
    with CoordinatorProcess(config, tmp_path / "live"):
        clean = tiercache("clean")
        assert clean.returncode == 0 and os.path.exists(path), clean.stdout
        assert "presence map" not in clean.stdout
    coordinator = CoordinatorProcess(config, tmp_path / "killed")
    try:
        coordinator.kill()
        os.unlink(f"/dev/shm/{config.shm_name}")  # its region went (by hand, or a clean)
        status = tiercache("status")
        assert status.returncode == 0, status.stderr
        assert f"key presence map {config.name}  {path}  STALE" in status.stdout, status.stdout
        dry = tiercache("clean", "--dry-run")
        assert f"would remove stale key presence map {path}" in dry.stdout and os.path.exists(path)
        clean = tiercache("clean")
        assert f"removed stale key presence map {path}" in clean.stdout, clean.stdout
        assert not os.path.exists(path)
    finally:
        coordinator.cleanup()
