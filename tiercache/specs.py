"""Load/store specs: the small values that pass between bookkeeping and byte moving.

The cache index hands out ``CPULoadStoreSpec`` (slot ids in the region); the engine
describes its side with ``GPULoadStoreSpec``. A transfer is the pair
``(src_spec, dst_spec)`` moving in a ``Direction``. Nothing here imports torch.

The direction is decided once, where a transfer enters: by the verb
(``Worker.submit_store`` / ``submit_load``) or, for the generic
``transfer_async(job_id, (src, dst))``, by ``Direction.of`` from the pair's types.
Below that it is passed down (planner, handler, ``CopyPlan``, backends), never
inferred again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import TypeVar

import numpy as np

from tiercache.errors import SpecError

_Side = TypeVar("_Side")


class Medium(Enum):
    """Where a block lives; the values are vLLM's KV-event medium names."""

    CPU = "CPU"
    GPU = "GPU"
    STORAGE = "STORAGE"  # a lower tier on a local disk (vLLM's medium for storage tiers)


def _as_block_ids(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.array(block_ids, dtype=np.int64, copy=True).reshape(-1)
    if ids.size and ids.min() < 0:
        raise SpecError(f"block ids must be >= 0, got {int(ids.min())}")
    ids.setflags(write=False)
    return ids


@dataclass(frozen=True, eq=False)
class CPULoadStoreSpec:
    """Region slot ids, in transfer order: ``block_ids`` (the seed API's name) holds one
    slot id per slot the transfer touches (each slot is one block's row of
    ``block_size_factor`` GPU pages per tensor in every rank's slice), per KV-cache group
    in group order.

    **Fencing.** A spec the cache index hands out names what its slots are bound to:
    ``region_id``, the identity of the region the index belongs to (``RegionHeader``), and
    ``slot_gens``, each slot's generation when it was handed out (``region.ledger``). A
    worker copies only if the region it maps is that region and every slot still has that
    generation (``tiercache.transfer.fence``). ``region_id = 0`` and ``slot_gens = None``
    make an unfenced spec: the caller vouches for the slots (in-process use, tests).
    """

    block_ids: np.ndarray
    slot_gens: np.ndarray | None = None
    region_id: int = 0

    def __init__(self, block_ids: Sequence[int] | np.ndarray,
                 slot_gens: Sequence[int] | np.ndarray | None = None, region_id: int = 0):
        ids = _as_block_ids(block_ids)
        object.__setattr__(self, "block_ids", ids)
        if slot_gens is not None:
            gens = np.array(slot_gens, dtype=np.uint64, copy=True).reshape(-1)
            if gens.size != ids.size:
                raise SpecError(f"{gens.size} slot generations for {ids.size} slot ids; "
                                "one per slot")
            gens.setflags(write=False)
            object.__setattr__(self, "slot_gens", gens)
        else:
            object.__setattr__(self, "slot_gens", None)
        if not 0 <= region_id < 1 << 64:
            raise SpecError(f"region_id = {region_id!r}: a 64-bit identity (0: not fenced)")
        object.__setattr__(self, "region_id", int(region_id))

    @property
    def fenced(self) -> bool:
        return self.region_id != 0

    @staticmethod
    def medium() -> Medium:
        return Medium.CPU

    def __len__(self) -> int:
        return int(self.block_ids.size)

    def __repr__(self) -> str:
        if not self.fenced:
            return f"CPULoadStoreSpec({self.block_ids.tolist()})"
        gens = None if self.slot_gens is None else self.slot_gens.tolist()
        return (f"CPULoadStoreSpec({self.block_ids.tolist()}, slot_gens={gens}, "
                f"region_id={self.region_id:#x})")


@dataclass(frozen=True, eq=False)
class GPULoadStoreSpec:
    """GPU block ids of one transfer, grouped by KV-cache group.

    ``group_sizes[g]`` blocks of group g follow those of group g-1 in ``block_ids``
    (``sum(group_sizes) == len(block_ids)``); ``block_indices[g]`` is the logical
    index, inside the request, of group g's first GPU block, so a load may start in
    the middle of a slot (``block_indices[g] % block_size_factor`` sub-pages of its first
    slot are skipped). ``group_sizes=None`` means one group; ``block_indices=None`` means
    every group starts on a slot boundary (always true for stores).
    """

    block_ids: np.ndarray
    group_sizes: tuple[int, ...] = field(default=())
    block_indices: tuple[int, ...] = field(default=())

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ):
        ids = _as_block_ids(block_ids)
        sizes = (ids.size,) if group_sizes is None else tuple(int(s) for s in group_sizes)
        if any(s < 0 for s in sizes):
            raise SpecError(f"group_sizes must be >= 0, got {list(sizes)}")
        if sum(sizes) != ids.size:
            raise SpecError(
                f"group_sizes {list(sizes)} add up to {sum(sizes)}, "
                f"but there are {ids.size} block ids"
            )
        indices = ((0,) * len(sizes) if block_indices is None
                   else tuple(int(i) for i in block_indices))
        if len(indices) != len(sizes):
            raise SpecError(
                f"block_indices has {len(indices)} entries, group_sizes has {len(sizes)}; "
                "they must match (one per KV-cache group)"
            )
        if any(i < 0 for i in indices):
            raise SpecError(f"block_indices must be >= 0, got {list(indices)}")
        object.__setattr__(self, "block_ids", ids)
        object.__setattr__(self, "group_sizes", sizes)
        object.__setattr__(self, "block_indices", indices)

    @staticmethod
    def medium() -> Medium:
        return Medium.GPU

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    def __len__(self) -> int:
        return int(self.block_ids.size)

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec({self.block_ids.tolist()}, group_sizes={list(self.group_sizes)}, "
            f"block_indices={list(self.block_indices)})"
        )


