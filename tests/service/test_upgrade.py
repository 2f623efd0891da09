"""Upgrades: a region (header, ledger, session table, rows) and a disk tier written by the
previous tree (``tests/fixtures/upgrade``, made by its ``make_fixture.py`` from a pinned
revision, SIGKILLed with blocks in both) are re-adopted warm by today's ``serve``, every
block exact; a region or disk file of another format is refused in one line and rebuilt,
and then nothing of it is served."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

from tiercache.config import Config, DiskConfig, ExporterConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.region.layout import FORMAT_VERSION
from tiercache.region.presence import presence_path
from tiercache.region.shared import SharedOffloadRegion
from tiercache.service.process import CoordinatorProcess
from tiercache.tiers.disk_file import HEADER_BYTES

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "upgrade"
_spec = importlib.util.spec_from_file_location("make_fixture", FIXTURE / "make_fixture.py")
assert _spec is not None and _spec.loader is not None
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)
MANIFEST = json.loads((FIXTURE / "manifest.json").read_text())
NAME = MANIFEST["name"]
KEYS = [k.encode() for k in MANIFEST["keys"]]
REGION_PATH = f"/dev/shm/tiercache-{NAME}"
SETTLE_S = 30.0  # a lease pending on a promotion from disk is asked again until then


def restore(src: Path, dst: str, patch: tuple[int, bytes] | None = None) -> None:
    """``src`` unpacked to a new 0600 file ``dst`` (O_EXCL), ``patch`` (offset, bytes)
    written over it."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out, gzip.open(src, "rb") as data:
        shutil.copyfileobj(data, out)
        if patch is not None:
            out.seek(patch[0])
            out.write(patch[1])


def config_for(tmp_path: Path) -> Config:
    """Today's config of the fixture's geometry."""
    slot = HEADER_BYTES + MANIFEST["world_size"] * MANIFEST["row_bytes"]
    return Config(name=NAME, world_size=MANIFEST["world_size"],
                  kv=KVGeometry(page_bytes=(MANIFEST["row_bytes"],)),
                  region=RegionConfig(capacity_bytes=None, num_blocks=MANIFEST["host_blocks"],
                                      prefault_threads=1),
                  exporter=ExporterConfig(port=0), control_socket=str(tmp_path / "ctl.sock"),
                  index_max_session_share=1.0,
                  disk=DiskConfig(path=str(tmp_path / "disk"),
                                  capacity_bytes=MANIFEST["disk_slots"] * slot,
                                  low_watermark=0.5))


def load_every_key(config: Config) -> tuple[int, int, int]:
    """(exact, wrong, missing) over the fixture's keys: each leased (asked again while it
    is promoted from disk), its rows compared with what the old tree stored while the
    lease pins them."""
    region = SharedOffloadRegion.attach(config.name)
    exact = wrong = missing = 0
    try:
        with Client(config) as client:
            for key in KEYS:
                deadline = time.monotonic() + SETTLE_S
                lease = client.lease([key])
                while not lease.num_hit and lease.pending:
                    assert time.monotonic() < deadline, f"{key!r} pending for {SETTLE_S} s"
                    time.sleep(0.005)
                    lease = client.lease([key])
                if not lease.num_hit:
                    missing += 1
                    continue
                slot = int(client.prepare_load([key]).block_ids[0])
                held = all(
                    (region.rank_array(rank)[slot] == fixture.block_bytes(key, rank)).all()
                    for rank in range(config.world_size))
                exact, wrong = exact + held, wrong + (not held)
                client.complete_load([key])
                client.release([key])
    finally:
        region.close()
    return exact, wrong, missing


@pytest.fixture
def restored_name():
    """The fixture's instance name, this test's alone while it runs; nothing of it left
    in /dev/shm after."""
    with fixture.name_lock():
        for path in (REGION_PATH, presence_path(NAME)):  # a killed run's, under the lock
            if os.path.exists(path):
                os.unlink(path)
        try:
            yield NAME
        finally:
            for path in (REGION_PATH, presence_path(NAME)):
                if os.path.exists(path):
                    os.unlink(path)


def test_the_fixture_is_the_previous_trees():
    assert MANIFEST["revision"] == fixture.REVISION
    assert MANIFEST["disk_blocks"] == len(KEYS)  # the old tree demoted every key
    assert sum(p.stat().st_size for p in FIXTURE.glob("*.gz")) < 1 << 20


# (region patch, disk patch, what the start logs, expected (exact, wrong, missing))
NEWER_REGION = (8, struct.pack("<I", FORMAT_VERSION + 1))  # the header's format_version
OTHER_DISK = (0, b"TCDFILE0")  # the disk file's magic names its format
CASES = {
    "as-written": (None, None, ["re-adopted stale region"], (len(KEYS), 0, 0)),
    "region-of-another-format": (
        NEWER_REGION, None,
        [f"region format version {FORMAT_VERSION + 1}; this tiercache reads {FORMAT_VERSION}",
         "rebuilt from slot headers"],
        (len(KEYS), 0, 0)),  # the disk tier keeps every block: they come back from it
    "both-of-another-format": (
        NEWER_REGION, OTHER_DISK,
        [f"region format version {FORMAT_VERSION + 1}; this tiercache reads {FORMAT_VERSION}",
         "it starts empty: its header did not check (an older format, or damaged)"],
        (0, 0, len(KEYS))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_previous_trees_region_and_disk_tier_come_back_warm_or_are_refused(
        restored_name, tmp_path, case):
    region_patch, disk_patch, lines, expected = CASES[case]
    if MANIFEST["region_format"] != FORMAT_VERSION and region_patch is None:
        # the rule (docs/deploy.md): a region of another format is refused and rebuilt, and
        # the disk file, bound to the region's layout digest (which names the format), too
        lines = [f"region format version {MANIFEST['region_format']}; this tiercache reads",
                 "it starts empty: it was made for another block geometry"]
        expected = (0, 0, len(KEYS))
    config = config_for(tmp_path)
    (tmp_path / "disk").mkdir()
    restore(FIXTURE / "region.gz", REGION_PATH, region_patch)
    restore(FIXTURE / "disk.gz", config.disk.file_path(NAME), disk_patch)
    with CoordinatorProcess(config, tmp_path / "coordinator") as coordinator:
        log = coordinator.output()
        for line in lines:
            assert line in log, f"{line!r} not in the start's log:\n{log}"
        assert load_every_key(config) == expected
        assert coordinator.stop() == 0  # no worker attached: the region goes with it
    assert not os.path.exists(REGION_PATH)
