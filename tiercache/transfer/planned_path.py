"""The planned path: a transfer planned, fenced, marked and submitted from Python.

For every backend (``ce``, ``kernel``, ``cpu``; ``staged`` without its native loop, or
over a geometry its loop was not built for), on the caller's thread, in this order:

1. the planner validates and plans the transfer once, in the form the backend declared
   (``CopyBackend.plan_form``; a refusal is the planner's ``SpecError``, nothing is
   enqueued). Page plans are written into pooled ``PlanBuffers`` (one per transfer in
   flight: fresh arrays of a large plan cost page faults several times the planning),
   given back by ``release`` once the transfer was reported;
2. the fence (``tiercache.transfer.fence``) checks the CPU spec's region and slots;
3. the compute stream's work so far is marked (``StreamPlatform.mark_current``);
4. the backend gets the plan and the ``Ordering`` (the stream, the mark and the previous
   transfer's end to wait for, its own start and end events) in one ``submit``.

A fenced transfer, or one whose mark failed, is submitted as ordering only (no plan: the
backend records the waits and the events, so it keeps its place); the contract is
``tiercache.transfer.path.TransferPath``'s.
"""

from __future__ import annotations

import logging
from typing import cast

from tiercache.backends.base import CopyBackend, Ordering
from tiercache.device.events import Event, Stream
from tiercache.device.streams import StreamPlatform
from tiercache.errors import BackendError, SpecError
from tiercache.native.codes import Outcome, TransferCode
from tiercache.planning.planner import PlanBuffers, TransferPlanner
from tiercache.planning.plans import PlanForm
from tiercache.specs import Direction, TransferSpec
from tiercache.transfer.fence import SlotFence
from tiercache.transfer.path import TransferPath, order_only

log = logging.getLogger(__name__)


class PlannedPath(TransferPath):
    """``backend``'s transfers in ``direction``, planned by ``planner`` and checked
    against ``fence`` (None: unfenced); the mark on ``streams``' compute stream."""

    def __init__(self, direction: Direction, backend: CopyBackend, planner: TransferPlanner,
                 streams: StreamPlatform, fence: SlotFence | None = None):
        self.direction = direction
        self.backend = backend
        self.kind = backend.kind
        self._planner = planner
        self._streams = streams
        self._fence = fence
        self._buffers: list[PlanBuffers] = []

    def transfer(self, job_id: int, transfer: TransferSpec, stream: Stream, mark: Event,
                 previous: Event | None, start: Event, end: Event) -> Outcome:
        direction, form = self.direction, self.backend.plan_form
        buffers = None  # block plans are O(blocks) arrays of their own; page plans reuse these
        if form is not PlanForm.BLOCKS:
            buffers = self._buffers.pop() if self._buffers else PlanBuffers()
        try:
            plan = self._planner.plan_as(form, direction, transfer, buffers)
        except SpecError:
            if buffers is not None:
                self._buffers.append(buffers)
            raise
        code = TransferCode.QUEUED
        if self._fence is not None:
            refusal = self._fence.refusal(direction, direction.gpu_cpu(*transfer)[1])
            if refusal is not None:
                log.error("%s job %d refused, nothing copied: %s", direction.label, job_id,
                          refusal)
                code = TransferCode.FENCED
        if not code:
            try:  # the compute stream's work so far: the transfer starts after it
                self._streams.mark_current(mark)
            except BackendError as e:
                self._log_refusal(job_id, plan.num_bytes, e)
                code = TransferCode.MARK_FAILED
        ordering = Ordering(stream, (None if code else mark, previous), start, end)
        try:  # the backend records ``end`` in order whatever happens (later transfers wait on it)
            token = self.backend.submit(None if code or plan.empty else plan, ordering)
        except BackendError as e:
            self._log_refusal(job_id, plan.num_bytes, e)
            order_only(stream, previous, end, f"{direction.label} job {job_id}")
            return Outcome(TransferCode.SUBMIT_FAILED, 0, plan.num_bytes, None, (None, buffers))
        return Outcome(code, 0, plan.num_bytes, token.ticket, (token, buffers))

    def release(self, held: object) -> None:
        _, buffers = cast("tuple[object, PlanBuffers | None]", held)
        if buffers is not None:
            self._buffers.append(buffers)

    def close(self) -> None:
        self.backend.close()
        self._buffers.clear()

    def _log_refusal(self, job_id: int, num_bytes: int, error: BaseException) -> None:
        log.error("%s job %d: the %s backend could not submit %d bytes: %s",
                  self.direction.label, job_id, self.kind.label, num_bytes, error)
