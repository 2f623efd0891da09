"""Spawned entry points of the NUMA placement tests (importable by a child process)."""

from __future__ import annotations

import os


def slice_policies(name: str, conn) -> None:
    """Map region ``name`` (no rank) in a process of its own and send the memory policy
    of its header and of each rank's slice, as this process's mapping reads them: the
    policies set before fallocate are the file's, not one mapping's."""
    from tiercache.numa.mempolicy import policy_at
    from tiercache.region.shared import SharedOffloadRegion

    region = SharedOffloadRegion.attach(name)
    try:
        layout = region.layout
        conn.send((policy_at(region.base_address),
                   [policy_at(region.base_address + layout.slice_offset(r))
                    for r in range(layout.world_size)]))
    finally:
        region.close()


def attach_and_report(config, rank: int, caches_kind: str, conn) -> None:
    """A worker process: ``tiercache.attach`` rank ``rank`` over host caches (``"touched"``:
    tensors with their pages in memory; ``"untouched"``: page arrays over a fresh anonymous
    mapping, whose node nobody can know yet), report the pid, where its slice's mapping
    starts and the node its caches are on (None: not known), wait for "close", detach."""
    import ctypes
    import mmap

    import torch

    from tiercache.device.locality import host_node
    from tiercache.pages import PageArray
    from tiercache.transfer.worker import attach

    blocks = 8
    if caches_kind == "touched":
        caches: list = [torch.ones(blocks, b, dtype=torch.uint8) for b in config.kv.page_bytes]
        keep = None
    else:
        keep = mmap.mmap(-1, blocks * sum(config.kv.page_bytes))
        base = ctypes.addressof(ctypes.c_char.from_buffer(keep))
        caches, offset = [], 0
        for size in config.kv.page_bytes:
            caches.append(PageArray(base + offset, blocks, size, size))
            offset += blocks * size
    first = caches[0].data_ptr() if caches_kind == "touched" else caches[0].base_address
    node = host_node(first).node  # where this process's caches are: the slice's node
    worker = attach(config, rank, caches, device="cpu")
    region = worker.region
    conn.send((os.getpid(), region.base_address + region.layout.slice_offset(rank), node))
    assert conn.poll(120)
    conn.recv()
    worker.close()
    del caches, keep
    conn.send("closed")
