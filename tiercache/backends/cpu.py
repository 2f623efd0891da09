"""The ``cpu`` backend: both sides in host memory (CPU-only hosts, CI).

Each plan runs as one host function on the transfer's ``HostStream``: a memmove per
descriptor (``ctypes.memmove`` releases the GIL for the call), so the backend
contract (stream order, events) holds exactly as on a GPU.
"""

from __future__ import annotations

import ctypes

from tiercache.backends.base import BackendContext, StreamBackend
from tiercache.backend_kind import BackendKind
from tiercache.device.events import Stream
from tiercache.device.host_streams import HostStream
from tiercache.errors import BackendError
from tiercache.planning.plans import CopyPlan


def _execute(plan: CopyPlan) -> None:
    memmove = ctypes.memmove
    for src, dst, size in zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()):
        memmove(dst, src, size)


class CpuCopyBackend(StreamBackend[CopyPlan]):
    """memmove on a host thread; the submission holds the plan."""

    kind = BackendKind.CPU

    def copy(self, plan: CopyPlan, stream: Stream) -> tuple[object, ...]:
        if not isinstance(stream, HostStream):
            raise BackendError(f"the cpu backend runs on a HostStream, got {type(stream).__name__}")
        stream.launch(lambda: _execute(plan))
        return (plan,)


def create(context: BackendContext) -> CpuCopyBackend:
    return CpuCopyBackend()
