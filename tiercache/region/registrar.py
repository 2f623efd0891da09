"""``HostRegistrar``: the extension point through which a worker's mapping of the region is
page-locked (``SharedOffloadRegion.pin``). The region knows ranges and bytes; what
registers them with a device is the worker's (``tiercache.device.pinning.HostPinner``),
so the region never imports a device binding."""

from __future__ import annotations

from typing import Protocol

from tiercache.region.progress import Progress


class HostRegistrar(Protocol):
    """What page-locks host ranges for one GPU in this process: ``pin`` registers every
    (address, length) range, all or nothing for the call (earlier calls' ranges stay: a
    slice is pinned chunk by chunk), telling ``progress`` each range's length once it is
    registered, and returns seconds, raising ``PinError``; ``pinned_bytes`` counts every
    call's; ``unpin`` undoes them all and returns seconds."""

    @property
    def pinned_bytes(self) -> int: ...

    def pin(self, ranges: list[tuple[int, int]], progress: Progress | None = None) -> float: ...

    def unpin(self) -> float: ...
