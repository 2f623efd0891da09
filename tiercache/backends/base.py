"""The copy-backend contract: what byte-moving code guarantees to the handlers.

A ``CopyPlan`` is flat numpy arrays of (src address, dst address, bytes), already
validated and merged by the planner, with the direction the caller decided; a backend
only moves bytes. Addresses are process virtual addresses: GPU memory, or host memory
of the region (pinned and UVA-mapped when the worker pinned its slice).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.backends.kind import BackendKind
from tiercache.backends.streams import StreamPlatform
from tiercache.errors import BackendError
from tiercache.pages import PageArray
from tiercache.specs import Direction


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """Descriptors of one transfer; ``src[i] -> dst[i]``, ``sizes[i]`` bytes each.

    Arrays are uint64, equal length, read-only; copies never overlap each other.
    """

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    direction: Direction

    @property
    def num_descriptors(self) -> int:
        return int(self.sizes.size)

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum(dtype=np.uint64))


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """One transfer at block level: per non-empty KV-cache group its validated pairs
    (``tiercache.transfer.page_groups.GroupWork``: GPU ids, CPU rows, sub-pages), O(blocks).
    A backend that ``takes_blocks`` expands them to pages on the device."""

    pairs: tuple[Any, ...]
    direction: Direction

    @property
    def num_pairs(self) -> int:
        return sum(int(w.gpu_ids.size) for w in self.pairs)

    @property
    def num_bytes(self) -> int:
        return sum(w.num_bytes for w in self.pairs)

    @property
    def num_pages(self) -> int:
        """Page descriptors the plan expands to before runs are merged."""
        return sum(w.num_descriptors for w in self.pairs)


@dataclass(frozen=True)
class BackendContext:
    """What a backend factory is given: one direction of one rank.

    ``gpu_pages[t]`` / ``cpu_pages[t]`` describe tensor t on each side (addresses,
    strides, un-padded page bytes; ``cpu_pages[t].pages_per_block`` is the
    block_size_factor and ``cpu_pages[t].block_stride_bytes`` the region's row stride).
    ``device`` is the caches' torch device; ``host_pinned`` says whether the region
    slice is registered with the driver; ``streams`` is the platform the handler uses
    (for calibration runs at attach).
    """

    direction: Direction
    gpu_pages: tuple[PageArray, ...]
    cpu_pages: tuple[PageArray, ...]
    device: Any
    host_pinned: bool
    streams: StreamPlatform
    planner: Any = None

    def __post_init__(self) -> None:
        if len(self.gpu_pages) != len(self.cpu_pages) or not self.gpu_pages:
            raise BackendError(f"BackendContext: {len(self.gpu_pages)} GPU and "
                               f"{len(self.cpu_pages)} CPU page arrays; need as many, >= 1")


@dataclass(frozen=True, eq=False)
class Submitted:
    """What ``copy_async`` returns: everything the device still reads after the call
    (pointer arrays, descriptor tables, staging layouts), kept alive by holding this
    until the stream has passed the copies. ``ticket`` (``native_loop.Ticket``) is set
    when a thread of the backend's still issues the work: its events mean nothing before
    ``ticket.issued()``, and ``ticket.status`` is then the first failing CUresult (0: none)."""

    keep: tuple[Any, ...]
    ticket: Any = None


class CopyBackend(ABC):
    """Moves the bytes of a plan, ordered on a stream.

    Guarantees: ``copy_async`` enqueues every copy of the plan on ``stream`` and
    returns without waiting for the device; copies start only after work already
    enqueued on ``stream`` (the handler makes the stream wait for the compute stream
    and for the previous transfer first) and finish before work enqueued after them.
    The returned ``Submitted`` must be kept alive by the caller until the stream has
    passed the copies. On failure to submit it raises ``BackendError`` and leaves
    nothing enqueued that it cannot account for. Plans are never empty (the handler
    does not call a backend for a transfer without descriptors).

    ``kind`` is what the stats block records for the handler using this backend.
    """

    kind: BackendKind
    takes_blocks: bool = False  # True: the handler passes BlockPlans to copy_blocks_async

    @abstractmethod
    def copy_async(self, plan: CopyPlan, stream: Any) -> Submitted:
        """Enqueue the plan's copies on ``stream``; return the keep-alive token."""

    def plan(self, planner: Any, direction: Direction, transfer: Any, out: Any = None) -> Any:
        """``transfer`` validated and planned the way this backend takes it: a BlockPlan
        when it ``takes_blocks``, else a CopyPlan (into ``out``, the handler's reused
        buffers). Raises ``SpecError`` naming what is wrong; nothing is enqueued. The
        handler reads ``num_bytes`` and ``num_pairs`` / ``num_descriptors`` of the result
        and passes it back to ``submit_ordered``."""
        if self.takes_blocks:
            return planner.block_plan(direction, transfer)
        return planner.plan(direction, transfer, out=out)

    def submit_plan(self, plan: CopyPlan | BlockPlan, stream: Any) -> Submitted:
        """``copy_async`` or ``copy_blocks_async``, whichever the plan is for."""
        if isinstance(plan, BlockPlan):
            return self.copy_blocks_async(plan, stream)
        return self.copy_async(plan, stream)

    def copy_blocks_async(self, plan: BlockPlan, stream: Any) -> Submitted:
        """``copy_async`` for a block-level plan (only when ``takes_blocks``): the same
        guarantees, with the pages expanded on the device."""
        raise BackendError(f"the {self.kind.label} backend takes page plans, not block plans")

    def submit_ordered(self, plan: CopyPlan | BlockPlan | None, stream: Any,
                       after: tuple[Any, ...], start: Any, end: Any) -> Submitted | None:
        """One handler transfer on ``stream``: wait for the events ``after`` (the compute
        stream's mark, the previous transfer's end; None entries skipped), record
        ``start``, enqueue the plan's copies (None: none), record ``end``. ``end`` is
        recorded whatever happens, in order, so later transfers can wait on it; a failure
        to submit raises (``BackendError``) after that. Here all of it runs on the calling
        thread, after ``drain``; a backend that issues on a thread of its own overrides it
        and returns a ``Submitted`` with a ticket."""
        self.drain()
        try:
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            start.record(stream)
            return None if plan is None else self.submit_plan(plan, stream)
        finally:
            end.record(stream)

    def drain(self) -> None:
        """Block until everything submitted was issued to the device (a backend with an
        issuing thread; nothing to do here). Work enqueued on the calling thread after
        this is ordered after it."""

    def close(self) -> None:
        """Release buffers; called once after every transfer has finished."""
