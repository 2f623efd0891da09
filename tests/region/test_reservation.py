"""The region's slices reserved in the background (``tiercache.region.reservation``): slot
order, a full /dev/shm midway (a real private tmpfs), and a coordinator SIGKILLed
mid-reservation whose region the next ``serve`` re-adopts and reserves on."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os

import numpy as np
from prometheus_client.utils import floatToGoString

from private_shm import run_on_small_dev_shm
from reserve_children import ROW_CHUNK_ROWS, reserve_store_and_die, slot_value
from tiercache.config import RegionConfig
from tiercache.link.client import Client
from tiercache.region.header import Reservation
from tiercache.region.layout import RegionLayout
from tiercache.region.reservation import reservation_chunks
from tiercache.region.shared import SharedOffloadRegion
from tiercache.service.process import CoordinatorProcess

SPAWN = mp.get_context("spawn")


def test_chunks_reserve_rows_in_slot_order_every_rank_in_step_and_cover_each_slice():
    layout = RegionLayout(world_size=3, num_blocks=37, page_bytes=(4096, 8192, 4096))
    chunk_bytes = 5 * layout.row_stride * layout.world_size
    chunks = list(reservation_chunks(layout, 0, chunk_bytes))
    assert [(c.first_row, c.end_row) for c in chunks] == [
        (r, min(r + 5, 37)) for r in range(0, 37, 5)]
    for chunk in chunks:
        assert [off for off, _ in chunk.ranges] == [
            layout.slice_offset(rank) + chunk.first_row * layout.row_stride for rank in range(3)]
    # together: every byte of every slice once (the last chunk takes the 2 MiB padding)
    covered = sorted(r for c in chunks for r in c.ranges)
    for rank in range(3):
        mine = [(off, n) for off, n in covered
                if layout.slice_offset(rank) <= off < layout.slice_offset(rank) + layout.slice_bytes]
        assert mine[0][0] == layout.slice_offset(rank)
        assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))
        assert mine[-1][0] + mine[-1][1] == layout.slice_offset(rank) + layout.slice_bytes
    # from a row on (a re-adopted region): only what is left
    later = list(reservation_chunks(layout, 20, chunk_bytes))
    assert later[0].first_row == 20 and later[-1].end_row == 37


def test_a_new_region_is_ready_before_its_slices_are_reserved_and_the_reserver_backs_them(
        make_config):
    region = SharedOffloadRegion.create(make_config(region=RegionConfig(
        capacity_bytes=None, num_blocks=256, prefault_threads=2)), reserve_now=False)
    try:
        layout = region.layout
        info = region.info()
        assert (info.reservation, info.reserved_rows) == (Reservation.RESERVING, 0)
        assert [info.reserved_bytes(r) for r in range(2)] == [0, 0]
        assert os.stat(region.path).st_blocks * 512 < layout.total_bytes  # slices: not yet
        told: list[int] = []
        reserver = region.reserver(told.append,
                                   chunk_bytes=16 * layout.row_stride * layout.world_size)
        assert reserver is not None
        reserver.run()
        assert told == list(range(16, 257, 16))  # the index hears each chunk, in order
        info = region.info()
        assert (info.reservation, info.reserved_rows) == (Reservation.COMPLETE, 256)
        assert [info.reserved_bytes(r) for r in range(2)] == [layout.slice_bytes] * 2
        assert os.stat(region.path).st_blocks * 512 >= layout.total_bytes
        assert region.reserver(told.append) is None  # nothing left to reserve
    finally:
        region.close()


def test_start_reserves_the_first_chunk_before_it_returns_and_the_rest_in_a_thread(
        make_config):
    """``serve`` calls ``start`` before its control socket answers: the first chunk's slots
    are usable when it returns (a store right after READY is never refused for want of
    reserved slots: CI once saw exactly that), and a region of one chunk is whole."""
    for num_blocks, chunk_rows in ((256, 16), (32, 64)):
        region = SharedOffloadRegion.create(make_config(region=RegionConfig(
            capacity_bytes=None, num_blocks=num_blocks, prefault_threads=2)), reserve_now=False)
        try:
            layout = region.layout
            told: list[int] = []
            reserver = region.reserver(
                told.append, chunk_bytes=chunk_rows * layout.row_stride * layout.world_size)
            assert reserver is not None
            reserver.start()
            assert told[:1] == [min(chunk_rows, num_blocks)]  # told in the caller
            assert region.info().reserved_rows >= told[0]
            assert reserver.wait(60)
            reserver.close()
            assert told[-1] == num_blocks and told == sorted(told)
            assert region.info().reservation == Reservation.COMPLETE
        finally:
            region.close()


_FULL_SHM_CHILD = r"""
import contextlib, io, json, os
import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from tiercache.cli import main
from tiercache.config import config_from_dict
import tiercache.region.hostmem as hostmem
from tiercache.index.manager import OffloadingManager
from tiercache.metrics.collector import TiercacheCollector
from tiercache.region.ledger import IndexLedger
from tiercache.region.shared import SharedOffloadRegion

cfg = config_from_dict({"instance": {"name": "small", "world_size": 2},
                        "kv": {"page_bytes": [4096, 8192, 4096]},
                        "region": {"num_blocks": 512, "check_host_memory": False},
                        "exporter": {"enabled": False}})
