"""attach() places its slice: a real worker process over host caches (the ``cpu`` backend)
records its node and local fraction in its stats block; the kernel's numa_maps of that
process agrees; ``tiercache status`` and the exporter show it; an unknown node and
placement off are shown as such."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from tiercache.metrics.collector import TiercacheCollector
from tiercache.numa.mempolicy import PAGE_BYTES
from tiercache.numa.placement import NumaState
from tiercache.numa.topology import HostTopology
from tiercache.region.shared import SharedOffloadRegion

from numa_children import attach_and_report
from numa_maps import numa_maps_line, numa_maps_pages

SPAWN = mp.get_context("spawn")
WAIT_S = 120


class Attached:
    """A worker process attached to ``rank`` until ``close``."""

    def __init__(self, config, rank: int, caches_kind: str):
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=attach_and_report, args=(config, rank, caches_kind,
                                                                  child))
        self.proc.start()
        assert self.conn.poll(WAIT_S), "the worker did not attach"
        self.pid, self.slice_address, self.caches_node = self.conn.recv()

    def close(self) -> None:
        self.conn.send("close")
        assert self.conn.poll(WAIT_S) and self.conn.recv() == "closed"
        self.proc.join(WAIT_S)
        assert self.proc.exitcode == 0


def _status(name: str) -> str:
    run = subprocess.run([sys.executable, "-m", "tiercache", "status", "--name", name],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    return run.stdout


def _metrics(region: SharedOffloadRegion, rank: int) -> dict[str, float | None]:
    registry = CollectorRegistry()
    registry.register(TiercacheCollector(region))
    labels = {"rank": str(rank)}
    state = next(s for s in NumaState if registry.get_sample_value(
        "tiercache_numa_placement", {**labels, "state": s.label}) == 1)
    return {"node": registry.get_sample_value("tiercache_numa_node", labels),
            "ratio": registry.get_sample_value("tiercache_numa_local_ratio", labels),
            "state": state.label}


def test_a_worker_records_its_node_and_fraction_and_numa_maps_agrees(make_config):
    config = make_config()
    region = SharedOffloadRegion.create(config)
    try:
        worker = Attached(config, 1, "touched")
        try:
            assert worker.caches_node in HostTopology.read().memory_nodes
            node = worker.caches_node
            pages = math.ceil(region.layout.slice_used_bytes / PAGE_BYTES)
            numa = region.stats(1).snapshot().numa
            assert (numa.state, numa.node, numa.slice_pages, numa.local_pages) == (
                NumaState.PLACED, node, pages, pages)
            line = numa_maps_line(worker.pid, worker.slice_address)  # the kernel's own count
            assert f"prefer:{node}" in line and numa_maps_pages(line) == {node: pages}
            assert _metrics(region, 1) == {"node": node, "ratio": 1.0, "state": "placed"}
            assert _metrics(region, 0) == {"node": -1, "ratio": None, "state": "none"}
            out = _status(config.name)
            assert (f"NUMA placed on node {node} (100.0% of the slice's pages there)"
                    in out.split("rank 1:")[1])
            assert "NUMA not checked" in out.split("rank 1:")[0]  # rank 0: nobody attached
        finally:
            worker.close()
        assert region.stats(1).snapshot().numa.state is NumaState.PLACED  # kept: pages stay
    finally:
        region.close()


def test_caches_whose_node_nobody_knows_yet_are_reported_unknown(make_config):
    config = make_config()
    region = SharedOffloadRegion.create(config)
    try:
        worker = Attached(config, 0, "untouched")
        try:
            numa = region.stats(0).snapshot().numa
            assert (numa.state, numa.node, numa.local_ratio) == (
                NumaState.UNKNOWN_NODE, None, None)
            assert _metrics(region, 0) == {"node": -1, "ratio": None, "state": "unknown_node"}
            assert "NUMA node UNKNOWN" in _status(config.name).split("rank 0:")[1]
        finally:
            worker.close()
    finally:
        region.close()


def test_placement_off_binds_nothing_and_reports_what_it_found(make_config):
    base = make_config()
    config = dataclasses.replace(base, region=dataclasses.replace(base.region,
                                                                  numa_placement=False))
    region = SharedOffloadRegion.create(config)
    try:
        worker = Attached(config, 1, "touched")
        try:
            node = worker.caches_node
            numa = region.stats(1).snapshot().numa
            assert numa.state is NumaState.OFF and numa.node == node is not None
            # nothing bound or moved: the fraction is wherever the pages happened to be
            assert numa.local_ratio is not None and 0 <= numa.local_ratio <= 1
            with pytest.raises(AssertionError, match="no mapping"):  # no call: nothing split
                numa_maps_line(worker.pid, worker.slice_address)
            assert _metrics(region, 1) == {"node": node, "ratio": numa.local_ratio,
                                           "state": "off"}
            assert f"NUMA placement off (node {node}, " in _status(config.name)
            if HostTopology.read().single_node is not None:  # one node: all of it is there
                assert numa.local_ratio == 1.0
        finally:
            worker.close()
    finally:
        region.close()
