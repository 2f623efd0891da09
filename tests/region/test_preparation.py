"""A worker's slice prepared chunk by chunk behind the coordinator's reservation
(``tiercache.region.preparation``): on a real region whose reservation the test holds
chunk by chunk, the preparer never touches a row that is not reserved (the file's
allocated blocks say so: a pre-faulted unreserved page would be allocated by the worker),
exports PINNING until the whole slice is registered (once every row is pre-faulted, in the
registrations a whole-slice pin makes) and PINNED after, stops at a FAILED reservation
when run in the caller, and turns a registration failing into a state.

The registrar is the one test double: page-locking needs a CUDA device, which this machine
lacks (``tests/transfer/test_background_pinning_gpu.py`` runs the real one). It records
each range and checks, when it is asked, that the header already says the rows are
reserved."""

from __future__ import annotations

import errno
import math
import os
import threading
import time

import pytest

from tiercache.config import KVGeometry, PinningPolicy, RegionConfig
from tiercache.errors import PinError, RegionError
from tiercache.region.attachments import AttachmentReader
from tiercache.region.header import Reservation
from tiercache.region.hostmem import process_start_ns
from tiercache.region.layout import OS_PAGE
from tiercache.region.preparation import SlicePreparer, chunk_rows
from tiercache.region.reservation import _allocate
from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stats import PinState

NUM_BLOCKS = 64
RESERVE_ROWS = 16  # rows per reservation chunk (one rank)
PREPARE_ROWS = 4  # rows per preparation chunk
DEADLINE_S = 120.0  # a failure bound only: every wait below ends on its condition


class RecordingRegistrar:
    """Records each pinned range; refuses the call numbered ``fail_at`` (1-based)."""

    def __init__(self, region: SharedOffloadRegion, fail_at: int = 0):
        self.region, self.fail_at = region, fail_at
        self.ranges: list[tuple[int, int]] = []
        self.calls = 0
        self.unreserved: list[tuple[int, int]] = []

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self.ranges)

    def pin(self, ranges, progress=None) -> float:
        self.calls += 1
        if self.calls == self.fail_at:
            raise PinError("cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY (test)")
        layout, info = self.region.layout, self.region.info()
        base = self.region.base_address + layout.slice_offset(0)
        for address, length in ranges:
            end_row = (address + length - base) // layout.row_stride
            if info.reservation != Reservation.COMPLETE and end_row > info.reserved_rows:
                self.unreserved.append((address, length))
        self.ranges += ranges
        return 0.001

    def unpin(self) -> float:
        self.ranges.clear()
        return 0.0


class HeldReservation:
    """A real ``SliceReserver`` whose chunks the test releases one at a time."""

    def __init__(self, region: SharedOffloadRegion, fail_after: int | None = None):
        self.gate = threading.Semaphore(0)
        self.fail_after, self.done = fail_after, 0
        layout = region.layout
        self.reserver = region.reserver(
            lambda rows: None, chunk_bytes=RESERVE_ROWS * layout.row_stride * layout.world_size,
            allocate=self._allocate)
        assert self.reserver is not None

    def _allocate(self, fd, num_bytes, path, offset):
        self.gate.acquire()
        if self.fail_after is not None and self.done >= self.fail_after:
            raise RegionError(f"posix_fallocate({path}) failed") from OSError(
                errno.ENOSPC, "No space left on device")
        _allocate(fd, num_bytes, path, offset)
        self.done += 1


def _config(make_config):
    return make_config(world_size=1, kv=KVGeometry(page_bytes=(OS_PAGE,)),
                       region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS,
                                           prefault_threads=2))


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"never came: {what}"
        time.sleep(0.002)


def _allocated_bytes(region: SharedOffloadRegion) -> int:
    return os.stat(region.path).st_blocks * 512


def test_every_pin_state_has_a_place_in_a_ranks_worst_of():
    from tiercache.region.attachments import _PIN_RANK

    assert set(_PIN_RANK) == set(PinState)


