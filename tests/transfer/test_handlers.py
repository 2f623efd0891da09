"""Handlers through the real ``cpu`` backend and host streams, byte for byte.

Every buffer starts as random poison; the expected world is a clone on which an
independent reference (torch indexing: "block b of tensor t is t[b]", "CPU block c,
sub-page j is view[c, j*page:(j+1)*page]") applies the transfer. The whole of every
buffer, padding and untouched blocks included, must then equal the reference.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tiercache.backends.base import StreamBackend, Submission
from tiercache.backends.cpu import CpuCopyBackend
from tiercache.backend_kind import BackendKind
from tiercache.device.host_streams import HostStreams
from tiercache.planning.plans import CopyPlan
from tiercache.errors import BackendError, HandlerClosedError, HandlerError, SpecError
from tiercache.region.layout import RegionLayout
from tiercache.region.stats import STATS_BLOCK_BYTES, RankStats
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
from tiercache.transfer.handlers import CpuGpuOffloadingHandlers, TransferResult
from tiercache.transfer.kv_caches import page_arrays_of, split_kv
from tiercache.transfer.wiring import build_handlers
from tiercache.planning.planner import TransferPlanner

NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 24, 12
G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU


# ---------------------------------------------------------------- worlds

@dataclass
class World:
    """Backing buffers (uint8, 1-D) and the views a layout cuts from them."""

    layout: RegionLayout
    backing: list[torch.Tensor]
    make_views: Callable[[list[torch.Tensor]], tuple[Any, list[torch.Tensor]]]

    def views(self, backing=None):
        return self.make_views(self.backing if backing is None else backing)

    def clone(self) -> list[torch.Tensor]:
        return [b.clone() for b in self.backing]


def _poisoned(num_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)


def _cpu_views(layout: RegionLayout, buf: torch.Tensor) -> list[torch.Tensor]:
    rows = buf[: layout.num_blocks * layout.row_stride].view(layout.num_blocks, layout.row_stride)
    return [rows[:, off: off + size] for off, size in zip(layout.page_offsets, layout.cpu_page_bytes)]


def make_world(style: str, factor: int, num_tensors: int = 3) -> World:
    """Layouts: 'separate' (one allocation per tensor, some padded), 'kv_split'
    ((2, num_blocks, ...) bf16 tensors), 'cross_layer' (one (num_blocks, layers, ...) tensor)."""
    if style == "separate":
        pages = [256, 512, 768, 256, 512][:num_tensors]
        pads = [0, 64, 0, 128, 0][:num_tensors]  # bytes of padding after each GPU page
        layout = RegionLayout(1, NUM_CPU_BLOCKS, tuple(pages), factor)
        gpu = [_poisoned(NUM_GPU_BLOCKS * (p + d), seed=t) for t, (p, d) in enumerate(zip(pages, pads))]

        def views(backing):
            tensors = [b.view(NUM_GPU_BLOCKS, p + d)[:, :p] if d == 0 else
                       b.view(NUM_GPU_BLOCKS, p + d)[:, : p + d // 2]  # trailing padding too
                       for b, p, d in zip(backing, pages, pads)]
            return tensors, _cpu_views(layout, backing[-1])
    elif style == "kv_split":
        heads, head_dim, tokens = 2, 16, 4  # bf16: a page is 256 bytes
        page = tokens * heads * head_dim * 2
        layers = num_tensors
        layout = RegionLayout(1, NUM_CPU_BLOCKS, (page,) * (2 * layers), factor)
        gpu = [_poisoned(2 * NUM_GPU_BLOCKS * page, seed=t) for t in range(layers)]

        def views(backing):
            kv = [b.view(torch.bfloat16).view(2, NUM_GPU_BLOCKS, tokens, heads, head_dim)
                  for b in backing[:-1]]
            return split_kv(kv), _cpu_views(layout, backing[-1])
    elif style == "cross_layer":
        layers, layer_bytes = num_tensors, 384
        layout = RegionLayout(1, NUM_CPU_BLOCKS, (layers * layer_bytes,), factor)
        gpu = [_poisoned(NUM_GPU_BLOCKS * layers * layer_bytes, seed=0)]

        def views(backing):
            return backing[0].view(NUM_GPU_BLOCKS, layers, layer_bytes), _cpu_views(layout, backing[-1])
    else:
        raise AssertionError(style)
    cpu = _poisoned(NUM_CPU_BLOCKS * layout.row_stride + 512, seed=99)  # + a tail past the rows
    return World(layout, [*gpu, cpu], views)


def _block_bytes(tensor: torch.Tensor, block: int, page: int) -> torch.Tensor:
    return tensor[block].view(torch.uint8).reshape(-1)[:page]


def apply_reference(world: World, backing, groups, gpu_spec, cpu_spec, store: bool) -> None:
    """The transfer by the spec's semantics, one page at a time, with torch indexing."""
    gpu_tensors, cpu_views = world.views(backing)
    if isinstance(gpu_tensors, torch.Tensor):
        gpu_tensors = [gpu_tensors]
    factor = world.layout.block_size_factor
    gpu_at = cpu_at = 0
    for tensors, n, index in zip(groups, gpu_spec.group_sizes, gpu_spec.block_indices):
        if n == 0:
            continue
        skip = index % factor
        used = (n + skip + factor - 1) // factor
        gids = gpu_spec.block_ids[gpu_at:gpu_at + n].tolist()
        cids = cpu_spec.block_ids[cpu_at:cpu_at + used].tolist()
        gpu_at, cpu_at = gpu_at + n, cpu_at + used
        for t in tensors:
            page = world.layout.page_bytes[t]
            for i, gid in enumerate(gids):
                row, sub = divmod(skip + i, factor)
                cpu_page = cpu_views[t][cids[row], sub * page:(sub + 1) * page]
                gpu_page = _block_bytes(gpu_tensors[t], gid, page)
                if store:
                    cpu_page.copy_(gpu_page)
                else:
                    gpu_page.copy_(cpu_page)


