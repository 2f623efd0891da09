"""Which transfer path each handler gets, and the handlers of a rank built over them.

``path_for`` decides once per handler, at attach: the native path when the backend lends
a chunk loop built for the planner's geometry (``CopyBackend.transfer_loop``: ``staged``,
or ``auto`` that chose it), the planner validates natively (``native_validation``) and
the stream platform can name the compute stream's raw handle (``CudaStreams``); the
planned path otherwise. Both keep one contract (``tiercache.transfer.path``), so the
handlers never know which they have.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiercache.backends.base import CopyBackend
from tiercache.device.streams import StreamPlatform
from tiercache.planning.planner import TransferPlanner
from tiercache.region.stats import RankStats
from tiercache.specs import Direction
from tiercache.transfer.fence import SlotFence
from tiercache.transfer.handlers import CpuGpuOffloadingHandlers
from tiercache.transfer.native_path import NativePath
from tiercache.transfer.path import TransferPath
from tiercache.transfer.planned_path import PlannedPath


def path_for(direction: Direction, backend: CopyBackend, planner: TransferPlanner,
             streams: StreamPlatform, fence: SlotFence | None = None) -> TransferPath:
    """The path ``backend``'s transfers in ``direction`` take (module docstring)."""
    loop = backend.transfer_loop(planner.geometry) if planner.native_validation else None
    compute = streams.current_stream_getter()
    if loop is not None and compute is not None:
        return NativePath(direction, backend, loop, planner, compute, fence)
    return PlannedPath(direction, backend, planner, streams, fence)


def build_handlers(planner: TransferPlanner, backends: Mapping[Direction, CopyBackend],
                   streams: StreamPlatform, stats: RankStats | None = None,
                   fence: SlotFence | None = None) -> CpuGpuOffloadingHandlers:
    """Both handlers of one rank, each over its direction's backend's path."""
    paths = {d: path_for(d, backends[d], planner, streams, fence) for d in Direction}
    return CpuGpuOffloadingHandlers.of_paths(paths, streams, stats)
