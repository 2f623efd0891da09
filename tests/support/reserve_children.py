"""Children for the region reservation's tests (``tests/region/test_reservation.py``):
spawned by name, so this module sits on the test ``pythonpath``."""

from __future__ import annotations

import os
import signal

from tiercache.config import Config
from tiercache.index.manager import OffloadingManager
from tiercache.region.ledger import IndexLedger
from tiercache.region.shared import SharedOffloadRegion

ROW_CHUNK_ROWS = 4  # rows a chunk reserves in these children


def slot_value(slot: int, rank: int) -> int:
    """The byte stored in ``slot``'s row of ``rank``: differs by slot and rank."""
    return (slot * 7 + rank * 3 + 1) % 251


def reserve_store_and_die(config: Config, die_at_rows: int, conn) -> None:
    """A coordinator SIGKILLed mid-reservation: create the region, reserve it chunk by chunk
    (as ``serve`` does, the index told after the header), and once ``die_at_rows`` rows are
    usable, store a block in every usable slot (bytes first, READY after), send
    ``(keys, slots)`` and SIGKILL itself."""
    region = SharedOffloadRegion.create(config, reserve_now=False)
    layout = region.layout
    manager = OffloadingManager(layout.num_blocks, ledger=IndexLedger(region.ledger_array()),
                                region_id=region.region_id, usable_blocks=0)

    def on_reserved(rows: int) -> None:
        manager.set_usable_blocks(rows)
        if rows < die_at_rows:
            return
        keys = [f"key-{i}".encode() for i in range(rows)]
        out = manager.prepare_store(keys)
        assert out is not None
        slots = [int(s) for s in out.store_spec.block_ids]
        for slot in slots:
            for rank in range(layout.world_size):
                region.rank_array(rank)[slot] = slot_value(slot, rank)
        manager.complete_store(keys)
        conn.send((keys, slots))
        os.kill(os.getpid(), signal.SIGKILL)

    chunk = ROW_CHUNK_ROWS * layout.row_stride * layout.world_size
    reserver = region.reserver(on_reserved, chunk_bytes=chunk)
    assert reserver is not None
    reserver.run()
    conn.send("reserved everything before dying")
