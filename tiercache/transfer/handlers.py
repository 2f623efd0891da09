"""Single-direction transfer handlers: plan, order on pooled streams, copy, report.

Contract of ``SingleDirectionOffloadingHandler`` (one per direction, driven by one
thread):

* ``transfer_async(job_id, (src_spec, dst_spec))`` plans first, in the handler's own
  direction (a pair that moves the other way is a ``SpecError`` naming the given types,
  never re-routed): a bad spec raises ``SpecError`` and nothing is enqueued; after
  ``shutdown()`` it raises ``HandlerClosedError``. Otherwise the transfer goes on a
  stream of its own that waits for the compute stream (a store must not read KV still
  being written; a load must not be overwritten by compute work queued before it) and
  for the previous transfer of this handler (FIFO). Returns True once the transfer is
  accepted; exactly one ``TransferResult`` for the job follows (``success=False`` when the
  backend refused the copies or the device failed them).
* ``get_finished()`` returns finished transfers in submission order (a later transfer is
  never reported before an earlier one), each with its bytes and stream-timed seconds;
  a backend or device failure is ``success=False``, never an exception.
* ``wait(job_ids)`` blocks until those jobs finished (ids not in flight are ignored);
  their results still come from ``get_finished()``.
* ``shutdown()`` waits for every transfer, returns their results and releases the backend.

Every finished transfer is accounted in the optional ``RankStats`` exactly once.

The caller's thread does only what can fail on its input: it validates the transfer at
block level (``TransferPlanner.block_plan``: O(blocks)), marks the compute stream with an
event, and queues the transfer. A submit thread per handler then, in submission order,
orders the transfer's stream after that mark and after the previous transfer, expands
pages where the backend takes pages, and drives the backend (layouts, kernel launches,
DMA batches: O(chunks) driver calls, most with the GIL released). Why: an engine calls
``transfer_async`` on its step's critical path, and the driver calls of a 512 MiB
transfer hold a thread for about a millisecond whatever the layout (docs/benchmarks.md,
"Host path"); the caller now pays tens of microseconds. A transfer is never reported done
before the submit thread has enqueued it (a never-recorded event would look complete).

``CpuGpuOffloadingHandlers.transfer_async`` is the generic entry: it decides the
direction once (``Direction.of``) and hands the transfer to that direction's handler.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tiercache.backends.base import BlockPlan, CopyBackend, Submitted
from tiercache.backends.streams import Event, Stream, StreamPlatform
from tiercache.errors import BackendError, HandlerClosedError, HandlerError, SpecError
from tiercache.region.stats import RankStats
from tiercache.specs import Direction, TransferSpec
from tiercache.transfer.planner import PlanBuffers, TransferPlanner

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


@dataclass(eq=False)
class _Transfer:
    job_id: int
    plan: BlockPlan
    stream: Stream
    compute_mark: Event  # the compute stream's state when transfer_async was called
    start_event: Event
    end_event: Event
    buffers: PlanBuffers  # page arrays, for backends that take pages: reused when finished
    submitted: bool = False  # the backend accepted the copies (set by the submit thread)
    keep_alive: Submitted | None = field(default=None, repr=False)  # the backend's token
    failed_on_device: bool = False
    enqueued: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def num_bytes(self) -> int:
        return self.plan.num_bytes


class SingleDirectionOffloadingHandler:
    """Moves blocks in one direction; see the module docstring for the contract."""

    def __init__(self, planner: TransferPlanner, direction: Direction, backend: CopyBackend,
                 streams: StreamPlatform, stats: RankStats | None = None):
        self.planner = planner
        self.direction = direction
        self.backend = backend
        self._streams = streams
        self._stats = stats
        self._transfers: deque[_Transfer] = deque()
        self._by_job: dict[int, _Transfer] = {}
        self._stream_pool: list[Stream] = []
        self._event_pool: list[Event] = []
        self._buffer_pool: list[PlanBuffers] = []
        self._closed = False
        self._queue: queue.SimpleQueue[_Transfer | None] = queue.SimpleQueue()
        self._submitter: threading.Thread | None = None
        self._last_end: Event | None = None  # the submit thread's previous transfer

    # ---------------------------------------------------------------- submit
    def transfer_async(self, job_id: int, transfer: TransferSpec) -> bool:
        if self._closed:
            raise HandlerClosedError(f"{self.direction.label} handler is shut down; job {job_id} "
                                     "refused")
        if job_id in self._by_job:
            raise SpecError(f"job id {job_id} is already in flight on the "
                            f"{self.direction.label} handler; job ids must be unique")
        plan = self.planner.block_plan(self.direction, transfer)  # raises SpecError
        stream = self._stream_pool.pop() if self._stream_pool else self._streams.new_stream()
        mark, start, end = (self._event_pool.pop() if self._event_pool
                            else self._streams.new_timing_event() for _ in range(3))
        mark.record(self._streams.current_stream())
        buffers = self._buffer_pool.pop() if self._buffer_pool else PlanBuffers()
        transfer_ = _Transfer(job_id, plan, stream, mark, start, end, buffers)
        self._transfers.append(transfer_)
        self._by_job[job_id] = transfer_
        if self._submitter is None:
            self._submitter = threading.Thread(
                target=self._submit_loop, daemon=True,
                name=f"tiercache-{self.direction.label}-submit")
            self._submitter.start()
        self._queue.put(transfer_)
        return True

    def _submit_loop(self) -> None:
        self._streams.enter_thread()
        while (transfer := self._queue.get()) is not None:
            transfer.submitted, transfer.keep_alive = self._enqueue(transfer)
            transfer.enqueued.set()

    def _enqueue(self, t: _Transfer) -> tuple[bool, Submitted | None]:
        """On the submit thread, in submission order."""
        try:
            t.stream.wait_event(t.compute_mark)
            if self._last_end is not None:
                t.stream.wait_event(self._last_end)
            t.start_event.record(t.stream)
            if not t.plan.num_pairs:
                return True, None
            plan = t.plan if self.backend.takes_blocks else \
                self.planner.expand(t.plan, out=t.buffers)
            return True, self.backend.submit_plan(plan, t.stream)
        except _DEVICE_ERRORS as e:
            log.error("%s job %d: the %s backend could not submit %d bytes: %s",
                      self.direction.label, t.job_id, self.backend.kind.label, t.num_bytes, e)
            return False, None
        except BaseException as e:  # a bug, not a device failure: the job fails loudly
            log.exception("%s job %d: submitting failed: %r", self.direction.label, t.job_id, e)
            return False, None
        finally:
            t.end_event.record(t.stream)  # later transfers order after this one whatever happened
            self._last_end = t.end_event

    # ---------------------------------------------------------------- complete
    def _is_done(self, transfer: _Transfer) -> bool:
        if not transfer.enqueued.is_set():
            return False
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
        self._event_pool += (transfer.compute_mark, transfer.start_event)
        if transfer.end_event is not self._last_end:  # the next submission still waits on it
            self._event_pool.append(transfer.end_event)
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
        transfer.enqueued.wait()
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
            if self._submitter is not None:
                self._queue.put(None)
                self._submitter.join()
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
              streams: StreamPlatform, stats: RankStats | None = None) -> CpuGpuOffloadingHandlers:
        g2c, c2g = (SingleDirectionOffloadingHandler(planner, d, backends[d], streams, stats)
                    for d in (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU))
        return cls(g2c, c2g, streams)

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
