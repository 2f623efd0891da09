"""Stream platforms: where a handler gets the streams and events that order its transfers.

The handlers speak the subset of torch.cuda's stream/event API listed in
``tiercache.device.events`` (``Stream``, ``Event``); ``CudaStreams`` hands out torch.cuda
streams and driver events, ``tiercache.device.host_streams.HostStreams`` host-thread
look-alikes for the ``cpu`` backend. The handler code is the same for both.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from tiercache.device.driver import CudaDriver
from tiercache.device.events import DriverEvent, Event, Stream, event_handle


def current_stream_handle(torch: Any) -> Callable[[int], int]:
    """``handle(device_index)``: the calling thread's current stream of that device as a raw
    ``CUstream``, without building a torch Stream object (a transfer marks the compute
    stream every time); CUDA builds of torch have the getter, others go through a Stream."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw or (lambda index: torch.cuda.current_stream(index).cuda_stream)


class StreamPlatform(ABC):
    """Creates the streams and events a handler orders its transfers with.

    ``current_stream()`` is the compute stream the model writes KV on: every transfer
    waits for the work enqueued there before it starts. Failures of work on a stream
    surface as exceptions from ``Event.query``/``Event.synchronize``.
    """

    @abstractmethod
    def new_stream(self) -> Stream:
        """A fresh stream (the handler pools them: one per transfer in flight)."""

    @abstractmethod
    def new_timing_event(self) -> Event:
        """A fresh event with timing enabled."""

    def new_marker(self) -> Event:
        """A fresh event that only marks (never asked for ``elapsed_time``): the compute
        stream's mark of a transfer. The same as a timing event unless the platform has a
        cheaper kind."""
        return self.new_timing_event()

    @abstractmethod
    def current_stream(self) -> Stream:
        """The compute stream of the calling thread."""

    def mark_current(self, event: Event) -> None:
        """Record ``event`` on the calling thread's compute stream: work that waits for it
        starts after everything enqueued there so far."""
        event.record(self.current_stream())

    def current_stream_getter(self) -> Callable[[], int] | None:
        """A function answering the raw handle of the calling thread's compute stream (the
        stream ``mark_current`` records on), for native code that records the mark
        itself; None where streams have no raw handles (host streams)."""
        return None

    def close(self) -> None:
        """Release what the platform created; called after every transfer has finished."""


class CudaStreams(StreamPlatform):
    """torch.cuda streams on one device, and driver events with raw handles
    (``DriverEvent``: a backend that issues on a thread of its own records them there)."""

    def __init__(self, device: Any):
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self._index = torch.cuda.current_device() if self.device.index is None \
            else int(self.device.index)
        self._driver = CudaDriver()
        self._events: list[DriverEvent] = []
        self._current_handle = current_stream_handle(torch)

    def new_stream(self) -> Stream:
        return self._torch.cuda.Stream(device=self.device)

    def new_timing_event(self) -> Event:
        return self._event(timing=True)

    def _event(self, timing: bool) -> DriverEvent:
        if not self._driver.has_current_context():
            self._torch.cuda.set_device(self.device)  # the primary context, current
        event = DriverEvent(self._driver, timing)
        self._events.append(event)
        return event

    def new_marker(self) -> Event:
        """A driver event with timing disabled (recorded once per transfer on the
        engine's thread: the cheaper record)."""
        return self._event(timing=False)

    def mark_current(self, event: Event) -> None:
        self._driver.event_record(event_handle(event), self._current_handle(self._index))

    def current_stream_getter(self) -> Callable[[], int]:
        return functools.partial(self._current_handle, self._index)  # no Python frame a call

    def close(self) -> None:
        for event in self._events:
            event.destroy()
        self._events.clear()

    def current_stream(self) -> Stream:
        return self._torch.cuda.current_stream(self.device)
