"""What goes down to the lower tiers: the tier chain's demotions and publishes, waiting
and in flight, per tier.

* **Demotion ahead of eviction** (tiers with ``policy.demote_below``): while fewer host
  slots than that fraction are free, the blocks the eviction policy would evict next, not
  on the tier yet, are admitted. **Admission: reused first.** A block that was reused in
  host memory (leased or loaded since it was stored) is always admitted; one that never
  was only while the tier's queue is less than half full. Under pressure the unproven
  spill is dropped and counted, never waited for.
* **Publish, write-through** (tiers with ``policy.publish``): a block that became READY,
  stored by an engine or promoted from another tier (never the tier's own promotions), is
  queued unless the tier says it holds it; past ``max_queued_blocks`` it is dropped.
* Admitted blocks **wait unpinned**, in order; the chain hands a tier ``job_blocks`` at a
  time, pinned (``pin_for_tier``), while it has fewer in flight than it works on at once
  (``max_in_flight_blocks``) and than ``1 / MAX_READ_SHARE`` of host memory, so a small
  host tier keeps room to store.

Called by the chain under the index's lock; reads host memory's index through the chain's
``HostSlots`` (``tiercache.index.host_slots``). Nothing here locks or calls a tier but its
``holds``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tiercache.tiers.base import JobKind, LowerTier, Presence, TierPolicy
from tiercache.results import BlockSource

if TYPE_CHECKING:
    from tiercache.index.host_slots import HostSlots

MAX_READ_SHARE = 8  # a tier's jobs pin at most 1/8 of host memory at once (one job at least)

# (tier, kind, keys): pin ``keys`` for the tier's read and hand them over as one job
HandOver = Callable[[LowerTier, JobKind, list[bytes]], None]


class Feed:
    """One tier's blocks waiting to go down (publishes and admitted demotions, in order,
    not pinned yet) and in flight (pinned, in its jobs)."""

    __slots__ = ("waiting", "in_flight", "dropped")

    def __init__(self) -> None:
        self.waiting: OrderedDict[bytes, JobKind] = OrderedDict()
        self.in_flight: set[bytes] = set()  # keys of its demote and publish jobs
        self.dropped = 0

    @property
    def queued(self) -> int:
        return len(self.waiting) + len(self.in_flight)

    def take(self, count: int) -> tuple[JobKind, list[bytes]]:
        """The next up to ``count`` waiting keys of one kind, in order."""
        kind = next(iter(self.waiting.values()))
        batch: list[bytes] = []
        for key, of in self.waiting.items():
            if of is not kind or len(batch) == count:
                break
            batch.append(key)
        for key in batch:
            del self.waiting[key]
        return kind, batch


class Feeds:
    """Every tier's ``Feed`` (see the module docstring)."""

    def __init__(self, host: HostSlots, tier_owner: int):
        self._host = host
        self._owner = tier_owner
        self._feeds: dict[LowerTier, Feed] = {}

    def __getitem__(self, tier: LowerTier) -> Feed:
        return self._feeds[tier]

    def use(self, tiers: Sequence[LowerTier]) -> None:
        self._feeds = {tier: self._feeds.get(tier) or Feed() for tier in tiers}

    def forget_waiting(self) -> None:
        """Host memory was reset: what waits is gone (in-flight jobs finish on their own)."""
        for feed in self._feeds.values():
            feed.dropped += len(feed.waiting)
            feed.waiting.clear()

    def publish(self, tiers: Sequence[LowerTier], keys: Sequence[bytes],
                source: BlockSource) -> bool:
        """Queue ``keys`` (READY now) for the tiers that publish, all but ``source``;
        whether any was queued."""
        queued = False
        for tier in tiers:
            if not tier.policy.publish or tier.source is source or not keys:
                continue
            feed = self._feeds[tier]
            fresh = [k for k in keys if k not in feed.waiting and k not in feed.in_flight
                     and tier.holds(k, self._owner) is not Presence.YES]
            room = max(0, tier.policy.max_queued_blocks - feed.queued)
            feed.waiting.update(dict.fromkeys(fresh[:room], JobKind.PUBLISH))
            feed.dropped += max(0, len(fresh) - room)
            queued = queued or bool(fresh[:room])
        return queued

    def refill(self, tier: LowerTier, hand_over: HandOver) -> None:
        """Admit demotions below the watermark, then hand the tier what waits for it."""
        policy, feed = tier.policy, self._feeds[tier]
        if policy.demote_below > 0:
            self._admit_demotions(tier, policy, feed)
        limit = min(policy.max_in_flight_blocks,
                    max(policy.job_blocks, self._host.num_blocks // MAX_READ_SHARE))
        while feed.waiting and len(feed.in_flight) < limit:
            kind, batch = feed.take(min(policy.job_blocks, limit - len(feed.in_flight)))
            # the others were evicted meanwhile, or are pinned by as many owners as a slot
            # records: nothing to move now
            keys = self._host.pinnable(batch)
            feed.dropped += len(batch) - len(keys)
            if keys:
                hand_over(tier, kind, keys)

    def _admit_demotions(self, tier: LowerTier, policy: TierPolicy, feed: Feed) -> None:
        host = self._host
        low = max(1, int(host.num_blocks * policy.demote_below))
        free = host.num_free()
        if free >= low or feed.queued * 2 > policy.max_queued_blocks:
            return  # refill only once the queue is down to half: a refill walks the policy
        want = min(policy.max_queued_blocks - feed.queued, low - free + policy.job_blocks)

        def admissible(key: bytes) -> bool:
            return (key not in feed.in_flight and key not in feed.waiting
                    and tier.holds(key, self._owner) is not Presence.YES)

        for key, reused in host.peek_evictions(want, admissible):
            if reused or feed.queued * 2 < policy.max_queued_blocks:
                feed.waiting[key] = JobKind.DEMOTE
            else:
                feed.dropped += 1  # unproven, and the tier is busy: not worth it
