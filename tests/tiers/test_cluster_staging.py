"""``BlockTransfers`` against a real pool (a ``mooncake_master`` and a real coordinator as
the node that published): blocks come up through staging into host rows, and a read that
Mooncake gave up on while its transfer still runs (the publishing node frozen with
SIGSTOP, Mooncake's ``TRANSFER_FAIL``) lands, when the node thaws, in a staging area held
out of use, never in a host row; the next read uses a fresh area."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time

import numpy as np

from control_children import block_pattern
from control_support import stop_process, wait_for
from mooncake_master import short_transfer_timeouts
from test_cluster_tier import KEYS, master, start_node, store  # noqa: F401
from tiercache.config import ClusterConfig
from tiercache.region.layout import RegionLayout
from tiercache.tiers.cluster_key import load_cluster_key
from tiercache.tiers.cluster_object import HEADER_BYTES, BlockFormat
from tiercache.tiers.cluster_transfer import BlockTransfers
from tiercache.tiers.mooncake_pool import NOTHING_MOVED, MooncakePool

SENTINEL = 0x5A


def test_a_read_given_up_on_lands_in_a_held_staging_area_never_a_host_row(start_node, master,
                                                                           monkeypatch):
    short_transfer_timeouts(monkeypatch)  # this process's pool gives up sooner than 60 s
    a = start_node("a")
    keys = KEYS[:4]
    assert store(a, keys)
    fmt = BlockFormat.of(RegionLayout.from_config(a.config), load_cluster_key(master.key_file))
    world, stride = fmt.world_size, fmt.row_stride
    host = mmap.mmap(-1, len(keys) * world * stride)
    rows_of = np.frombuffer(host, np.uint8).reshape(len(keys), world, stride)

    def rows(slot: int) -> list[tuple[int, memoryview]]:
        return [(ctypes.addressof(ctypes.c_char.from_buffer(host, (slot * world + r) * stride)),
                 memoryview(rows_of[slot, r])) for r in range(world)]

    def exact(slot: int, key: bytes) -> bool:
        return all(np.array_equal(rows_of[slot, r], block_pattern(key, r, stride))
                   for r in range(world))

    pool = MooncakePool(ClusterConfig(master=master.address, metadata_server=master.metadata_url,
                                      local_hostname="127.0.0.1", key_file=master.key_file,
                                      segment_bytes=16 << 20))
    pool.open()
    try:
        moves = BlockTransfers(pool, fmt, rows, num_areas=1, max_blocks=len(keys))
        blocks = list(zip(keys, range(len(keys))))
        assert moves.get(0, blocks).done == keys  # through staging, checked in the rows
        assert all(exact(slot, key) for key, slot in blocks)
        rows_of[:] = SENTINEL
        stop_process(a.pid)
        try:
            got = moves.get(0, blocks)  # waits for Mooncake's transfer timeout
        finally:
            os.kill(a.pid, signal.SIGCONT)
        assert got.done == [] and got.landing == keys, got.codes
        assert all(c < 0 and c not in NOTHING_MOVED for c in got.codes)
        assert moves.held_areas == 1
        held = moves._held[0].map  # what the thawed node's answers write into

        def landed() -> bool:
            return all(held[i * fmt.object_bytes + HEADER_BYTES:(i + 1) * fmt.object_bytes]
                       == block_pattern(key, rank, stride).tobytes()
                       for i, (key, rank) in enumerate((k, r) for k in keys
                                                       for r in range(world)))
        wait_for(landed, "the late answers land in the held staging area", 30)
        time.sleep(0.5)
        assert (rows_of == SENTINEL).all()  # never in a host row
        # frozen past the master's client TTL, node a lost its segment (and objects): it
        fresh = KEYS[4:8]  # publishes new blocks, read through a fresh staging area
        assert store(a, fresh)
        blocks = list(zip(fresh, range(len(fresh))))
        tries = []  # the first reads after the thaw may fail (Mooncake reconnecting)

        def read_again() -> bool:
            tries.append(moves.get(0, blocks))
            return tries[-1].done == fresh or time.sleep(0.5)
        wait_for(read_again, "a read through a fresh staging area", 30)
        assert all(exact(slot, key) for key, slot in blocks)
        assert moves.held_areas == 1 + sum(bool(t.landing) for t in tries)
    finally:
        pool.close()