def assert_world(world: World, expected: list[torch.Tensor]) -> None:
    for i, (got, want) in enumerate(zip(world.backing, expected)):
        if not torch.equal(got, want):
            bad = torch.nonzero(got != want).flatten()
            raise AssertionError(f"buffer {i}: {bad.numel()} bytes differ, first at {bad[:8].tolist()}")


class Rig:
    """A world with both handlers over it (cpu backend, host streams, a stats block)."""

    def __init__(self, world: World, groups=None, backends=None, streams=None):
        self.world = world
        gpu_tensors, cpu_views = world.views()
        layout = world.layout
        self.groups = groups or [list(range(layout.num_tensors))]
        planner = TransferPlanner(page_arrays_of(gpu_tensors, layout.page_bytes),
                                  page_arrays_of(cpu_views, layout.page_bytes, layout.block_size_factor),
                                  layout.block_size_factor, self.groups)
        self.streams = streams or HostStreams()
        self.stats_buffer = bytearray(STATS_BLOCK_BYTES)
        self.stats = RankStats(self.stats_buffer, 0, rank=0)
        backends = backends or {d: CpuCopyBackend() for d in Direction}
        self.handlers = build_handlers(planner, backends, self.streams, self.stats)
        self.gates: list[threading.Event] = []

    def run(self, job_id: int, spec) -> TransferResult:
        assert self.handlers.transfer_async(job_id, spec)
        self.handlers.wait([job_id])
        (result,) = self.handlers.get_finished()
        return result

    def gate(self) -> threading.Event:
        """Hold the compute stream until the returned event is set (closing sets it too)."""
        gate = threading.Event()
        self.gates.append(gate)
        self.streams.current_stream().launch(lambda: gate.wait(timeout=60))
        return gate

    def close(self):
        for gate in self.gates:
            gate.set()
        self.handlers.shutdown()
        self.stats.release()


