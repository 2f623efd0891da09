"""An independent numpy reference for block staging (tests only).

Random rank geometries and transfers (several groups, block_size_factor 1/2/4, mid-block
loads, padded pages and rows, mixed page sizes, scattered and adjacent ids), memory as
numpy buffers at fixed base addresses, and two executors over that memory:

* ``run_plan``: the existing per-page plan (``TransferPlanner.plan``), one copy per
  descriptor — what the transfer must do;
* ``run_layout``: a ``BlockLayout`` executed chunk by chunk through a poisoned staging
  slot — pack every pair's pages into the slot (from the PageArrays and the documented
  formulas, not from the module's tables), then DMA the chunk's runs to the host; loads
  the reverse. ``pack`` can be replaced by a real kernel (interpreter or CUDA).

Generators draw through a small adapter so that hypothesis (shrinking) and a seeded
numpy generator (subprocesses, GPU runs) produce the same cases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tiercache.pages import PageArray
from tiercache.region.layout import RegionLayout
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec

HOST_POISON, SLOT_POISON, GPU_POISON = 0xA5, 0x5A, 0xC3
GPU_BASE = 0x10_0000_0000  # fake addresses for pure numpy runs (nothing dereferences them)
CPU_BASE = 0x7F00_0000_0000


class RngDraw:
    """Draws from a seeded numpy generator."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def int(self, lo: int, hi: int) -> int:  # inclusive
        return int(self.rng.integers(lo, hi + 1))

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def perm(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.permutation(n)]


class HypDraw:
    """Draws through hypothesis (``st.data()``), so failures shrink."""

    def __init__(self, data):
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def pick(self, options):
        return self.data.draw(self.st.sampled_from(options))

    def perm(self, n: int) -> list[int]:
        return list(self.data.draw(self.st.permutations(range(n))))


