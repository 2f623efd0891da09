"""One KV-cache group's pages: geometry fixed at attach, and one transfer's share of it.

``GroupPages`` holds a group's k tensors (ordered by CPU address) as numpy columns (a
scalar where every tensor agrees, so the common uniform case costs one pass over the
k*n addresses instead of k). ``GroupWork`` is one group of one transfer: n GPU ids
and, per page, the region slot and sub-page; it writes the group's k*n descriptors
as a (rows, cols) array and says which neighbours inside a row continue each other.

Descriptor order follows host memory where that is cheap, because ``staged`` moves
whole host runs and would otherwise sort 16 k addresses per transfer:

* *interleaved* groups (block_size_factor 1, k >= 2 tensors side by side in each CPU
  row, the region's layout) are written page by page (rows = pages, cols = tensors),
  pages in ascending CPU row: ascending host addresses.
* other groups are written tensor by tensor (rows = tensors, cols = pages); with
  block_size_factor 1 pages are in ascending CPU row too, so tensors whose CPU pages
  do not interleave come out ascending; with a larger factor the spec's order is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tiercache.pages import PageArray

_U64 = np.uint64


def _column(values: Sequence[int]) -> np.ndarray:
    return np.array(values, dtype=_U64).reshape(-1, 1)


def _compact(values: Sequence[int]) -> np.ndarray | np.uint64:
    """A scalar when every tensor of the group agrees (one pass instead of k), else a column."""
    return _U64(values[0]) if len(set(values)) == 1 else _column(values)


def _compact_flags(flags: Sequence[bool]) -> np.ndarray | np.bool_:
    return np.bool_(flags[0]) if len(set(flags)) == 1 else np.array(flags).reshape(-1, 1)


def _as_row(value: np.ndarray | np.uint64) -> np.ndarray | np.uint64:
    """A per-tensor column as a row (interleaved layout); scalars unchanged."""
    return value.T if isinstance(value, np.ndarray) else value


def _interleaved(cpu: Sequence[PageArray], factor: int) -> bool:
    """k >= 2 tensors (ordered by address) share each CPU row without overlapping."""
    if factor != 1 or len(cpu) < 2 or len({c.block_stride_bytes for c in cpu}) != 1:
        return False
    ends = [c.base_address + c.block_bytes for c in cpu]
    disjoint = all(end <= nxt.base_address for end, nxt in zip(ends, cpu[1:]))
    return disjoint and max(ends) - cpu[0].base_address <= cpu[0].block_stride_bytes


@dataclass(frozen=True, eq=False)
class GroupPages:
    """One group's page geometry: base columns (k, 1), strides and page sizes as a scalar
    when uniform across the group's k tensors, else as columns. ``tensors`` are ordered
    by CPU base address."""

    tensors: tuple[int, ...]
    gpu_base: np.ndarray
    gpu_stride: np.ndarray | np.uint64
    cpu_base: np.ndarray
    cpu_stride: np.ndarray | np.uint64
    page_bytes: np.ndarray | np.uint64
    gpu_dense: np.ndarray | np.bool_  # GPU stride == page: consecutive ids are adjacent
    cpu_dense: np.ndarray | np.bool_  # CPU stride == block_size_factor * page
    num_gpu_blocks: int
    num_slots: int
    interleaved: bool  # written page by page (see the module docstring)
    # interleaved only, (k-1,) flags: tensor j's page ends where tensor j+1's begins, in a
    # CPU row (cpu_side_by_side) and on both sides for every block (side_by_side; None
    # when the GPU side depends on the block because the tensors' GPU strides differ)
    cpu_side_by_side: np.ndarray | None
    side_by_side: np.ndarray | None

    @property
    def pair_bytes(self) -> int:
        """Bytes one (GPU block, CPU row, sub-page) pair moves: a page of every tensor."""
        if np.ndim(self.page_bytes) == 0:
            return int(self.page_bytes) * len(self.tensors)
        return int(self.page_bytes.sum())

    @classmethod
    def of(cls, tensors: tuple[int, ...], gpu: Sequence[PageArray], cpu: Sequence[PageArray],
           factor: int) -> GroupPages:
        tensors = tuple(sorted(tensors, key=lambda t: cpu[t].base_address))
        pages = [gpu[t].page_bytes for t in tensors]
        gbases = [gpu[t].base_address for t in tensors]
        cbases = [cpu[t].base_address for t in tensors]
        gstrides = [gpu[t].block_stride_bytes for t in tensors]
        cstrides = [cpu[t].block_stride_bytes for t in tensors]
        interleaved = _interleaved([cpu[t] for t in tensors], factor)
        cpu_side = side_by_side = None
        if interleaved:
            pairs = range(len(tensors) - 1)
            cpu_side = np.array([cbases[j] + pages[j] == cbases[j + 1] for j in pairs])
            if len(set(gstrides)) == 1:
                side_by_side = cpu_side & np.array([gbases[j] + pages[j] == gbases[j + 1]
                                                    for j in pairs])
        return cls(
            tensors=tensors,
            gpu_base=_column(gbases),
            gpu_stride=_compact(gstrides),
            cpu_base=_column(cbases),
            cpu_stride=_compact(cstrides),
            page_bytes=_compact(pages),
            gpu_dense=_compact_flags([s == p for s, p in zip(gstrides, pages)]),
            cpu_dense=_compact_flags([s == factor * p for s, p in zip(cstrides, pages)]),
            num_gpu_blocks=min(gpu[t].num_blocks for t in tensors),
            num_slots=min(cpu[t].num_blocks for t in tensors),
            interleaved=interleaved,
            cpu_side_by_side=cpu_side,
            side_by_side=side_by_side,
        )


@dataclass(frozen=True, eq=False)
class GroupWork:
    """One non-empty group of one transfer: its GPU ids and, per GPU page, the region slot
    and the sub-page inside it."""

    group: GroupPages
    gpu_ids: np.ndarray
    slots: np.ndarray
    sub_pages: np.ndarray | None  # None when block_size_factor == 1
    run_pages: np.ndarray | None = None  # pages per descriptor once runs are fused; None = 1
    page_joins: np.ndarray | None = None  # (k, n-1) joins left unfused (tensors disagree)

    def fused(self) -> GroupWork:
        """Consecutive pages that continue each other in every tensor become one
        descriptor; joins that only some tensors have are kept for the merge."""
        joins = self._page_joins()
        if joins is None:
            return self
        if joins.ndim == 2:
            return replace(self, page_joins=joins)
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        lengths = np.diff(np.append(starts, self.gpu_ids.size)).astype(_U64)
        subs = None if self.sub_pages is None else self.sub_pages[starts]
        return GroupWork(self.group, self.gpu_ids[starts], self.slots[starts], subs, lengths)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of this group's descriptors: (pages, tensors) when interleaved,
        else (tensors, pages)."""
        k, n = len(self.group.tensors), self.gpu_ids.size
        return (n, k) if self.group.interleaved else (k, n)

    @property
    def num_bytes(self) -> int:
        """Bytes this group's pages hold (every tensor's page for every pair)."""
        return self.group.pair_bytes * int(self.gpu_ids.size if self.run_pages is None
                                           else self.run_pages.sum())

    @property
    def num_descriptors(self) -> int:
        return len(self.group.tensors) * self.gpu_ids.size

    def write(self, gpu_addr: np.ndarray, cpu_addr: np.ndarray, sizes: np.ndarray) -> None:
        """Fill this group's ``num_descriptors`` entries of the arrays as a ``shape`` array."""
        g, shape = self.group, self.shape
        if g.interleaved:  # pages as a column, the k tensors side by side as a row
            ids, rows = self.gpu_ids.astype(_U64)[:, None], self.slots.astype(_U64)[:, None]
            np.add(_as_row(g.gpu_base), ids * _as_row(g.gpu_stride), out=gpu_addr.reshape(shape))
            np.add(_as_row(g.cpu_base), rows * g.cpu_stride, out=cpu_addr.reshape(shape))
            sizes.reshape(shape)[...] = _as_row(g.page_bytes)
            return
        gpu_offsets = self.gpu_ids.astype(_U64) * g.gpu_stride
        cpu_offsets = self.slots.astype(_U64) * g.cpu_stride
        if self.sub_pages is not None:
            cpu_offsets = cpu_offsets + self.sub_pages * g.page_bytes
        np.add(g.gpu_base, gpu_offsets, out=gpu_addr.reshape(shape))
        np.add(g.cpu_base, cpu_offsets, out=cpu_addr.reshape(shape))
        if self.run_pages is None:
            sizes.reshape(shape)[...] = g.page_bytes
        else:
            np.multiply(g.page_bytes, self.run_pages, out=sizes.reshape(shape))

    def row_joins(self, gpu_addr: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
        """Flags, (cols-1,) or (rows, cols-1): descriptor i of a row continues into i+1 on
        both sides; None when none does. ``gpu_addr``/``sizes`` are what ``write`` filled."""
        g = self.group
        if not g.interleaved:
            return self.page_joins
        if g.side_by_side is not None:
            return g.side_by_side if g.side_by_side.any() else None
        if g.cpu_side_by_side is None or not g.cpu_side_by_side.any():  # set when interleaved
            return None
        # GPU strides differ across the tensors: whether pages meet depends on the block
        gpu, size = gpu_addr.reshape(self.shape), sizes.reshape(self.shape)
        joins = (gpu[:, :-1] + size[:, :-1] == gpu[:, 1:]) & g.cpu_side_by_side
        return joins if joins.any() else None

    def _page_joins(self) -> np.ndarray | None:
        """Flags, (n-1,) or (k, n-1): page i and i+1 of a tensor are adjacent on both
        sides; None when no pair is. Derived from the n ids, not the k*n addresses.
        Interleaved groups have none (a tensor's pages in two rows are apart on the host)."""
        g, ids = self.group, self.gpu_ids
        if g.interleaved:
            return None
        next_gpu = ids[1:] == ids[:-1] + 1
        if not np.any(g.gpu_dense) or not next_gpu.any():
            return None
        rows = self.slots
        across = next_gpu & (rows[1:] == rows[:-1] + 1)  # last sub-page, then next row's first
        joins = (g.gpu_dense & g.cpu_dense) & across if np.any(g.cpu_dense) and across.any() \
            else None
        if self.sub_pages is not None:
            inside = g.gpu_dense & (next_gpu & (self.sub_pages[1:] != 0))  # same row
            joins = inside if joins is None else joins | inside
        return joins
