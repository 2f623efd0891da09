"""What a worker found and did about its slice's NUMA placement: the value its stats block
records, the exporter and ``tiercache status`` read."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class NumaState(IntEnum):
    """A rank slice's placement, as its worker left it at attach."""

    NONE = 0  # no worker has checked (none attached yet, or it detached)
    PLACED = 1  # bound to the node of the worker's device; local_pages says how much is there
    OFF = 2  # region.numa_placement = false: nothing bound or moved; what was found is reported
    UNKNOWN_NODE = 3  # the device's node is not known (the worker's log says why): no call
    FAILED = 4  # a NUMA call failed (the worker's log names it; EPERM in a container)

    @property
    def label(self) -> str:
        return self.name.lower()


# which of several attachments' states a rank reports: the one that most needs a look
_WORST = {NumaState.FAILED: 4, NumaState.UNKNOWN_NODE: 3, NumaState.OFF: 2, NumaState.NONE: 1,
          NumaState.PLACED: 0}


@dataclass(frozen=True)
class NumaPlacement:
    """One attachment's slice placement. ``slice_pages``: the OS pages of the slice's rows
    that were counted (0 when nothing could be counted); ``local_pages``: those on
    ``node``; ``seconds``: what binding, counting and moving took at attach."""

    state: NumaState = NumaState.NONE
    node: int | None = None
    slice_pages: int = 0
    local_pages: int = 0
    seconds: float = 0.0  # not validated: a reader decodes it from shared memory

    @property
    def local_ratio(self) -> float | None:
        """The fraction of the slice's pages on ``node``; None when not measured."""
        if self.node is None or self.slice_pages == 0:
            return None
        return self.local_pages / self.slice_pages

    def describe(self) -> str:
        """One phrase for ``tiercache status``."""
        ratio = self.local_ratio
        there = "" if ratio is None else f", {100 * ratio:.1f}% of the slice's pages there"
        if self.state is NumaState.NONE:
            return "NUMA not checked"
        if self.state is NumaState.UNKNOWN_NODE:
            return "NUMA node UNKNOWN (nothing bound; the worker's log says why)"
        if self.state is NumaState.FAILED:
            return (f"NUMA placement FAILED on node {self.node} (a NUMA call failed; the "
                    "worker's log names it)")
        where = "node unknown" if self.node is None else f"node {self.node}"
        if self.state is NumaState.OFF:
            return f"NUMA placement off ({where}{there})"
        return f"NUMA placed on {where}{there.replace(', ', ' (', 1)}{')' if there else ''}"

    @staticmethod
    def worst(placements: list[NumaPlacement]) -> NumaPlacement:
        """The placement a rank reports for several attachments: the worst state, then the
        lowest local fraction (an engine on the other socket sharing the rank shows)."""
        if not placements:
            return NumaPlacement()
        return max(placements, key=lambda p: (_WORST[p.state], -(p.local_ratio or 0.0)))
