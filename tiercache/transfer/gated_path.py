"""``GatedPath``: a rank's transfers while its slice is being page-locked in the background
(``tiercache.region.preparation``): a transfer whose host rows are all page-locked takes
the rank's own path (its chosen backend, which may rely on page-locked rows: ``staged``,
``kernel``, ``ce`` with asynchronous copies), any other takes a path that needs no page-
locked memory (``ce`` over pageable rows: the driver copies them through its own staging
buffers, synchronously with the host, slower but exact).

One rule, checked per transfer: the rows ``[0, max(slot ids) + 1)`` are page-locked
(``SlicePreparer.pinned_below``). Registration only grows, so a transfer routed to the
pinned path never meets a row that is not registered; a transfer on the unpinned path may
meet one registered meanwhile, which changes nothing it reads or writes. Both paths keep
the contract of ``tiercache.transfer.path`` (FIFO through ``previous``, one ``Outcome``
each), so the handler orders them as one path. Once the whole slice is pinned every
transfer takes the pinned path; ``routed`` counts both ways (what the GPU test and the
benchmark read).
"""

from __future__ import annotations

from collections.abc import Callable

from tiercache.device.events import Event, Stream
from tiercache.native.codes import Outcome
from tiercache.specs import CPULoadStoreSpec, TransferSpec
from tiercache.transfer.path import TransferPath


class GatedPath(TransferPath):
    """``pinned`` for transfers ``pinned_below(rows_end)`` allows, ``unpinned`` otherwise."""

    def __init__(self, pinned: TransferPath, unpinned: TransferPath,
                 pinned_below: Callable[[int], bool]):
        self.direction, self.kind, self.native = pinned.direction, pinned.kind, pinned.native
        self._pinned, self._unpinned, self._pinned_below = pinned, unpinned, pinned_below
        self.routed = {"pinned": 0, "unpinned": 0}

    def _route(self, transfer: TransferSpec) -> TransferPath:
        cpu = next((s for s in transfer if isinstance(s, CPULoadStoreSpec)), None)
        if cpu is None or not cpu.block_ids.size:  # refused or empty: the pinned path says why
            return self._pinned
        return self._pinned if self._pinned_below(int(cpu.block_ids.max()) + 1) \
            else self._unpinned

    def transfer(self, job_id: int, transfer: TransferSpec, stream: Stream, mark: Event,
                 previous: Event | None, start: Event, end: Event) -> Outcome:
        path = self._route(transfer)
        outcome = path.transfer(job_id, transfer, stream, mark, previous, start, end)
        self.routed["pinned" if path is self._pinned else "unpinned"] += 1
        return outcome if outcome.held is None else outcome._replace(held=(path, outcome.held))

    def release(self, held: object) -> None:
        assert isinstance(held, tuple)
        path, inner = held
        path.release(inner)

    def close(self) -> None:
        try:
            self._unpinned.close()
        finally:
            self._pinned.close()