@pytest.fixture
def rigs():
    made = []

    def make(*args, **kwargs) -> Rig:
        made.append(Rig(*args, **kwargs))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def _specs(rng, groups, sizes, indices, factor, store):
    """Random ids for the given group sizes: unique on the destination side."""
    gids, cids = [], []
    for n, index in zip(sizes, indices):
        if n == 0:
            continue
        used = (n + index % factor + factor - 1) // factor
        gids += rng.choice(NUM_GPU_BLOCKS, n, replace=False).tolist()
        cids += rng.choice(NUM_CPU_BLOCKS, used, replace=False).tolist()
    return GPULoadStoreSpec(gids, sizes, indices), CPULoadStoreSpec(cids)


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("style", ["separate", "kv_split", "cross_layer"])
@pytest.mark.parametrize("factor", [1, 3, 4])
def test_round_trip_is_byte_exact(rigs, style, factor):
    world = make_world(style, factor)
    rig = rigs(world)
    rng = np.random.default_rng(factor)
    expected = world.clone()
    # a store of whole CPU blocks, then a load that starts mid block into other GPU blocks
    gpu_spec, cpu_spec = _specs(rng, rig.groups, [2 * factor], [0], factor, store=True)
    apply_reference(world, expected, rig.groups, gpu_spec, cpu_spec, store=True)
    result = rig.run(7, (gpu_spec, cpu_spec))
    assert_world(world, expected)
    page_sum = sum(world.layout.page_bytes)
    assert result == TransferResult(7, True, 2 * factor * page_sum, result.transfer_time, G2C)

    skip = factor - 1  # the load starts on the last sub-page of the first CPU block
    stored = gpu_spec.block_ids.tolist()
    load_gpu = GPULoadStoreSpec([b for b in range(NUM_GPU_BLOCKS) if b not in stored][: factor + 1],
                                block_indices=[skip + factor])
    load_cpu = CPULoadStoreSpec(cpu_spec.block_ids[:2])  # ceil((factor + 1 + skip) / factor)
    apply_reference(world, expected, rig.groups, load_gpu, load_cpu, store=False)
    result = rig.run(8, (load_cpu, load_gpu))
    assert_world(world, expected)
    assert (result.success, result.transfer_size, result.transfer_type) == \
        (True, (factor + 1) * page_sum, C2G)


@pytest.mark.parametrize("factor", [1, 3])
def test_three_groups_one_empty_with_mid_block_starts(rigs, factor):
    world = make_world("separate", factor, num_tensors=5)
    rig = rigs(world, groups=[[0, 3], [1], [2, 4]])
    rng = np.random.default_rng(3)
    expected = world.clone()
    for job, store in enumerate([True, False, True, False]):
        sizes = [2 * factor, 0, factor + 1]
        indices = [0, 0, factor - 1] if not store else [0, 0, 0]
        gpu_spec, cpu_spec = _specs(rng, rig.groups, sizes, indices, factor, store)
        apply_reference(world, expected, rig.groups, gpu_spec, cpu_spec, store)
        spec = (gpu_spec, cpu_spec) if store else (cpu_spec, gpu_spec)
        result = rig.run(job, spec)
        assert result.success
        assert_world(world, expected)
    snap = rig.stats.snapshot()
    assert snap.directions[G2C].transfers_ok == snap.directions[C2G].transfers_ok == 2


# ---------------------------------------------------------------- ordering

def test_many_jobs_finish_in_submission_order_and_run_fifo(rigs):
    world = make_world("separate", 1)
    rig = rigs(world)
    gate = rig.gate()
    rng = np.random.default_rng(5)
    job_ids = rng.choice(10_000, 60, replace=False).tolist()
    expected = world.clone()
    for job, gpu_block in zip(job_ids, range(60)):
        spec = (GPULoadStoreSpec([gpu_block % NUM_GPU_BLOCKS]), CPULoadStoreSpec([4]))
        apply_reference(world, expected, rig.groups, *spec, store=True)
        assert rig.handlers.transfer_async(job, spec)
    assert rig.handlers.get_finished() == []  # all wait for the compute stream
    gate.set()
    rig.handlers.wait(job_ids)
    results = rig.handlers.get_finished()
    assert [r.job_id for r in results] == job_ids and all(r.success for r in results)
    assert_world(world, expected)  # the last store to CPU block 4 won: FIFO


