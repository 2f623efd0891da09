"""Single-direction transfer handlers: plan, order on pooled streams, copy, report.

Contract of ``SingleDirectionOffloadingHandler`` (one per direction, driven by one
thread):

* ``transfer_async(job_id, (src_spec, dst_spec))`` plans first, in the handler's own
  direction (a pair that moves the other way is a ``SpecError`` naming the given types,
  never re-routed): a bad spec raises ``SpecError`` and nothing is enqueued; after
  ``shutdown()`` it raises ``HandlerClosedError``. Otherwise the transfer goes on a
  stream of its own that waits for the compute stream (a store must not read KV still
  being written; a load must not be overwritten by compute work queued before it) and
  for the previous transfer of this handler (FIFO). Returns True when the copies were
  enqueued, False when the backend refused them; either way exactly one
  ``TransferResult`` for the job follows.
* ``get_finished()`` returns finished transfers in submission order (a later transfer is
  never reported before an earlier one), each with its bytes and stream-timed seconds;
  a backend or device failure is ``success=False``, never an exception.
* ``wait(job_ids)`` blocks until those jobs finished (ids not in flight are ignored);
  their results still come from ``get_finished()``.
* ``shutdown()`` waits for every transfer, returns their results and releases the backend.
* With a ``fence`` (``tiercache.transfer.fence.SlotFence``), a transfer whose CPU spec is
  for another region, or names a slot handed to another block since, copies nothing: it is
  logged and reported ``success=False``, in order, like a refused submission.

Every finished transfer is accounted in the optional ``RankStats`` exactly once.

One pass, downward: the planner validates and plans the transfer once, on the caller's
thread, in the form the backend declared (``CopyBackend.plan_form``); the fence checks its
slots; the backend gets the plan and the ``Ordering`` (the stream, the compute stream's
mark and the previous transfer's end to wait for, its own start and end events) in one
``submit``. A backend with a native whole-transfer entry (``staged`` issuing block plans:
``CopyBackend.native_transfers``) takes all of that in one native call instead, under
the same rules (a refusal there is re-checked by the planner, so the ``SpecError`` says
why; a fenced transfer is logged with the fence's reason): in an engine step the Python
between four native calls cost more than the calls. A backend that issues on a thread of
its own (``staged``'s chunk loop) returns a ticket: the transfer's events mean something
only once it says issued, which ``get_finished`` and ``wait`` check first, and a failure
on that thread is ``success=False`` like a device failure.

``CpuGpuOffloadingHandlers.transfer_async`` is the generic entry: it decides the
direction once (``Direction.of``) and hands the transfer to that direction's handler.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tiercache.backends.base import CopyBackend, Ordering, Plan, Submission, Ticket
from tiercache.device.events import Event, Stream
from tiercache.device.streams import StreamPlatform
from tiercache.errors import BackendError, HandlerClosedError, HandlerError, SpecError
from tiercache.native.transfer_call import Outcome, TransferCode
from tiercache.planning.planner import PlanBuffers, TransferPlanner
from tiercache.planning.plans import PlanForm
from tiercache.region.stats import RankStats
from tiercache.specs import CPULoadStoreSpec, Direction, TransferSpec
from tiercache.transfer.fence import SlotFence

log = logging.getLogger(__name__)

# What stream work raises when it failed: host streams raise BackendError, torch raises
# RuntimeError (torch.AcceleratorError) for CUDA errors. Both become success=False.
_DEVICE_ERRORS = (BackendError, RuntimeError)


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
    buffers: PlanBuffers | None  # a page plan's arrays: reused once the transfer finished
    submitted: bool  # the backend accepted the copies
    keep: tuple[object, ...] = field(default=(), repr=False)  # what the device reads: held
    ticket: Ticket | None = None  # the backend thread's, while one issues this transfer
    failed_on_device: bool = False


class SingleDirectionOffloadingHandler:
    """Moves blocks in one direction; see the module docstring for the contract."""

    def __init__(self, planner: TransferPlanner, direction: Direction, backend: CopyBackend,
                 streams: StreamPlatform, stats: RankStats | None = None,
                 fence: SlotFence | None = None):
        self.planner = planner
        self.direction = direction
        self.backend = backend
        self._fence = fence
        self._streams = streams
        self._stats = stats
        self._transfers: deque[_Transfer] = deque()
        self._by_job: dict[int, _Transfer] = {}
        self._stream_pool: list[Stream] = []
        self._event_pool: list[tuple[Event, Event, Event]] = []  # start, end, compute mark
        self._buffer_pool: list[PlanBuffers] = []
        self._closed = False
        self._native = backend.native_transfers(planner, None if fence is None else fence.table)

    # ---------------------------------------------------------------- submit
    def transfer_async(self, job_id: int, transfer: TransferSpec) -> bool:
        if self._closed:
            raise HandlerClosedError(f"{self.direction.label} handler is shut down; job {job_id} "
                                     "refused")
        if job_id in self._by_job:
            raise SpecError(f"job id {job_id} is already in flight on the "
                            f"{self.direction.label} handler; job ids must be unique")
        if self._native is not None:
            return self._transfer_native(job_id, transfer)
        form = self.backend.plan_form
        buffers = None  # block plans are O(blocks) arrays of their own; page plans reuse these
        if form is not PlanForm.BLOCKS:
            buffers = self._buffer_pool.pop() if self._buffer_pool else PlanBuffers()
        try:
            plan = self.planner.plan_as(form, self.direction, transfer, buffers)
        except SpecError:
            if buffers is not None:
                self._buffer_pool.append(buffers)
            raise
        refusal = None
        if self._fence is not None:
            refusal = self._fence.refusal(self.direction, self.direction.gpu_cpu(*transfer)[1])
            if refusal is not None:
                log.error("%s job %d refused, nothing copied: %s", self.direction.label, job_id,
                          refusal)
        stream = self._stream_pool.pop() if self._stream_pool else self._streams.new_stream()
        start, end, mark = self._events()
        submitted, token = self._enqueue(job_id, plan, stream, start, end, mark,
                                         refused=refusal is not None)
        transfer_ = _Transfer(job_id, plan.num_bytes, stream, start, end, mark, buffers,
                              submitted, *((token.keep, token.ticket) if token else ()))
        self._transfers.append(transfer_)
        self._by_job[job_id] = transfer_
        return submitted

    def _events(self) -> tuple[Event, Event, Event]:
        """A transfer's start and end (timing) events and its compute mark (a marker)."""
        if self._event_pool:
            return self._event_pool.pop()
        new = self._streams
        return new.new_timing_event(), new.new_timing_event(), new.new_marker()

    def _transfer_native(self, job_id: int, transfer: TransferSpec) -> bool:
        """``transfer_async`` in one native call (``CopyBackend.native_transfers``): the
        planner's validation, the fence, the compute stream's mark and the submission as
        the steps above make them, with the same outcomes."""
        direction = self.direction
        gpu, cpu = self.planner.specs(direction, transfer)
        stream = self._stream_pool.pop() if self._stream_pool else self._streams.new_stream()
        start, end, mark = self._events()
        previous = self._transfers[-1].end_event if self._transfers else None
        try:
            outcome = self._native.transfer(direction, gpu, cpu, stream, mark, previous, start,
                                            end)
        except _DEVICE_ERRORS as e:  # the backend took nothing: failed, in order
            num_bytes = self.planner.bytes_of(gpu)
            log.error("%s job %d: the %s backend could not submit %d bytes: %s",
                      direction.label, job_id, self.backend.kind.label, num_bytes, e)
            transfer_ = _Transfer(job_id, num_bytes, stream, start, end, mark, None, False)
        else:
            code = outcome.code
            if code:  # not queued (TransferCode: QUEUED is 0)
                if outcome.ticket is None:  # refused by the validation: nothing enqueued
                    self._stream_pool.append(stream)
                    self._event_pool.append((start, end, mark))
                    self.planner.refuse(direction, transfer, code)
                self._log_not_copied(job_id, cpu, outcome)
            transfer_ = _Transfer(job_id, outcome.num_bytes, stream, start, end, mark, None,
                                  not code, (), outcome.ticket)
        self._transfers.append(transfer_)
        self._by_job[job_id] = transfer_
        return transfer_.submitted

    def _log_not_copied(self, job_id: int, cpu: CPULoadStoreSpec, outcome: Outcome) -> None:
        """Why a transfer the native entry queued only its ordering for copied nothing."""
        label = self.direction.label
        if outcome.code == TransferCode.FENCED:
            refusal = self._fence.refusal(self.direction, cpu) if self._fence is not None else None
            log.error("%s job %d refused, nothing copied: %s", label, job_id,
                      refusal or "the fence refused its slots (since given back again)")
        else:
            log.error("%s job %d: the compute stream's mark could not be recorded (CUresult "
                      "%d); nothing copied", label, job_id, outcome.cu)

    def _enqueue(self, job_id: int, plan: Plan, stream: Stream, start: Event, end: Event,
                 mark: Event, refused: bool = False) -> tuple[bool, Submission | None]:
        previous = self._transfers[-1].end_event if self._transfers else None
        ok = not refused
        try:  # the compute stream's work so far: the transfer starts after it
            if ok:
                self._streams.mark_current(mark)
        except _DEVICE_ERRORS as e:
            self._log_refusal(job_id, plan, e)
            ok = False
        ordering = Ordering(stream, (mark if ok else None, previous), start, end)
        try:  # the backend records ``end`` in order whatever happens (later transfers wait on it)
            token = self.backend.submit(plan if ok and not plan.empty else None, ordering)
        except _DEVICE_ERRORS as e:
            self._log_refusal(job_id, plan, e)
            return False, None
        return ok, token

    @property
    def native(self) -> bool:
        """Transfers go through the backend's native whole-transfer entry."""
        return self._native is not None

    @property
    def fence(self) -> SlotFence | None:
        return self._fence

    def _log_refusal(self, job_id: int, plan: Plan, error: BaseException) -> None:
        log.error("%s job %d: the %s backend could not submit %d bytes: %s",
                  self.direction.label, job_id, self.backend.kind.label, plan.num_bytes, error)

    # ---------------------------------------------------------------- complete
    def _is_done(self, transfer: _Transfer) -> bool:
        ticket = transfer.ticket
        if ticket is not None:
            if not ticket.issued():  # its events are not recorded yet
                return False
            self._note_issue_failure(transfer, ticket)
        try:
            return transfer.end_event.query()
        except _DEVICE_ERRORS as e:
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
                      self.direction.label, transfer.job_id, self.backend.kind.label,
                      ticket.status)
            transfer.failed_on_device = True

    def _finish(self, transfer: _Transfer) -> TransferResult:
        success = transfer.submitted and not transfer.failed_on_device
        seconds = 0.0
        if success:
            try:
                seconds = max(transfer.start_event.elapsed_time(transfer.end_event), 0.0) / 1e3
            except _DEVICE_ERRORS as e:
                self._note_device_failure(transfer, e)
                success = False
        del self._by_job[transfer.job_id]
        self._stream_pool.append(transfer.stream)
        self._event_pool.append((transfer.start_event, transfer.end_event, transfer.compute_mark))
        if transfer.buffers is not None:
            self._buffer_pool.append(transfer.buffers)
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
        except _DEVICE_ERRORS as e:
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
        """Wait for every transfer, return their results, release the backend."""
        results = []
        while self._transfers:
            self._synchronize(self._transfers[0])
            results.append(self._finish(self._transfers.popleft()))
        if not self._closed:
            self._closed = True
            self.backend.close()
            self._stream_pool.clear()
            self._event_pool.clear()
            self._buffer_pool.clear()
        return results


