"""Fenced host-to-host transfers against a real ``tiercache serve``: what the index hands out
is copied exactly, anything else is refused before a byte moves, and the attachment says
what it is (pin state not_needed, its transfers counted)."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.link.client import Client
from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stats import PinState
from tiercache.service.process import CoordinatorProcess
from tiercache.specs import CPULoadStoreSpec, Direction
from tiercache.transfer.host_pages import PageMap
from tiercache.transfer.host_transfer import HostAttachment, HostTransfer

BLOBS = (8192, 8192)  # one engine page over the suite's rows of 4096 + 8192 + 4096 bytes


@pytest.fixture
def served(make_config, tmp_path):
    config = make_config(world_size=1)
    with CoordinatorProcess(config, workdir=tmp_path / "coord") as coordinator:
        attachment = HostAttachment.attach(config.name, 0, prefault_threads=1)
        transfer = HostTransfer(attachment, PageMap.onto(BLOBS, attachment.layout), 1)
        with Client(config) as index:
            yield config, transfer, index
        transfer.close()
        attachment.close()
        assert coordinator.proc.poll() is None


def _pages(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    pages = np.random.default_rng(seed).integers(0, 256, (n, sum(BLOBS)), dtype=np.uint8)
    addrs = np.array([[p.ctypes.data, p.ctypes.data + BLOBS[0]] for p in pages],
                     dtype=np.uint64)
    return pages, addrs


def test_a_stored_page_loads_back_exactly_and_is_counted(served):
    config, transfer, index = served
    keys = [b"a", b"b", b"c"]
    pages, addrs = _pages(3, 1)
    out = index.prepare_store(keys)
    assert transfer.store(out.store_spec, addrs).ok
    index.complete_store(keys)
    lease = index.lease(keys)
    back, back_addrs = _pages(3, 2)
    outcome = transfer.load(lease.spec, back_addrs)
    index.release(keys)
    assert outcome.ok and outcome.num_bytes == 3 * sum(BLOBS)
    assert np.array_equal(back, pages)
    snap = transfer.attachment.stats.snapshot()
    assert snap.pin_state is PinState.NOT_NEEDED
    assert snap.directions[Direction.GPU_TO_CPU].transfers_ok == 1
    assert snap.directions[Direction.CPU_TO_GPU].bytes_total == 3 * sum(BLOBS)


def test_specs_the_index_did_not_hand_out_are_refused_and_nothing_moves(served):
    config, transfer, index = served
    keys = [b"x", b"y"]
    pages, addrs = _pages(2, 3)
    out = index.prepare_store(keys)
    spec = out.store_spec
    stale = CPULoadStoreSpec(spec.block_ids, spec.slot_gens + 1, spec.region_id)
    other_region = CPULoadStoreSpec(spec.block_ids, spec.slot_gens, spec.region_id ^ 1)
    unfenced = CPULoadStoreSpec(spec.block_ids)
    for bad, reason in ((stale, "generation"), (other_region, "region"),
                        (unfenced, "not fenced")):
        outcome = transfer.store(bad, addrs)
        assert not outcome.ok and reason in outcome.reason
    with SharedOffloadRegion.attach(config.name) as region:
        rows = region.rank_array(0)[spec.block_ids]
        assert not rows.any(), "a refused store wrote into the rows"
    # a load of slots still being written is refused too (READY is what a load needs)
    assert not transfer.load(spec, addrs).ok
    index.complete_store(keys, success=False)
    assert transfer.attachment.stats.snapshot().directions[Direction.GPU_TO_CPU] \
        .transfers_failed == 3


def test_closing_the_attachment_detaches_it(make_config, tmp_path):
    config = make_config(world_size=1)
    with CoordinatorProcess(config, workdir=tmp_path / "coord"):
        attachment = HostAttachment.attach(config.name, 0, prefault_threads=1)
        slot = attachment.region.slot
        attachment.close()
        with SharedOffloadRegion.attach(config.name) as region:
            assert not region.slot_held(0, slot)
            assert region.stats(0, slot).snapshot().pid == 0
