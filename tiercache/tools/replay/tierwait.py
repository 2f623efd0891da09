"""The disk tier on the replay's clock: ``TierSettler.settle()`` before each engine step.

tiercache's tier chain works on wall time: it looks at host memory's free slots every
``POLL_S`` (20 ms) and demotes the blocks next in line for eviction while fewer than
``disk.low_watermark`` of them are free; promotions from disk finish when their reads do.
The replay's clock runs far faster than that, so without a wait an engine would store a
whole trace's blocks before the chain woke once: evictions would drop blocks that a served
engine's minutes would have demoted, and a disk hit would wait a wall-time read on a
clock that does not count it, both depending on the machine's speed.

So, with a disk tier, the replay gives the chain the time it needs before each step, as a
served engine's wall time would: ``settle`` returns once the disk tier has nothing queued
or in flight and one chain round (``CHAIN_ROUND_S``) passed without its counters moving;
at once while the tier is idle and host memory above the watermark (the chain has nothing
to do) or nothing changed since it last settled (a step that stored nothing). The wait
itself is wall time only. The disk's reads are put on the clock where they are used: a
load of blocks promoted from disk first reads them at the cost model's ``disk_read_bps``
(``engine``). Its writes (demotions ahead of eviction) take no simulated time: a served
tier demotes in the background, off the engines' path, while it keeps up.
"""

from __future__ import annotations

import time
from typing import Any

from tiercache.config import Config

CHAIN_ROUND_S = 0.05  # more than the chain's POLL_S (0.02 s): a look at the watermark at least
GIVE_UP_S = 120.0  # a disk tier busy this long on a settled trace is broken (a bug)


class TierSettleError(RuntimeError):
    """The disk tier kept working for ``GIVE_UP_S`` (a bug, never a result)."""


class TierSettler:
    """See the module docstring. ``waits``: settles that had to wait a chain round."""

    def __init__(self, config: Config, low_watermark: float):
        from tiercache.link.client import Client

        self._client = Client(config, name="replay-tier-settler")
        self._low_watermark = low_watermark
        self._settled: tuple[int, ...] | None = None  # the counters when it last settled
        self.waits = 0

    def _look(self) -> tuple[bool, tuple[int, ...], bool]:
        disk = self._client.tier_stats()["disk"]
        index = self._client.stats()
        idle = disk.queued_blocks == 0 and disk.calls_in_flight == 0
        counters = (disk.demotions, disk.promotions, disk.dropped_spills, disk.used_blocks,
                    index.free_blocks, index.stored_blocks)
        above = index.free_blocks >= self._low_watermark * index.capacity_blocks
        return idle, counters, above

    def settle(self) -> None:
        idle, counters, above = self._look()
        if idle and (above or counters == self._settled):
            return  # nothing for the chain to do, or nothing happened since it last settled
        self.waits += 1
        began = time.monotonic()
        while True:
            time.sleep(CHAIN_ROUND_S)
            was = counters
            idle, counters, _ = self._look()
            if idle and counters == was:
                self._settled = counters
                return
            if time.monotonic() - began > GIVE_UP_S:
                raise TierSettleError(f"the disk tier did not settle in {GIVE_UP_S} s: {counters}")

    def stats(self) -> dict[str, Any]:
        disk = self._client.tier_stats()["disk"]
        return {"disk_reads_on_clock": True,  # a disk hit's load reads first (engine)
                "disk_writes_on_clock": False,  # demotions take no simulated time
                "settle_waits": self.waits, "demotions": disk.demotions,
                "promotions": disk.promotions, "dropped_spills": disk.dropped_spills,
                "used_blocks": disk.used_blocks, "capacity_blocks": disk.capacity_blocks}

    def close(self) -> None:
        self._client.close()
