"""Block-level staging layout of one transfer: pure numpy, no torch, no CUDA.

``staged`` packs GPU pages into a GPU staging ring with a kernel and moves whole host
runs on the copy engines. This module describes one transfer in *pairs* (one per GPU
page of a group: GPU block id, CPU row, sub-page) and *rows* (one per CPU block of a
group), never per (page, tensor): the tensor dimension lives in a static table that is
built once per rank geometry and expanded on the device (``block_kernel``). Host work per
transfer is O(pairs + rows + DMAs); with the region's layout (a row's pages side by
side) a DMA is one staged row, or several adjacent rows merged.

Static part (``BlockStaging``, per geometry). Group g has k_g tensors, ordered by CPU
address, at entries ``group_first[g] .. group_first[g] + k_g - 1`` of ``tensors``
(int64, shape (4, T))::

    tensors[0, t] gpu_base     GPU address of block 0's page
    tensors[1, t] gpu_stride   bytes from one GPU block to the next
    tensors[2, t] page_bytes   bytes of one GPU page (only these are ever copied)
    tensors[3, t] row_offset   cpu_base[t] - row_origin[g]: the tensor's CPU page in the row image

    row_origin[g] = min over the group's tensors of cpu_base      (host address of row 0's image)
    span[g]       = max over t of row_offset[t] + F * page_bytes[t] (bytes of a row image)
    pitch[g]      = span[g] rounded up to SLOT_ALIGN                (slot bytes a staged row takes)
    host address of byte x of CPU row c's image = row_origin[g] + c * cpu_stride[g] + x

F is the block_size_factor: a CPU page is F GPU pages back to back, sub-page j at
``row_offset[t] + j * page_bytes[t]``. The group's tensors must share one CPU block
stride and their CPU pages must not overlap (true of the region); a row image never
spans two rows. A *run template* lists the image bytes a row moves, as maximal runs
(``runs[:, tpl_first[i] : tpl_first[i] + tpl_count[i]]``, built once): template
``i = (g * F + a) * F + b`` is a row covering sub-pages a..b, the union over t of
``[row_offset[t] + a * page_bytes[t], row_offset[t] + (b + 1) * page_bytes[t])``;
template ``i = G * F * F + g`` is the whole image ``[0, span[g])`` (G groups). The
kernel's access width ``access_bytes`` (16, 8, 4, 2 or 1) divides every table entry,
so it is static too.

Per transfer (``BlockLayout``): rows in ascending host address within each group,
groups in order; chunk k holds rows back to back, each at ``pitch`` from the last, all
inside ``chunk_bytes`` (a row never straddles two chunks; a pitch over ``chunk_bytes``
is refused at construction). Pairs follow their rows; ``pair_first[k] ..
pair_first[k+1]`` are chunk k's. For pair p of chunk k and every tensor t of its group::

    pairs[0, p] GPU block id    GPU address  = gpu_base[t] + id * gpu_stride[t]
    pairs[1, p] row slot offset slot address = slot_base[k] + pairs[1, p] + row_offset[t]
    pairs[2, p] sub-page j                                    + j * page_bytes[t]
    pairs[3, p] group g         page_bytes[t] bytes, GPU <-> slot (pack / unpack)

DMAs ``dma_first[k] .. dma_first[k+1]`` are chunk k's: ``dma_bytes[d]`` between host
``dma_host[d]`` and ``slot_base[k] + dma_slot[d]``: each row's template runs, where two
neighbours continue each other on both sides merged into one. A store's DMAs cover
exactly the host bytes of its pages, each once: image bytes outside them (padding,
other groups' pages, sub-pages of a partial row) are never written. A load uses the
same templates, or with ``load_whole_rows`` the whole-image template for every row:
one DMA per row (or per run of adjacent rows) even where a mid-block load or a
padded layout needs only part of it, at the cost of reading bytes it does not unpack
(at most the unused sub-pages of a group's first and last row, plus padding). A
load may read one row twice (repeated CPU ids). The pages of a chunk lie inside that
chunk's DMAs, so the kernel and the copy engines only need to agree per chunk.

Host cost (benchmarks/block_staging_bench.py, docs/results/block_staging_cpu.txt): a
few dozen numpy calls on arrays of pairs or rows, whatever the tensor count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiercache.errors import BackendError
from tiercache.native.chunk_loop import Geometry
from tiercache.pages import PageArray
from tiercache.planning.page_groups import GroupPages
from tiercache.planning.geometry import TransferGeometry
from tiercache.planning.plans import BlockPlan, GroupPairs

SLOT_ALIGN = 256  # row images start 256-byte aligned in a slot: 16-byte accesses stay aligned
MAX_ACCESS_BYTES = 16
_I64 = np.int64
_NONE = np.zeros(0, dtype=_I64)


def _runs(starts: list[int], lengths: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of the union of disjoint intervals."""
    out: list[list[int]] = []
    for start, length in sorted(zip(starts, lengths)):
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return [(a, n) for a, n in out]


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """One transfer laid out in chunks (see the module docstring for every formula)."""

    pairs: np.ndarray  # int64 (4, P): GPU id, row slot offset, sub-page, group
    pair_first: np.ndarray  # int64 (num_chunks + 1,)
    dma_host: np.ndarray  # uint64 (D,)
    dma_slot: np.ndarray  # uint64 (D,), from the chunk's slot base
    dma_bytes: np.ndarray  # uint64 (D,)
    dma_first: np.ndarray  # int64 (num_chunks + 1,)
    num_rows: int

    @property
    def num_chunks(self) -> int:
        return int(self.pair_first.size) - 1

    @property
    def num_pairs(self) -> int:
        return int(self.pairs.shape[1])

    @property
    def num_bytes(self) -> int:
        """Bytes the DMAs move: the pages', each once (whole-row loads: the rows')."""
        return int(self.dma_bytes.sum())

    def pair_range(self, k: int) -> tuple[int, int]:
        """(first, count) of chunk k's pairs: the kernel launch's range."""
        first = int(self.pair_first[k])
        return first, int(self.pair_first[k + 1]) - first

    def dma_range(self, k: int) -> slice:
        return slice(int(self.dma_first[k]), int(self.dma_first[k + 1]))

    def dma_slot_addresses(self, slot_bases: Sequence[int] | np.ndarray) -> np.ndarray:
        """Absolute slot end of every DMA, chunk k's slot at ``slot_bases[k]`` (uint64)."""
        bases = np.asarray(slot_bases, dtype=np.uint64)
        if bases.size != self.num_chunks:
            raise BackendError(f"{bases.size} slot bases for {self.num_chunks} chunks: need "
                               "one per chunk")
        return np.repeat(bases, np.diff(self.dma_first)) + self.dma_slot


