"""The ``cpu`` backend: both sides in host memory (CPU-only hosts, CI).

Each plan runs as one host function on the transfer's ``HostStream``: a memmove per
descriptor (``ctypes.memmove`` releases the GIL for the call), so the handler's
async, stream-ordered contract holds exactly as on a GPU.
"""

from __future__ import annotations

import ctypes

from tiercache.backends.base import BackendContext, CopyBackend, CopyPlan, Submitted
from tiercache.backends.host_streams import HostStream
from tiercache.backends.kind import BackendKind
from tiercache.errors import BackendError


def _execute(plan: CopyPlan) -> None:
    memmove = ctypes.memmove
    for src, dst, size in zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()):
        memmove(dst, src, size)


class CpuCopyBackend(CopyBackend):
    """memmove on a host thread; the keep-alive token holds the plan."""

    kind = BackendKind.CPU

    def copy_async(self, plan: CopyPlan, stream: HostStream) -> Submitted:
        if not isinstance(stream, HostStream):
            raise BackendError(f"the cpu backend runs on a HostStream, got {type(stream).__name__}")
        stream.launch(lambda: _execute(plan))
        return Submitted((plan,))


def create(context: BackendContext) -> CpuCopyBackend:
    return CpuCopyBackend()
