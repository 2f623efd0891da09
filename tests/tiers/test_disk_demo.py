"""The demo over a host tier far smaller than its working set, with a disk tier below:
every block loaded back is checked on every rank (0 wrong), blocks come up from disk, and
pending leases (promotions) are asked again like an engine's next step. The hit rates with
and without the disk tier are in the README's demo section (measured, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from tiercache.config import DiskConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.service.process import CoordinatorProcess


def test_the_demo_with_a_disk_tier_loads_only_exact_blocks_and_promotes(make_config, tmp_path):
    (tmp_path / "disk").mkdir()
    config = make_config(kv=KVGeometry(page_bytes=(4096, 4096)),
                         region=RegionConfig(capacity_bytes=None, num_blocks=32,
                                             prefault_threads=1),
                         disk=DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=64 << 20,
                                         low_watermark=0.25))
    with CoordinatorProcess(config, tmp_path / "coord") as coordinator:
        out = subprocess.run(
            [sys.executable, "-m", "tiercache", "demo", "--config", str(coordinator.config_path),
             "--requests", "120", "--prefixes", "24", "--device", "cpu", "--quiet",
             "--json", str(tmp_path / "demo.json")],
            capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        totals = json.loads((tmp_path / "demo.json").read_text())
        assert totals["mismatched_blocks"] == 0 and totals["failed_jobs"] == 0
        assert totals["checked_blocks"] == 2 * totals["loaded_blocks"] > 0
        with Client(config) as client:
            disk = client.tier_stats()["disk"]
            assert disk.demotions > 0 and disk.promotions > 0
            assert disk.checksum_failures == 0 and disk.errors == 0
