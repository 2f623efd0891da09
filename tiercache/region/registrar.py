"""``HostRegistrar``: the extension point through which a worker's mapping of the region is
page-locked (``SharedOffloadRegion.pin``). The region knows ranges and bytes; what
registers them with a device is the worker's (``tiercache.device.pinning.HostPinner``),
so the region never imports a device binding."""

from __future__ import annotations

from typing import Protocol

from tiercache.config import PinningPolicy
from tiercache.errors import PinError
from tiercache.region.progress import Progress
from tiercache.region.stats import PinState, RankStats


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


def failed_pin_state(policy: PinningPolicy, stats: RankStats,
                     raise_error: PinError | None = None) -> PinState:
    """The pinning policy's answer to a failed registration, for a whole-slice pin
    (``SharedOffloadRegion.pin``) and a prepared slice (``SlicePreparer``) alike: the state
    the rank runs in, UNPINNED under ``allow_unpinned``, FAILED under ``required``; under
    ``required`` a caller that must fail (``attach``) passes the error as ``raise_error``,
    and it is raised here once FAILED is exported. The caller logs and exports the state
    returned (with what it had registered)."""
    if policy is not PinningPolicy.REQUIRED:
        return PinState.UNPINNED
    if raise_error is not None:
        stats.set_pin(PinState.FAILED)
        raise raise_error
    return PinState.FAILED
