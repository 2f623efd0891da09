"""Support for the metrics tests: a region's header and stats blocks over a bytearray,
cache-index stats with fixed values, and promtool (which must be installed)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess

import pytest
from prometheus_client import CollectorRegistry

from tiercache.region.header import HeaderInfo, RegionHeader, RegionState
from tiercache.region.hostmem import process_start_ns
from tiercache.region.layout import HEADER_FIXED_BYTES, RegionLayout
from tiercache.index.manager import ManagerStats
from tiercache.metrics.collector import TiercacheCollector
from tiercache.region.stats import RankStats


class FakeRegion:
    """The header and stats blocks of a region over a bytearray (no data slices)."""

    def __init__(self, world_size: int = 2, num_blocks: int = 8):
        self.layout = RegionLayout(world_size, num_blocks, (4096, 8192))
        self.buffer = bytearray(self.layout.header_bytes)
        self.header = RegionHeader(memoryview(self.buffer)[:HEADER_FIXED_BYTES])
        self.header.write(self.layout, generation=3, owner_pid=os.getpid(),
                          owner_start_ns=process_start_ns(os.getpid()), created_ns=0,
                          region_id=0x5EED)
        self.header.set_state(RegionState.READY)

    def info(self) -> HeaderInfo:
        return self.header.read()

    def stats(self, rank: int, slot: int | None = None) -> RankStats:
        return RankStats(self.buffer, self.layout.stats_offset(rank, slot or 0), rank)

    def slot_held(self, rank: int, slot: int) -> bool:
        return False  # no file, so no slot locks: a block is held while its pid lives

    def set_seq(self, rank: int, value: int) -> None:
        """Word 0 of a stats block is its sequence lock (see tiercache.region.stats)."""
        struct.pack_into("<Q", self.buffer, self.layout.stats_offset(rank), value)

    def seq(self, rank: int) -> int:
        return struct.unpack_from("<Q", self.buffer, self.layout.stats_offset(rank))[0]


def sample_manager_stats() -> ManagerStats:
    """Index counters as the real ManagerStats, a distinct value in every field."""
    return ManagerStats(lookups=7, hit_blocks=11, miss_blocks=5, stored_blocks=20,
                        loaded_blocks=11, store_rejections=2, evicted_blocks=4,
                        failed_store_blocks=1, capacity_blocks=8, free_blocks=2,
                        writing_blocks=1, ready_blocks=4, loading_blocks=1)


def attach_self(region: FakeRegion, rank: int) -> RankStats:
    view = region.stats(rank)
    view.mark_attached(os.getpid(), process_start_ns(os.getpid()))
    return view


def registry_of(collector: TiercacheCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def require_tool(name: str, needed_for: str) -> str:
    """The path of Debian prometheus's ``name``; a clear failure (not a skip) without it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: install Debian's prometheus package "
                    f"(`make prometheus`); {needed_for} cannot run without it")
    return path


def promtool() -> str:
    return require_tool("promtool", "the metrics lint")


def promtool_check(exposition: bytes) -> None:
    run = subprocess.run([promtool(), "check", "metrics"], input=exposition,
                         capture_output=True)
    assert run.returncode == 0, (run.stdout + run.stderr).decode()
