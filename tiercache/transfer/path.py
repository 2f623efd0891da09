"""The transfer contract: how a handler's transfers go from specs onto the device.

The handler (``tiercache.transfer.handlers``) only orders, tracks and reports: it gives
each transfer a pooled stream, its start and end events, a marker for the compute stream
and the previous transfer's end, hands all of it to its ``TransferPath`` in one call, and
reports the ``Outcome`` in submission order. What a transfer *is* (validation, fence,
plan, mark, issue) is the path's. Two paths keep the contract:

* ``native_path.NativePath``: the whole transfer in one native call (``tc_transfer`` on a
  ``staged`` backend's chunk loop): validation, fence, mark and queueing in C, tens of
  microseconds of the engine's thread (docs/benchmarks.md, "One native call per
  transfer");
* ``planned_path.PlannedPath``: plan -> fence -> mark -> submit in Python, for every
  backend (``ce``, ``kernel``, ``cpu``, ``staged`` without its loop).

``wiring.path_for`` picks one per handler. A path for another kind of copy (host to host,
a backend of its own) is a third implementation of the same contract.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from tiercache.backend_kind import BackendKind
from tiercache.device.events import Event, Stream
from tiercache.errors import BackendError
from tiercache.native.codes import Outcome
from tiercache.specs import Direction, TransferSpec

log = logging.getLogger(__name__)


class TransferPath(ABC):
    """One direction of one rank: whole transfers, from specs to the device.

    ``transfer(job_id, transfer, stream, mark, previous, start, end)`` guarantees:

    * **Refused before anything is enqueued.** ``transfer`` = ``(src_spec, dst_spec)``
      is checked against the rank in ``direction``: a pair of other types (never
      re-routed), or ids the rank's geometry does not allow (group count, slot count, a
      block out of range, a destination block twice), raises ``SpecError`` naming why,
      and nothing is enqueued, not the mark and not the events: the caller may use the
      stream and the events for another transfer.
    * **Otherwise exactly one ``Outcome``** (``tiercache.native.codes``) with the bytes
      the transfer moves, whose ``code`` is ``QUEUED`` (0): the compute stream's work so
      far is marked (``mark`` recorded on the calling thread's current stream of the
      rank's device) and the copies are put on ``stream`` after ``mark`` and
      ``previous``, between the records of ``start`` and ``end``; or a failure that
      copies nothing and keeps the transfer's place in the order (``end`` is recorded
      after ``previous``, so later transfers still wait for the earlier ones): ``FENCED``
      (the CPU spec is for another region, or names a slot handed to another block since:
      ``tiercache.transfer.fence``; the mark is not recorded), ``MARK_FAILED`` (``cu``:
      the CUresult), ``SUBMIT_FAILED`` (the backend could not take the job). The path
      logs why; it never raises for these.
    * **FIFO.** Transfers are issued in call order; each starts after ``previous``.
    * **Tickets.** When a thread of the path's own still issues the transfer,
      ``Outcome.ticket`` says when it has: the transfer's events mean nothing before
      ``ticket.issued()``, and ``ticket.status`` is then 0 or the CUresult that thread
      failed with. None: everything was enqueued before ``transfer`` returned.
    * ``Outcome.held`` is what the device may still read, held by the caller until the
      stream passed the transfer; then given back with ``release`` (None: nothing).

    ``kind`` is what the stats block records for the handler; ``native`` says whether a
    transfer is one native call. Driven by one thread; ``close`` once, after every
    transfer finished.
    """

    direction: Direction
    kind: BackendKind
    native: bool = False

    @abstractmethod
    def transfer(self, job_id: int, transfer: TransferSpec, stream: Stream, mark: Event,
                 previous: Event | None, start: Event, end: Event) -> Outcome:
        """One transfer, as the class docstring says (``job_id`` names it in the log)."""

    def release(self, held: object) -> None:
        """Take back what a finished transfer's ``Outcome.held`` kept alive."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend; called once, after every transfer finished."""


def order_only(stream: Stream, previous: Event | None, end: Event, what: str) -> None:
    """``end`` recorded on ``stream`` after ``previous``: the place in the order of a
    transfer that copies nothing (``what`` names it in the log should even that fail)."""
    try:
        if previous is not None:
            stream.wait_event(previous)
        end.record(stream)
    except BackendError as e:
        log.error("%s: its end could not be recorded in order either: %s", what, e)