def _empty_layout() -> BlockLayout:
    none = np.zeros(1, dtype=_I64)
    u = np.zeros(0, dtype=np.uint64)
    return BlockLayout(np.zeros((4, 0), dtype=_I64), none, u, u, u, none, 0)


class BlockStaging:
    """The static tables of one rank's geometry, and the per-transfer ``layout``.

    ``groups[g]`` lists the tensors of group g (as the geometry has them); ``gpu[t]``,
    ``cpu[t]`` the pages of tensor t on each side. Raises BackendError when the
    geometry cannot be staged by rows (tensors of a group with different CPU strides,
    overlapping CPU pages, a row image wider than its stride or than ``chunk_bytes``).
    """

    def __init__(self, gpu: Sequence[PageArray], cpu: Sequence[PageArray], factor: int,
                 groups: Sequence[Sequence[int]], chunk_bytes: int,
                 load_whole_rows: bool = False, break_rows: int = 0):
        if chunk_bytes < SLOT_ALIGN or chunk_bytes % SLOT_ALIGN:
            raise BackendError(f"chunk_bytes = {chunk_bytes}: must be a positive multiple of "
                               f"{SLOT_ALIGN}")
        self.factor, self.chunk_bytes = int(factor), int(chunk_bytes)
        self._sub_pages = np.arange(self.factor, dtype=_I64)
        self.load_whole_rows = bool(load_whole_rows)
        # no DMA runs into a row whose slot is a multiple of this: a registration boundary
        # of the region (RegionLayout.registrations; 0: none)
        self.break_rows = int(break_rows)
        self.groups: tuple[GroupPages, ...] | None = None  # the geometry's, set by of_geometry
        columns: list[list[int]] = [[], [], [], []]
        self.group_first = np.zeros(len(groups), dtype=_I64)
        self.group_count = np.zeros(len(groups), dtype=_I64)
        origin, stride, span = [], [], []
        for g, members in enumerate(groups):
            tensors = sorted(members, key=lambda t: cpu[t].base_address)
            lo = cpu[tensors[0]].base_address
            strides = {cpu[t].block_stride_bytes for t in tensors}
            if len(strides) > 1 and min(cpu[t].num_blocks for t in tensors) > 1:
                raise BackendError(f"group {g}: CPU block strides {sorted(strides)} differ; "
                                   "block staging needs one row stride per group")
            ends = [cpu[t].base_address - lo + factor * cpu[t].page_bytes for t in tensors]
            for a, b in zip(tensors, tensors[1:]):
                if cpu[a].base_address + factor * cpu[a].page_bytes > cpu[b].base_address:
                    raise BackendError(f"group {g}: CPU pages of tensors {a} and {b} overlap")
            self.group_first[g], self.group_count[g] = len(columns[0]), len(tensors)
            for t in tensors:
                for column, value in zip(columns, (gpu[t].base_address, gpu[t].block_stride_bytes,
                                                   gpu[t].page_bytes, cpu[t].base_address - lo)):
                    column.append(value)
            origin.append(lo)
            stride.append(cpu[tensors[0]].block_stride_bytes)
            span.append(max(ends))
            if span[-1] > stride[-1] and min(cpu[t].num_blocks for t in tensors) > 1:
                raise BackendError(f"group {g}: a row image of {span[-1]} bytes is wider than "
                                   f"the CPU block stride {stride[-1]}: rows would overlap")
        self.tensors = np.array(columns, dtype=_I64).reshape(4, -1)
        self.row_origin = np.array(origin, dtype=_I64)
        self.cpu_stride = np.array(stride, dtype=_I64)
        self.span = np.array(span, dtype=_I64)
        self.pitch = -(-self.span // SLOT_ALIGN) * SLOT_ALIGN
        if int(self.pitch.max()) > chunk_bytes:
            g = int(self.pitch.argmax())
            raise BackendError(f"group {g}: a staged row takes {int(self.pitch[g])} bytes, more "
                               f"than chunk_bytes = {chunk_bytes}; use chunk_bytes >= "
                               f"{int(self.pitch.max())}")
        self._uniform_pitch = int(self.pitch[0]) if np.all(self.pitch == self.pitch[0]) else 0
        if self._uniform_pitch:  # rows' slot offsets and chunk starts, reused by every transfer
            self._rows_per_chunk = chunk_bytes // self._uniform_pitch
            self._uniform = _NONE, _NONE  # (slot offsets, chunk starts): see _chunks
        self._build_templates()
        bits = int(np.bitwise_or.reduce(self.tensors.reshape(-1))) | MAX_ACCESS_BYTES
        self.access_bytes = bits & -bits  # widest access every address and size allows

    @classmethod
    def of_geometry(cls, geometry: TransferGeometry, chunk_bytes: int,
                    load_whole_rows: bool = False, break_rows: int = 0) -> BlockStaging:
        """The tables of ``geometry`` (its groups in its order): ``layout`` takes the block
        plans of its planner."""
        staging = cls(geometry.gpu_pages, geometry.cpu_pages, geometry.block_size_factor,
                      [g.tensors for g in geometry.groups], chunk_bytes, load_whole_rows,
                      break_rows)
        staging.groups = geometry.groups
        return staging

    def check(self, plan: BlockPlan) -> None:
        """``BackendError`` unless ``plan`` is of the geometry these tables were built for."""
        if plan.groups is not self.groups:
            raise BackendError("a block plan of a geometry this BlockStaging was not built "
                               "for (build it with BlockStaging.of_geometry(geometry, ...))")

    def loop_geometry(self) -> Geometry:
        """These tables as the native chunk loop lays transfers out with them."""
        i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
        return Geometry(self.factor, self.chunk_bytes, self.load_whole_rows,
                        i64(self.cpu_stride), i64(self.row_origin), i64(self.pitch),
                        i64(self.tpl_first), i64(self.tpl_count), i64(self.runs[0]),
                        i64(self.runs[1]), self.break_rows)

    @property
    def num_groups(self) -> int:
        return int(self.group_first.size)

    def _build_templates(self) -> None:
        f, starts, counts = self.factor, [], []
        runs: list[tuple[int, int]] = []
        for g in range(self.num_groups):
            cols = self.tensors[:, self.group_first[g]:self.group_first[g] + self.group_count[g]]
            offsets, pages = cols[3].tolist(), cols[2].tolist()
            for a in range(f):
                for b in range(f):
                    found = [] if b < a else _runs(
                        [o + a * p for o, p in zip(offsets, pages)],
                        [(b - a + 1) * p for p in pages])
                    starts.append(len(runs))
                    counts.append(len(found))
                    runs.extend(found)
        for g in range(self.num_groups):  # whole row images: template num_groups * F * F + g
            starts.append(len(runs))
            counts.append(1)
            runs.append((0, int(self.span[g])))
        self.tpl_first = np.array(starts, dtype=_I64)
        self.tpl_count = np.array(counts, dtype=_I64)
        self.runs = np.array(runs, dtype=_I64).T.copy()  # (2, n): image offset, bytes
        self._tpl_count = self.tpl_count.tolist()
        self._tpl_run = [tuple(self.runs[:, a].tolist()) if n else None
                         for a, n in zip(starts, counts)]

    # ------------------------------------------------------------ per transfer
    def layout(self, plan: BlockPlan) -> BlockLayout:
        """Lay out one block plan of this geometry's planner; O(pairs + rows + DMAs). A
        store writes host bytes, so its DMAs cover exactly the pages (loads read whole
        row images when ``load_whole_rows``)."""
        self.check(plan)
        whole = self.load_whole_rows and plan.direction.loads
        parts = [self._group_rows(p, whole) for p in plan.group_pairs()]
        if not parts:
            return _empty_layout()
        row_break = self._row_breaks(parts)
        if len(parts) == 1:
            row_host, row_tpl, gpu_ids, pair_row, subs, groups = parts[0]
            row_pitch = None if self._uniform_pitch else np.full(row_host.size, self.pitch[groups])
        else:
            sizes = [p[0].size for p in parts]
            row_host = np.concatenate([p[0] for p in parts])
            row_tpl = np.concatenate([np.broadcast_to(p[1], (n,)) for p, n in zip(parts, sizes)])
            gpu_ids = np.concatenate([p[2] for p in parts])
            subs = 0 if self.factor == 1 else np.concatenate([p[4] for p in parts])
            pair_row = np.concatenate([(np.arange(p[2].size) if p[3] is None else p[3]) + base
                                       for p, base in zip(parts, np.cumsum([0] + sizes[:-1]))])
            groups = np.repeat([p[5] for p in parts], [p[2].size for p in parts])
            row_pitch = None if self._uniform_pitch else \
                np.repeat(self.pitch[[p[5] for p in parts]], sizes)
        row_first, row_slot = self._chunks(row_host.size, row_pitch)
        pairs = np.empty((4, gpu_ids.size), dtype=_I64)
        pairs[0], pairs[2], pairs[3] = gpu_ids, subs, groups
        if pair_row is None:  # one pair per row, in row order
            pairs[1], pair_first = row_slot, row_first
        else:
            np.take(row_slot, pair_row, out=pairs[1])
            pair_first = np.searchsorted(pair_row, row_first).astype(_I64)
        if isinstance(row_tpl, int) and self._tpl_count[row_tpl] == 1:  # one work: one group
            host, slot, size, dma_first = self._uniform_dmas(
                row_host, row_slot, row_tpl, row_first, int(self.pitch[groups]), row_break)
        else:
            host, slot, size, dma_first = self._dmas(
                row_host, row_slot, np.broadcast_to(row_tpl, row_host.shape), row_first,
                row_break)
        return BlockLayout(pairs, pair_first, host.view(np.uint64), slot.view(np.uint64),
                           size.view(np.uint64), dma_first, int(row_host.size))

    def _group_rows(self, w: GroupPairs, whole: bool):
        """One group's rows (host address of the image; template, an int when all rows
        share it) in ascending host address, and its pairs (GPU id, row index or None for
        one pair per row in order, sub-page), with the group index."""
        g = w.group
        f, n = self.factor, int(w.gpu_ids.size)
        ids, rows = w.gpu_ids, w.slots
        tpl: int | np.ndarray  # one template for all rows, or one per row
        tpl = self.num_groups * f * f + g if whole else g  # (F = 1: sub-page 0..0 is g)
        if f == 1:
            if rows.size > 1 and not (rows[1:] >= rows[:-1]).all():
                order = np.argsort(rows)
                rows, ids = rows[order], ids[order]
            return rows * self.cpu_stride[g] + self.row_origin[g], tpl, ids, None, 0, g
        subs = w.sub_pages
        skip, last = int(subs[0]), int(subs[-1])
        num_rows = (skip + n - 1) // f + 1
        starts = np.arange(-skip, num_rows * f - skip, f)  # pair index of each row's sub-page 0
        starts[0] = 0
        rows = rows[starts]
        if whole:
            pass
        elif skip == 0 and last == f - 1:  # whole CPU blocks: every row covers 0..F-1
            tpl = (g * f) * f + f - 1
        else:
            tpl = np.full(num_rows, (g * f) * f + f - 1, dtype=_I64)
            tpl[-1] = (g * f) * f + last
            tpl[0] = (g * f + skip) * f + (last if num_rows == 1 else f - 1)
        if num_rows < 2 or (rows[1:] >= rows[:-1]).all():
            entry = np.arange(skip, skip + n) // f
        else:  # rows to host order, each row's pairs (consecutive, sub-pages ascending) with it
            order = np.argsort(rows)
            rows = rows[order]
            tpl = tpl if isinstance(tpl, int) else tpl[order]
            pair = (order * f).reshape(-1, 1) + (self._sub_pages - skip)  # (rows, F) indices
            valid = (pair >= 0) & (pair < n)
            pair = pair[valid]
            ids, subs = ids[pair], subs[pair]
            rank = np.empty_like(order)
            rank[order] = np.arange(num_rows)
            entry = rank[(pair + skip) // f]
        return rows * self.cpu_stride[g] + self.row_origin[g], tpl, ids, entry, subs, g

    def _chunks(self, num_rows: int, pitch: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Row boundaries of the chunks (num_chunks + 1) and each row's slot offset: rows
        fill a chunk in order while they fit (``pitch`` None: every row has the uniform one)."""
        if pitch is None:
            slots, firsts = self._uniform
            if num_rows > slots.size:  # grows to the largest transfer seen, never written after
                per, cap = self._rows_per_chunk, 2 * num_rows
                slots = np.arange(cap, dtype=_I64) % per * self._uniform_pitch
                firsts = np.arange(0, cap + per, per, dtype=_I64)
                slots.setflags(write=False)
                self._uniform = slots, firsts
            first = firsts[:-(-num_rows // self._rows_per_chunk) + 1].copy()
            first[-1] = num_rows
            return first, slots[:num_rows]
        end = np.cumsum(pitch)
        cuts, at, base = [0], 0, 0
        while at < num_rows:
            at = int(np.searchsorted(end, base + self.chunk_bytes, side="right"))
            cuts.append(at)
            base = int(end[at - 1])
        first = np.array(cuts, dtype=_I64)
        start = end - pitch
        return first, start - np.repeat(start[first[:-1]], np.diff(first))

    def _row_breaks(self, parts) -> np.ndarray | None:
        """Per row: its slot is a multiple of ``break_rows`` (no DMA runs into it)."""
        if not self.break_rows:
            return None
        slots = [(p[0] - self.row_origin[p[5]]) // self.cpu_stride[p[5]] for p in parts]
        return np.concatenate(slots) % self.break_rows == 0

    def _uniform_dmas(self, row_host: np.ndarray, row_slot: np.ndarray, tpl: int,
                      row_first: np.ndarray, pitch: int, row_break: np.ndarray | None):
        """``_dmas`` when every row has template ``tpl`` of one run (the common case): the
        rows of one group, each ``pitch`` (that group's) after the last in its chunk. Two
        rows' runs continue each other in the slot only when the run is the whole pitch;
        the group's own pitch, not the geometry's uniform one (0 when groups' pitches
        differ), or such rows would never merge where the C loop merges them."""
        run = self._tpl_run[tpl]
        assert run is not None, "the caller checked: the template is one run"
        offset, length = run
        num_rows = row_host.size
        if offset or length != pitch or num_rows < 2:  # rows never meet in a slot
            return (row_host + offset, row_slot + offset, np.full(num_rows, length, dtype=_I64),
                    row_first)
        breaks = (row_host[1:] - row_host[:-1]) != length  # a DMA begins after row i
        if row_break is not None:
            breaks |= row_break[1:]  # a registration begins at row i + 1
        if row_first.size > 2:
            breaks[row_first[1:-1] - 1] = True  # never across chunks
        inner = np.flatnonzero(breaks)
        if inner.size == num_rows - 1:
            return row_host, row_slot, np.full(num_rows, length, dtype=_I64), row_first
        count = inner.size + 1
        starts = np.empty(count + 1, dtype=_I64)
        starts[0], starts[count] = 0, num_rows
        np.add(inner, 1, out=starts[1:count])
        size = (starts[1:] - starts[:-1]) * length
        starts = starts[:count]
        return row_host[starts], row_slot[starts], size, np.searchsorted(starts, row_first)

    def _dmas(self, row_host: np.ndarray, row_slot: np.ndarray, row_tpl: np.ndarray,
              row_first: np.ndarray, row_break: np.ndarray | None = None):
        """The template runs of every row, neighbours that continue each other on both
        sides (inside one chunk) merged: (host, slot offset, bytes, chunk boundaries)."""
        counts = self.tpl_count[row_tpl]
        rows = np.repeat(np.arange(row_host.size), counts)
        before = np.cumsum(counts) - counts
        run = np.repeat(self.tpl_first[row_tpl] - before, counts) + np.arange(rows.size)
        off = self.runs[0, run]
        host, slot, size = row_host[rows] + off, row_slot[rows] + off, self.runs[1, run]
        first = np.append(before[row_first[:-1]], rows.size)
        if size.size < 2:
            return host, slot, size, first
        joins = (host[:-1] + size[:-1] == host[1:]) & (slot[:-1] + size[:-1] == slot[1:])
        joins[first[1:-1] - 1] = False  # never across chunks
        if row_break is not None:  # never into a row where a registration begins
            opening = before[row_break & (counts > 0)]
            joins[opening[opening > 0] - 1] = False
        if not joins.any():
            return host, slot, size, first
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        return (host[starts], slot[starts], np.add.reduceat(size, starts),
                np.searchsorted(starts, first).astype(_I64))
