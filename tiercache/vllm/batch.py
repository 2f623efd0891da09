"""What passes between the lease book (``tiercache.vllm.leases``), the flusher and the
scheduler's manager: a request's ``RequestLeases`` (kept in vLLM's ``ReqContext``, carried
in each ``Probe`` to the flusher and back), each step's ``Batch`` of work for the
coordinator, and the coordinator's ``LeaseAnswer`` per probe. Plain values: this module
imports nothing of the book, so the book, the flusher and the manager all import it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tiercache.results import BlockSource
from tiercache.vllm.fenced_slot import FencedSlot


class RequestLeases:
    """One request's share of the book (kept in vLLM's ``ReqContext`` state)."""

    __slots__ = ("req_id", "context_id", "fresh", "leased", "answers", "answers_step", "probe",
                 "in_flight", "reserved", "skip", "unreserved", "retrying", "finished")

    def __init__(self, req_id: str, context_id: int = 0):
        self.req_id = req_id
        self.context_id = context_id  # id() of the vLLM ReqContext it belongs to
        self.fresh = True  # no lease, answer, reservation or probe sent yet (fast path)
        self.leased: dict[bytes, None] = {}  # keys this request holds a ref on (ordered)
        self.answers: dict[bytes, Any] = {}  # MISS / HIT_PENDING from the last probe
        self.answers_step = -1
        self.probe: list[bytes] = []  # keys to probe at the next flush
        self.in_flight = 0  # probes sent, answers not filed yet
        self.reserved: dict[bytes, FencedSlot] = {}  # stores reserved for this request: key -> slot
        self.skip: set[bytes] = set()  # keys of its probes held by someone already
        self.unreserved: dict[bytes, None] = {}  # keys of its probes that found no room
        self.retrying = 0  # retries of ``unreserved`` sent, answers not filed yet
        self.finished = False


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