# the free-space check passes, as if another tenant filled the tmpfs right after it
hostmem.shm_free_bytes = lambda d: 1 << 40
region = SharedOffloadRegion.create(cfg, reserve_now=False)
layout = region.layout
manager = OffloadingManager(layout.num_blocks, ledger=IndexLedger(region.ledger_array()),
                            region_id=region.region_id, usable_blocks=0)
reserver = region.reserver(manager.set_usable_blocks,
                           chunk_bytes=32 * layout.row_stride * layout.world_size)
reserver.run()
info = region.info()
out = {"reservation": info.reservation.label, "errno": info.reserve_errno,
       "rows": info.reserved_rows, "error": reserver.error,
       "capacity": manager.stats().capacity_blocks,
       "file_bytes": os.stat(region.path).st_blocks * 512}
keys = [b"k%d" % i for i in range(layout.num_blocks)]
got = manager.prepare_store(keys, max_evictions=0)
slots = got.store_spec.block_ids.tolist()
out["stored"], out["no_room"], out["max_slot"] = len(slots), len(got.no_room_keys), max(slots)
for slot in slots:  # a touch of an unreserved page would be a SIGBUS here (the tmpfs is full)
    for rank in range(2):
        region.rank_array(rank)[slot] = slot % 251
manager.complete_store(list(got.keys_to_store))
out["exact"] = all(bool(np.all(region.rank_array(r)[s] == s % 251)) for s in slots for r in (0, 1))
again = manager.prepare_store([b"new"])  # full: it evicts a reserved block, never goes past
out["evicted_into"] = int(again.store_spec.block_ids[0])
registry = CollectorRegistry()
registry.register(TiercacheCollector(region, manager_stats=manager.stats))
out["metrics"] = [line for line in generate_latest(registry).decode().splitlines()
                  if line.startswith(("tiercache_region_reservation{", "tiercache_region_reserved",
                                      "tiercache_index_capacity_blocks "))]
status = io.StringIO()
with contextlib.redirect_stdout(status):
    main(["status", "--name", "small"])
out["status"] = status.getvalue()
region.close()
out["left"] = os.listdir("/dev/shm")
print(json.dumps(out))
"""


def test_a_full_dev_shm_mid_reservation_is_a_visible_failure_and_only_reserved_slots_are_used(
        tmp_path):
    out = run_on_small_dev_shm(_FULL_SHM_CHILD, tmp_path)
    rows = out["rows"]
    # 16 MiB of slices on an 8 MiB tmpfs: stopped at a chunk boundary, well short
    assert out["reservation"] == "failed" and out["errno"] == errno.ENOSPC
    assert 0 < rows < 512 and rows % 32 == 0, rows
    assert out["error"].startswith("cannot allocate") and "No space left" in out["error"]
    assert "region reservation FAILED after" in out["stderr"]  # the error line
    assert out["capacity"] == rows and out["file_bytes"] <= 8 << 20
    # the index hands out the reserved slots only; the bytes there are exact
    assert (out["stored"], out["no_room"], out["max_slot"]) == (rows, 512 - rows, rows - 1)
    assert out["exact"] and out["evicted_into"] < rows
    reserved = rows * RegionLayout(2, 512, (4096, 8192, 4096)).row_stride
    assert set(out["metrics"]) >= {
        'tiercache_region_reservation{state="failed"} 1.0',
        'tiercache_region_reservation{state="complete"} 0.0',
        f'tiercache_region_reserved_bytes{{rank="0"}} {floatToGoString(reserved)}',
        f'tiercache_region_reserved_bytes{{rank="1"}} {floatToGoString(reserved)}',
        f"tiercache_index_capacity_blocks {floatToGoString(rows)}"}, out["metrics"]
    assert (f"  reserved: {rows} of 512 blocks" in out["status"]
            and "FAILED: No space left on device (/dev/shm ran out)" in out["status"]), out["status"]
    assert out["left"] == []


def test_a_restart_serves_a_partly_reserved_region_warm_and_reserves_the_rest(make_config):
    config = make_config(region=RegionConfig(capacity_bytes=None, num_blocks=64,
                                             prefault_threads=2))
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=reserve_store_and_die, args=(config, 3 * ROW_CHUNK_ROWS, child))
    proc.start()
    assert parent.poll(120), "the child sent nothing"
    keys, slots = parent.recv()
    proc.join(30)
    assert proc.exitcode == -9  # SIGKILLed mid-reservation
    assert sorted(slots) == list(range(12))  # the usable rows, every one stored
    with CoordinatorProcess(config) as serve:
        said = serve.output()
        assert "re-adopted stale region" in said and "12 of 64 blocks reserved" in said, said
        with Client(config.socket_path) as client:
            assert client.lookup(keys) == len(keys)  # warm: every block is a hit
            # the reservation goes on in the background: wait for the index to hear of it
            while client.stats().capacity_blocks < 64:
                client.ping()
            spec = client.prepare_load(keys)
            region = SharedOffloadRegion.attach(config.name)
            try:
                for slot in spec.block_ids.tolist():
                    for rank in range(2):
                        assert np.all(region.rank_array(rank)[slot] == slot_value(slot, rank))
                info = region.info()
                assert (info.reservation, info.reserved_rows) == (Reservation.COMPLETE, 64)
            finally:
                region.close()
            client.complete_load(keys)
            fresh = client.prepare_store([b"fresh"])
            assert fresh is not None and int(fresh.store_spec.block_ids[0]) >= 12
