"""Pinning on a real GPU (``gpu`` marker): each rank pins only its own slice, in its own
process; failures roll back; pinned memory round-trips bytes exactly."""

import multiprocessing as mp
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tiercache.config import KVGeometry, PinningPolicy, RegionConfig  # noqa: E402
from tiercache.errors import PinError  # noqa: E402
from tiercache.device.pinning import HostPinner  # noqa: E402
from tiercache.region.progress import Progress  # noqa: E402
from tiercache.region.shared import SharedOffloadRegion  # noqa: E402
from tiercache.region.stats import PinState  # noqa: E402

SPAWN = mp.get_context("spawn")


def _pin_and_copy(name: str, rank: int, result) -> None:
    from tiercache.region.hostmem import process_start_ns

    region = SharedOffloadRegion.attach(name, rank, timeout_s=10)
    try:  # as attach() does: the attachment is live while this process is
        region.stats(rank).mark_attached(os.getpid(), process_start_ns(os.getpid()))
        state = region.pin(PinningPolicy.REQUIRED, HostPinner())
        rows = region.rank_array(rank)
        host = torch.from_numpy(rows)
        gpu = torch.randint(0, 255, host.shape, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            host.copy_(gpu, non_blocking=True)
        stream.synchronize()
        same = bool(torch.equal(host, gpu.cpu()))
        snap = region.stats(rank).snapshot()
        result.put((rank, state.value, same, snap.pinned_bytes, snap.pin_state.value,
                    region.layout.slice_used_bytes))
    finally:
        region.close()


def test_two_ranks_each_pin_their_own_slice_and_copy_exactly(make_config):
    cfg = make_config(kv=KVGeometry(page_bytes=(32768,) * 4),
                      region=RegionConfig(capacity_bytes=None, num_blocks=64, prefault_threads=4))
    region = SharedOffloadRegion.create(cfg)
    try:
        result = SPAWN.Queue()
        procs = [SPAWN.Process(target=_pin_and_copy, args=(cfg.name, r, result)) for r in range(2)]
        for p in procs:
            p.start()
        got = sorted(result.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        for rank, state, same, pinned, exported, slice_bytes in got:
            assert state == PinState.PINNED.value and exported == PinState.PINNED.value
            assert same, f"rank {rank}: bytes differ after a copy into its pinned slice"
            assert pinned == slice_bytes  # its own slice, not the whole region
    finally:
        region.close()


def _pin_and_hold(name: str, rank: int, result, release) -> None:
    from tiercache.region.hostmem import process_start_ns

    region = SharedOffloadRegion.attach(name, rank, timeout_s=10)
    try:  # as attach() does: the attachment is live while this process is
        region.stats(rank).mark_attached(os.getpid(), process_start_ns(os.getpid()))
        state = region.pin(PinningPolicy.REQUIRED, HostPinner())
        result.put((region.slot, state.value, region.stats(rank).snapshot().pinned_bytes))
        release.wait(120)
    finally:
        region.close()


def test_two_attachments_of_one_rank_each_pin_it_in_their_own_context(make_config):
    """Two engines' workers on rank 0: each registers the slice in its own CUDA context
    (registration is per process) and exports it in its own attachment block."""
    from prometheus_client import CollectorRegistry

    from tiercache.metrics.collector import TiercacheCollector

    cfg = make_config(world_size=1, kv=KVGeometry(page_bytes=(32768,) * 4),
                      region=RegionConfig(capacity_bytes=None, num_blocks=64, prefault_threads=2))
    region = SharedOffloadRegion.create(cfg)
    release = SPAWN.Event()
    procs = []
    try:
        result = SPAWN.Queue()
        procs = [SPAWN.Process(target=_pin_and_hold, args=(cfg.name, 0, result, release))
                 for _ in range(2)]
        for p in procs:
            p.start()
        got = sorted(result.get(timeout=120) for _ in procs)
        slice_bytes = region.layout.slice_used_bytes
        pinned = PinState.PINNED.value
        assert got == [(0, pinned, slice_bytes), (1, pinned, slice_bytes)]
        registry = CollectorRegistry()
        registry.register(TiercacheCollector(region))
        assert registry.get_sample_value("tiercache_region_pinned", {"rank": "0"}) == 1
        assert registry.get_sample_value("tiercache_pinned_bytes", {"rank": "0"}) == 2 * slice_bytes
        for slot in ("0", "1"):
            assert registry.get_sample_value("tiercache_attachment_pin_state", {
                "rank": "0", "attachment": slot, "state": "pinned"}) == 1
        release.set()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        release.set()
        for p in procs:
            p.join(60)
        region.close()


def test_a_failed_registration_rolls_back_the_ones_before_it(make_config):
    region = SharedOffloadRegion.create(make_config(
        region=RegionConfig(capacity_bytes=None, num_blocks=64, prefault_threads=2)))
    try:
        ranges = [(region.base_address + off, n)
                  for off, n in region.layout.registrations(0, 1 << 16)]
        pinner = HostPinner(0)
        with pytest.raises(PinError, match="cuMemHostRegister"):
            pinner.pin(ranges + [ranges[0]])  # registering a range twice fails
        assert pinner.pinned_bytes == 0
        again = HostPinner(0)
        lines: list[str] = []
        ticks = iter(range(0, 1_000_000, 2))  # 2 s a reading: every range reports
        progress = Progress("pinning", region.layout.slice_used_bytes, lines.append,
                            clock=lambda: float(next(ticks)))
        again.pin(ranges, progress)  # would fail if the rollback had left anything registered
        assert again.pinned_bytes == region.layout.slice_used_bytes == progress.done_bytes
        assert len(lines) == len(ranges)
        again.unpin()
        torch.zeros(1, device="cuda").add_(1)  # no stale CUDA error surfaces in torch
        torch.cuda.synchronize()
    finally:
        region.close()
