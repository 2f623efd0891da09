"""``FencedSlot``: a region slot as the coordinator handed it out (id, generation, region
identity). The lease book keeps these where it kept slot ids, and the spec the workers
receive (``tiercache.vllm.load_store_spec``) carries them; plain data, so the book loads
nothing of vLLM to hold them (its tests run without vLLM: tests/vllm/test_leases.py)."""

from __future__ import annotations

from typing import Any, NamedTuple


class FencedSlot(NamedTuple):
    """A region slot as the coordinator handed it out: its id, its generation, and the
    identity of the region (see ``CPULoadStoreSpec``'s fencing). The book keeps these
    where it kept slot ids, so every spec it builds can be checked by the workers."""

    slot_id: int
    gen: int
    region_id: int


def fenced_slots(spec: Any) -> list[FencedSlot]:
    """The slots of a ``CPULoadStoreSpec`` from the coordinator, one ``FencedSlot`` each."""
    gens = spec.slot_gens.tolist() if spec.slot_gens is not None else [0] * len(spec)
    region = spec.region_id
    return [FencedSlot(s, g, region) for s, g in zip(spec.block_ids.tolist(), gens)]
