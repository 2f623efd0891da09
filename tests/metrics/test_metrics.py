"""The collector over fabricated stats blocks (a bytearray region), on a private registry:
exact values, liveness against real processes, promtool on the exposition."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiercache.metrics.exposition import encode_text
from tiercache.region.header import HeaderInfo, RegionState
from tiercache.region.hostmem import process_start_ns
from tiercache.metrics.collector import METRIC_NAMES, TiercacheCollector
from tiercache.backend_kind import BackendKind
from tiercache.numa.placement import NumaPlacement, NumaState
from tiercache.region.stats import PinState
from tiercache.specs import Direction

from metrics_support import (
    sample_manager_stats, FakeRegion, attach_self, promtool_check, registry_of,
)

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU


def scrape(registry: CollectorRegistry) -> dict[tuple, float]:
    """One collect: ``(name, *sorted label pairs) -> value``."""
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in registry.collect() for s in family.samples}


# ---------------------------------------------------------------- values

def test_transfer_counters_and_histograms_are_exact():
    region = FakeRegion()
    view = attach_self(region, 0)
    for _ in range(3):
        view.record_transfer(G2C, 4096, 1e-3, success=True)
    view.record_transfer(G2C, 1 << 20, 0.05, success=True)
    view.record_transfer(G2C, 1 << 20, 0.05, success=True)
    view.record_transfer(G2C, 1 << 40, 20.0, success=True)  # beyond every finite bucket
    view.record_transfer(G2C, 1 << 20, 0.5, success=False)
    view.record_transfer(C2G, 8192, 2e-4, success=True)
    reg = registry_of(TiercacheCollector(region))
    g2c = {"rank": "0", "direction": "gpu_to_cpu"}
    c2g = {"rank": "0", "direction": "cpu_to_gpu"}

    moved = 3 * 4096 + 2 * (1 << 20) + (1 << 40)
    assert reg.get_sample_value("tiercache_transfer_bytes_total", g2c) == moved
    assert reg.get_sample_value("tiercache_transfer_bytes_total", c2g) == 8192
    assert reg.get_sample_value("tiercache_transfer_seconds_total", g2c) == pytest.approx(20.103)
    assert reg.get_sample_value("tiercache_transfers_total", {**g2c, "outcome": "ok"}) == 6
    assert reg.get_sample_value("tiercache_transfers_total", {**g2c, "outcome": "failed"}) == 1
    assert reg.get_sample_value("tiercache_transfers_total", {**c2g, "outcome": "failed"}) == 0

    def bucket(name, le, labels=g2c):
        return reg.get_sample_value(f"{name}_bucket", {**labels, "le": le})

    dur = "tiercache_transfer_duration_seconds"
    assert bucket(dur, "0.0005") == 0
    assert bucket(dur, "0.001") == 3  # le is inclusive: exactly 1 ms lands here
    assert bucket(dur, "0.02") == 3
    assert bucket(dur, "0.05") == 5
    assert bucket(dur, "10.0") == 5
    assert bucket(dur, "+Inf") == 6
    assert reg.get_sample_value(f"{dur}_count", g2c) == 6
    assert reg.get_sample_value(f"{dur}_sum", g2c) == pytest.approx(20.103)
    assert bucket(dur, "0.0002", c2g) == 1 and bucket(dur, "0.0001", c2g) == 0

    size = "tiercache_transfer_size_bytes"
    assert bucket(size, "4096.0") == 3
    assert bucket(size, "1.048576e+06") == 5
    assert bucket(size, "1.7179869184e+10") == 5
    assert bucket(size, "+Inf") == 6
    assert reg.get_sample_value(f"{size}_sum", g2c) == moved


def test_every_histogram_is_cumulative_and_counts_its_transfers():
    region = FakeRegion(world_size=3)
    durations = [3e-6, 1e-5, 7e-4, 0.3, 4.0, 99.0]
    for rank in range(3):
        view = attach_self(region, rank)
        for i, seconds in enumerate(durations[rank:]):
            view.record_transfer(Direction(i % 2), 4096 << (3 * i), seconds, success=True)
    text = generate_latest(registry_of(TiercacheCollector(region))).decode()
    histograms = [f for f in text_string_to_metric_families(text) if f.type == "histogram"]
    assert {f.name for f in histograms} == {"tiercache_transfer_duration_seconds",
                                            "tiercache_transfer_size_bytes"}
    checked = 0
    for family in histograms:
        series: dict[tuple, list[float]] = {}
        counts: dict[tuple, float] = {}
        for s in family.samples:
            key = (s.labels["rank"], s.labels["direction"])
            if s.name.endswith("_bucket"):
                series.setdefault(key, []).append(s.value)
            elif s.name.endswith("_count"):
                counts[key] = s.value
        for key, values in series.items():
            assert values == sorted(values), f"{family.name}{key} buckets are not cumulative"
            assert values[-1] == counts[key]
            checked += 1
    assert checked == 2 * 3 * 2
    reg = registry_of(TiercacheCollector(region))
    assert reg.get_sample_value("tiercache_transfers_total",
                                {"rank": "0", "direction": "gpu_to_cpu", "outcome": "ok"}) == 3


def test_pin_state_backend_and_region_gauges():
    region = FakeRegion(world_size=2)
    pinned = attach_self(region, 0)
    pinned.set_pin(PinState.PINNED, pinned_bytes=region.layout.slice_bytes, seconds=0.25)
    pinned.set_backend(G2C, BackendKind.CE)
    pinned.set_backend(C2G, BackendKind.KERNEL)
    pinned.set_prefault(0.5)
    unpinned = attach_self(region, 1)
    unpinned.set_pin(PinState.UNPINNED)
    unpinned.set_backend(G2C, BackendKind.CPU)
    reg = registry_of(TiercacheCollector(region))
    value = reg.get_sample_value

    assert value("tiercache_region_pinned", {"rank": "0"}) == 1
    assert value("tiercache_region_pinned", {"rank": "1"}) == 0
    assert value("tiercache_pinned_bytes", {"rank": "0"}) == region.layout.slice_bytes
    assert value("tiercache_pinned_bytes", {"rank": "1"}) == 0
    assert value("tiercache_pin_duration_seconds", {"rank": "0"}) == 0.25
    assert value("tiercache_prefault_duration_seconds", {"rank": "0"}) == 0.5
    assert value("tiercache_prefault_duration_seconds", {"rank": "1"}) == 0
    for state in PinState:
        assert value("tiercache_pin_state", {"rank": "0", "state": state.label}) == (
            1 if state is PinState.PINNED else 0)
        assert value("tiercache_pin_state", {"rank": "1", "state": state.label}) == (
            1 if state is PinState.UNPINNED else 0)
    backend = "tiercache_transfer_backend_info"
    assert value(backend, {"rank": "0", "direction": "gpu_to_cpu", "backend": "ce"}) == 1
    assert value(backend, {"rank": "0", "direction": "cpu_to_gpu", "backend": "kernel"}) == 1
    assert value(backend, {"rank": "1", "direction": "gpu_to_cpu", "backend": "cpu"}) == 1
    assert value(backend, {"rank": "1", "direction": "cpu_to_gpu", "backend": "none"}) == 1
    assert value(backend, {"rank": "1", "direction": "gpu_to_cpu", "backend": "ce"}) is None
    assert value("tiercache_worker_attaches_total", {"rank": "1"}) == 1

    layout = region.layout
    assert value("tiercache_region_bytes") == layout.total_bytes
    assert value("tiercache_region_block_bytes") == layout.row_stride * 2
    assert value("tiercache_region_ranks") == 2
    assert value("tiercache_region_generation") == 3
    assert value("tiercache_region_state", {"state": "ready"}) == 1
    region.header.set_state(RegionState.CLOSING)
    assert value("tiercache_region_state", {"state": "ready"}) == 0
    assert value("tiercache_region_state", {"state": "closing"}) == 1


def test_numa_node_local_ratio_and_placement_state_per_rank():
    region = FakeRegion(world_size=4)
    attach_self(region, 0).set_numa(NumaPlacement(NumaState.PLACED, 1, 4000, 3000, 0.2))
    attach_self(region, 1).set_numa(NumaPlacement(NumaState.UNKNOWN_NODE))
    # rank 2: two engines attached, the second on the other socket: the rank shows the worse
    region.stats(2, 0).mark_attached(os.getpid(), process_start_ns(os.getpid()))
    region.stats(2, 0).set_numa(NumaPlacement(NumaState.PLACED, 0, 100, 100, 0.1))
    region.stats(2, 1).mark_attached(os.getpid(), process_start_ns(os.getpid()))
    region.stats(2, 1).set_numa(NumaPlacement(NumaState.PLACED, 1, 100, 0, 0.1))
    attach_self(region, 3)  # attached, not yet checked
    reg = registry_of(TiercacheCollector(region))
    value = reg.get_sample_value

    assert [value("tiercache_numa_node", {"rank": r}) for r in "0123"] == [1, -1, 1, -1]
    assert value("tiercache_numa_local_ratio", {"rank": "0"}) == 0.75
    assert value("tiercache_numa_local_ratio", {"rank": "2"}) == 0.0
    assert value("tiercache_numa_local_ratio", {"rank": "1"}) is None  # not counted: absent
    assert value("tiercache_numa_local_ratio", {"rank": "3"}) is None
    for rank, expected in (("0", "placed"), ("1", "unknown_node"), ("2", "placed"),
                           ("3", "none")):
        for state in NumaState:
            assert value("tiercache_numa_placement", {"rank": rank, "state": state.label}) == (
                1 if state.label == expected else 0)
    promtool_check(encode_text(TiercacheCollector(region).collect()))


def test_index_counters_and_gauges_come_from_manager_stats():
    region = FakeRegion()
    stats = sample_manager_stats()
    reg = registry_of(TiercacheCollector(region, manager_stats=lambda: stats))
    value = reg.get_sample_value
    assert value("tiercache_index_lookups_total") == 7
    assert value("tiercache_index_hit_blocks_total") == 11
    assert value("tiercache_index_miss_blocks_total") == 5
    assert value("tiercache_index_stored_blocks_total") == 20
    assert value("tiercache_index_loaded_blocks_total") == 11
    assert value("tiercache_index_store_rejections_total") == 2
    assert value("tiercache_index_evicted_blocks_total") == 4
    assert value("tiercache_index_failed_store_blocks_total") == 1
    assert value("tiercache_index_capacity_blocks") == 8
    by_state = {s: value("tiercache_index_blocks", {"state": s})
                for s in ("free", "writing", "ready", "loading", "quarantined")}
    assert by_state == {"free": 2, "writing": 1, "ready": 4, "loading": 1, "quarantined": 0}
    assert sum(by_state.values()) == value("tiercache_index_capacity_blocks")
    assert value("tiercache_index_occupancy_ratio") == 0.75

    without = registry_of(TiercacheCollector(region))
    assert without.get_sample_value("tiercache_index_lookups_total") is None


def test_metric_names_list_every_exported_family():
    region = FakeRegion()
    attach_self(region, 0)
    from tiercache.results import TierStats

    disk = TierStats(capacity_blocks=8, used_blocks=3, read_bytes=4096, promotions=1, up=True)
    text = generate_latest(registry_of(TiercacheCollector(
        region, manager_stats=sample_manager_stats,
        tier_stats=lambda: {"disk": disk}))).decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name + "_total" if family.type == "counter" else family.name)
    assert exported == set(METRIC_NAMES)
    assert all(":" not in n and n.startswith("tiercache_") for n in METRIC_NAMES)
    samples = {(s.name, s.labels.get("tier")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("tiercache_tier_blocks", "disk")] == 3
    assert samples[("tiercache_tier_promotions_total", "disk")] == 1
    assert samples[("tiercache_tier_up", "disk")] == 1


def test_the_observability_doc_lists_every_metric():
    """By its full name, or as a ``_suffix`` beside a sibling of the same family prefix
    (``tiercache_tier_checksum_failures_total``, ``_errors_total``)."""
    doc = (Path(__file__).resolve().parents[2] / "docs/observability.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `tiercache_")]
    missing = []
    for name in METRIC_NAMES:
        prefix = "_".join(name.split("_")[:2])  # tiercache_<group>
        if not any(f"`{name}`" in row or (f"`{prefix}_" in row and
                                           f"`{name[len(prefix):]}`" in row) for row in rows):
            missing.append(name)
    assert not missing, f"docs/observability.md does not list {missing}"


def test_without_a_lower_tier_no_tier_family_is_exported():
    region = FakeRegion()
    text = generate_latest(registry_of(TiercacheCollector(region))).decode()
    assert "tiercache_tier_" not in text


def test_describe_does_not_read_shared_state():
    class Unreadable(FakeRegion):
        def info(self) -> HeaderInfo:
            raise AssertionError("read at registration")

    collector = TiercacheCollector(Unreadable())
    registry = registry_of(collector)  # auto_describe: would call collect() without describe()
    described = {m.name for m in collector.describe()}
    assert described >= {"tiercache_worker_up", "tiercache_region_bytes"}
    with pytest.raises(AssertionError, match="read at registration"):
        generate_latest(registry)


# ---------------------------------------------------------------- liveness

def test_worker_up_follows_a_real_process_through_sigkill():
    region = FakeRegion(world_size=3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        region.stats(0).mark_attached(child.pid, process_start_ns(child.pid))
        # rank 1: our own pid but another start time -> a reused pid, not its worker
        region.stats(1).mark_attached(os.getpid(), process_start_ns(os.getpid()) + 10**7)
        # rank 2: never attached (pid 0)
        reg = registry_of(TiercacheCollector(region))

        def up(rank: int) -> float:
            return reg.get_sample_value("tiercache_worker_up", {"rank": str(rank)})

        assert (up(0), up(1), up(2)) == (1, 0, 0)
        child.send_signal(signal.SIGKILL)
        _wait_status(child.pid, psutil.STATUS_ZOMBIE)  # killed, not yet reaped by us
        assert up(0) == 0, "a zombie worker must read as down"
        child.wait(10)
        assert up(0) == 0, "a reaped worker must read as down"
        assert reg.get_sample_value("tiercache_worker_attaches_total", {"rank": "0"}) == 1
    finally:
        child.kill()
        child.wait(10)


def _wait_status(pid: int, status: str, timeout_s: float = 10.0) -> None:
    proc = psutil.Process(pid)
    for _ in range(int(timeout_s / 0.01)):
        if proc.status() == status:
            return
        psutil.wait_procs([], timeout=0.01)
    raise AssertionError(f"pid {pid} never reached status {status}")


def test_block_left_mid_update_keeps_the_scrape_and_reports_down():
    region = FakeRegion()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        view = region.stats(0)
        view.mark_attached(child.pid, process_start_ns(child.pid))
        view.record_transfer(G2C, 4096, 1e-3, success=True)
        collector = TiercacheCollector(region)
        reg = registry_of(collector)
        assert reg.get_sample_value("tiercache_worker_up", {"rank": "0"}) == 1
        # the writer dies between its two sequence bumps: the block stays odd for good
        region.set_seq(0, region.seq(0) + 1)
        child.kill()
        child.wait(10)
        first, second = scrape(reg), scrape(reg)
        assert first["tiercache_worker_up", ("rank", "0")] == 0
        assert first["tiercache_stats_read_failures_total", ("rank", "0")] == 1
        assert second["tiercache_stats_read_failures_total", ("rank", "0")] == 2
        assert first["tiercache_stats_read_failures_total", ("rank", "1")] == 0
        assert first["tiercache_transfer_bytes_total",
                     ("direction", "gpu_to_cpu"), ("rank", "0")] == 4096
    finally:
        child.kill()
        child.wait(10)


def test_rank_never_read_consistently_is_down_without_counters():
    region = FakeRegion()
    region.set_seq(1, 1)
    reg = registry_of(TiercacheCollector(region))
    assert reg.get_sample_value("tiercache_worker_up", {"rank": "1"}) == 0
    assert reg.get_sample_value("tiercache_transfer_bytes_total",
                                {"rank": "1", "direction": "gpu_to_cpu"}) is None


# ---------------------------------------------------------------- exposition

def test_promtool_accepts_the_exposition():
    region = FakeRegion(world_size=2)
    view = attach_self(region, 0)
    view.record_transfer(G2C, 65536, 3e-4, success=True)
    view.record_transfer(C2G, 65536, 0, success=False)
    collector = TiercacheCollector(region, manager_stats=sample_manager_stats)
    promtool_check(encode_text(collector.collect()))


def test_a_rank_aggregates_its_attachments_and_keeps_a_stuck_ones_last_counters():
    """Two attachment blocks of rank 0: the live one (this process) and a dead one."""
    region = FakeRegion()
    live = region.stats(0, 0)
    live.mark_attached(os.getpid(), process_start_ns(os.getpid()))
    live.set_pin(PinState.UNPINNED)
    live.record_transfer(G2C, 4096, 1e-3, success=True)
    dead = region.stats(0, 1)
    dead.mark_attached(os.getpid(), process_start_ns(os.getpid()) + 10**7)  # another process
    dead.set_pin(PinState.PINNED, 1 << 20, 0.5)
    dead.record_transfer(G2C, 8192, 2e-3, success=True)
    reg = registry_of(TiercacheCollector(region))
    g2c = {"rank": "0", "direction": "gpu_to_cpu"}

    def check() -> None:
        assert reg.get_sample_value("tiercache_transfer_bytes_total", g2c) == 4096 + 8192
        assert reg.get_sample_value("tiercache_transfer_duration_seconds_count", g2c) == 2
        assert reg.get_sample_value("tiercache_worker_up", {"rank": "0"}) == 1
        assert reg.get_sample_value("tiercache_worker_attaches_total", {"rank": "0"}) == 2
        # the rank's pin state is its live attachments' (the dead one's pinned is history)
        assert reg.get_sample_value("tiercache_pin_state", {"rank": "0", "state": "unpinned"}) == 1
        assert reg.get_sample_value("tiercache_pinned_bytes", {"rank": "0"}) == 0
        for slot, up, state, moved in (("0", 1, "unpinned", 4096), ("1", 0, "pinned", 8192)):
            labels = {"rank": "0", "attachment": slot}
            assert reg.get_sample_value("tiercache_attachment_up", labels) == up
            assert reg.get_sample_value("tiercache_attachment_pin_state",
                                        {**labels, "state": state}) == 1
            assert reg.get_sample_value("tiercache_attachment_transfer_bytes_total",
                                        {**labels, "direction": "gpu_to_cpu"}) == moved
        assert reg.get_sample_value("tiercache_attachment_up",
                                    {"rank": "0", "attachment": "2"}) is None  # never used
        assert reg.get_sample_value("tiercache_attachment_up",
                                    {"rank": "1", "attachment": "0"}) is None

    check()
    offset = region.layout.stats_offset(0, 1)
    seq = int.from_bytes(region.buffer[offset:offset + 8], "little")
    region.buffer[offset:offset + 8] = (seq + 1).to_bytes(8, "little")  # its writer died mid-update
    check()  # its last snapshot still counts: the rank's totals do not drop
    failures = reg.get_sample_value("tiercache_stats_read_failures_total", {"rank": "0"})
    assert failures > 0  # every collect (each get_sample_value is one) counts one more
    again = reg.get_sample_value("tiercache_stats_read_failures_total", {"rank": "0"})
    assert again == failures + 1