class CpuGpuOffloadingHandlers:
    """Both directions of one rank; owns the stream platform it was built with."""

    def __init__(self, gpu_to_cpu: SingleDirectionOffloadingHandler,
                 cpu_to_gpu: SingleDirectionOffloadingHandler,
                 streams: StreamPlatform | None = None):
        for handler, want in ((gpu_to_cpu, Direction.GPU_TO_CPU), (cpu_to_gpu, Direction.CPU_TO_GPU)):
            if handler.direction is not want:
                raise HandlerError(f"expected a {want.label} handler, got "
                                   f"{handler.direction.label}")
        self.gpu_to_cpu_handler = gpu_to_cpu
        self.cpu_to_gpu_handler = cpu_to_gpu
        self._streams = streams

    @classmethod
    def build(cls, planner: TransferPlanner, backends: Mapping[Direction, CopyBackend],
              streams: StreamPlatform, stats: RankStats | None = None,
              fence: SlotFence | None = None) -> CpuGpuOffloadingHandlers:
        store, load = (SingleDirectionOffloadingHandler(planner, d, backends[d], streams, stats,
                                                        fence)
                       for d in (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU))
        return cls(store, load, streams)

    @property
    def streams(self) -> StreamPlatform | None:
        """The platform the handlers order on (its ``current_stream()`` is the compute
        stream every transfer waits for); ``None`` after ``shutdown``."""
        return self._streams

    def handler(self, direction: Direction) -> SingleDirectionOffloadingHandler:
        return self.gpu_to_cpu_handler if direction is Direction.GPU_TO_CPU \
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
