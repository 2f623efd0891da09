"""``GatedPath``: a rank's transfers while its slice is being page-locked in the background
(``tiercache.region.preparation``): once the slice is registered every transfer takes the
rank's own path (its chosen backend, which may rely on page-locked rows: ``staged``,
``kernel``, ``ce`` with asynchronous copies), before that a path that needs no page-locked
rows (the worker gives copies through a page-locked bounce buffer of its own:
``tiercache.backends.bounce``; slower, and synchronous with the host, but exact).

One rule, checked per transfer: ``pinned()`` (``SlicePreparer.pinned``: the whole slice is
registered, at once, never a part). It only turns true, so a transfer routed to the pinned
path never meets a row that is not registered; a transfer on the unpinned path may meet
rows registered meanwhile, which changes nothing it reads or writes. The first transfer
that finds the slice registered closes the unpinned path (the worker's is a
``tiercache.backends.bounce.BounceBackend``: its page-locked bounce buffer and copy threads
are given back; closing waits for its last DMAs, at most the buffer's two halves). Its
transfers still in flight keep what they hold: ``release`` takes it back later. Both paths keep
the contract of ``tiercache.transfer.path`` (FIFO through ``previous``, one ``Outcome``
each), so the handler orders them as one path. Once the whole slice is pinned every
transfer takes the pinned path; ``routed`` counts both ways (what the GPU test and the
benchmark read).
"""

from __future__ import annotations

from collections.abc import Callable

from tiercache.device.events import Event, Stream
from tiercache.native.codes import Outcome
from tiercache.specs import TransferSpec
from tiercache.transfer.path import TransferPath


class GatedPath(TransferPath):
    """``pinned_path`` once ``pinned()``, ``unpinned`` before."""

    def __init__(self, pinned_path: TransferPath, unpinned: TransferPath,
                 pinned: Callable[[], bool]):
        self.direction = pinned_path.direction
        self.kind, self.native = pinned_path.kind, pinned_path.native
        self._pinned, self._ready = pinned_path, pinned
        self.unpinned = unpinned  # until the slice is pinned (the tests read its backend)
        self._unpinned_open = True
        self.routed = {"pinned": 0, "unpinned": 0}

    def transfer(self, job_id: int, transfer: TransferSpec, stream: Stream, mark: Event,
                 previous: Event | None, start: Event, end: Event) -> Outcome:
        if self._ready():
            path = self._pinned
            if self._unpinned_open:  # never used again: its buffers and threads go now
                self._unpinned_open = False
                self.unpinned.close()
        else:
            path = self.unpinned
        outcome = path.transfer(job_id, transfer, stream, mark, previous, start, end)
        self.routed["pinned" if path is self._pinned else "unpinned"] += 1
        return outcome if outcome.held is None else outcome._replace(held=(path, outcome.held))

    def release(self, held: object) -> None:
        assert isinstance(held, tuple)
        path, inner = held
        path.release(inner)

    def close(self) -> None:
        try:
            if self._unpinned_open:
                self._unpinned_open = False
                self.unpinned.close()
        finally:
            self._pinned.close()