def test_load_waits_for_queued_compute_writes(rigs):
    world = make_world("separate", 1)
    rig = rigs(world)
    gpu_tensors, _ = world.views()
    expected = world.clone()
    spec = (CPULoadStoreSpec([2, 3]), GPULoadStoreSpec([5, 6]))
    for t in expected_tensors(world, expected):
        t[5:7].fill_(0)
    apply_reference(world, expected, rig.groups, spec[1], spec[0], store=False)
    gate = rig.gate()
    rig.streams.current_stream().launch(lambda: [t[5:7].fill_(0) for t in gpu_tensors])
    assert rig.handlers.transfer_async(1, spec)
    gate.set()
    rig.handlers.wait([1])
    assert_world(world, expected)  # loaded data, not the zeros queued before the load


def test_store_waits_for_queued_compute_writes(rigs):
    world = make_world("separate", 1)
    rig = rigs(world)
    gpu_tensors, _ = world.views()
    expected = world.clone()
    for t in expected_tensors(world, expected):
        t[9].fill_(0x5A)
    spec = (GPULoadStoreSpec([9]), CPULoadStoreSpec([0]))
    apply_reference(world, expected, rig.groups, *spec, store=True)
    gate = rig.gate()
    rig.streams.current_stream().launch(lambda: [t[9].fill_(0x5A) for t in gpu_tensors])
    assert rig.handlers.transfer_async(1, spec)
    gate.set()
    rig.handlers.wait([1])
    assert_world(world, expected)


def expected_tensors(world: World, backing) -> list[torch.Tensor]:
    tensors, _ = world.views(backing)
    return tensors


def test_wait_returns_after_the_copy_landed_and_ignores_unknown_ids(rigs):
    world = make_world("separate", 1)
    rig = rigs(world)
    expected = world.clone()
    spec = (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([3, 4]))
    apply_reference(world, expected, rig.groups, *spec, store=True)
    gate = rig.gate()
    assert rig.handlers.transfer_async(11, spec)
    opener = threading.Thread(target=gate.set)
    opener.start()
    rig.handlers.wait([11, 12345])
    opener.join(timeout=60)
    assert_world(world, expected)
    assert [r.job_id for r in rig.handlers.get_finished()] == [11]


def test_shutdown_drains_and_then_refuses(rigs):
    world = make_world("separate", 1)
    rig = rigs(world)
    expected = world.clone()
    gate = rig.gate()
    for job in range(10):
        spec = (CPULoadStoreSpec([job % NUM_CPU_BLOCKS]), GPULoadStoreSpec([job]))
        apply_reference(world, expected, rig.groups, spec[1], spec[0], store=False)
        rig.handlers.transfer_async(job, spec)
    opener = threading.Thread(target=gate.set)
    opener.start()
    results = rig.handlers.shutdown()
    opener.join(timeout=60)
    assert [r.job_id for r in results] == list(range(10)) and all(r.success for r in results)
    assert_world(world, expected)
    assert rig.stats.snapshot().directions[C2G].transfers_ok == 10
    with pytest.raises(HandlerClosedError, match="cpu_to_gpu handler is shut down; job 99"):
        rig.handlers.transfer_async(99, (CPULoadStoreSpec([0]), GPULoadStoreSpec([0])))


# ---------------------------------------------------------------- failures

class RefusingBackend(StreamBackend):
    kind = BackendKind.CPU

    def copy(self, plan: CopyPlan, stream: Any) -> tuple[object, ...]:
        raise BackendError("refused on purpose")


class FaultingBackend(StreamBackend):
    """Accepts the plan, then fails on the stream (like a device fault)."""

    kind = BackendKind.CPU

    def copy(self, plan: CopyPlan, stream: Any) -> tuple[object, ...]:
        def fault():
            raise OSError("device fault on purpose")
        stream.launch(fault)
        return ()


