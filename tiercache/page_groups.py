"""One KV-cache group's pages: geometry fixed at attach, and one transfer's share of it.

``GroupPages`` holds a group's k tensors as numpy columns (a scalar where every tensor
agrees, so the common uniform case costs one pass over the k*n addresses instead of
k). ``GroupWork`` is one group of one transfer: n GPU ids and, per page, the CPU block
id and sub-page; it writes the group's k*n descriptors (tensor by tensor, then page
order) and finds the pages that continue each other from the n ids alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, eq=False)
class GroupPages:
    """One group's page geometry: base columns (k, 1), strides and page sizes as a scalar
    when uniform across the group's k tensors, else as columns."""

    tensors: tuple[int, ...]
    gpu_base: np.ndarray
    gpu_stride: np.ndarray | np.uint64
    cpu_base: np.ndarray
    cpu_stride: np.ndarray | np.uint64
    page_bytes: np.ndarray | np.uint64
    gpu_dense: np.ndarray | np.bool_  # GPU stride == page: consecutive ids are adjacent
    cpu_dense: np.ndarray | np.bool_  # CPU stride == block_size_factor * page
    num_gpu_blocks: int
    num_cpu_blocks: int

    @classmethod
    def of(cls, tensors: tuple[int, ...], gpu: Sequence[PageArray], cpu: Sequence[PageArray],
           factor: int) -> GroupPages:
        pages = [gpu[t].page_bytes for t in tensors]
        gstrides = [gpu[t].block_stride_bytes for t in tensors]
        cstrides = [cpu[t].block_stride_bytes for t in tensors]
        return cls(
            tensors=tensors,
            gpu_base=_column([gpu[t].base_address for t in tensors]),
            gpu_stride=_compact(gstrides),
            cpu_base=_column([cpu[t].base_address for t in tensors]),
            cpu_stride=_compact(cstrides),
            page_bytes=_compact(pages),
            gpu_dense=_compact_flags([s == p for s, p in zip(gstrides, pages)]),
            cpu_dense=_compact_flags([s == factor * p for s, p in zip(cstrides, pages)]),
            num_gpu_blocks=min(gpu[t].num_blocks for t in tensors),
            num_cpu_blocks=min(cpu[t].num_blocks for t in tensors),
        )


@dataclass(frozen=True, eq=False)
class GroupWork:
    """One non-empty group of one transfer: its GPU ids and, per GPU page, the CPU block
    id and the sub-page inside it."""

    group: GroupPages
    gpu_ids: np.ndarray
    cpu_rows: np.ndarray
    sub_pages: np.ndarray | None  # None when block_size_factor == 1
    run_pages: np.ndarray | None = None  # pages per descriptor once runs are fused; None = 1

    def fuse(self, joins: np.ndarray) -> GroupWork:
        """The same pages as one descriptor per run ((n-1,) flags shared by every tensor)."""
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        lengths = np.diff(np.append(starts, self.gpu_ids.size)).astype(_U64)
        subs = None if self.sub_pages is None else self.sub_pages[starts]
        return GroupWork(self.group, self.gpu_ids[starts], self.cpu_rows[starts], subs, lengths)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.group.tensors), self.gpu_ids.size

    @property
    def num_descriptors(self) -> int:
        return len(self.group.tensors) * self.gpu_ids.size

    def write(self, gpu_addr: np.ndarray, cpu_addr: np.ndarray, sizes: np.ndarray) -> None:
        """Fill this group's ``num_descriptors`` slots, tensor by tensor, in page order."""
        g, shape = self.group, self.shape
        cpu_offsets = self.cpu_rows.astype(_U64) * g.cpu_stride
        if self.sub_pages is not None:
            cpu_offsets = cpu_offsets + self.sub_pages * g.page_bytes
        np.add(g.gpu_base, self.gpu_ids.astype(_U64) * g.gpu_stride, out=gpu_addr.reshape(shape))
        np.add(g.cpu_base, cpu_offsets, out=cpu_addr.reshape(shape))
        if self.run_pages is None:
            sizes.reshape(shape)[...] = g.page_bytes
        else:
            np.multiply(g.page_bytes, self.run_pages, out=sizes.reshape(shape))

    def within_joins(self) -> np.ndarray | None:
        """Flags, (n-1,) or (k, n-1): page i and i+1 of a tensor are adjacent on both
        sides; None when no pair is. Derived from the n ids, not the k*n addresses."""
        g, ids = self.group, self.gpu_ids
        next_gpu = ids[1:] == ids[:-1] + 1
        if not np.any(g.gpu_dense) or not next_gpu.any():
            return None
        rows = self.cpu_rows
        across = next_gpu & (rows[1:] == rows[:-1] + 1)  # last sub-page, then next row's first
        joins = (g.gpu_dense & g.cpu_dense) & across if np.any(g.cpu_dense) and across.any() \
            else None
        if self.sub_pages is not None:
            inside = g.gpu_dense & (next_gpu & (self.sub_pages[1:] != 0))  # same row
            joins = inside if joins is None else joins | inside
        return joins
