"""What passes between the lease book and the flusher: each step's ``Batch`` of work for
the coordinator, and the coordinator's ``LeaseAnswer`` per probe. Plain values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from tiercache.results import BlockSource
from tiercache.vllm.fenced_slot import FencedSlot

if TYPE_CHECKING:
    from tiercache.vllm.lease_records import RequestLeases


class Answers(NamedTuple):
    """The values ``lookup`` returns (vLLM's ``LookupResult`` members in production)."""

    hit: Any
    miss: Any
    pending: Any
    retry: Any


class Probe(NamedTuple):
    request: RequestLeases
    keys: list[bytes]


class LeaseAnswer(NamedTuple):
    """What the coordinator said about one probe: ``num_hit`` leading keys leased, at these
    slots; ``pending``: the key after them is being written; ``reserved``: (key, slot) of
    the keys past the run whose store was reserved; ``skipped``: keys past the run that
    were not reserved because they are held already; ``no_room``: keys past the run that
    found no room (asked again in a later step). The answer to a retry has no run."""

    num_hit: int
    pending: bool
    slots: Sequence[FencedSlot]
    reserved: Sequence[tuple[bytes, FencedSlot]] = ()
    skipped: Sequence[bytes] = ()
    no_room: Sequence[bytes] = ()
    promoted: Sequence[int] = ()  # positions in the run that came up from a lower tier
    sources: Sequence[BlockSource] = ()  # co-indexed with promoted: which tier


@dataclass
class Batch:
    """Everything one step leaves for the coordinator, in the order it is sent:
    completed stores (publish them), failed stores (free them), releases (all wire keys),
    retries (keys of earlier probes that found no room to reserve), then probes (vLLM
    keys, sent as ``prefix + key``). ``num_stored``: keys vLLM's ``prepare_store`` handed
    out for storing during the step, the most blocks this batch's reservations may evict."""

    prefix: bytes = b""
    generation: int = 0
    stores_done: list[bytes] = field(default_factory=list)
    stores_failed: list[bytes] = field(default_factory=list)
    releases: list[bytes] = field(default_factory=list)
    retries: list[Probe] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    num_stored: int = 0

    def __bool__(self) -> bool:
        return bool(self.stores_done or self.stores_failed or self.releases or self.retries
                    or self.probes)
