"""The copy-backend contract: what byte-moving code guarantees to the transfer paths.

A backend only moves bytes: it gets a plan the planner already validated, in the form it
declared (``plan_form``: page descriptors or block pairs), with the direction the caller
decided, and where on which stream to put it (``Ordering``). It never sees specs, and
never plans: what it needs of the rank's pages comes with its ``BackendContext`` as a
frozen ``TransferGeometry``.

A backend that issues block plans on a native chunk loop built for the rank's geometry
lends that loop (``transfer_loop``) to the native transfer path
(``tiercache.transfer.native_path``), which hands it whole transfers in one call each:
doing validation, fence, mark and issue in one native call is what makes a transfer cost
the engine's thread tens of microseconds instead of hundreds (docs/benchmarks.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from tiercache.backend_kind import BackendKind
from tiercache.device.events import Event, Stream, Ticket
from tiercache.device.streams import StreamPlatform
from tiercache.errors import BackendError
from tiercache.pages import PageArray
from tiercache.planning.geometry import TransferGeometry
from tiercache.planning.plans import BlockPlan, CopyPlan, PlanForm
from tiercache.specs import Direction

if TYPE_CHECKING:  # the region's page-locking loads this module, and no native code
    from tiercache.native.chunk_loop import ChunkLoop

Plan = CopyPlan | BlockPlan
_P = TypeVar("_P", bound=Plan)  # the plans a StreamBackend's copy takes


@dataclass(frozen=True)
class BackendContext:
    """What a backend factory is given: one direction of one rank.

    ``gpu_pages[t]`` / ``cpu_pages[t]`` describe tensor t on each side (addresses,
    strides, un-padded page bytes; ``cpu_pages[t].pages_per_block`` is the
    block_size_factor and ``cpu_pages[t].block_stride_bytes`` the region's row stride).
    ``device`` is the caches' torch device; ``host_registered`` says whether the region
    slice is page-locked and registered with the driver; ``streams`` is the platform the
    handler uses (for calibration runs at attach); ``geometry`` is the rank's
    ``TransferGeometry`` over the same pages (None: a backend built without one, for a
    calibration or a benchmark, takes page plans): a backend that takes block plans
    builds its tables from it; ``zero_copy_bytes`` bounds the transfers ``staged`` moves
    zero-copy (the config's ``transfer.zero_copy_bytes``; honoured only where
    ``host_registered``).
    """

    direction: Direction
    gpu_pages: tuple[PageArray, ...]
    cpu_pages: tuple[PageArray, ...]
    device: object
    host_registered: bool
    streams: StreamPlatform
    geometry: TransferGeometry | None = None
    zero_copy_bytes: int = 0

    def __post_init__(self) -> None:
        if len(self.gpu_pages) != len(self.cpu_pages) or not self.gpu_pages:
            raise BackendError(f"BackendContext: {len(self.gpu_pages)} GPU and "
                               f"{len(self.cpu_pages)} CPU page arrays; need as many, >= 1")
        if self.geometry is not None and (tuple(self.gpu_pages) != self.geometry.gpu_pages
                                          or tuple(self.cpu_pages) != self.geometry.cpu_pages):
            raise BackendError("BackendContext: the geometry is of other pages than the "
                               "context's; give the rank's geometry over the same pages")

    @property
    def zero_copy_limit(self) -> int:
        """The zero-copy bound a backend may use: ``zero_copy_bytes`` where the host rows
        are registered, else 0 (the kernel would dereference unmapped host addresses, and
        the CUDA context would be lost)."""
        return self.zero_copy_bytes if self.host_registered else 0


@dataclass(frozen=True)
class Ordering:
    """Where a transfer goes: on ``stream``, after the events ``after`` (in order; the
    handler passes the compute stream's mark and the previous transfer's end, None
    entries skipped), between the records of ``start`` and ``end``. Without events (a
    benchmark, a calibration) the copies are ordered by ``stream`` alone. The stream and
    events are the platform's (``tiercache.device``): a ``torch.cuda.Stream`` and
    ``DriverEvent`` for the GPU kinds (never the legacy default stream), a ``HostStream``
    and ``HostEvent`` for ``cpu``."""

    stream: Stream
    after: tuple[Event | None, ...] = ()
    start: Event | None = None
    end: Event | None = None


@dataclass(frozen=True, eq=False)
class Submission:
    """What ``submit`` returns: everything the device still reads after the call
    (pointer arrays, descriptor tables, staging layouts) in ``keep``, alive while the
    caller holds this, until the stream has passed the transfer; and the ``ticket`` when
    a thread of the backend's still issues it (None: issued before ``submit`` returned)."""

    keep: tuple[object, ...] = ()
    ticket: Ticket | None = None

    def wait_issued(self) -> int:
        """Block until the transfer was issued; its status (0: fine, else the CUresult
        the issuing thread failed with). Work enqueued on the stream after this call is
        ordered after the transfer."""
        if self.ticket is None:
            return 0
        self.ticket.wait()
        return self.ticket.status


class CopyBackend(ABC):
    """Moves the bytes of a plan, ordered on a stream.

    Guarantees of ``submit(plan, ordering)``: the transfer is put on ``ordering.stream``
    after the ``after`` events and after work already enqueued there, between the records
    of ``start`` and ``end``, and finishes before work enqueued there later; the call
    returns without waiting for the device. ``plan`` is of the backend's ``plan_form``,
    or None (an empty or refused transfer: only the events). ``end`` is recorded in
    order whatever happens, so later transfers can wait on it; a failure to submit
    raises ``BackendError`` after that, leaving nothing enqueued it cannot account for.
    Transfers of one backend are issued in submission order. The ``Submission`` must be
    held until the stream has passed the transfer (and, with a ticket, until it was
    issued).

    ``close()`` releases buffers; it is called once, after every transfer has finished.
    ``kind`` is what the stats block records for the handler using this backend.
    """

    kind: BackendKind
    plan_form: PlanForm = PlanForm.PAGES

    @abstractmethod
    def submit(self, plan: Plan | None, ordering: Ordering) -> Submission:
        """Put ``plan``'s copies on the stream as ``ordering`` says (class docstring)."""

    def close(self) -> None:
        """Release buffers; called once after every transfer has finished."""

    def transfer_loop(self, geometry: TransferGeometry) -> ChunkLoop | None:
        """The native chunk loop that takes whole transfers of ``geometry`` in one call each
        (``ChunkLoop.transfer``): this backend's, when it was built for that geometry and
        issues its block plans on it; None (the default) when it has none. The native
        transfer path sends every transfer through it instead of plan + ``submit``."""
        return None


class StreamBackend(CopyBackend, Generic[_P]):
    """A backend that enqueues on the calling thread: ``submit`` makes the stream wait for
    the ``after`` events, records ``start``, ``copy``-s the plan and records ``end`` (in a
    ``finally``: always). A plan of the wrong form is a ``BackendError``. ``_P``: the plans
    ``copy`` takes (those of ``plan_form``)."""

    def submit(self, plan: Plan | None, ordering: Ordering) -> Submission:
        stream = ordering.stream
        try:
            for event in ordering.after:
                if event is not None:
                    stream.wait_event(event)
            if ordering.start is not None:
                ordering.start.record(stream)
            if plan is None:
                return Submission()
            if not isinstance(plan, CopyPlan if self.plan_form is PlanForm.PAGES else BlockPlan):
                raise BackendError(f"the {self.kind.label} backend takes "
                                   f"{self.plan_form.value} plans, got {type(plan).__name__}")
            return Submission(self.copy(cast(_P, plan), stream))  # of plan_form: checked above
        finally:
            if ordering.end is not None:
                ordering.end.record(stream)

    @abstractmethod
    def copy(self, plan: _P, stream: Stream) -> tuple[object, ...]:
        """Enqueue the copies of ``plan`` (of ``plan_form``, non-empty) on ``stream``;
        return what the device still reads (the ``Submission``'s ``keep``)."""
