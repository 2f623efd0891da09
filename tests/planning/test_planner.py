"""The planner against an independent reference: a plain loop per group, tensor and page.

Addresses here are numbers, not memory (the planner never dereferences them); byte-exact
copies through real memory are in test_handlers.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.errors import ArgumentError, SpecError
from tiercache.pages import PageArray
from tiercache.region.layout import RegionLayout
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
from tiercache.planning.planner import TransferPlanner

from plan_reference import merge_runs

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU

GPU_BASE = 0x10_0000_0000
CPU_BASE = 0x7F00_0000_0000


def reference_pages(gpu, cpu, factor, group_tensors, gpu_spec, cpu_spec, store):
    """(src, dst, size) per GPU page, from the spec semantics, one Python step at a time."""
    out, gpu_at, cpu_at = [], 0, 0
    for tensors, n, index in zip(group_tensors, gpu_spec.group_sizes, gpu_spec.block_indices):
        if n == 0:
            continue
        skip = index % factor
        gids = [int(b) for b in gpu_spec.block_ids[gpu_at:gpu_at + n]]
        used = (n + skip + factor - 1) // factor
        cids = [int(b) for b in cpu_spec.block_ids[cpu_at:cpu_at + used]]
        gpu_at, cpu_at = gpu_at + n, cpu_at + used
        for t in tensors:
            g, c = gpu[t], cpu[t]
            for i in range(n):
                row, sub = divmod(skip + i, factor)
                gpu_addr = g.base_address + gids[i] * g.block_stride_bytes
                cpu_addr = c.base_address + cids[row] * c.block_stride_bytes + sub * c.page_bytes
                pair = (gpu_addr, cpu_addr) if store else (cpu_addr, gpu_addr)
                out.append((*pair, g.page_bytes))
    return out


def canonical(src, dst, sizes):
    """The byte mapping as maximal runs sorted by destination (destinations never overlap,
    so this form is unique for a mapping)."""
    order = np.argsort(np.asarray(dst, dtype=np.uint64), kind="stable")
    s, d, z = (np.asarray(a, dtype=np.uint64)[order] for a in (src, dst, sizes))
    runs = []
    for a, b, n in zip(s.tolist(), d.tolist(), z.tolist()):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += n
        else:
            runs.append([a, b, n])
    return [tuple(r) for r in runs]


@st.composite
def geometries(draw):
    """Page arrays for a random rank: padding, packed allocations, K/V halves."""
    num_tensors = draw(st.integers(1, 5))
    factor = draw(st.integers(1, 4))
    pages = tuple(draw(st.sampled_from([8, 24, 64, 256])) for _ in range(num_tensors))
    num_gpu_blocks = draw(st.integers(1, 10))
    num_cpu_blocks = draw(st.integers(1, 8))
    style = draw(st.sampled_from(["separate", "padded", "packed", "kv_pairs"]))
    gpu = []
    cursor = GPU_BASE
    for t, page in enumerate(pages):
        stride = page + (draw(st.sampled_from([0, 8, 40])) if style == "padded" else 0)
        if style == "kv_pairs" and t % 2 == 1 and pages[t - 1] == page:
            base = gpu[-1].base_address + num_gpu_blocks * stride  # V half after K half
        else:
            base = cursor
        gpu.append(PageArray(base, num_gpu_blocks, stride, page))
        span = num_gpu_blocks * stride
        cursor = max(cursor, base + span) + (0 if style == "packed" else 1 << 20)
    layout = RegionLayout(1, num_cpu_blocks, pages, factor)
    cpu = [PageArray(CPU_BASE + layout.page_offsets[t], num_cpu_blocks, layout.row_stride, page,
                     factor) for t, page in enumerate(pages)]
    order = draw(st.permutations(range(num_tensors)))
    cuts = sorted(draw(st.lists(st.integers(1, num_tensors), max_size=2)))
    bounds = [0, *cuts, num_tensors]
    groups = [list(order[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    return gpu, cpu, factor, groups


def _ids(draw, count, limit, unique):
    if count == 0:
        return []
    if unique and count > limit:
        return None
    if draw(st.booleans()):  # a run: merges become possible
        start = draw(st.integers(0, max(limit - count, 0)))
        return [min(start + i, limit - 1) for i in range(count)] if not unique else \
            list(range(start, start + count))
    if unique:
        return draw(st.permutations(range(limit)))[:count]
    return draw(st.lists(st.integers(0, limit - 1), min_size=count, max_size=count))


@st.composite
def transfers(draw):
    gpu, cpu, factor, groups = draw(geometries())
    store = draw(st.booleans())
    sizes, indices, gids, cids = [], [], [], []
    for _ in groups:
        n = draw(st.integers(0, 6))
        skip = draw(st.integers(0, factor - 1))
        used = (n + skip + factor - 1) // factor if n else 0
        g = _ids(draw, n, gpu[0].num_blocks, unique=not store)
        c = _ids(draw, used, cpu[0].num_blocks, unique=store)
        if g is None or c is None:  # not enough blocks for unique ids: make the group empty
            n, used, g, c = 0, 0, [], []
        sizes.append(n)
        indices.append(skip + factor * draw(st.integers(0, 3)))
        gids += g
        cids += c
    gpu_spec = GPULoadStoreSpec(gids, sizes, indices)
    cpu_spec = CPULoadStoreSpec(cids)
    return gpu, cpu, factor, groups, gpu_spec, cpu_spec, store


@settings(max_examples=300, deadline=None)
@given(transfers())
def test_plan_matches_reference_and_merging_keeps_every_byte(case):
    gpu, cpu, factor, groups, gpu_spec, cpu_spec, store = case
    planner = TransferPlanner(gpu, cpu, factor, groups)
    direction = G2C if store else C2G
    spec = direction.src_dst(gpu_spec, cpu_spec)
    expected = reference_pages(gpu, cpu, factor, groups, gpu_spec, cpu_spec, store)

    raw = planner.plan(direction, spec, merge=False)
    assert raw.direction is direction
    assert sorted(zip(raw.src.tolist(), raw.dst.tolist(), raw.sizes.tolist())) == sorted(expected)

    merged = planner.plan(direction, spec)
    general = merge_runs(raw.src, raw.dst, raw.sizes)
    for fast, slow in zip((merged.src, merged.dst, merged.sizes), general):
        np.testing.assert_array_equal(fast, slow)  # the fast join test finds every run
    assert canonical(merged.src, merged.dst, merged.sizes) == canonical(*zip(*expected)) \
        if expected else merged.num_descriptors == 0
    assert merged.num_bytes == sum(size for *_, size in expected)
    for array in (merged.src, merged.dst, merged.sizes):
        assert array.dtype == np.uint64 and not array.flags.writeable
    host = merged.dst if store else merged.src
    if factor == 1 and len(groups) == 1 and store:  # CPU rows unique: host order, for staged
        assert np.all(host[1:] > host[:-1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 64), st.integers(1, 4)),
                min_size=0, max_size=30))
def test_merge_runs_preserves_the_byte_multiset(rows):
    src = np.array([a * 4 for a, _, _ in rows], dtype=np.uint64)
    dst = np.cumsum([0] + [n * 4 for *_, n in rows])[:-1].astype(np.uint64) + 1000
    sizes = np.array([n * 4 for *_, n in rows], dtype=np.uint64)
    m_src, m_dst, m_sizes = merge_runs(src, dst, sizes)

    def bytes_of(s, d, z):
        return sorted((a + i, b + i) for a, b, n in zip(s.tolist(), d.tolist(), z.tolist())
                      for i in range(n))

    assert bytes_of(m_src, m_dst, m_sizes) == bytes_of(src, dst, sizes)
    assert m_sizes.size <= sizes.size


def _dense_rank(num_tensors, page, factor, gpu_blocks=64, cpu_blocks=32):
    gpu = [PageArray(GPU_BASE + t * (1 << 30), gpu_blocks, page, page) for t in range(num_tensors)]
    layout = RegionLayout(1, cpu_blocks, (page,) * num_tensors, factor)
    cpu = [PageArray(CPU_BASE + layout.page_offsets[t], cpu_blocks, layout.row_stride, page,
                     factor) for t in range(num_tensors)]
    return gpu, cpu


def test_consecutive_gpu_pages_fill_whole_cpu_pages_in_one_descriptor():
    gpu, cpu = _dense_rank(num_tensors=4, page=4096, factor=4)
    planner = TransferPlanner(gpu, cpu, 4)
    spec = (GPULoadStoreSpec(range(8, 16)), CPULoadStoreSpec([5, 2]))
    assert planner.plan(G2C, spec, merge=False).num_descriptors == 4 * 8
    plan = planner.plan(G2C, spec)
    assert plan.num_descriptors == 4 * 2  # one per (tensor, CPU block)
    assert set(plan.sizes.tolist()) == {4 * 4096}


def test_cross_layer_layout_with_consecutive_ids_is_one_descriptor():
    page = 2 << 20  # whole block of every layer: rows are exactly one page
    gpu, cpu = _dense_rank(num_tensors=1, page=page, factor=1)
    plan = TransferPlanner(gpu, cpu, 1).plan(C2G, (CPULoadStoreSpec(range(3, 11)),
                                                   GPULoadStoreSpec(range(20, 28))))
    assert plan.num_descriptors == 1 and plan.num_bytes == 8 * page
    assert int(plan.src[0]) == cpu[0].base_address + 3 * cpu[0].block_stride_bytes


def test_mid_block_load_skips_leading_sub_pages():
    gpu, cpu = _dense_rank(num_tensors=1, page=256, factor=4)
    plan = TransferPlanner(gpu, cpu, 4).plan(
        C2G, (CPULoadStoreSpec([7, 9]), GPULoadStoreSpec([40, 41, 42], block_indices=[6])))
    c = cpu[0]
    row7 = c.base_address + 7 * c.block_stride_bytes
    row9 = c.base_address + 9 * c.block_stride_bytes
    got = list(zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()))
    assert got == [(row7 + 2 * 256, GPU_BASE + 40 * 256, 512), (row9, GPU_BASE + 42 * 256, 256)]


# ---------------------------------------------------------------- bad specs

@pytest.fixture
def planner():
    gpu, cpu = _dense_rank(num_tensors=3, page=512, factor=2, gpu_blocks=16, cpu_blocks=8)
    return TransferPlanner(gpu, cpu, 2, group_tensors=[[0, 1], [2]])


@pytest.mark.parametrize("direction, spec, message", [
    (G2C, (GPULoadStoreSpec([1, 16], [1, 1]), CPULoadStoreSpec([0, 1])), "GPU block id 16"),
    (C2G, (CPULoadStoreSpec([8, 1]), GPULoadStoreSpec([1, 2], [1, 1])), "CPU block id 8"),
    (G2C, (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0])), "this rank has 2 groups"),
    (G2C, (GPULoadStoreSpec([1, 2, 3], [2, 1]), CPULoadStoreSpec([0])), "need 2"),
    (G2C, (GPULoadStoreSpec([1, 2, 3], [2, 1]), CPULoadStoreSpec([0, 1, 2])), "need 2"),
    (C2G, (CPULoadStoreSpec([0]), GPULoadStoreSpec([3, 3], [2, 0])), "GPU block id 3 appears"),
    (G2C, (GPULoadStoreSpec([1, 2, 3, 4], [4, 0]), CPULoadStoreSpec([5, 5])),
     "CPU block id 5 appears"),
    (G2C, (GPULoadStoreSpec([1]), GPULoadStoreSpec([1])),
     r"gpu_to_cpu transfer takes .*; got \(GPULoadStoreSpec, GPULoadStoreSpec\)"),
    (C2G, (CPULoadStoreSpec([1]), CPULoadStoreSpec([1])),
     r"cpu_to_gpu transfer takes .*; got \(CPULoadStoreSpec, CPULoadStoreSpec\)"),
    (G2C, (CPULoadStoreSpec([1]), GPULoadStoreSpec([1])),  # a load given as a store
     r"= \(GPULoadStoreSpec, CPULoadStoreSpec\); got \(CPULoadStoreSpec, GPULoadStoreSpec\)"),
    (C2G, [CPULoadStoreSpec([1]), GPULoadStoreSpec([1])], r"a \(src_spec, dst_spec\) pair"),
])
def test_bad_specs_are_refused_naming_the_value(planner, direction, spec, message):
    with pytest.raises(SpecError, match=message):
        planner.plan(direction, spec)


def test_direction_of_a_pair_is_read_from_its_types_once():
    gpu, cpu = GPULoadStoreSpec([1]), CPULoadStoreSpec([2])
    assert Direction.of((gpu, cpu)) is G2C and Direction.of((cpu, gpu)) is C2G
    for bad in ((gpu, gpu), (cpu, cpu), (gpu,), "spec"):
        with pytest.raises(SpecError, match="pairs a GPU and a CPU spec"):
            Direction.of(bad)


def test_same_cpu_block_in_two_groups_is_fine(planner):
    plan = planner.plan(G2C, (GPULoadStoreSpec([1, 2, 3], [2, 1]), CPULoadStoreSpec([4, 4])))
    assert plan.num_bytes == 3 * 512 * 2 - 512  # group 0: 2 tensors x 2 pages, group 1: 1 x 1


@pytest.mark.parametrize("direction", [G2C, C2G])
def test_groups_overlaid_on_the_same_tensors_each_move_their_own_blocks(direction):
    """vLLM's hybrid allocator overlays its KV-cache groups (full attention, sliding window)
    on the same tensors: each group's blocks and slots are its own, every byte is moved."""
    gpu, cpu = _dense_rank(num_tensors=3, page=512, factor=1)
    groups = [[0, 1, 2], [0, 1, 2]]
    planner = TransferPlanner(gpu, cpu, 1, groups)
    gpu_spec, cpu_spec = GPULoadStoreSpec([4, 5, 6, 9, 10], [3, 2]), CPULoadStoreSpec(
        [1, 2, 3, 7, 8])
    spec = (gpu_spec, cpu_spec) if direction is G2C else (cpu_spec, gpu_spec)
    plan = planner.plan(direction, spec)
    expected = reference_pages(gpu, cpu, 1, groups, gpu_spec, cpu_spec, direction is G2C)
    assert plan.num_bytes == 5 * 3 * 512
    assert canonical(plan.src, plan.dst, plan.sizes) == canonical(*zip(*expected))


@pytest.mark.parametrize("groups, message", [
    ([[0, 3]], "names tensor 3"),
    ([[0, 1, 1]], "names a tensor twice"),
    ([[0], []], "group_tensors\\[1\\] is empty"),
])
def test_bad_group_tensors_are_refused(groups, message):
    gpu, cpu = _dense_rank(num_tensors=3, page=512, factor=1)
    with pytest.raises(ArgumentError, match=message):
        TransferPlanner(gpu, cpu, 1, groups)


def test_page_arrays_must_agree():
    gpu, cpu = _dense_rank(num_tensors=2, page=512, factor=2)
    with pytest.raises(ArgumentError, match="must be 3"):
        TransferPlanner(gpu, cpu, 3)
    with pytest.raises(ArgumentError, match="blocks would overlap"):
        PageArray(GPU_BASE, 4, 256, 512)
