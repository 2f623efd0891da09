"""``HostRegistrar``: the extension point through which a worker's mapping of the region is
page-locked (``SharedOffloadRegion.pin``). The region knows ranges and bytes; what
registers them with a device is the worker's (``tiercache.device.pinning.HostPinner``),
so the region never imports a device binding."""

from __future__ import annotations

from typing import Protocol

from tiercache.region.progress import Progress


class HostRegistrar(Protocol):
    """What page-locks host ranges for one GPU in this process: ``pin`` registers every
    (address, length) range, all or nothing, telling ``progress`` each range's length once
    it is registered, and returns seconds, raising ``PinError``; ``unpin`` undoes it and
    returns seconds."""

    @property
    def pinned_bytes(self) -> int: ...

    def pin(self, ranges: list[tuple[int, int]], progress: Progress) -> float: ...

    def unpin(self) -> float: ...
