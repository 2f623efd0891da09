"""The planner: a (src_spec, dst_spec) pair -> a validated, merged ``CopyPlan``.

It works on addresses only (``PageArray``), never on devices. For each KV-cache group
g, GPU page i of the group (i = 0..n-1, n = ``group_sizes[g]``) pairs with CPU block
``cpu_ids[(skip + i) // F]``, sub-page ``(skip + i) % F``, where F is the
block_size_factor and ``skip = block_indices[g] % F`` (a load may start mid CPU block);
the group consumes ``ceil((n + skip) / F)`` CPU ids. Descriptors are laid out group by
group, tensor by tensor, then in page order, so consecutive pages that are adjacent
on both sides sit next to each other and merge into one descriptor.

Everything is checked before a plan is returned: medium pairing, group count, CPU id
count, ids inside both sides, no destination block written twice in a group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiercache.backends.base import CopyPlan
from tiercache.errors import LayoutMismatchError, SpecError
from tiercache.pages import PageArray
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec
from tiercache.stats import Direction

_U64 = np.uint64
_ENDS_CACHE_ENTRIES = 1024  # distinct (group shape) tuples remembered; small arrays each


def _column(values: Sequence[int]) -> np.ndarray:
    return np.array(values, dtype=_U64).reshape(-1, 1)


def _compact(values: Sequence[int]) -> np.ndarray | np.uint64:
    """A scalar when every tensor of the group agrees (one pass instead of k), else a column."""
    return _U64(values[0]) if len(set(values)) == 1 else _column(values)


def _compact_flags(flags: Sequence[bool]) -> np.ndarray | np.bool_:
    return np.bool_(flags[0]) if len(set(flags)) == 1 else np.array(flags).reshape(-1, 1)


@dataclass(frozen=True, eq=False)
class _GroupPages:
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
           factor: int) -> _GroupPages:
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
class _GroupWork:
    """One non-empty group of one transfer: its GPU ids and, per GPU page, the CPU block
    id and the sub-page inside it."""

    group: _GroupPages
    gpu_ids: np.ndarray
    cpu_rows: np.ndarray
    sub_pages: np.ndarray | None  # None when block_size_factor == 1
    run_pages: np.ndarray | None = None  # pages per descriptor once runs are fused; None = 1

    def fuse(self, joins: np.ndarray) -> _GroupWork:
        """The same pages as one descriptor per run ((n-1,) flags shared by every tensor)."""
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        lengths = np.diff(np.append(starts, self.gpu_ids.size)).astype(_U64)
        subs = None if self.sub_pages is None else self.sub_pages[starts]
        return _GroupWork(self.group, self.gpu_ids[starts], self.cpu_rows[starts], subs, lengths)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.group.tensors), self.gpu_ids.size

    @property
    def num_descriptors(self) -> int:
        return len(self.group.tensors) * self.gpu_ids.size

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


def merge_runs(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fuse neighbouring descriptors that continue each other on both sides."""
    if sizes.size < 2:
        return src, dst, sizes
    joins = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    if not joins.any():
        return src, dst, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)


def _check_ids(ids: np.ndarray, limit: int, side: str, group: int) -> None:
    top = int(ids.max())
    if top >= limit:
        raise SpecError(f"{side} block id {top} in group {group} is out of range: "
                        f"allowed 0..{limit - 1}")


def _check_unique(ids: np.ndarray, side: str, group: int) -> None:
    ordered = np.sort(ids)
    repeats = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeats.size:
        raise SpecError(f"destination {side} block id {int(repeats[0])} appears more than once "
                        f"in group {group}: a page would be written twice")


