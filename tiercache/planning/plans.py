"""The two forms of a planned transfer, and which one a backend takes.

Both are checked already (ids in range, no destination written twice) and say their
``direction``; a backend only moves their bytes.

* ``CopyPlan``: page descriptors (src address, dst address, bytes), merged where pages
  continue each other on both sides. For backends that copy pages (``ce``, ``kernel``,
  ``cpu``).
* ``BlockPlan``: per non-empty KV-cache group, one (GPU block id, region slot, sub-page)
  pair per GPU page, O(blocks); the tensor dimension is left to the backend (``staged``
  expands it on the device). Its one int64 buffer is what ``tc_validate`` writes and the
  native chunk loop reads (``tiercache.native.validator``).

Addresses are process virtual addresses: GPU memory, or the region's host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import numpy as np

from tiercache.planning.page_groups import GroupPages
from tiercache.specs import Direction


class PlanForm(Enum):
    """What a backend takes (``CopyBackend.plan_form``): the planner makes that form."""

    PAGES = "pages"  # CopyPlan
    BLOCKS = "blocks"  # BlockPlan


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """Descriptors of one transfer; ``src[i] -> dst[i]``, ``sizes[i]`` bytes each.

    Arrays are uint64, equal length, read-only; copies never overlap each other.
    """

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    direction: Direction

    @property
    def num_descriptors(self) -> int:
        return int(self.sizes.size)

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum(dtype=np.uint64))

    @property
    def empty(self) -> bool:
        return not self.sizes.size

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, sizes) as C-contiguous uint64 (no copy when they already are)."""
        src, dst, sizes = (np.ascontiguousarray(a, dtype=np.uint64)
                           for a in (self.src, self.dst, self.sizes))
        return src, dst, sizes


@dataclass(frozen=True)
class GroupPairs:
    """One non-empty group of a block plan: its index and, per pair, the GPU block id,
    the region slot and the sub-page inside the slot (views of the plan's buffer)."""

    group: int
    gpu_ids: np.ndarray  # int64
    slots: np.ndarray  # int64
    sub_pages: np.ndarray  # int64; all 0 when block_size_factor is 1


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """One transfer at block level. ``buffer`` (int64) holds ``pairs`` ((3, P): GPU ids,
    region slots, sub-pages; each non-empty group's pairs back to back, in group order)
    then ``works`` ((G, 2) rows of group index and pair count; the first ``num_works``
    are used). ``num_bytes``: what the pairs move, a page of each of the group's tensors
    per pair. ``groups``: the planner's geometry (``TransferPlanner.groups``), which a
    backend checks by identity: a plan is laid out only with tables of its own planner."""

    direction: Direction
    buffer: np.ndarray
    num_pairs: int
    num_works: int
    num_bytes: int
    groups: tuple[GroupPages, ...]

    @property
    def pairs(self) -> np.ndarray:
        return self.buffer[:3 * self.num_pairs].reshape(3, -1)

    @property
    def works(self) -> np.ndarray:
        return self.buffer[3 * self.num_pairs:].reshape(-1, 2)[:self.num_works]

    @property
    def empty(self) -> bool:
        return not self.num_pairs

    def group_pairs(self) -> Iterator[GroupPairs]:
        """Each non-empty group's pairs, in group order."""
        pairs, at = self.pairs, 0
        for group, count in self.works.tolist():
            yield GroupPairs(group, pairs[0, at:at + count], pairs[1, at:at + count],
                             pairs[2, at:at + count])
            at += count