def test_chunks_are_whole_pages_so_no_two_registrations_share_one():
    for stride in (4096, 8192, 4352, 12544, 256, 2 << 20, 4096 * 3 + 256):
        rows = chunk_rows(stride, 1 << 20)
        assert rows >= 1 and (rows * stride) % OS_PAGE == 0
        assert rows * stride <= max(1 << 20, stride * (OS_PAGE // math.gcd(stride, OS_PAGE)))


def test_a_worker_prepares_only_reserved_rows_following_the_reservation(make_config,
                                                                        instance_name):
    region = SharedOffloadRegion.create(_config(make_config), reserve_now=False)
    held = HeldReservation(region)
    worker = SharedOffloadRegion.attach(instance_name, 0)
    layout = worker.layout
    registrar = RecordingRegistrar(worker)
    preparer = SlicePreparer(worker, 2, registrar, PinningPolicy.REQUIRED,
                             chunk_bytes=PREPARE_ROWS * layout.row_stride)
    worker.stats(0).mark_attached(os.getpid(), process_start_ns(os.getpid()))
    coordinator_view = AttachmentReader(region, layout)  # what status and /metrics read
    try:
        header_bytes = _allocated_bytes(region)  # the header: reserved by create
        threading.Thread(target=held.reserver.run, daemon=True).start()
        held.gate.release()  # the first reservation chunk
        preparer.first_chunk()  # waited for it, prepared its first rows in the caller
        assert preparer.ready_rows == PREPARE_ROWS
        assert registrar.calls == 1 and registrar.ranges == []  # a one-page probe, undone
        preparer.start()
        for step in range(1, NUM_BLOCKS // RESERVE_ROWS + 1):
            if step > 1:
                held.gate.release()
            rows = step * RESERVE_ROWS
            _until(lambda: preparer.ready_rows == rows, f"{rows} rows prepared")
            # never past the reservation: its rows are allocated by fallocate alone
            assert preparer.ready_rows == worker.info().reserved_rows == rows
            assert _allocated_bytes(region) <= header_bytes + rows * layout.row_stride + (
                2 << 20 if rows == NUM_BLOCKS else 0)  # the last chunk takes the padding
            snap = worker.stats(0).snapshot()
            if rows < NUM_BLOCKS:
                assert (snap.pin_state, snap.pinned_bytes) == (PinState.PINNING, 0)
                assert not preparer.pinned()  # nothing is pinned before every row is
                assert coordinator_view.read(0).pin_state is PinState.PINNING
        assert preparer.wait(DEADLINE_S)
        snap = worker.stats(0).snapshot()
        assert (snap.pin_state, snap.pinned_bytes) == (PinState.PINNED,
                                                       NUM_BLOCKS * layout.row_stride)
        assert coordinator_view.read(0).pin_state is PinState.PINNED
        assert registrar.unreserved == []  # every range was reserved when it was pinned
        # the registrations a whole-slice pin makes: no DMA of adjacent rows spans two
        assert registrar.ranges == [(worker.base_address + off, n)
                                    for off, n in layout.registrations(0)]
        assert preparer.pinned()
    finally:
        for _ in range(NUM_BLOCKS):
            held.gate.release()
        preparer.close()
        held.reserver.close()
        worker.close()
        region.close()


def test_prefaulting_in_the_caller_stops_at_a_failed_reservation(make_config, instance_name):
    region = SharedOffloadRegion.create(_config(make_config), reserve_now=False)
    held = HeldReservation(region, fail_after=2)
    worker = SharedOffloadRegion.attach(instance_name, 0)
    said: list[str] = []
    try:
        for _ in range(3):
            held.gate.release()
        held.reserver.run()  # two chunks, then ENOSPC: FAILED at 32 rows
        assert (region.info().reservation, region.info().reserved_rows) == (
            Reservation.FAILED, 2 * RESERVE_ROWS)
        worker.prefault_slice(2, log_step=said.append)  # returns: it does not wait forever
        assert any("reserved 32 of 64 blocks (failed); prepared those only" in s for s in said)
        assert _allocated_bytes(region) <= (worker.layout.slice_offset(0)
                                            + 2 * RESERVE_ROWS * worker.layout.row_stride)
    finally:
        worker.close()
        region.close()


@pytest.mark.parametrize("policy,state", [(PinningPolicy.REQUIRED, PinState.FAILED),
                                          (PinningPolicy.ALLOW_UNPINNED, PinState.UNPINNED)])
def test_a_registration_failing_is_a_state_and_every_row_stays_unpinned(
        make_config, instance_name, policy, state):
    region = SharedOffloadRegion.create(_config(make_config))  # reserved in the caller
    worker = SharedOffloadRegion.attach(instance_name, 0)
    layout = worker.layout
    registrar = RecordingRegistrar(worker, fail_at=2)  # the probe passes, the slice fails
    preparer = SlicePreparer(worker, 2, registrar, policy,
                             chunk_bytes=PREPARE_ROWS * layout.row_stride)
    try:
        preparer.first_chunk()
        preparer.start()
        assert preparer.wait(DEADLINE_S)
        assert preparer.ready_rows == NUM_BLOCKS  # the pre-fault went on
        snap = worker.stats(0).snapshot()
        assert (snap.pin_state, snap.pinned_bytes) == (state, 0)
        assert not preparer.pinned()  # nothing counts as pinned
    finally:
        preparer.close()
        worker.close()
        region.close()


def test_the_first_chunk_failing_to_register_raises_under_required(make_config, instance_name):
    region = SharedOffloadRegion.create(_config(make_config))
    worker = SharedOffloadRegion.attach(instance_name, 0)
    preparer = SlicePreparer(worker, 2, RecordingRegistrar(worker, fail_at=1),
                             PinningPolicy.REQUIRED)
    try:
        with pytest.raises(PinError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            preparer.first_chunk()
        assert worker.stats(0).snapshot().pin_state is PinState.FAILED
    finally:
        preparer.close()
        worker.close()
        region.close()


def test_the_first_chunk_failing_to_register_is_unpinned_under_allow_unpinned(
        make_config, instance_name):
    region = SharedOffloadRegion.create(_config(make_config))
    worker = SharedOffloadRegion.attach(instance_name, 0)
    registrar = RecordingRegistrar(worker, fail_at=1)  # the probe fails
    preparer = SlicePreparer(worker, 2, registrar, PinningPolicy.ALLOW_UNPINNED,
                             chunk_bytes=PREPARE_ROWS * worker.layout.row_stride)
    try:
        preparer.first_chunk()  # no raise: the rank runs unpinned
        assert worker.stats(0).snapshot().pin_state is PinState.UNPINNED
        preparer.start()
        assert preparer.wait(DEADLINE_S)
        assert preparer.ready_rows == NUM_BLOCKS  # the pre-fault went on
        assert registrar.calls == 1  # the slice was never registered after the probe
        assert worker.stats(0).snapshot().pin_state is PinState.UNPINNED
        assert not preparer.pinned()
    finally:
        preparer.close()
        worker.close()
        region.close()
