"""A stream platform over the stand-in GPU of ``loop_fakes`` (tests/transfer): what a
handler needs to drive the native transfer path on the CPU.

Streams and events are handles the stand-in names in its trace (``S1``, ``S2``, ...;
``event1``, ``event2``, ... for the handler's start and end events, two per transfer;
``mark1``, ... for its compute marks). The stand-in does the copies while the loop issues
them, so an event whose transfer was issued has passed: ``query`` is True and
``synchronize`` returns (the handler trusts a transfer's events only once its ticket says
issued). Events are
``DriverEvent``\\ s with their handle, as ``CudaStreams`` gives, so the native path reads
them the same way; no driver is behind them.
"""

from __future__ import annotations

import itertools

from loop_fakes import COMPUTE, FakeGpu
from tiercache.device.events import DriverEvent
from tiercache.device.streams import StreamPlatform

FIRST_HANDLE = 0x1000


class FakeStream:
    """A stream the stand-in knows by its handle (``cuda_stream``, as torch's streams);
    a wait from Python goes to the stand-in as the driver's would."""

    def __init__(self, handle: int, fake: FakeGpu):
        self.cuda_stream, self._fake = handle, fake

    def wait_event(self, event: FakeEvent) -> None:
        assert self._fake.wait(self.cuda_stream, event.handle, 0) == 0


class FakeEvent(DriverEvent):
    """A handle the stand-in knows; issued work has run (it copies while issuing)."""

    def __init__(self, handle: int, fake: FakeGpu):  # no driver: nothing is created
        self.handle, self._fake = handle, fake

    def record(self, stream: FakeStream) -> None:
        assert self._fake.record(self.handle, stream.cuda_stream) == 0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: DriverEvent) -> float:
        return 0.5  # ms: what the stand-in's transfers "take"


class FakeStreams(StreamPlatform):
    """New streams and events named in ``fake``'s trace; the compute stream is ``C``."""

    def __init__(self, fake: FakeGpu):
        self._fake = fake
        self._handles = itertools.count(FIRST_HANDLE)
        self._numbers: dict[str, itertools.count] = {}
        self.marks: list[FakeEvent] = []  # every compute mark made, in order

    def _new(self, kind: str) -> int:
        handle = next(self._handles)
        number = next(self._numbers.setdefault(kind, itertools.count(1)))
        self._fake.names[handle] = f"{kind}{number}"
        return handle

    def new_stream(self) -> FakeStream:
        return FakeStream(self._new("S"), self._fake)

    def new_timing_event(self) -> FakeEvent:
        return FakeEvent(self._new("event"), self._fake)

    def new_marker(self) -> FakeEvent:
        mark = FakeEvent(self._new("mark"), self._fake)
        self.marks.append(mark)
        return mark

    def current_stream(self) -> FakeStream:
        return FakeStream(COMPUTE, self._fake)

    def current_stream_getter(self):
        return lambda: COMPUTE