@dataclass
class Case:
    """A rank geometry (offsets from the two bases) and one transfer over it."""

    factor: int
    pages: list[int]
    gpu_offset: list[int]
    gpu_stride: list[int]
    num_gpu_blocks: int
    cpu_offset: list[int]
    cpu_stride: int
    num_cpu_blocks: int
    groups: list[list[int]]
    gpu_spec: GPULoadStoreSpec
    cpu_spec: CPULoadStoreSpec
    store: bool
    chunk_rows: int  # chunk_bytes in rows of the widest stride
    load_whole_rows: bool = False  # BlockStaging's load policy
    break_rows: int = 0  # BlockStaging's registration boundary (no DMA runs into such a row)

    @property
    def gpu_bytes(self) -> int:
        return max(o + (self.num_gpu_blocks - 1) * s + p
                   for o, s, p in zip(self.gpu_offset, self.gpu_stride, self.pages))

    @property
    def cpu_bytes(self) -> int:
        return self.num_cpu_blocks * self.cpu_stride

    @property
    def chunk_bytes(self) -> int:
        return -(-self.cpu_stride // 256) * 256 * self.chunk_rows

    @property
    def spec(self):
        return (self.gpu_spec, self.cpu_spec) if self.store else (self.cpu_spec, self.gpu_spec)

    @property
    def direction(self) -> Direction:
        return Direction.GPU_TO_CPU if self.store else Direction.CPU_TO_GPU

    def page_arrays(self, gpu_base: int, cpu_base: int):
        gpu = [PageArray(gpu_base + o, self.num_gpu_blocks, s, p)
               for o, s, p in zip(self.gpu_offset, self.gpu_stride, self.pages)]
        cpu = [PageArray(cpu_base + o, self.num_cpu_blocks, self.cpu_stride, p, self.factor)
               for o, p in zip(self.cpu_offset, self.pages)]
        return gpu, cpu


def _ids(d, count: int, limit: int, unique: bool) -> list[int] | None:
    if count == 0:
        return []
    if unique and count > limit:
        return None
    if d.int(0, 1):  # a run of adjacent ids: rows and pages can merge
        start = d.int(0, max(limit - count, 0))
        return [min(start + i, limit - 1) for i in range(count)]
    if unique:
        return d.perm(limit)[:count]
    return [d.int(0, limit - 1) for _ in range(count)]


def draw_case(d, max_tensors: int = 6, max_pages: int = 8) -> Case:
    num_tensors = d.int(1, max_tensors)
    factor = d.pick([1, 2, 4])
    sizes = d.pick([[16, 48, 256, 1024, 4096, 24], [256, 1024, 4096]])  # the 2nd tiles rows
    pages = [d.pick(sizes) for _ in range(num_tensors)]
    num_gpu, num_cpu = d.int(1, 12), d.int(1, 10)
    style = d.pick(["separate", "padded", "packed", "kv_pairs"])
    offsets, strides, cursor = [], [], 0
    for t, page in enumerate(pages):
        stride = page + (d.pick([0, 16, 48]) if style == "padded" else 0)
        if style == "kv_pairs" and t % 2 == 1 and pages[t - 1] == page:
            base = offsets[-1] + num_gpu * stride  # V half after the K half
        else:
            base = cursor
        offsets.append(base)
        strides.append(stride)
        cursor = max(cursor, base + num_gpu * stride) + (0 if style == "packed" else 256)
    layout = RegionLayout(1, num_cpu, tuple(pages), factor)
    row_pad = d.pick([0, 0, 256, 4096])  # padded rows: images of adjacent rows do not meet
    order = d.perm(num_tensors)
    cuts = sorted({d.int(1, num_tensors) for _ in range(d.int(0, 2))})
    bounds = [0, *cuts, num_tensors]
    groups = [order[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    store = bool(d.int(0, 1))
    sizes, indices, gids, cids = [], [], [], []
    for _ in groups:
        n = d.int(0, max_pages)
        skip = d.int(0, factor - 1)  # mid-block: the first row is partial
        used = -(-(n + skip) // factor) if n else 0
        g = _ids(d, n, num_gpu, unique=not store)
        c = _ids(d, used, num_cpu, unique=store)
        if g is None or c is None:  # too few blocks for unique ids: an empty group
            n, used, g, c = 0, 0, [], []
        sizes.append(n)
        indices.append(skip + factor * d.int(0, 3))
        gids += g
        cids += c
    return Case(factor, pages, offsets, strides, num_gpu, list(layout.page_offsets),
                layout.row_stride + row_pad, num_cpu, groups,
                GPULoadStoreSpec(gids, sizes, indices), CPULoadStoreSpec(cids), store,
                chunk_rows=d.pick([1, 1, 2, 3, 64]), load_whole_rows=bool(d.int(0, 1)),
                break_rows=d.pick([0, 0, 1, 2, 3]))


def aligned(num_bytes: int, fill_byte: int = 0, align: int = 4096) -> np.ndarray:
    """A uint8 buffer whose first byte is ``align``-aligned (slots must be 256-aligned)."""
    raw = np.full(num_bytes + align, fill_byte, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + num_bytes]


class Memory:
    """A numpy buffer standing in for memory at ``base`` (``at`` checks the bounds)."""

    def __init__(self, data: np.ndarray, base: int):
        self.data, self.base = data, base

    def at(self, address: int, num_bytes: int) -> np.ndarray:
        start = int(address) - self.base
        if start < 0 or start + int(num_bytes) > self.data.size:
            raise AssertionError(f"[{address:#x}, +{num_bytes}) lies outside "
                                 f"[{self.base:#x}, +{self.data.size})")
        return self.data[start:start + int(num_bytes)]


def run_plan(plan, gpu: Memory, cpu: Memory, store: bool) -> None:
    """Apply the per-page plan (src -> dst, one copy per descriptor)."""
    src_mem, dst_mem = (gpu, cpu) if store else (cpu, gpu)
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()):
        dst_mem.at(d, n)[:] = src_mem.at(s, n)


def page_places(case: Case, gpu_pages, cpu_pages, pairs: np.ndarray):
    """(GPU address, slot offset, bytes) of every page of the given pairs, from the
    PageArrays and the documented formulas: slot offset = row slot offset +
    (cpu_base[t] - min cpu_base of the group) + sub * page_bytes[t]."""
    out = []
    for gid, row_slot, sub, g in pairs.T.tolist():
        origin = min(cpu_pages[t].base_address for t in case.groups[g])
        for t in case.groups[g]:
            gp, cp = gpu_pages[t], cpu_pages[t]
            out.append((gp.base_address + gid * gp.block_stride_bytes,
                        row_slot + cp.base_address - origin + sub * gp.page_bytes, gp.page_bytes))
    return out


Pack = Callable[[np.ndarray, int, int], None]  # (slot, first pair, count) -> None


def run_layout(case: Case, layout, gpu_pages, cpu_pages, gpu: Memory, cpu: Memory,
               pack: Pack | None = None) -> None:
    """Execute ``layout`` chunk by chunk through a fresh poisoned slot. ``pack`` moves the
    chunk's pages between GPU memory and the slot (store: into it, load: out of it);
    None: the numpy model of the kernel."""
    store = case.store
    for k in range(layout.num_chunks):
        slot = aligned(case.chunk_bytes, SLOT_POISON)
        dmas = layout.dma_range(k)
        runs = list(zip(layout.dma_host[dmas].tolist(), layout.dma_slot[dmas].tolist(),
                        layout.dma_bytes[dmas].tolist()))
        for _, offset, n in runs:
            assert offset + n <= slot.size, f"DMA [{offset}, +{n}) past the {slot.size}-byte slot"
        if not store:
            for host, offset, n in runs:
                slot[offset:offset + n] = cpu.at(host, n)
        first, count = layout.pair_range(k)
        if pack is not None:
            pack(slot, first, count)
        else:
            for address, offset, n in page_places(case, gpu_pages, cpu_pages,
                                                  layout.pairs[:, first:first + count]):
                assert offset + n <= slot.size, f"page [{offset}, +{n}) past the slot"
                if store:
                    slot[offset:offset + n] = gpu.at(address, n)
                else:
                    gpu.at(address, n)[:] = slot[offset:offset + n]
        if store:
            for host, offset, n in runs:
                cpu.at(host, n)[:] = slot[offset:offset + n]


def intervals(starts, lengths) -> list[tuple[int, int]]:
    """The union of [start, start + length) ranges as sorted maximal (start, end) pairs."""
    out: list[list[int]] = []
    for a, n in sorted(zip(np.asarray(starts).tolist(), np.asarray(lengths).tolist())):
        if out and out[-1][1] >= a:
            out[-1][1] = max(out[-1][1], a + n)
        else:
            out.append([a, a + n])
    return [tuple(x) for x in out]


def expected_after(case: Case, planner, gpu_data: np.ndarray, cpu_data: np.ndarray,
                   gpu_base: int, cpu_base: int):
    """(plan, GPU bytes, region bytes) after the per-page plan ran over copies."""
    plan = planner.plan(case.direction, case.spec)
    gpu, cpu = Memory(gpu_data.copy(), gpu_base), Memory(cpu_data.copy(), cpu_base)
    run_plan(plan, gpu, cpu, case.store)
    return plan, gpu.data, cpu.data


def assert_same(case: Case, plan, layout, gpu_got, cpu_got, gpu_expected, cpu_expected) -> None:
    """Every byte equal, and the DMAs cover exactly the plan's host bytes (whole-row
    loads: at least those)."""
    np.testing.assert_array_equal(cpu_got, cpu_expected, err_msg="region differs")
    np.testing.assert_array_equal(gpu_got, gpu_expected, err_msg="GPU memory differs")
    host = plan.dst if case.store else plan.src
    dma = intervals(layout.dma_host, layout.dma_bytes)
    needed = intervals(host, plan.sizes)
    if case.load_whole_rows and not case.store:
        assert all(any(a <= x and y <= b for a, b in dma) for x, y in needed), \
            "a page the load needs is not read"
    else:
        assert dma == needed, "DMAs do not cover exactly the plan's host bytes"
    if case.store:  # loads may read a row twice (repeated CPU ids); stores write each byte once
        assert int(layout.dma_bytes.sum()) == sum(b - a for a, b in dma), "host byte written twice"


def check_case(case: Case, layout, planner, gpu_pages, cpu_pages, gpu_base: int, cpu_base: int,
               gpu_data: np.ndarray, cpu_data: np.ndarray, pack: Pack | None = None) -> None:
    """Run the case both ways over copies of the same buffers and compare every byte
    (``fill`` poisons the destination side: bytes outside the plan must keep it)."""
    plan, gpu_expected, cpu_expected = expected_after(case, planner, gpu_data, cpu_data,
                                                      gpu_base, cpu_base)
    run_layout(case, layout, gpu_pages, cpu_pages, Memory(gpu_data, gpu_base),
               Memory(cpu_data, cpu_base), pack)
    assert_same(case, plan, layout, gpu_data, cpu_data, gpu_expected, cpu_expected)


def fill(case: Case, gpu_data: np.ndarray, cpu_data: np.ndarray, seed: int) -> None:
    """Random bytes on the source side, poison on the destination side."""
    rng = np.random.default_rng(seed)
    if case.store:
        gpu_data[:] = rng.integers(0, 256, gpu_data.size, dtype=np.uint8)
        cpu_data[:] = HOST_POISON
    else:
        cpu_data[:] = rng.integers(0, 256, cpu_data.size, dtype=np.uint8)
        gpu_data[:] = GPU_POISON