@pytest.mark.parametrize("bad_backend, accepted", [(RefusingBackend, False), (FaultingBackend, True)])
def test_failure_is_a_result_and_later_jobs_still_run(rigs, bad_backend, accepted):
    world = make_world("separate", 1)
    rig = rigs(world, backends={G2C: bad_backend(), C2G: CpuCopyBackend()})
    expected = world.clone()
    page_sum = sum(world.layout.page_bytes)
    assert rig.handlers.transfer_async(1, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))) is accepted
    load = (CPULoadStoreSpec([1]), GPULoadStoreSpec([2]))
    apply_reference(world, expected, rig.groups, load[1], load[0], store=False)
    assert rig.handlers.transfer_async(2, load)
    rig.handlers.wait([1, 2])
    results = rig.handlers.get_finished()
    assert results == [TransferResult(1, False, page_sum, 0.0, G2C),
                       TransferResult(2, True, page_sum, results[1].transfer_time, C2G)]
    assert_world(world, expected)  # the failed store wrote nothing here; the load landed
    snap = rig.stats.snapshot()
    assert (snap.directions[G2C].transfers_failed, snap.directions[G2C].bytes_total) == (1, 0)
    assert (snap.directions[C2G].transfers_ok, snap.directions[C2G].bytes_total) == (1, page_sum)


class MarkFailingStreams(HostStreams):
    """Host streams whose compute-stream mark fails while ``failing`` (as a CUDA error
    recording it would)."""

    failing = False

    def mark_current(self, event) -> None:
        if self.failing:
            raise BackendError("mark refused on purpose")
        super().mark_current(event)


def test_a_failed_mark_copies_nothing_and_fails_in_its_place(rigs, caplog):
    """The planned path's side of the contract (the native one: test_native_path.py)."""
    world = make_world("separate", 1)
    streams = MarkFailingStreams()
    rig = rigs(world, streams=streams)
    expected = world.clone()
    first, second, third = ((GPULoadStoreSpec([g]), CPULoadStoreSpec([c]))
                            for g, c in ((1, 2), (3, 4), (5, 6)))
    for spec in (first, third):  # the second lands nowhere
        apply_reference(world, expected, rig.groups, *spec, store=True)
    assert rig.handlers.transfer_async(1, first)
    streams.failing = True
    with caplog.at_level("ERROR", logger="tiercache.transfer.planned_path"):
        assert not rig.handlers.transfer_async(2, second)
    streams.failing = False
    assert rig.handlers.transfer_async(3, third)
    rig.handlers.wait([1, 2, 3])
    results = rig.handlers.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False), (3, True)]
    assert_world(world, expected)
    assert any("gpu_to_cpu job 2: the cpu backend could not submit" in r.getMessage()
               and "mark refused on purpose" in r.getMessage() for r in caplog.records)


class HeldTicket:
    """A ``Ticket`` (``tiercache.backends.base``), issued when the test says so (a backend
    whose own thread enqueues the transfer: ``staged``'s chunk loop)."""

    def __init__(self, status: int):
        self._issued = threading.Event()
        self._status = status

    def issue(self) -> None:
        self._issued.set()

    def issued(self) -> bool:
        return self._issued.is_set()

    def wait(self) -> None:
        assert self._issued.wait(timeout=30)

    @property
    def status(self) -> int:
        return self._status if self.issued() else -1


class LateIssuingBackend(CpuCopyBackend):
    """Copies as ``cpu`` does, then reports the transfer issued only when the test issues
    its ticket, with ``status`` (a CUresult: 0, or the failure of the issuing thread)."""

    def __init__(self, status: int):
        super().__init__()
        self.status = status
        self.tickets: list[HeldTicket] = []

    def submit(self, plan, ordering):
        done = super().submit(plan, ordering)
        self.tickets.append(HeldTicket(self.status))
        return Submission(done.keep, self.tickets[-1])


