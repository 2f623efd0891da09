"""What the scheduler hands its workers: ``TierCacheLoadStoreSpec``, region slots each with
its generation and region identity (``FencedSlot``). It travels in vLLM's connector
metadata from the scheduler process (``tiercache.vllm.manager``) to every worker process
(``tiercache.vllm.worker``), so it stands apart from both: a worker loads nothing of the
scheduler's lease book to read it, and the scheduler nothing of the worker's transfers."""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.kv_offload.base import LoadStoreSpec

from tiercache.errors import SpecError
from tiercache.specs import CPULoadStoreSpec
from tiercache.vllm.fenced_slot import FencedSlot


class TierCacheLoadStoreSpec(LoadStoreSpec):
    """Slots in the coordinator's region (one per chunk), in transfer order, each with its
    generation and region identity (``FencedSlot``: the workers check them before they copy,
    see ``tiercache.transfer.fence``). Travels in vLLM's connector metadata from the
    scheduler to every worker; plain data only (a list of tuples: the worker makes the
    arrays, off the scheduler's path)."""

    def __init__(self, slots: Sequence[FencedSlot]):
        self.slots = slots if isinstance(slots, list) else list(slots)

    def to_cpu_spec(self) -> CPULoadStoreSpec:
        """The spec the worker's handlers take; ``SpecError`` if the slots name several
        regions (they never should: one coordinator handed them out)."""
        if not self.slots:
            return CPULoadStoreSpec([])
        ids, gens, regions = zip(*self.slots)
        if len(set(regions)) != 1:
            raise SpecError(f"one transfer's slots name regions {sorted(set(regions))}; a "
                            "spec is for one region")
        if not regions[0]:  # unfenced slots (region 0): the caller vouches for them
            return CPULoadStoreSpec(ids)
        return CPULoadStoreSpec(ids, gens, regions[0])

    @property
    def slot_ids(self) -> list[int]:
        return [s.slot_id for s in self.slots]

    def __len__(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        return f"TierCacheLoadStoreSpec({self.slot_ids})"
