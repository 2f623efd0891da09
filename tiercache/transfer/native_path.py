"""The native path: a whole transfer in one native call (``tc_transfer``).

Why: on the engine's thread a staged transfer used to be four steps of Python around
native calls (the planner's ``tc_validate``, the fence's numpy gather, the compute
stream's mark, the chunk loop's ``tc_submit``), and the Python between the calls cost
more than the calls. One call that keeps the GIL does the four in C
(``tiercache.native.transfer_call``) under the planned path's rules, in a fraction of
the host time (measured before and after in docs/benchmarks.md, "One native call per
transfer"). So this path adds no Python per transfer beyond reading the specs' id arrays
and the events' handles: no plan object, no fence gather, no per-transfer allocation.

The same rules, and where they live: the validation is the planner's (a refusal is
re-checked by the planner in numpy, so the ``SpecError`` says why); the fence is
``tiercache.transfer.fence``'s (checked in C over ``SlotFence.table``; a fenced transfer
is logged with the fence's own reason); the mark is recorded on the calling thread's
current stream of the rank's device (``compute``: what ``mark_current`` records on);
the issue is the backend's chunk loop (``CopyBackend.transfer_loop``), in order with the
loop's other jobs. The contract is ``tiercache.transfer.path.TransferPath``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tiercache.backends.base import CopyBackend
from tiercache.device.driver import stream_handle
from tiercache.device.events import Event, Stream, event_handle
from tiercache.errors import BackendError
from tiercache.native.chunk_loop import ChunkLoop
from tiercache.native.codes import Outcome, TransferCode
from tiercache.native.transfer_call import TransferChecks
from tiercache.planning.planner import TransferPlanner
from tiercache.specs import CPULoadStoreSpec, Direction, TransferSpec
from tiercache.transfer.fence import SlotFence
from tiercache.transfer.path import TransferPath, order_only

log = logging.getLogger(__name__)


class NativePath(TransferPath):
    """``backend``'s transfers in ``direction`` through ``loop`` (its
    ``transfer_loop(planner.geometry)``), validated against ``planner``'s bounds and
    checked against ``fence`` (None: unfenced); ``compute()`` answers the raw handle of
    the calling thread's compute stream."""

    native = True

    def __init__(self, direction: Direction, backend: CopyBackend, loop: ChunkLoop,
                 planner: TransferPlanner, compute: Callable[[], int],
                 fence: SlotFence | None = None):
        self.direction = direction
        self.backend = backend
        self.kind = backend.kind
        self._planner = planner
        self._fence = fence
        self._compute = compute
        self._call = loop.transfer
        self._issue_all = loop.wait  # blocks until every job queued so far was issued
        self._checks = TransferChecks(planner.validator(), planner.pair_bytes,
                                      None if fence is None else fence.table)

    def transfer(self, job_id: int, transfer: TransferSpec, stream: Stream, mark: Event,
                 previous: Event | None, start: Event, end: Event) -> Outcome:
        direction = self.direction
        gpu, cpu = self._planner.specs(direction, transfer)
        try:
            outcome = self._call(
                self._checks, direction, gpu.block_ids, gpu.group_sizes, gpu.block_indices,
                cpu.block_ids, cpu.slot_gens, cpu.region_id, stream=stream_handle(stream),
                compute=self._compute(), mark=event_handle(mark),
                prev_end=event_handle(previous), start_event=event_handle(start),
                end_event=event_handle(end))
        except BackendError as e:  # the loop took nothing (closing, out of memory)
            num_bytes = self._planner.bytes_of(gpu)
            what = f"{direction.label} job {job_id}"
            log.error("%s: the %s backend could not submit %d bytes: %s", what,
                      self.kind.label, num_bytes, e)
            self._issue_all()  # the previous transfer's end recorded, so the wait means it
            order_only(stream, previous, end, what)
            return Outcome(TransferCode.SUBMIT_FAILED, 0, num_bytes, None)
        if outcome.code:
            if outcome.ticket is None:  # refused by the validation: nothing enqueued
                self._planner.refuse(direction, transfer, outcome.code)
            self._log_not_copied(job_id, cpu, outcome)
        return outcome

    def _log_not_copied(self, job_id: int, cpu: CPULoadStoreSpec, outcome: Outcome) -> None:
        """Why a transfer the native call queued only its ordering for copied nothing."""
        label = self.direction.label
        if outcome.code == TransferCode.FENCED:
            refusal = self._fence.refusal(self.direction, cpu) if self._fence is not None else None
            log.error("%s job %d refused, nothing copied: %s", label, job_id,
                      refusal or "the fence refused its slots (since given back again)")
        else:
            log.error("%s job %d: the compute stream's mark could not be recorded (CUresult "
                      "%d); nothing copied", label, job_id, outcome.cu)

    def close(self) -> None:
        self.backend.close()
