"""One rank's transfer geometry: its GPU pages, its region pages and how they pair up.

A frozen value, checked at construction and fixed for the rank's life. The planner plans
with it (``TransferPlanner.geometry``) and a backend gets it (``BackendContext.geometry``)
to build the tables it copies with, without the planner: a backend never plans.

``gpu_pages[t]`` and ``cpu_pages[t]`` are tensor t on each side (the same ``page_bytes``;
a CPU page array has ``block_size_factor`` pages per block, a GPU one 1).
``group_tensors[g]`` lists the tensors of KV-cache group g (one group of every tensor
when not given). A tensor may be in several groups: vLLM's hybrid allocator overlays its
groups on the same tensors (a full-attention and a sliding-window layer share one), and a
block belongs to one group at a time, so each group's copies touch only its own blocks and
slots. ``groups`` is each group's page
geometry (``GroupPages``), derived once: a block plan carries this very tuple, and a
backend's tables lay out only plans of the geometry they were built for (compared by
identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.errors import ArgumentError
from tiercache.pages import PageArray
from tiercache.planning.page_groups import GroupPages


@dataclass(frozen=True, eq=False)
class TransferGeometry:
    """See the module docstring. ``ArgumentError`` naming what does not fit."""

    gpu_pages: tuple[PageArray, ...]
    cpu_pages: tuple[PageArray, ...]
    block_size_factor: int
    group_tensors: tuple[tuple[int, ...], ...] | None = None
    groups: tuple[GroupPages, ...] = field(init=False, repr=False)

    @classmethod
    def of(cls, gpu_pages: Sequence[PageArray], cpu_pages: Sequence[PageArray],
           block_size_factor: int, group_tensors: Sequence[Sequence[int]] | None = None
           ) -> TransferGeometry:
        """The geometry of these pages (``group_tensors`` None: one group of every tensor)."""
        groups = None if group_tensors is None else tuple(tuple(int(t) for t in g)
                                                          for g in group_tensors)
        return cls(tuple(gpu_pages), tuple(cpu_pages), block_size_factor, groups)

    def __post_init__(self) -> None:
        factor = self.block_size_factor
        num_tensors = len(self.gpu_pages)
        if factor < 1:
            raise ArgumentError(f"block_size_factor = {factor}: must be >= 1")
        if num_tensors == 0 or len(self.cpu_pages) != num_tensors:
            raise ArgumentError(f"{num_tensors} GPU and {len(self.cpu_pages)} CPU page "
                                "arrays: need the same number, at least one")
        for t, (gpu, cpu) in enumerate(zip(self.gpu_pages, self.cpu_pages)):
            if gpu.pages_per_block != 1 or cpu.pages_per_block != factor:
                raise ArgumentError(
                    f"tensor {t}: GPU pages_per_block {gpu.pages_per_block} (must be 1), CPU "
                    f"pages_per_block {cpu.pages_per_block} (must be {factor})")
            if gpu.page_bytes != cpu.page_bytes:
                raise ArgumentError(f"tensor {t}: GPU page_bytes {gpu.page_bytes} != CPU "
                                    f"page_bytes {cpu.page_bytes}")
        tensor_groups = (tuple(range(num_tensors)),) if self.group_tensors is None \
            else self.group_tensors
        for g, tensors in enumerate(tensor_groups):
            if not tensors:
                raise ArgumentError(f"group_tensors[{g}] is empty: a group needs a tensor")
            if len(set(tensors)) != len(tensors):
                raise ArgumentError(f"group_tensors[{g}] = {list(tensors)} names a tensor "
                                    "twice")
            for t in tensors:
                if not 0 <= t < num_tensors:
                    raise ArgumentError(f"group_tensors[{g}] names tensor {t}; allowed "
                                        f"0..{num_tensors - 1}")
        object.__setattr__(self, "groups", tuple(
            GroupPages.of(g, self.gpu_pages, self.cpu_pages, factor) for g in tensor_groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def pair_bytes(self) -> tuple[int, ...]:
        """Bytes one (GPU block, slot) pair of each group moves: a page of each of its
        tensors."""
        return tuple(g.pair_bytes for g in self.groups)