@pytest.mark.parametrize("status", [0, 700])
def test_a_transfer_is_done_only_once_its_ticket_says_issued(rigs, status):
    """Its end event may have passed already: until the backend's thread says issued the
    transfer is not reported and ``wait`` blocks; a failing status is ``success=False``."""
    world = make_world("separate", 1)
    backend = LateIssuingBackend(status)
    rig = rigs(world, backends={G2C: backend, C2G: CpuCopyBackend()})
    assert rig.handlers.transfer_async(1, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    rig.handlers.gpu_to_cpu_handler._transfers[0].end_event.synchronize()
    assert rig.handlers.get_finished() == []
    waiter = threading.Thread(target=rig.handlers.wait, args=([1],))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # wait() holds until the ticket is issued
    backend.tickets[0].issue()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    (result,) = rig.handlers.get_finished()
    assert result.job_id == 1 and result.success is (status == 0)
    direction = rig.stats.snapshot().directions[G2C]
    assert (direction.transfers_ok, direction.transfers_failed) == \
        ((1, 0) if status == 0 else (0, 1))


def test_bad_spec_raises_before_anything_is_enqueued(rigs):
    rig = rigs(make_world("separate", 1))
    with pytest.raises(SpecError, match="GPU block id 24"):
        rig.handlers.transfer_async(1, (GPULoadStoreSpec([24]), CPULoadStoreSpec([0])))
    assert rig.handlers.gpu_to_cpu_handler.num_in_flight == 0
    rig.handlers.transfer_async(1, (GPULoadStoreSpec([1]), CPULoadStoreSpec([0])))
    with pytest.raises(SpecError, match="job id 1 is already in flight"):
        rig.handlers.transfer_async(1, (GPULoadStoreSpec([2]), CPULoadStoreSpec([1])))
    with pytest.raises(SpecError, match=r"cpu_to_gpu transfer takes .* got \(GPULoadStoreSpec, "
                                        r"CPULoadStoreSpec\)"):
        rig.handlers.cpu_to_gpu_handler.transfer_async(5, (GPULoadStoreSpec([2]),
                                                           CPULoadStoreSpec([1])))
    with pytest.raises(SpecError, match=r"pairs a GPU and a CPU spec .* got \(GPULoadStoreSpec, "
                                        r"GPULoadStoreSpec\)"):
        rig.handlers.transfer_async(6, (GPULoadStoreSpec([2]), GPULoadStoreSpec([1])))
    assert rig.handlers.cpu_to_gpu_handler.num_in_flight == 0


def test_handlers_refuse_a_pairing_of_the_wrong_directions(rigs):
    rig = rigs(make_world("separate", 1))
    g2c, c2g = rig.handlers.gpu_to_cpu_handler, rig.handlers.cpu_to_gpu_handler
    with pytest.raises(HandlerError, match="expected a gpu_to_cpu handler, got cpu_to_gpu"):
        CpuGpuOffloadingHandlers(c2g, g2c)
    with pytest.raises(HandlerError, match="transfer_size=-1"):
        TransferResult(1, True, -1, 0.0, G2C)


def test_stats_account_every_transfer_exactly(rigs):
    world = make_world("separate", 2)
    rig = rigs(world)
    page_sum = sum(world.layout.page_bytes)
    sizes = []
    for job in range(6):
        n = 2 * (job + 1) if job % 2 == 0 else 2
        n = min(n, NUM_CPU_BLOCKS * 2)
        spec = (GPULoadStoreSpec(range(n)), CPULoadStoreSpec(range(n // 2)))
        rig.handlers.transfer_async(job, spec)
        sizes.append(n * page_sum)
    rig.handlers.wait(range(6))
    results = rig.handlers.get_finished()
    snap = rig.stats.snapshot().directions[G2C]
    assert snap.bytes_total == sum(sizes) == sum(r.transfer_size for r in results)
    assert snap.transfers_ok == 6 and snap.transfers_failed == 0
    assert sum(snap.duration_counts) == sum(snap.size_counts) == 6
    assert snap.busy_seconds_total == pytest.approx(sum(r.transfer_time for r in results), abs=1e-6)


def test_the_handler_knows_only_the_transfer_contract():
    """The handler orders, tracks and reports: what a transfer is (plan, fence, native
    call, backend) is its path's, so it imports none of those."""
    import ast
    from pathlib import Path

    import tiercache.transfer.handlers as handlers

    tree = ast.parse(Path(handlers.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for a in node.names}
    forbidden = ("tiercache.planning", "tiercache.native", "tiercache.backends",
                 "tiercache.transfer.fence", "tiercache.transfer.native_path",
                 "tiercache.transfer.planned_path")
    assert not [m for m in imported if m and m.startswith(forbidden)], imported
    assert "tiercache.transfer.path" in imported
