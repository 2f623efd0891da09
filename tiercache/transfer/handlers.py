"""Single-direction transfer handlers: order on pooled streams, track, report.

Contract of ``SingleDirectionOffloadingHandler`` (one per direction, driven by one
thread):

* ``transfer_async(job_id, (src_spec, dst_spec))`` hands the transfer to the handler's
  ``TransferPath`` (``tiercache.transfer.path``) in the handler's own direction: a pair
  that moves the other way, or a spec the rank cannot take, is a ``SpecError`` naming
  why, and nothing is enqueued; after ``shutdown()`` it raises ``HandlerClosedError``.
  Otherwise the transfer goes on a stream of its own that waits for the compute stream
  (a store must not read KV still being written; a load must not be overwritten by
  compute work queued before it) and for the previous transfer of this handler (FIFO).
  Returns True when the copies were enqueued, False when they were not (the backend
  refused them, the fence did, or the mark failed); either way exactly one
  ``TransferResult`` for the job follows.
* ``get_finished()`` returns finished transfers in submission order (a later transfer is
  never reported before an earlier one), each with its bytes and stream-timed seconds;
  a backend or device failure is ``success=False``, never an exception.
* ``wait(job_ids)`` blocks until those jobs finished (ids not in flight are ignored);
  their results still come from ``get_finished()``.
* ``shutdown()`` waits for every transfer, returns their results and closes the path.
* A transfer whose CPU spec is for another region, or names a slot handed to another
  block since, copies nothing: the path logs it and it is reported ``success=False``, in
  order, like a refused submission.

Every finished transfer is accounted in the optional ``RankStats`` exactly once.

The handler only orders, tracks and reports: each transfer gets a pooled stream, its
start and end events and a marker for the compute stream, and goes to the path with the
previous transfer's end in one call; what a transfer is (validation, fence, plan, mark,
issue) is the path's, native or planned (``tiercache.transfer.wiring.path_for``). A path
that issues on a thread of its own (``staged``'s chunk loop) returns a ticket: the
transfer's events mean something only once it says issued, which ``get_finished`` and
``wait`` check first, and a failure on that thread is ``success=False`` like a device
failure.

``CpuGpuOffloadingHandlers.transfer_async`` is the generic entry: it decides the
direction once (``Direction.of``) and hands the transfer to that direction's handler.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tiercache.backend_kind import BackendKind
from tiercache.device.events import Event, Stream, Ticket
from tiercache.device.streams import StreamPlatform
from tiercache.errors import BackendError, HandlerClosedError, HandlerError, SpecError
from tiercache.region.stats import RankStats
from tiercache.specs import Direction, TransferSpec
from tiercache.transfer.path import TransferPath

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TransferResult:
    """One finished transfer. ``transfer_size`` is the bytes it was to move (moved when
    ``success``); ``transfer_time`` is stream-timed seconds, 0.0 when it failed."""

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float
    transfer_type: Direction

    def __post_init__(self) -> None:
        if self.transfer_size < 0 or self.transfer_time < 0:
            raise HandlerError(f"TransferResult(transfer_size={self.transfer_size}, "
                               f"transfer_time={self.transfer_time}): both must be >= 0")


@dataclass(eq=False, slots=True)
class _Transfer:
    job_id: int
    num_bytes: int
    stream: Stream
    start_event: Event
    end_event: Event
    compute_mark: Event  # the compute stream's work at submit time, which the transfer waits for
    submitted: bool  # the copies were enqueued
    ticket: Ticket | None  # the path's thread's, while one issues this transfer
    held: object  # what the device may still read: given back to the path once reported
    failed_on_device: bool = False


class SingleDirectionOffloadingHandler:
    """Moves blocks in ``path``'s direction; see the module docstring for the contract."""

    def __init__(self, path: TransferPath, streams: StreamPlatform,
                 stats: RankStats | None = None):
        self.direction = path.direction
        self._path = path
        self._streams = streams
        self._stats = stats
        self._transfers: deque[_Transfer] = deque()
        self._by_job: dict[int, _Transfer] = {}
        self._stream_pool: list[Stream] = []
        self._event_pool: list[tuple[Event, Event, Event]] = []  # start, end, compute mark
        self._closed = False

    # ---------------------------------------------------------------- submit
    def transfer_async(self, job_id: int, transfer: TransferSpec) -> bool:
        if self._closed:
            raise HandlerClosedError(f"{self.direction.label} handler is shut down; job {job_id} "
                                     "refused")
        if job_id in self._by_job:
            raise SpecError(f"job id {job_id} is already in flight on the "
                            f"{self.direction.label} handler; job ids must be unique")
        stream = self._stream_pool.pop() if self._stream_pool else self._streams.new_stream()
        start, end, mark = self._events()
        previous = self._transfers[-1].end_event if self._transfers else None
        try:
            outcome = self._path.transfer(job_id, transfer, stream, mark, previous, start, end)
        except SpecError:  # refused before anything was enqueued: all of it is reusable
            self._stream_pool.append(stream)
            self._event_pool.append((start, end, mark))
            raise
        transfer_ = _Transfer(job_id, outcome.num_bytes, stream, start, end, mark,
                              not outcome.code, outcome.ticket, outcome.held)
        self._transfers.append(transfer_)
        self._by_job[job_id] = transfer_
        return transfer_.submitted

    def _events(self) -> tuple[Event, Event, Event]:
        """A transfer's start and end (timing) events and its compute mark (a marker)."""
        if self._event_pool:
            return self._event_pool.pop()
        new = self._streams
        return new.new_timing_event(), new.new_timing_event(), new.new_marker()

    @property
    def path(self) -> TransferPath:
        """The path this handler's transfers take (``tiercache.transfer.path``)."""
        return self._path

    @property
    def native(self) -> bool:
        """Each transfer is one native call (the path's ``native``)."""
        return self._path.native

    @property
    def kind(self) -> BackendKind:
        """The backend kind the path copies with (what the stats block records)."""
        return self._path.kind

    # ---------------------------------------------------------------- complete
    def _is_done(self, transfer: _Transfer) -> bool:
        ticket = transfer.ticket
        if ticket is not None:
            if not ticket.issued():  # its events are not recorded yet
                return False
            self._note_issue_failure(transfer, ticket)
        try:
            return transfer.end_event.query()
        except BackendError as e:
            self._note_device_failure(transfer, e)
            return True

    def _note_device_failure(self, transfer: _Transfer, error: BaseException) -> None:
        if not transfer.failed_on_device:
            log.error("%s job %d failed on the device: %s", self.direction.label,
                      transfer.job_id, error)
            transfer.failed_on_device = True

    def _note_issue_failure(self, transfer: _Transfer, ticket: Ticket) -> None:
        if ticket.status and not transfer.failed_on_device:
            log.error("%s job %d: the %s backend's issuing thread failed: CUresult %d",
                      self.direction.label, transfer.job_id, self._path.kind.label,
                      ticket.status)
            transfer.failed_on_device = True

    def _finish(self, transfer: _Transfer) -> TransferResult:
        success = transfer.submitted and not transfer.failed_on_device
        seconds = 0.0
        if success:
            try:
                seconds = max(transfer.start_event.elapsed_time(transfer.end_event), 0.0) / 1e3
            except BackendError as e:
                self._note_device_failure(transfer, e)
                success = False
        del self._by_job[transfer.job_id]
        self._stream_pool.append(transfer.stream)
        self._event_pool.append((transfer.start_event, transfer.end_event, transfer.compute_mark))
        if transfer.held is not None:
            self._path.release(transfer.held)
        if self._stats is not None:
            self._stats.record_transfer(self.direction, transfer.num_bytes, seconds, success)
        return TransferResult(transfer.job_id, success, transfer.num_bytes, seconds,
                              self.direction)

    def get_finished(self) -> list[TransferResult]:
        results = []
        while self._transfers and self._is_done(self._transfers[0]):
            results.append(self._finish(self._transfers.popleft()))
        return results

    def _synchronize(self, transfer: _Transfer) -> None:
        ticket = transfer.ticket
        if ticket is not None:
            ticket.wait()
            self._note_issue_failure(transfer, ticket)
        try:
            transfer.end_event.synchronize()
        except BackendError as e:
            self._note_device_failure(transfer, e)

    def wait(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            transfer = self._by_job.get(job_id)
            if transfer is not None:
                self._synchronize(transfer)

    @property
    def num_in_flight(self) -> int:
        return len(self._transfers)

    def shutdown(self) -> list[TransferResult]:
        """Wait for every transfer, return their results, close the path."""
        results = []
        while self._transfers:
            self._synchronize(self._transfers[0])
            results.append(self._finish(self._transfers.popleft()))
        if not self._closed:
            self._closed = True
            self._path.close()
            self._stream_pool.clear()
            self._event_pool.clear()
        return results


class CpuGpuOffloadingHandlers:
    """Both directions of one rank; owns the stream platform it was built with."""

    def __init__(self, gpu_to_cpu: SingleDirectionOffloadingHandler,
                 cpu_to_gpu: SingleDirectionOffloadingHandler,
                 streams: StreamPlatform | None = None):
        for handler, want in ((gpu_to_cpu, Direction.GPU_TO_CPU),
                              (cpu_to_gpu, Direction.CPU_TO_GPU)):
            if handler.direction is not want:
                raise HandlerError(f"expected a {want.label} handler, got "
                                   f"{handler.direction.label}")
        self.gpu_to_cpu_handler = gpu_to_cpu
        self.cpu_to_gpu_handler = cpu_to_gpu
        self._streams = streams

    @classmethod
    def of_paths(cls, paths: Mapping[Direction, TransferPath], streams: StreamPlatform,
                 stats: RankStats | None = None) -> CpuGpuOffloadingHandlers:
        """One handler over each direction's path (``tiercache.transfer.wiring`` builds
        them from a rank's planner and backends)."""
        store, load = (SingleDirectionOffloadingHandler(paths[d], streams, stats)
                       for d in (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU))
        return cls(store, load, streams)

    @property
    def streams(self) -> StreamPlatform | None:
        """The platform the handlers order on (its ``current_stream()`` is the compute
        stream every transfer waits for); ``None`` after ``shutdown``."""
        return self._streams

    def handler(self, direction: Direction) -> SingleDirectionOffloadingHandler:
        return self.gpu_to_cpu_handler if direction.stores \
            else self.cpu_to_gpu_handler

    def transfer_async(self, job_id: int, transfer: TransferSpec) -> bool:
        """The generic entry: the direction is decided here, once, from the pair's spec
        types (``SpecError`` naming them when they are not one GPU and one CPU spec)."""
        return self.handler(Direction.of(transfer)).transfer_async(job_id, transfer)

    def get_finished(self) -> list[TransferResult]:
        return self.gpu_to_cpu_handler.get_finished() + self.cpu_to_gpu_handler.get_finished()

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = list(job_ids)
        self.gpu_to_cpu_handler.wait(ids)
        self.cpu_to_gpu_handler.wait(ids)

    def shutdown(self) -> list[TransferResult]:
        results = self.gpu_to_cpu_handler.shutdown() + self.cpu_to_gpu_handler.shutdown()
        if self._streams is not None:
            self._streams.close()
            self._streams = None
        return results
