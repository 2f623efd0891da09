"""Each rank's slice in the NUMA node of the device its worker copies to and from.

Two steps, one per process, both before the pages they govern are allocated or used:

1. **The coordinator, before ``posix_fallocate``** (``bind_rank_slices``): on tmpfs,
   ``posix_fallocate`` allocates every page of the file (measured: it is where the pages
   come from, and they go to the allocating thread's node unless the file has a policy),
   so the binding must come first. The coordinator maps the still-sparse file and binds
   each slice (``MPOL_PREFERRED``, a shared policy of the file) to the node
   ``HostTopology.rank_nodes`` gives: rank r on the node of the r-th GPU in PCI bus
   order. It cannot see the workers' GPUs; that rule is what an engine over all of the
   node's GPUs does, and step 2 corrects it where it is wrong. ``fallocate`` keeps its
   promise: a preferred node falls back to the others when full (no new failure), and
   the spill is measured in step 2.
2. **Each worker, around its pre-fault** (``SlicePlacer``): it knows its device (the
   GPU's PCI node from sysfs, or for host caches the node their memory is on). Before
   the pre-fault it binds its slice to that node (for any page not allocated yet; the
   pre-fault itself allocates nothing fallocate did not), after it counts where the
   slice's pages are (``move_pages`` in query mode, the pre-fault's threads over
   disjoint ranges) and moves those elsewhere to its node (``move_pages`` with
   ``MPOL_MF_MOVE``: pages another process maps, such as a second engine attached to
   the same rank, stay where they are and are counted as not local). The outcome goes to
   the attachment's stats block: state, node, pages counted, pages local, seconds.

Nothing here is silent: a node that is unknown (``UNKNOWN_NODE``), a call that fails
(``FAILED``, e.g. ``EPERM`` in a container without ``CAP_SYS_NICE``) or pages that stayed
elsewhere are logged and exported; none of them stops an attach (placement is a
bandwidth matter, never a correctness one). With ``region.numa_placement = false`` no
binding or moving call is made: the worker only counts, and reports state ``OFF``.
"""

from __future__ import annotations

import errno
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np

from tiercache.errors import NumaError
from tiercache.numa.mempolicy import PAGE_BYTES, bind_preferred, move_to_node, page_nodes
from tiercache.numa.placement import NumaPlacement, NumaState
from tiercache.numa.topology import NodeChoice
from tiercache.region.layout import RegionLayout

log = logging.getLogger(__name__)

_CHUNK_BYTES = 256 << 20  # counted (and moved) at a time: 64 Ki pages of 4 KiB


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"."""
    spans: list[str] = []
    start = ranks[0]
    for prev, rank in zip(ranks, ranks[1:] + [-1]):
        if rank != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def bind_rank_slices(base_address: int, layout: RegionLayout,
                     choices: tuple[NodeChoice, ...]) -> list[str]:
    """Bind each rank's slice of the mapping at ``base_address`` to its chosen node (the
    coordinator's step, before ``posix_fallocate``); returns the lines to print: where
    each rank went, which ranks have no known node and why, and each failed call."""
    by_node: dict[int, list[int]] = {}
    unknown: dict[str, list[int]] = {}
    failed: list[str] = []
    for rank, choice in enumerate(choices):
        if choice.node is None:
            unknown.setdefault(choice.why, []).append(rank)
            continue
        try:
            bind_preferred(base_address + layout.slice_offset(rank), layout.slice_bytes,
                           choice.node)
        except NumaError as e:
            failed.append(f"rank {rank} -> node {choice.node}: {e}")
            continue
        by_node.setdefault(choice.node, []).append(rank)
    lines = []
    if by_node:
        placed = "; ".join(f"{_ranks(ranks)} -> node {node}" for node, ranks in by_node.items())
        reasons = {c.why for c in choices if c.node is not None}
        source = reasons.pop() if len(reasons) == 1 else "GPU r in PCI bus order"
        lines.append(f"NUMA: rank slices bound before fallocate (MPOL_PREFERRED): {placed} "
                     f"({source})")
    for why, ranks in unknown.items():
        lines.append(f"NUMA: {_ranks(ranks)} not bound ({why}); their workers bind and move "
                     "their slices to their own device's node at attach")
    for line in failed:
        lines.append(f"NUMA: binding failed, {line}; the pages go where the kernel puts them "
                     "and the rank's worker reports where that is")
    return lines