class PlanBuffers:
    """Reusable output arrays for one plan in flight.

    A fresh 16384-descriptor plan is three 128 KiB arrays; glibc maps those with mmap
    and every call then pays page faults that cost several times the planning itself
    (measured: 60 us with reused memory, 300+ us without). Handlers pool these like
    streams: one per transfer in flight, returned when the transfer finished.
    """

    def __init__(self, capacity: int = 0):
        self._arrays = tuple(np.empty(capacity, dtype=_U64) for _ in range(3))

    @property
    def capacity(self) -> int:
        return self._arrays[0].size

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Three writable uint64 views of ``count`` elements (grown when too small)."""
        if count > self.capacity:
            self._arrays = tuple(np.empty(max(count, 2 * self.capacity), dtype=_U64)
                                 for _ in range(3))
        return tuple(a[:count] for a in self._arrays)  # type: ignore[return-value]


class TransferPlanner:
    """Plans transfers between one rank's GPU pages and its region slice.

    ``gpu_pages[t]`` and ``cpu_pages[t]`` are tensor t on each side (same
    ``page_bytes``; CPU arrays have ``block_size_factor`` pages per block).
    ``group_tensors[g]`` lists the tensors of KV-cache group g (default: one group
    holding every tensor); no tensor belongs to two groups.
    """

    def __init__(self, gpu_pages: Sequence[PageArray], cpu_pages: Sequence[PageArray],
                 block_size_factor: int, group_tensors: Sequence[Sequence[int]] | None = None):
        self.gpu_pages, self.cpu_pages = tuple(gpu_pages), tuple(cpu_pages)
        self.block_size_factor = block_size_factor
        num_tensors = len(self.gpu_pages)
        if block_size_factor < 1:
            raise LayoutMismatchError(f"block_size_factor = {block_size_factor}: must be >= 1")
        if num_tensors == 0 or len(self.cpu_pages) != num_tensors:
            raise LayoutMismatchError(f"{num_tensors} GPU and {len(self.cpu_pages)} CPU page "
                                      "arrays: need the same number, at least one")
        for t, (gpu, cpu) in enumerate(zip(self.gpu_pages, self.cpu_pages)):
            if gpu.pages_per_block != 1 or cpu.pages_per_block != block_size_factor:
                raise LayoutMismatchError(
                    f"tensor {t}: GPU pages_per_block {gpu.pages_per_block} (must be 1), CPU "
                    f"pages_per_block {cpu.pages_per_block} (must be {block_size_factor})")
            if gpu.page_bytes != cpu.page_bytes:
                raise LayoutMismatchError(f"tensor {t}: GPU page_bytes {gpu.page_bytes} != CPU "
                                          f"page_bytes {cpu.page_bytes}")
        groups = [tuple(range(num_tensors))] if group_tensors is None else \
            [tuple(int(t) for t in g) for g in group_tensors]
        seen: set[int] = set()
        for g, tensors in enumerate(groups):
            if not tensors:
                raise LayoutMismatchError(f"group_tensors[{g}] is empty: a group needs a tensor")
            for t in tensors:
                if not 0 <= t < num_tensors:
                    raise LayoutMismatchError(f"group_tensors[{g}] names tensor {t}; allowed "
                                              f"0..{num_tensors - 1}")
                if t in seen:
                    raise LayoutMismatchError(f"tensor {t} is in two groups (group_tensors"
                                              f"[{g}]); each tensor belongs to at most one")
                seen.add(t)
        self._ends_cache: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
        self._groups = tuple(_GroupPages.of(g, self.gpu_pages, self.cpu_pages, block_size_factor) for g in groups)

    def _row_ends(self, shapes: tuple[tuple[int, int], ...]) -> np.ndarray:
        """Index of each tensor row's last descriptor, but the very last (cached per shape)."""
        ends = self._ends_cache.get(shapes)
        if ends is None:
            offsets = np.cumsum([0] + [rows * cols for rows, cols in shapes])
            ends = np.concatenate([np.zeros(0, dtype=np.int64)] + [
                at + np.arange(1, rows + 1) * cols - 1
                for at, (rows, cols) in zip(offsets, shapes)])[:-1]
            if len(self._ends_cache) >= _ENDS_CACHE_ENTRIES:
                self._ends_cache.clear()
            self._ends_cache[shapes] = ends
        return ends

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def plan(self, transfer: TransferSpec, merge: bool = True, out: PlanBuffers | None = None
             ) -> CopyPlan:
        """The descriptors of ``transfer``, merged unless ``merge=False``; raises
        SpecError naming what is wrong before anything is returned. With ``out`` the
        plan's arrays are views of those buffers (valid until they are reused)."""
        src_spec, dst_spec = transfer
        if isinstance(src_spec, GPULoadStoreSpec) and isinstance(dst_spec, CPULoadStoreSpec):
            direction, gpu_spec, cpu_spec = Direction.GPU_TO_CPU, src_spec, dst_spec
        elif isinstance(src_spec, CPULoadStoreSpec) and isinstance(dst_spec, GPULoadStoreSpec):
            direction, gpu_spec, cpu_spec = Direction.CPU_TO_GPU, dst_spec, src_spec
        else:
            raise SpecError(f"a transfer pairs a GPU and a CPU spec (either order); got "
                            f"({type(src_spec).__name__}, {type(dst_spec).__name__})")
        work = self._validate(gpu_spec, cpu_spec, store=direction is Direction.GPU_TO_CPU)
        within: list[np.ndarray | None] = [None] * len(work)
        if merge:  # fuse runs per block where every tensor of the group agrees
            for i, w in enumerate(work):
                joins = w.within_joins()
                if joins is not None and joins.ndim == 1:
                    work[i] = w.fuse(joins)
                else:
                    within[i] = joins
        total = sum(w.num_descriptors for w in work)
        gpu_addr, cpu_addr, sizes = (out or PlanBuffers()).take(total)
        at = 0
        for w in work:
            g, shape, end = w.group, w.shape, at + w.num_descriptors
            cpu_offsets = w.cpu_rows.astype(_U64) * g.cpu_stride
            if w.sub_pages is not None:
                cpu_offsets = cpu_offsets + w.sub_pages * g.page_bytes
            np.add(g.gpu_base, w.gpu_ids.astype(_U64) * g.gpu_stride,
                   out=gpu_addr[at:end].reshape(shape))
            np.add(g.cpu_base, cpu_offsets, out=cpu_addr[at:end].reshape(shape))
            if w.run_pages is None:
                sizes[at:end].reshape(shape)[...] = g.page_bytes
            else:
                np.multiply(g.page_bytes, w.run_pages, out=sizes[at:end].reshape(shape))
            at = end
        if merge:
            ends = self._row_ends(tuple(w.shape for w in work))
            gpu_addr, cpu_addr, sizes = _merge(gpu_addr, cpu_addr, sizes, work, within, ends)
        src, dst = (gpu_addr, cpu_addr) if direction is Direction.GPU_TO_CPU else (cpu_addr, gpu_addr)
        for array in (src, dst, sizes):
            array.setflags(write=False)
        return CopyPlan(src=src, dst=dst, sizes=sizes, direction=direction)

    def _validate(self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, store: bool
                  ) -> list[_GroupWork]:
        if gpu_spec.num_groups != self.num_groups:
            raise SpecError(f"GPU spec has {gpu_spec.num_groups} KV-cache group(s) (group_sizes "
                            f"{list(gpu_spec.group_sizes)}); this rank has {self.num_groups} "
                            "groups and needs one entry for each")
        factor = self.block_size_factor
        skips = [index % factor for index in gpu_spec.block_indices]
        counts = [-(-(n + s) // factor) if n else 0 for n, s in zip(gpu_spec.group_sizes, skips)]
        if sum(counts) != len(cpu_spec):
            raise SpecError(
                f"CPU spec has {len(cpu_spec)} block ids, but group_sizes "
                f"{list(gpu_spec.group_sizes)} with block_indices {list(gpu_spec.block_indices)} "
                f"and block_size_factor {factor} need {sum(counts)} ({counts} per group)")
        work, gpu_at, cpu_at = [], 0, 0
        for g, (group, n, skip, count) in enumerate(
                zip(self._groups, gpu_spec.group_sizes, skips, counts)):
            if n == 0:
                continue
            gids = gpu_spec.block_ids[gpu_at:gpu_at + n]
            cids = cpu_spec.block_ids[cpu_at:cpu_at + count]
            gpu_at, cpu_at = gpu_at + n, cpu_at + count
            _check_ids(gids, group.num_gpu_blocks, "GPU", g)
            _check_ids(cids, group.num_cpu_blocks, "CPU", g)
            _check_unique(cids if store else gids, "CPU" if store else "GPU", g)
            if factor == 1:
                work.append(_GroupWork(group, gids, cids, None))
            else:
                logical = np.arange(skip, skip + n)
                work.append(_GroupWork(group, gids, cids[logical // factor],
                                       (logical % factor).astype(_U64)))
        return work


def _merge(gpu_addr: np.ndarray, cpu_addr: np.ndarray, sizes: np.ndarray,
           work: list[_GroupWork], within: list[np.ndarray | None], ends: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``merge_runs`` without scanning every descriptor: joins inside a tensor's row come
    from ``_GroupWork.within_joins``; only the row ends are checked on addresses."""
    end_joins = ((gpu_addr[ends] + sizes[ends] == gpu_addr[ends + 1])
                 & (cpu_addr[ends] + sizes[ends] == cpu_addr[ends + 1]))
    if all(j is None for j in within) and not end_joins.any():
        return gpu_addr, cpu_addr, sizes
    joins = np.zeros(sizes.size, dtype=bool)  # joins[p]: descriptor p continues into p + 1
    at = 0
    for w, flags in zip(work, within):
        rows, cols = w.shape
        if flags is not None:
            joins[at:at + rows * cols].reshape(rows, cols)[:, :-1] = flags
        at += rows * cols
    joins[ends] = end_joins
    starts = np.flatnonzero(np.concatenate(([True], ~joins[:-1])))
    count = starts.size  # compact in place: starts[i] >= i, and take/reduceat buffer overlaps
    np.add.reduceat(sizes, starts, out=sizes[:count])
    np.take(gpu_addr, starts, out=gpu_addr[:count])
    np.take(cpu_addr, starts, out=cpu_addr[:count])
    return gpu_addr[:count], cpu_addr[:count], sizes[:count]
