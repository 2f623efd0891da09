"""What orders transfers on a stream: the ``Stream`` and ``Event`` interfaces the handlers
and backends speak (torch.cuda semantics), the ``Ticket`` of a transfer a thread still
issues, ``DriverEvent`` (the CUDA event with a raw handle that native code can record
from a thread of its own) and what torch raises when the device fails under it
(``TORCH_DEVICE_ERRORS``, re-raised as ``BackendError``)."""

from __future__ import annotations

from typing import Any, Protocol

from tiercache.device.driver import CudaDriver
from tiercache.errors import BackendError

# What torch and Triton raise when the device fails under them: torch.AcceleratorError
# (torch >= 2.8) or a bare RuntimeError (the older torch pyproject allows) for a CUDA
# error, torch.OutOfMemoryError, and RuntimeError from Triton's launcher: all
# RuntimeErrors, and no narrower class holds them. Caught only around the device layer's
# own torch and Triton calls (a backend's copy from Python, auto's calibration) and
# re-raised there as BackendError with the cause (errors.py's rule). Above that, work on a
# stream that failed is a BackendError (driver events, host streams and every backend raise
# it), which the transfer code turns into a failed transfer
# (``TransferResult(success=False)``), never an exception in the engine's step; any other
# exception there is a bug and propagates.
TORCH_DEVICE_ERRORS = (RuntimeError,)


class Event(Protocol):
    """A marker in a stream (torch.cuda.Event semantics, created with timing enabled)."""

    def record(self, stream: Any) -> None: ...  # marks the point after work enqueued so far

    def query(self) -> bool: ...  # True once the stream passed the latest record

    def synchronize(self) -> None: ...  # block the calling thread until query() is True

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds from self to end


class Stream(Protocol):
    """An in-order work queue (torch.cuda.Stream semantics)."""

    def wait_event(self, event: Any) -> None: ...  # later work starts after event's record

    def wait_stream(self, stream: Any) -> None: ...  # later work starts after stream's work


class Ticket(Protocol):
    """A transfer still being issued by a thread of its own (``staged``'s native chunk
    loop): its events mean nothing before ``issued()``."""

    def issued(self) -> bool: ...  # every call of the transfer was made

    def wait(self) -> None: ...  # block until issued()

    @property
    def status(self) -> int: ...  # once issued: 0, or the first failing CUresult


class DriverEvent:
    """A CUDA event behind the ``Event`` interface, with its raw ``handle``: the chunk loop
    records and waits on it from its own thread, which a torch event (created lazily,
    handle hidden) does not allow. Errors of work before it raise ``BackendError`` from
    ``query`` / ``synchronize``. ``timing=False``: a marker only (no ``elapsed_time``),
    which the driver records for less."""

    __slots__ = ("_driver", "handle")

    def __init__(self, driver: CudaDriver, timing: bool = True):
        self._driver = driver
        self.handle = driver.event_create(timing=timing)

    def record(self, stream: Any) -> None:
        self._driver.event_record(self.handle, int(stream.cuda_stream))

    def query(self) -> bool:
        return self._driver.event_done(self.handle)

    def wait(self, stream: Any) -> None:
        """Work enqueued on ``stream`` later waits for this event (what torch's
        ``Stream.wait_event`` calls)."""
        self._driver.stream_wait_event(int(stream.cuda_stream), self.handle)

    def synchronize(self) -> None:
        self._driver.event_synchronize(self.handle)

    def elapsed_time(self, end_event: DriverEvent) -> float:
        return self._driver.event_elapsed_ms(self.handle, end_event.handle)

    def destroy(self) -> None:
        if self.handle:
            self._driver.event_destroy(self.handle)
            self.handle = 0


def event_handle(event: Event | None) -> int:
    """The raw handle native code records or waits on (0: none); only a ``DriverEvent``
    (``CudaStreams``' events) has one, anything else is a ``BackendError``."""
    if event is None:
        return 0
    if not isinstance(event, DriverEvent):
        raise BackendError(f"native code orders with DriverEvents (CudaStreams' events), "
                           f"got {type(event).__name__}")
    return event.handle
