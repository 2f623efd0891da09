"""The lease book's records: what one held key and one request keep
(``tiercache.vllm.leases``)."""

from __future__ import annotations

from typing import Any

from tiercache.results import BlockSource
from tiercache.vllm.fenced_slot import FencedSlot

ABSENT = object()


def always(key: bytes) -> bool:
    return True


class Held:
    """One key the book holds: its fenced slot (id, generation, region), the refs on it."""

    __slots__ = ("slot", "refs", "source")

    def __init__(self, slot: FencedSlot, source: BlockSource = BlockSource.HOST):
        self.slot = slot
        self.refs = 0
        self.source = source  # the tier it was promoted from (vLLM's load source)


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
