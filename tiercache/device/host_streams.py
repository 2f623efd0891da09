"""Host-thread streams and events that behave like torch.cuda's, for the ``cpu`` backend.

Each ``HostStream`` owns one thread that runs its queue in order: host functions
(``launch``), waits on events (``wait_event``) and event records. An event remembers
how many times it was recorded; a wait enqueued after the k-th record waits for that
record to execute (CUDA semantics: a wait on a never-recorded event does not block).
A host function that raises makes the next event recorded on its stream fail: that
event's ``query``/``synchronize`` raise ``BackendError`` (as torch raises on a CUDA
error), and the stream goes on with later work. All streams and events of one
``HostStreams`` share a condition variable, so a wait wakes when any record lands.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from tiercache.device.streams import StreamPlatform
from tiercache.errors import BackendError

log = logging.getLogger(__name__)
_stream_numbers = itertools.count()


class HostEvent:
    """A marker in a ``HostStream`` with a host-clock timestamp."""

    def __init__(self, cond: threading.Condition):
        self._cond = cond
        self._recorded = 0  # records enqueued
        self._done = 0  # records executed
        self._time_ns = 0
        self._error: BaseException | None = None

    def record(self, stream: HostStream) -> None:
        if not isinstance(stream, HostStream) or stream._cond is not self._cond:
            raise BackendError(f"HostEvent.record needs a HostStream of the same HostStreams, "
                               f"got {stream!r}")
        with self._cond:
            self._recorded += 1
            generation = self._recorded
        stream._put(functools.partial(stream._complete, self, generation))

    def _set_complete(self, generation: int, error: BaseException | None) -> None:
        with self._cond:
            self._time_ns = time.perf_counter_ns()
            self._error = error
            self._done = generation
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise BackendError(f"work on a host stream failed: {self._error!r}") from self._error

    def query(self) -> bool:
        with self._cond:
            if self._done < self._recorded:
                return False
        self._raise_if_failed()
        return True

    def synchronize(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done >= self._recorded)
        self._raise_if_failed()

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds between this event's and ``end_event``'s latest records."""
        for event in (self, end_event):
            if event._recorded == 0 or not event.query():
                raise BackendError("elapsed_time needs both events recorded and complete")
        return (end_event._time_ns - self._time_ns) / 1e6


class HostStream:
    """An in-order queue of host work run by its own thread."""

    def __init__(self, cond: threading.Condition):
        self._cond = cond
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tiercache-host-stream-{next(_stream_numbers)}")
        self._thread.start()

    def launch(self, fn: Callable[[], object]) -> None:
        """Enqueue ``fn`` to run after everything enqueued before it (its result is dropped)."""
        self._put(functools.partial(self._call, fn))

    def wait_event(self, event: HostEvent) -> None:
        if not isinstance(event, HostEvent) or event._cond is not self._cond:
            raise BackendError(f"HostStream.wait_event needs a HostEvent of the same HostStreams, "
                               f"got {event!r}")
        with self._cond:
            generation = event._recorded
        if generation:
            self._put(functools.partial(self._wait, event, generation))

    def wait_stream(self, stream: HostStream) -> None:
        marker = HostEvent(self._cond)
        marker.record(stream)
        self.wait_event(marker)

    def synchronize(self) -> None:
        marker = HostEvent(self._cond)
        marker.record(self)
        marker.synchronize()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    def _put(self, op: Callable[[], None]) -> None:
        if self._closed:
            raise BackendError(f"{self._thread.name} is closed")
        self._queue.put(op)

    def _run(self) -> None:
        while (op := self._queue.get()) is not None:
            op()

    # The ops below run on the stream's thread, in queue order.
    def _call(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as e:  # not swallowed: the next event recorded here raises it
            log.error("%s: host work failed: %r", self._thread.name, e)
            self._pending_error = self._pending_error or e

    def _wait(self, event: HostEvent, generation: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: event._done >= generation)

    def _complete(self, event: HostEvent, generation: int) -> None:
        error, self._pending_error = self._pending_error, None
        event._set_complete(generation, error)


class HostStreams(StreamPlatform):
    """The host platform: streams are threads, the compute stream is one more of them."""

    def __init__(self, device: Any = None) -> None:  # device: the host (kept for symmetry)
        self._cond = threading.Condition()
        self._streams: list[HostStream] = []
        self._compute = self.new_stream()

    def new_stream(self) -> HostStream:
        stream = HostStream(self._cond)
        self._streams.append(stream)
        return stream

    def new_timing_event(self) -> HostEvent:
        return HostEvent(self._cond)

    def current_stream(self) -> HostStream:
        return self._compute

    def close(self) -> None:
        while self._streams:
            self._streams.pop().close()