class SlicePlacer:
    """One worker's placement of its slice: ``before_touch`` before the pre-fault,
    ``after_touch`` after it (see the module docstring)."""

    def __init__(self, address: int, bound_bytes: int, used_bytes: int, choice: NodeChoice,
                 enabled: bool, rank: int):
        self.address, self.bound_bytes, self.rank = address, bound_bytes, rank
        self.used_bytes = -(-used_bytes // PAGE_BYTES) * PAGE_BYTES  # whole pages
        self.choice, self.enabled = choice, enabled
        self._error: NumaError | None = None
        self._seconds = 0.0

    def before_touch(self) -> None:
        if not (self.enabled and self.choice.known):
            return
        start = time.perf_counter()
        try:
            assert self.choice.node is not None
            bind_preferred(self.address, self.bound_bytes, self.choice.node)
        except NumaError as e:
            self._error = e
        self._seconds += time.perf_counter() - start

    def after_touch(self, num_threads: int) -> NumaPlacement:
        """Count (and, when enabled, move) the slice's pages; never raises a NumaError."""
        node = self.choice.node
        if node is None:
            state = NumaState.UNKNOWN_NODE if self.enabled else NumaState.OFF
            if self.enabled:
                log.warning("rank %d: NUMA placement skipped: the node of its device is not "
                            "known (%s)", self.rank, self.choice.why)
            return NumaPlacement(state, None, seconds=self._seconds)
        start = time.perf_counter()
        try:
            if self._error is not None:
                raise self._error
            tally = self._count(node, num_threads)
        except NumaError as e:
            log.warning("rank %d: NUMA placement on node %d (%s) failed: %s", self.rank, node,
                        self.choice.why, e)
            return NumaPlacement(NumaState.FAILED, node,
                                 seconds=self._seconds + time.perf_counter() - start)
        if tally.moved < tally.misplaced:
            log.warning("rank %d: %d of the slice's %d pages are not on node %d after moving: "
                        "%d mapped by another process too (such as a second engine attached "
                        "to this rank), %d not in memory, %d refused otherwise (e.g. the node "
                        "is full)", self.rank, tally.misplaced - tally.moved, tally.pages, node,
                        tally.shared, tally.absent,
                        tally.misplaced - tally.moved - tally.shared - tally.absent)
        placement = NumaPlacement(NumaState.PLACED if self.enabled else NumaState.OFF, node,
                                  tally.pages, tally.local,
                                  self._seconds + time.perf_counter() - start)
        log.info("rank %d: %s (%s) in %.3f s", self.rank, placement.describe(), self.choice.why,
                 placement.seconds)
        return placement

    def _count(self, node: int, num_threads: int) -> _Tally:
        """The slice's pages over ``num_threads`` threads, each a span of it, chunk by chunk
        (a few hundred KiB of arrays per thread whatever the slice's size): counted, and
        with placement on, those elsewhere moved to ``node`` (``MPOL_MF_MOVE``)."""
        pages = self.used_bytes // PAGE_BYTES
        step = -(-pages // max(1, num_threads)) * PAGE_BYTES
        spans = [(off, min(step, self.used_bytes - off)) for off in range(0, self.used_bytes, step)]
        with ThreadPoolExecutor(max_workers=max(1, len(spans)), thread_name_prefix="numa") as pool:
            tallies = list(pool.map(lambda span: self._count_span(node, *span), spans))
        return _Tally(*(sum(getattr(t, f.name) for t in tallies) for f in fields(_Tally)))

    def _count_span(self, node: int, offset: int, length: int) -> _Tally:
        tally = _Tally()
        for chunk in range(offset, offset + length, _CHUNK_BYTES):
            address, size = self.address + chunk, min(_CHUNK_BYTES, offset + length - chunk)
            nodes = page_nodes(address, size)
            local = int(np.count_nonzero(nodes == node))
            tally.pages += len(nodes)
            tally.local += local
            if not self.enabled or local == len(nodes):
                continue
            stray = np.flatnonzero(nodes != node).astype(np.uint64) * PAGE_BYTES + address
            status = move_to_node(stray, node)
            moved = int(np.count_nonzero(status == node))
            tally.misplaced += len(stray)
            tally.moved += moved
            tally.local += moved
            tally.shared += int(np.count_nonzero(status == -errno.EACCES))
            tally.absent += int(np.count_nonzero(status == -errno.ENOENT))
        return tally


@dataclass
class _Tally:
    """What counting (and moving) a part of a slice found: pages, those on the node (after
    any move), those found elsewhere, moved, left because shared or not in memory."""

    pages: int = 0
    local: int = 0
    misplaced: int = 0
    moved: int = 0
    shared: int = 0
    absent: int = 0
