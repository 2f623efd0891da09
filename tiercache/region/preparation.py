"""``SlicePreparer``: a worker's slice pre-faulted chunk by chunk, each chunk only once the
coordinator has reserved it, then page-locked (issue 41, "instant on", the worker side).

Why chunks, and why after the reservation: the coordinator reserves the slices in the
background (``tiercache.region.reservation``), so a worker may attach while most of its
slice is not reserved yet. Touching an unreserved tmpfs page would allocate it in the
worker's process, charged to the engine's cgroup rather than the coordinator's (and a full
/dev/shm would be the worker's error, not a state the coordinator exports). So the
preparer takes rows ``[0, n)`` in slot order, ``chunk_bytes`` at a time, and waits before
each chunk until the header says its rows are reserved. A reservation that FAILED, or a
coordinator that died mid-way, stops a preparation run in the caller (``run``, what the
host-only attachments use) at the rows reserved; one in the background (``start``) waits on
at a slower poll, since a new coordinator that re-adopts the region reserves the rest.

**Pre-faulted by chunks, registered at the end.** ``ready_rows`` grows after each chunk:
rows below it are pre-faulted. The slice is page-locked once every row is, in the same
registrations a whole-slice pin makes (``RegionLayout.registrations``: at most 64 GiB
each, cut every ``registration_rows``). Not chunk by chunk: ``staged`` merges the DMAs of
adjacent rows, and one DMA over two registrations fails (``CUDA_ERROR_INVALID_VALUE``: seen
on the H100 when this registered 256 MiB chunks); it merges none into a row where one of
those pieces begins (``BlockStaging.break_rows``), and the rule holds for the pieces only.
Until the registration is done the worker
copies every row on a path that needs no page-locked memory, after it on its chosen one
(``pinned``; ``tiercache.transfer.gated_path``). ``first_chunk`` registers one page
and unregisters it, so a driver that cannot pin at all still fails ``attach`` under
``required``.

**Exported as it goes.** While it works the rank's stats block says PINNING
(``tiercache_pin_state``) with the bytes registered so far (``tiercache_pinned_bytes{rank}``,
per registration), and PINNED with the whole slice's bytes and seconds at the end; the
pre-fault's seconds and the NUMA placement are recorded at the end, as before.

**A failure is a state.** A registration that fails rolls back its own ranges: the state
becomes FAILED (policy ``required``) or UNPINNED (``allow_unpinned``), an error line says
so, and every row keeps the unpinned path.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tiercache.config import PinningPolicy
from tiercache.errors import PinError, RegionError
from tiercache.region.header import Reservation
from tiercache.region.layout import OS_PAGE
from tiercache.region.placement import SlicePlacer
from tiercache.region.progress import Progress
from tiercache.region.registrar import HostRegistrar, failed_pin_state
from tiercache.region.stats import PinState
from tiercache.sizes import format_bytes

if TYPE_CHECKING:
    from tiercache.region.shared import SharedOffloadRegion

log = logging.getLogger(__name__)

PREPARE_CHUNK_BYTES = 256 << 20  # the reservation's chunk
_POLL_S = 0.005  # waiting for the coordinator's next reserved chunk
_SLOW_POLL_S = 1.0  # reservation FAILED or its owner gone: waiting for a new coordinator


def chunk_rows(row_stride: int, chunk_bytes: int) -> int:
    """Rows per chunk: about ``chunk_bytes``, a whole number of OS pages (pre-fault ranges
    are page-aligned)."""
    rows_per_page_run = OS_PAGE // math.gcd(row_stride, OS_PAGE)
    runs = max(1, chunk_bytes // (row_stride * rows_per_page_run))
    return runs * rows_per_page_run


class SlicePreparer:
    """Prepares ``region``'s slice of its rank (module docstring). ``registrar``: None pre-
    faults only (host caches, host-only attachments). ``first_chunk`` in the caller, the
    rest in a thread (``start``) or in the caller (``run``); ``close`` stops between
    chunks and joins."""

    def __init__(self, region: SharedOffloadRegion, num_threads: int,
                 registrar: HostRegistrar | None = None,
                 policy: PinningPolicy = PinningPolicy.REQUIRED,
                 placer: SlicePlacer | None = None,
                 say: Callable[[str], None] = log.info, *,
                 chunk_bytes: int | None = None):
        if region.rank is None:
            raise RegionError("a slice is prepared by a region attached with a rank")
        self._region, self.rank = region, region.rank
        self._threads, self._registrar, self._policy = num_threads, registrar, policy
        self._placer, self._say = placer, say
        layout = region.layout
        self.num_rows = layout.num_blocks
        self._rows_each = chunk_rows(layout.row_stride, chunk_bytes or PREPARE_CHUNK_BYTES)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready_rows = 0
        self._registered = False  # the whole slice page-locked
        self.pinned_ok = registrar is not None  # False once a registration failed
        self.prefault_s = self.pin_s = 0.0
        self._started = time.perf_counter()
        self._placed = False

    # ------------------------------------------------------------------ state
    @property
    def ready_rows(self) -> int:
        """Rows ``[0, ready_rows)`` are pre-faulted."""
        return self._ready_rows

    @property
    def complete(self) -> bool:
        return self._ready_rows >= self.num_rows

    def pinned(self) -> bool:
        """Whether the slice is page-locked for the worker's GPU: the whole of it once
        registered, none of it before (module docstring)."""
        return self._registered and self.pinned_ok

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the preparation completed, stopped or failed; False on timeout."""
        return self._done.wait(timeout_s)

    # ------------------------------------------------------------------ driving
    def first_chunk(self) -> None:
        """Pre-fault the first chunk in the caller (waiting for its reservation) and probe
        the registrar with one page: a driver that cannot pin raises here under
        ``required``, as a whole-slice pin did. A slice of one chunk is registered here."""
        if self._placer is not None:
            self._placer.before_touch()
            self._placed = True
        chunk = next(self._chunks(), None)
        if chunk is not None and self._wait_reserved(chunk[1], background=False):
            self._prepare(*chunk)
        if self.pinned_ok:
            if self.complete:
                self._register(raise_pin_error=True)
            else:
                self._probe()
        if self.complete:
            self._finish()

    def start(self) -> None:
        """The rest in a thread (after ``first_chunk``)."""
        if self.complete or self._done.is_set():
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, args=(True,), daemon=True,
                                        name=f"tiercache-prepare-rank{self.rank}")
        self._thread.start()

    def run(self) -> None:
        """Everything left, in the caller; stops at the reserved rows should the
        reservation have FAILED or its coordinator be gone."""
        if not self._placed and self._placer is not None:
            self._placer.before_touch()
            self._placed = True
        self._run(False)

    def close(self) -> None:
        """Stop after the chunk under way and join (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------------ the chunks
    def _chunks(self) -> Iterator[tuple[int, int]]:
        for first in range(self._ready_rows, self.num_rows, self._rows_each):
            yield first, min(first + self._rows_each, self.num_rows)

    def _run(self, background: bool) -> None:
        try:
            total = (self.num_rows - self._ready_rows) * self._region.layout.row_stride
            what = "pre-faulting and pinning" if self.pinned_ok else "pre-faulting"
            with Progress(f"rank {self.rank} {what}", total, self._say) as progress:
                for first, end in self._chunks():
                    if self._stop.is_set() or not self._wait_reserved(end, background):
                        return
                    self._prepare(first, end)
                    progress.advance((end - first) * self._region.layout.row_stride)
            if self.pinned_ok and not self._stop.is_set():
                self._register(raise_pin_error=False)
            self._finish()
        except Exception:  # a thread's failure is said and exported, never lost
            log.exception("rank %d: preparing the slice failed at row %d; rows from there "
                          "on use the unpinned path", self.rank, self._ready_rows)
            self._set_pin_failed("preparing the slice failed")
        finally:
            self._done.set()

    def _wait_reserved(self, rows_end: int, background: bool) -> bool:
        """Until the header says rows ``[0, rows_end)`` are reserved; False: stopped, or
        (in the caller) the reservation cannot complete."""
        region, said, checked = self._region, False, 0.0
        while True:
            info = region.header.read()
            if info.reservation == Reservation.COMPLETE or info.reserved_rows >= rows_end:
                return True
            now = time.monotonic()
            stuck = info.reservation == Reservation.FAILED
            if not stuck and now - checked >= _SLOW_POLL_S:
                stuck, checked = not region.owner_alive(), now
            if stuck and not background:
                self._say(f"rank {self.rank}: the coordinator reserved {info.reserved_rows} of "
                          f"{self.num_rows} blocks ({info.reservation.label}); prepared "
                          "those only")
                return False
            if stuck and not said:
                self._say(f"rank {self.rank}: waiting for a coordinator to reserve blocks "
                          f"from {info.reserved_rows} on ({info.reservation.label})")
                said = True
            if self._stop.wait(_SLOW_POLL_S if stuck else _POLL_S):
                return False

    def _prepare(self, first: int, end: int) -> None:
        self.prefault_s += self._region.prefault_rows(first, end, self._threads)
        self._ready_rows = end

    def _probe(self) -> None:
        """One page registered and unregistered (raises under ``required``)."""
        registrar, region = self._registrar, self._region
        assert registrar is not None
        address = region.base_address + region.layout.slice_offset(self.rank)
        try:
            registrar.pin([(address, OS_PAGE)])
            registrar.unpin()
        except PinError as e:
            failed_pin_state(self._policy, region.stats(self.rank), raise_error=e)
            self._set_pin_failed(str(e))
            return
        region.stats(self.rank).set_pin(PinState.PINNING)

    def _register(self, raise_pin_error: bool) -> None:
        """The whole slice, in ``RegionLayout.registrations`` (module docstring)."""
        registrar, region = self._registrar, self._region
        assert registrar is not None and self.rank is not None
        stats = region.stats(self.rank)
        stats.set_pin(PinState.PINNING, 0, 0.0)
        ranges = [(region.base_address + off, n)
                  for off, n in region.layout.registrations(self.rank)]
        region.adopt_registrar(registrar)  # its unpin undoes whatever is registered
        try:
            for address, length in ranges:  # each told as it is registered
                self.pin_s += registrar.pin([(address, length)])
                stats.set_pin(PinState.PINNING, registrar.pinned_bytes, self.pin_s)
        except PinError as e:
            failed_pin_state(self._policy, stats, raise_error=e if raise_pin_error else None)
            self._set_pin_failed(str(e))
            return
        self._registered = True

    def _set_pin_failed(self, why: str) -> None:
        if not self.pinned_ok:
            return
        self.pinned_ok = False
        state = failed_pin_state(self._policy, self._region.stats(self.rank))
        pinned = 0 if self._registrar is None else self._registrar.pinned_bytes
        log.error("rank %d: page-locking its slice failed after %s (%s): state %s; every row "
                  "is copied on the unpinned path", self.rank, format_bytes(pinned), why,
                  state.label)
        self._region.stats(self.rank).set_pin(state, pinned, self.pin_s)

    def _finish(self) -> None:
        stats, layout = self._region.stats(self.rank), self._region.layout
        stats.set_prefault(self.prefault_s)
        if self._placer is not None:
            stats.set_numa(self._placer.after_touch(self._threads))
        elapsed = time.perf_counter() - self._started
        if self.pinned_ok and self._registrar is not None:
            stats.set_pin(PinState.PINNED, self._registrar.pinned_bytes, self.pin_s)
            self._say(f"rank {self.rank} pre-faulted and page-locked its slice "
                      f"({format_bytes(layout.slice_used_bytes)}) in {elapsed:.2f} s "
                      f"(pre-fault {self.prefault_s:.2f} s with {self._threads} thread(s), "
                      f"registration {self.pin_s:.2f} s)")
        else:
            self._say(f"rank {self.rank} pre-faulted its slice "
                      f"({format_bytes(layout.slice_used_bytes)}) with {self._threads} "
                      f"thread(s) in {self.prefault_s:.2f} s")
        self._done.set()