LoadStoreSpec = CPULoadStoreSpec | GPULoadStoreSpec
TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]


class Direction(IntEnum):
    """Which way a transfer moves bytes. The value indexes per-direction records (the
    stats block's direction blocks, ``RankStatsSnapshot.directions``)."""

    GPU_TO_CPU = 0  # store
    CPU_TO_GPU = 1  # load

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def stores(self) -> bool:
        """A store: bytes go into the region's rows, from GPU memory or from an engine's
        host pool, which stands where the GPU does (``transfer/host_transfer.py``).
        Callers ask this rather than compare with ``GPU_TO_CPU``, whose name says where
        the bytes come from, which for a host pool it no longer does."""
        return self is Direction.GPU_TO_CPU

    @property
    def loads(self) -> bool:
        """A load: bytes go out of the region's rows, to GPU memory or an engine's host
        pool (the other way of ``stores``)."""
        return self is Direction.CPU_TO_GPU

    @classmethod
    def of(cls, transfer: TransferSpec) -> Direction:
        """The direction of a ``(src_spec, dst_spec)`` pair, from its spec types; a pair
        that is not one GPU and one CPU spec raises ``SpecError`` naming both types."""
        if isinstance(transfer, tuple) and len(transfer) == 2:
            for direction in cls:
                if direction._matches(*transfer):
                    return direction
        raise SpecError(f"a transfer pairs a GPU and a CPU spec (either order); got "
                        f"{_type_names(transfer)}")

    def gpu_cpu(self, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec
                ) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
        """``(gpu_spec, cpu_spec)`` of a transfer in this direction; ``SpecError`` naming
        the given types when the pair does not move this way."""
        gpu, cpu = self.src_dst(src_spec, dst_spec)
        if isinstance(gpu, GPULoadStoreSpec) and isinstance(cpu, CPULoadStoreSpec):
            return gpu, cpu
        want = ", ".join(c.__name__ for c in self.src_dst(GPULoadStoreSpec, CPULoadStoreSpec))
        raise SpecError(f"a {self.label} transfer takes (src_spec, dst_spec) = ({want}); "
                        f"got {_type_names((src_spec, dst_spec))}")

    def src_dst(self, gpu_side: _Side, cpu_side: _Side) -> tuple[_Side, _Side]:
        """Order a (GPU side, CPU side) pair as (source, destination); the same swap
        turns (source, destination) back into (GPU side, CPU side)."""
        return (gpu_side, cpu_side) if self.stores else (cpu_side, gpu_side)

    def _matches(self, src_spec: object, dst_spec: object) -> bool:
        gpu, cpu = self.src_dst(src_spec, dst_spec)
        return isinstance(gpu, GPULoadStoreSpec) and isinstance(cpu, CPULoadStoreSpec)


def _type_names(transfer: object) -> str:
    if not isinstance(transfer, tuple):
        return type(transfer).__name__
    return "(" + ", ".join(type(spec).__name__ for spec in transfer) + ")"
