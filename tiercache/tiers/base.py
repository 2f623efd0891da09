"""The one-way contract of a tier below host memory (disk, a cluster pool), in the shape
of vLLM 0.33's ``SecondaryTierManager``: the index's tier chain (``tiercache.index
.tiering``) asks, reserves, pins and books; a tier only answers, moves bytes and reports.

A tier never imports the index and never calls it. What passes between them:

* ``holds(key, asker) -> Presence``: from what the tier knows, never I/O, quick (it runs
  under the index's lock). ``MAYBE``: the tier does not know yet; the chain then gives it
  a ``PROBE`` job for the run and the asker hears "not yet" (pending).
* ``submit(job)``: a ``TierJob`` of keys and the host slots the chain already reserved
  (``PROMOTE``: the tier writes them) or pinned (``DEMOTE`` / ``PUBLISH``: the tier reads
  them), or of keys alone (``PROBE``). Quick: it queues, the tier's threads move bytes.
  A tier refusing a job (full, down, stopping) reports it failed; it never raises.
* ``take_finished() -> list[JobResult]``: each job's outcome once, per key: ``done``
  (moved and verified: header, checksum and, for the pool, the cluster's MAC checked
  first), ``failed`` (nothing moved into a host slot, nor will), ``may_land`` (a transfer
  into its host slot may still run: the chain holds the slot out). ``settled=False``
  promises a later result, ``settled=True``, once every transfer of the job provably
  ended. A ``PROBE``'s ``done`` is the leading run of its keys the tier holds.
* ``take_changes() -> list[KeyChange]``: keys the tier came to hold or stopped holding,
  for the node's events and the presence map.
* ``wake``: given at ``start``; the tier calls it when it has results or changes (it sets
  an event: not a call into the index).

Stats (``snapshot()``) are the tier's own; tiers come from ``tiercache.tiers``'s registry.
The contract lives beside the tiers (as ``backends/base.py`` and ``eviction/base.py`` do),
a layer below the index that drives it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from tiercache.errors import ManagerError
from tiercache.results import BlockSource, TierStats
from tiercache.specs import Medium


class Presence(Enum):
    """A tier's answer to "do you hold this key?", from what it knows now."""

    YES = "yes"  # promote it from here
    NO = "no"  # ask the next tier, or miss
    MAYBE = "maybe"  # finding out: the asker hears "not yet"; the chain sends a PROBE


class JobKind(Enum):
    """What a job asks of a tier, and so what the chain holds for it."""

    PROBE = "probe"  # find out which leading keys you hold (no host slot)
    PROMOTE = "promote"  # tier -> host: write these reserved host slots
    DEMOTE = "demote"  # host -> tier, ahead of eviction: read these pinned host slots
    PUBLISH = "publish"  # host -> tier, write-through: read these pinned host slots

    @property
    def writes_host(self) -> bool:
        return self is JobKind.PROMOTE

    @property
    def reads_host(self) -> bool:
        return self in (JobKind.DEMOTE, JobKind.PUBLISH)


@dataclass(frozen=True)
class TierJob:
    """``keys[i]`` lives in host slot ``slots[i]`` (empty for a ``PROBE``); ``asker``: the
    session whose lookup started a ``PROBE`` (it has heard "maybe" once already)."""

    job_id: int
    kind: JobKind
    keys: tuple[bytes, ...]
    slots: tuple[int, ...] = ()
    asker: int = 0

    def __post_init__(self) -> None:
        want = 0 if self.kind is JobKind.PROBE else len(self.keys)
        if len(self.slots) != want:
            raise ManagerError(f"a {self.kind.value} job of {len(self.keys)} key(s) with "
                               f"{len(self.slots)} host slot(s); it takes {want}")

    def blocks(self) -> list[tuple[bytes, int]]:
        return list(zip(self.keys, self.slots))


@dataclass(frozen=True)
class JobResult:
    """One job's outcome (see the module docstring); every key of the job is in exactly one
    of ``done``, ``failed``, ``may_land`` in its first result."""

    job_id: int
    done: tuple[bytes, ...] = ()
    failed: tuple[bytes, ...] = ()
    may_land: tuple[bytes, ...] = ()
    settled: bool = True


@dataclass(frozen=True)
class KeyChange:
    """Keys that came to be held by a tier (``removed=False``) or stopped being."""

    keys: tuple[bytes, ...]
    removed: bool


@dataclass(frozen=True)
class TierPolicy:
    """How the chain feeds a tier: which host blocks go down to it and how many at once.

    ``demote_below``: demote ahead of eviction while fewer than this fraction of host slots
    are free (0: never demote); ``publish``: write every block that becomes READY in host
    memory through to the tier (not the tier's own promotions); ``max_queued_blocks``:
    blocks the chain keeps waiting for the tier and in flight, past which an unproven
    block (never reused) is dropped and counted, never waited for; ``job_blocks``: blocks
    per demote or publish job (pinned and unpinned together), ``promote_blocks`` per
    promotion (its host slots reserved together); ``max_in_flight_blocks``: blocks it
    works on at once (the chain pins no more for it)."""

    medium: Medium
    demote_below: float = 0.0
    publish: bool = False
    max_queued_blocks: int = 256
    job_blocks: int = 4
    promote_blocks: int = 32
    max_in_flight_blocks: int = 32  # blocks it reads at once (its threads x job_blocks)
    stop_timeout_s: float = 5.0  # a stop waits this long for its transfers, then abandons them
    # the tier knows every key it holds (a disk); a pool only learns of other nodes'
    # objects by asking, so its holdings are neither announced nor counted as exact
    exact_holdings: bool = True


class LowerTier(ABC):
    """A tier below host memory; see the module docstring for the contract."""

    source: BlockSource
    policy: TierPolicy

    @property
    def name(self) -> str:
        return self.source.label

    @abstractmethod
    def holds(self, key: bytes, asker: int) -> Presence:
        """Whether this tier holds ``key``, as far as it knows (quick, no I/O)."""

    @abstractmethod
    def submit(self, job: TierJob) -> None:
        """Queue ``job`` (quick; never raises: a refused job is reported failed)."""

    @abstractmethod
    def take_finished(self) -> list[JobResult]:
        """Results since the last call, each job's first result exactly once."""

    def take_changes(self) -> list[KeyChange]:
        """Keys this tier came to hold or stopped holding since the last call."""
        return []

    def held_keys(self) -> list[bytes]:
        """Every key held now (for the presence map and events at start); empty when the
        tier cannot say."""
        return []

    @abstractmethod
    def start(self, wake: Callable[[], None]) -> None:
        """Start the tier's threads; ``wake()`` when results or changes are ready."""

    @abstractmethod
    def close(self, timeout_s: float | None = None) -> list[str]:
        """Stop, waiting at most ``timeout_s`` (None: as long as it takes) for transfers in
        flight; the jobs never started are reported failed. Returns what was abandoned
        (``"<thread>: <what>"`` each), so the region's owner keeps its mapping for them."""

    @abstractmethod
    def snapshot(self) -> TierStats:
        """The tier's figures now."""

