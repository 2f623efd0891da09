"""The planner: a (src_spec, dst_spec) pair -> a validated plan, in the form a backend takes.

It works on addresses only (``PageArray``), never on devices. For each KV-cache group
g, GPU page i of the group (i = 0..n-1, n = ``group_sizes[g]``) pairs with region slot
``slots[(skip + i) // F]``, sub-page ``(skip + i) % F``, where F is the
block_size_factor and ``skip = block_indices[g] % F`` (a load may start mid slot);
the group consumes ``ceil((n + skip) / F)`` slots. Descriptors are laid out group by
group, each group as rows (``GroupWork.shape``): in host-address order where the
geometry allows it cheaply (F = 1: pages sorted by CPU row; tensors sharing rows are
written page by page), which spares ``staged`` a sort of every descriptor. Pages that
continue each other on both sides are fused from the ids; neighbours where rows meet
are checked on addresses (``runs.merge_at_row_ends``).

The caller says the direction (``plan(direction, (src_spec, dst_spec))``); the
planner checks the pair against it and never infers it. Everything is checked before
a plan is returned: spec types for the direction, group count, slot count, ids inside
both sides, no destination block written twice in a group. A refusal is a ``SpecError``
naming what is wrong.

Block plans are validated in C by default (``tiercache.native.validator``, built at the
first block plan: the native build needs a C compiler, which only ``staged`` needs); a
refusal there is re-checked here so that the ``SpecError`` says why. Page plans are
validated here, in numpy (the reference the C is tested against).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from tiercache.errors import SpecError
from tiercache.pages import PageArray
from tiercache.planning.geometry import TransferGeometry
from tiercache.planning.page_groups import GroupPages, GroupWork
from tiercache.planning.plans import BlockPlan, CopyPlan, PlanForm
from tiercache.planning.runs import merge_at_row_ends
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, TransferSpec

if TYPE_CHECKING:
    from tiercache.native.validator import NativeValidator

_U64 = np.uint64
_ENDS_CACHE_ENTRIES = 1024  # distinct (group shape) tuples remembered; small arrays each

__all__ = ["PlanBuffers", "TransferPlanner"]


def _check_ids(ids: np.ndarray, limit: int, side: str, group: int) -> None:
    top = int(ids.max())
    if top >= limit:
        raise SpecError(f"{side} block id {top} in group {group} is out of range: "
                        f"allowed 0..{limit - 1}")


def _check_unique(ordered: np.ndarray, side: str, group: int) -> None:
    """``ordered``: the destination ids, sorted."""
    repeats = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeats.size:
        raise SpecError(f"destination {side} block id {int(repeats[0])} appears more than once "
                        f"in group {group}: a page would be written twice")


def _row_order(slots: np.ndarray) -> np.ndarray | None:
    """Permutation to ascending slots (stable); None when they already ascend."""
    if slots.size < 2 or bool(np.all(slots[1:] > slots[:-1])):
        return None
    return np.argsort(slots, kind="stable")


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
        gpu_addr, cpu_addr, sizes = (a[:count] for a in self._arrays)
        return gpu_addr, cpu_addr, sizes


class TransferPlanner:
    """Plans transfers between one rank's GPU pages and its region slice.

    ``gpu_pages[t]`` and ``cpu_pages[t]`` are tensor t on each side (same
    ``page_bytes``; CPU arrays have ``block_size_factor`` pages per block).
    ``group_tensors[g]`` lists the tensors of KV-cache group g (default: one group
    holding every tensor); no tensor belongs to two groups: the rank's
    ``TransferGeometry`` (``geometry``), checked at construction. ``native_validation``:
    block plans are validated in C (module docstring); False: in numpy.
    """

    def __init__(self, gpu_pages: Sequence[PageArray], cpu_pages: Sequence[PageArray],
                 block_size_factor: int, group_tensors: Sequence[Sequence[int]] | None = None,
                 native_validation: bool = True):
        self._init(TransferGeometry.of(gpu_pages, cpu_pages, block_size_factor, group_tensors),
                   native_validation)

    @classmethod
    def of(cls, geometry: TransferGeometry, native_validation: bool = True) -> TransferPlanner:
        """The planner of ``geometry`` (its plans carry ``geometry.groups``)."""
        planner = cls.__new__(cls)
        planner._init(geometry, native_validation)
        return planner

    def _init(self, geometry: TransferGeometry, native_validation: bool) -> None:
        self.geometry = geometry
        self.gpu_pages, self.cpu_pages = geometry.gpu_pages, geometry.cpu_pages
        self.block_size_factor = geometry.block_size_factor
        self._ends_cache: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
        self._groups = geometry.groups
        self._pair_bytes = list(geometry.pair_bytes)
        self.native_validation = native_validation
        self._validator: NativeValidator | None = None

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

    @property
    def groups(self) -> tuple[GroupPages, ...]:
        """Each KV-cache group's page geometry, in group order (fixed at construction)."""
        return self._groups

    def plan_as(self, form: PlanForm, direction: Direction, transfer: TransferSpec,
                out: PlanBuffers | None = None) -> CopyPlan | BlockPlan:
        """``transfer`` planned in ``form`` (what the backend takes): ``plan`` or
        ``block_plan``. Raises SpecError naming what is wrong; nothing is returned then."""
        if form is PlanForm.BLOCKS:
            return self.block_plan(direction, transfer)
        return self.plan(direction, transfer, out=out)

    def group_works(self, direction: Direction, transfer: TransferSpec) -> list[GroupWork]:
        """Per non-empty group its validated (GPU id, slot, sub-page) pairs, checked in
        numpy; raises SpecError like ``plan``."""
        gpu_spec, cpu_spec = self.specs(direction, transfer)
        return self._validate(gpu_spec, cpu_spec, store=direction.stores)

    @staticmethod
    def specs(direction: Direction, transfer: TransferSpec
              ) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
        """``(gpu_spec, cpu_spec)`` of a transfer moving in ``direction``; ``SpecError`` when
        it is not such a pair (what every validation starts with)."""
        if not isinstance(transfer, tuple) or len(transfer) != 2:
            raise SpecError(f"a transfer is a (src_spec, dst_spec) pair; got {transfer!r}")
        return direction.gpu_cpu(*transfer)

    def block_plan(self, direction: Direction, transfer: TransferSpec) -> BlockPlan:
        """The block-level form of ``transfer``: O(blocks), no page descriptors. Raises
        SpecError like ``plan``."""
        if not self.native_validation:
            return self._packed(direction, self.group_works(direction, transfer))
        gpu, cpu = self.specs(direction, transfer)
        sizes = gpu.group_sizes
        done = self.validator().validate(direction, gpu.block_ids, sizes, gpu.block_indices,
                                         cpu.block_ids)
        if isinstance(done, int):
            self.refuse(direction, transfer, done)
        buffer, num_works = done
        return BlockPlan(direction, buffer, int(gpu.block_ids.size), num_works,
                         self.bytes_of(gpu), self._groups)

    def validator(self) -> NativeValidator:
        """``tc_validate`` over this planner's bounds (built at the first call: the native
        build needs a C compiler, which only block plans need)."""
        if self._validator is None:
            from tiercache.native.validator import NativeValidator

            self._validator = NativeValidator(self.block_size_factor,
                                              [g.num_gpu_blocks for g in self._groups],
                                              [g.num_slots for g in self._groups])
        return self._validator

    def bytes_of(self, gpu_spec: GPULoadStoreSpec) -> int:
        """The bytes a transfer of ``gpu_spec``'s blocks moves (of a valid spec)."""
        return sum(n * b for n, b in zip(gpu_spec.group_sizes, self._pair_bytes))

    @property
    def pair_bytes(self) -> tuple[int, ...]:
        """Bytes one (GPU block, slot) pair of each group moves."""
        return tuple(self._pair_bytes)

    def refuse(self, direction: Direction, transfer: TransferSpec, code: int) -> NoReturn:
        """The ``SpecError`` for a transfer the native validation refused with ``code``:
        re-checked here so that it says why."""
        self.group_works(direction, transfer)  # raises the SpecError that says why
        from tiercache.native.codes import SPEC_ERRORS

        raise SpecError(f"transfer refused: {SPEC_ERRORS.get(code, code)}")

    def _packed(self, direction: Direction, works: list[GroupWork]) -> BlockPlan:
        """``works`` in a block plan's buffer (what ``tc_validate`` writes)."""
        n = sum(int(w.gpu_ids.size) for w in works)
        buffer = np.zeros(3 * n + 2 * max(self.num_groups, 1), dtype=np.int64)
        pairs, meta = buffer[:3 * n].reshape(3, n), buffer[3 * n:].reshape(-1, 2)
        at = 0
        for i, w in enumerate(works):
            k = int(w.gpu_ids.size)
            pairs[0, at:at + k], pairs[1, at:at + k] = w.gpu_ids, w.slots
            if w.sub_pages is not None:
                pairs[2, at:at + k] = w.sub_pages
            meta[i] = self._groups.index(w.group), k
            at += k
        return BlockPlan(direction, buffer, n, len(works), sum(w.num_bytes for w in works),
                         self._groups)

    def plan(self, direction: Direction, transfer: TransferSpec, merge: bool = True,
             out: PlanBuffers | None = None) -> CopyPlan:
        """The descriptors of ``transfer`` = ``(src_spec, dst_spec)`` moving in
        ``direction``, merged unless ``merge=False``; raises SpecError naming what is wrong
        (a pair that does not move in ``direction`` included) before anything is returned.
        With ``out`` the plan's arrays are views of those buffers (valid until reused)."""
        return self._expand(direction, self.group_works(direction, transfer), merge, out)

    def _expand(self, direction: Direction, work: list[GroupWork], merge: bool,
                out: PlanBuffers | None) -> CopyPlan:
        if merge:  # fuse runs of pages where every tensor of the group agrees
            work = [w.fused() for w in work]
        total = sum(w.num_descriptors for w in work)
        gpu_addr, cpu_addr, sizes = (out or PlanBuffers()).take(total)
        at, within = 0, []
        for w in work:
            end = at + w.num_descriptors
            w.write(gpu_addr[at:end], cpu_addr[at:end], sizes[at:end])
            if merge:
                within.append(w.row_joins(gpu_addr[at:end], sizes[at:end]))
            at = end
        if merge:
            shapes = tuple(w.shape for w in work)
            gpu_addr, cpu_addr, sizes = merge_at_row_ends(gpu_addr, cpu_addr, sizes, shapes,
                                                          within, self._row_ends(shapes))
        src, dst = direction.src_dst(gpu_addr, cpu_addr)
        for array in (src, dst, sizes):
            array.setflags(write=False)
        return CopyPlan(src=src, dst=dst, sizes=sizes, direction=direction)

    def _validate(self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, store: bool
                  ) -> list[GroupWork]:
        if gpu_spec.num_groups != self.num_groups:
            raise SpecError(f"GPU spec has {gpu_spec.num_groups} KV-cache group(s) (group_sizes "
                            f"{list(gpu_spec.group_sizes)}); this rank has {self.num_groups} "
                            "groups and needs one entry for each")
        factor = self.block_size_factor
        skips = [index % factor for index in gpu_spec.block_indices]
        counts = [-(-(n + s) // factor) if n else 0 for n, s in zip(gpu_spec.group_sizes, skips)]
        if sum(counts) != len(cpu_spec):
            raise SpecError(
                f"CPU spec has {len(cpu_spec)} slots, but group_sizes "
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
            _check_ids(cids, group.num_slots, "CPU", g)
            if factor == 1:  # pages in ascending slot: host order (module docstring)
                order = _row_order(cids)
                if order is not None:
                    gids, cids = gids[order], cids[order]
                _check_unique(cids if store else np.sort(gids), "CPU" if store else "GPU", g)
                work.append(GroupWork(group, gids, cids, None))
                continue
            _check_unique(np.sort(cids if store else gids), "CPU" if store else "GPU", g)
            logical = np.arange(skip, skip + n)
            work.append(GroupWork(group, gids, cids[logical // factor],
                                   (logical % factor).astype(_U64)))
        return work
