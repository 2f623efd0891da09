"""attach(): real region, real spawned worker processes, exact stats accounting."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest
import torch

from tiercache.backend_kind import BackendKind
from tiercache.config import KVGeometry, PinningPolicy, RegionConfig
from tiercache.errors import (
    ArgumentError, BackendError, ConfigError, LayoutMismatchError, RankError, RegionNotFoundError, SpecError,
)
from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stats import PinState
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
from tiercache.transfer.worker import attach

NUM_GPU_BLOCKS = 32
WAIT_S = 60
G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU


def gpu_pattern(rank: int, tensor: int, page_bytes: int) -> np.ndarray:
    """What rank ``rank`` holds in GPU tensor ``tensor``: distinct per rank and tensor."""
    return np.random.default_rng(1000 * rank + tensor).integers(
        0, 256, (NUM_GPU_BLOCKS, page_bytes), dtype=np.uint8)


def _expect(conn, tag: str):
    assert conn.poll(WAIT_S), f"no {tag!r} from the worker within {WAIT_S} s"
    message = conn.recv()
    assert message[0] == tag, message
    return message[1:]


def rank_main(config, rank: int, conn) -> None:
    """A worker process: attach, two stores and a load on command, report, close."""
    gpu = [torch.from_numpy(gpu_pattern(rank, t, p)) for t, p in enumerate(config.kv.page_bytes)]
    worker = attach(config, rank, gpu)
    conn.send(("attached", os.getpid()))
    _expect(conn, "go")
    worker.transfer_async(10, (GPULoadStoreSpec(range(0, 6)), CPULoadStoreSpec(range(3, 9))))
    worker.transfer_async(11, (GPULoadStoreSpec([7, 9]), CPULoadStoreSpec([12, 1])))
    worker.wait([10, 11])  # loads are not ordered after stores: the scheduler waits
    worker.transfer_async(12, (CPULoadStoreSpec([3, 12]), GPULoadStoreSpec([20, 21])))
    worker.wait([10, 11, 12])
    results = [(r.job_id, r.success, r.transfer_size, r.transfer_time, r.transfer_type)
               for r in worker.get_finished()]
    loaded = [t[20:22].numpy().copy() for t in gpu]
    conn.send(("done", results, loaded))
    _expect(conn, "close")
    worker.close()
    conn.send(("closed",))


def test_ranks_attach_in_their_own_processes_and_stats_match_bytes_moved(make_config):
    config = make_config()
    pages = config.kv.page_bytes
    page_sum = sum(pages)
    ctx = mp.get_context("spawn")
    region = SharedOffloadRegion.create(config)
    procs, conns = [], []
    try:
        for rank in range(config.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(config, rank, child))
            proc.start()
            procs.append(proc)
            conns.append(parent)
        for rank, (proc, conn) in enumerate(zip(procs, conns)):
            (pid,) = _expect(conn, "attached")
            snap = region.stats(rank).snapshot()
            assert (snap.pid, snap.attach_count, snap.pin_state) == (proc.pid, 1, PinState.UNPINNED)
            assert snap.backends == (BackendKind.CPU, BackendKind.CPU)
            assert snap.pid_start_ns > 0
            conn.send(("go",))
        for rank, conn in enumerate(conns):
            results, loaded = _expect(conn, "done")
            assert [r[:3] for r in results] == [(10, True, 6 * page_sum), (11, True, 2 * page_sum),
                                                (12, True, 2 * page_sum)]
            rows = region.rank_array(rank)
            layout = region.layout
            for t, page in enumerate(pages):
                source = gpu_pattern(rank, t, page)
                stored = {**{c: g for g, c in zip(range(0, 6), range(3, 9))}, 12: 7, 1: 9}
                for cpu_block, gpu_block in stored.items():
                    off = layout.page_offsets[t]
                    np.testing.assert_array_equal(rows[cpu_block, off:off + page], source[gpu_block])
                np.testing.assert_array_equal(loaded[t], source[[0, 7]])
            snap = region.stats(rank).snapshot()
            g2c, c2g = snap.directions[G2C], snap.directions[C2G]
            assert (g2c.bytes_total, g2c.transfers_ok, g2c.transfers_failed) == (8 * page_sum, 2, 0)
            assert (c2g.bytes_total, c2g.transfers_ok, c2g.transfers_failed) == (2 * page_sum, 1, 0)
            assert sum(g2c.duration_counts) == 2 and sum(c2g.size_counts) == 1
            assert g2c.busy_seconds_total == pytest.approx(
                sum(r[3] for r in results if r[4] is G2C), abs=1e-6)
        for rank, (proc, conn) in enumerate(zip(procs, conns)):
            conn.send(("close",))
            _expect(conn, "closed")
            proc.join(WAIT_S)
            assert proc.exitcode == 0
            snap = region.stats(rank).snapshot()
            assert (snap.pid, snap.pin_state, snap.backends) == \
                (0, PinState.NONE, (BackendKind.NONE, BackendKind.NONE))
            assert snap.directions[G2C].bytes_total == 8 * page_sum  # counters outlive the worker
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(WAIT_S)
        region.close()


@pytest.fixture
def served(make_config):
    config = make_config()
    region = SharedOffloadRegion.create(config)
    yield config, region
    region.close()


def _caches(config, num_blocks: int = NUM_GPU_BLOCKS):
    return [torch.zeros(num_blocks, p, dtype=torch.uint8) for p in config.kv.page_bytes]


def test_attach_by_name_round_trips_and_detaches(served):
    config, region = served
    caches = _caches(config)
    for t, cache in enumerate(caches):
        cache[3].fill_(t + 1)
    with attach(config.name, 1, caches, pinning=PinningPolicy.ALLOW_UNPINNED) as worker:
        assert worker.backends == {G2C: BackendKind.CPU, C2G: BackendKind.CPU}
        assert worker.pin_state is PinState.UNPINNED  # host caches: nothing to pin for
        snap = region.stats(1).snapshot()
        assert snap.pin_state is PinState.UNPINNED
        assert snap.prefault_seconds > 0  # the worker pre-faulted its own slice
        worker.transfer_async(1, (GPULoadStoreSpec([3]), CPULoadStoreSpec([15])))
        worker.wait([1])  # the two directions are independent: order them here
        worker.transfer_async(2, (CPULoadStoreSpec([15]), GPULoadStoreSpec([4])))
        worker.wait([1, 2])
        assert [r.success for r in worker.get_finished()] == [True, True]
        for t, cache in enumerate(caches):
            assert torch.equal(cache[4], torch.full_like(cache[4], t + 1))
    assert region.stats(1).snapshot().pid == 0
    assert region.stats(0).snapshot().attach_count == 0  # the other rank is untouched


def test_the_verbs_say_the_direction_and_refuse_specs_of_the_other(served):
    config, region = served
    caches = _caches(config)
    for t, cache in enumerate(caches):
        cache[5].fill_(t + 7)
    with attach(config, 0, caches) as worker:
        assert worker.submit_store(1, GPULoadStoreSpec([5]), CPULoadStoreSpec([9]))
        worker.wait([1])
        assert worker.submit_load(2, CPULoadStoreSpec([9]), GPULoadStoreSpec([6]))
        assert worker.submit_load(3, CPULoadStoreSpec([9]), GPULoadStoreSpec([8]),
                                  expedited=True)
        worker.wait([2, 3])
        results = {r.job_id: (r.success, r.transfer_type) for r in worker.get_finished()}
        assert results == {1: (True, G2C), 2: (True, C2G), 3: (True, C2G)}
        for cache in caches:
            assert torch.equal(cache[6], cache[5]) and torch.equal(cache[8], cache[5])
        with pytest.raises(SpecError, match=r"gpu_to_cpu transfer takes \(src_spec, dst_spec\) "
                           r"= \(GPULoadStoreSpec, CPULoadStoreSpec\); got \(CPULoadStoreSpec, "
                           r"GPULoadStoreSpec\)"):
            worker.submit_store(4, CPULoadStoreSpec([9]), GPULoadStoreSpec([5]))
        with pytest.raises(SpecError, match=r"cpu_to_gpu transfer takes .*; got "
                           r"\(GPULoadStoreSpec, CPULoadStoreSpec\)"):
            worker.submit_load(5, GPULoadStoreSpec([5]), CPULoadStoreSpec([9]))
        with pytest.raises(SpecError, match=r"cpu_to_gpu transfer .*; got \(CPULoadStoreSpec, "
                           r"CPULoadStoreSpec\)"):
            worker.submit_load(6, CPULoadStoreSpec([9]), CPULoadStoreSpec([5]), expedited=True)
        assert worker.handlers.gpu_to_cpu_handler.num_in_flight == 0
        assert worker.handlers.cpu_to_gpu_handler.num_in_flight == 0
    snap = region.stats(0).snapshot()
    assert (snap.directions[G2C].transfers_ok, snap.directions[C2G].transfers_ok) == (1, 2)
    assert snap.directions[G2C].transfers_failed == snap.directions[C2G].transfers_failed == 0


@pytest.mark.parametrize("change, error, message", [
    (dict(rank=2), RankError, "rank 2"),
    (dict(name="nope"), RegionNotFoundError, "no region"),
    (dict(other_geometry=True), LayoutMismatchError, "geometry"),
    (dict(caches=2), ArgumentError, "2 KV tensors given"),
    (dict(small_pages=True), ArgumentError, "bytes per block"),
    (dict(backend="ce"), BackendError, "CUDA device"),
    (dict(backend="ce_loop"), BackendError, "CUDA device"),
    (dict(backend="warp"), ConfigError, "backend = 'warp': allowed 'auto', 'ce', "),
])
def test_attach_refusals_leave_the_rank_untouched(served, make_config, change, error, message):
    config, region = served
    target = config
    if "other_geometry" in change:
        target = make_config(kv=KVGeometry(page_bytes=(4096, 4096, 4096)))
    if "name" in change:
        target = change["name"]
    caches = _caches(config)
    if "caches" in change:
        caches = caches[:change["caches"]]
    if "small_pages" in change:
        caches[1] = torch.zeros(NUM_GPU_BLOCKS, 100, dtype=torch.uint8)
    with pytest.raises(error, match=message):
        attach(target, change.get("rank", 0), caches, backend=change.get("backend"))
    snap = region.stats(0).snapshot()
    assert (snap.pid, snap.attach_count) == (0, 0)


def test_required_pinning_refuses_host_caches_clearly(served):
    from tiercache.errors import PinUnavailableError

    config, region = served
    with pytest.raises(PinUnavailableError, match="refuses to run unpinned"):
        attach(config.name, 0, _caches(config), pinning=PinningPolicy.REQUIRED)
    snap = region.stats(0).snapshot()
    assert snap.pin_state is PinState.FAILED and snap.pid == 0  # refused, and not attached


def test_a_prefault_failure_does_not_claim_pinning_failed(served, monkeypatch):
    from tiercache.errors import InsufficientMemoryError

    config, region = served

    def no_memory(self, first, end, num_threads):
        raise InsufficientMemoryError("cannot populate: /dev/shm ran out")

    monkeypatch.setattr(SharedOffloadRegion, "prefault_rows", no_memory)
    with pytest.raises(InsufficientMemoryError):
        attach(config.name, 0, _caches(config), pinning=PinningPolicy.ALLOW_UNPINNED)
    snap = region.stats(0).snapshot()
    assert snap.pin_state is PinState.NONE and snap.pid == 0


def test_a_rank_can_attach_again_after_close(served):
    config, region = served
    for round_ in range(2):
        with attach(config, 0, _caches(config)) as worker:
            worker.transfer_async(round_, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    snap = region.stats(0).snapshot()
    assert snap.attach_count == 2 and snap.directions[G2C].transfers_ok == 2


def test_wait_for_ready_gives_up_after_the_timeout(make_config):
    config = make_config(region=RegionConfig(capacity_bytes=None, num_blocks=4))
    with pytest.raises(RegionNotFoundError):
        attach(config, 0, _caches(config), ready_timeout_s=0.05)
