"""The shared region with real processes: attach by rank, isolation, refusals, staleness."""

import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

from tiercache.config import PinningPolicy, RegionConfig
from tiercache.device.pinning import HostPinner
from tiercache.errors import (
    InsufficientMemoryError, LayoutMismatchError, PinError, RankError, RegionExistsError,
    RegionError, RegionNotFoundError, RegionNotReadyError, RegionTrustError, StatsStuckError,
)
from tiercache.region.header import RegionState, Reservation
from tiercache.region.layout import RegionLayout
from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stale import list_regions, remove_stale
from tiercache.region.stats import PinState
from private_shm import run_on_small_dev_shm
from spawned import attach_and_hold, write_rank_pattern

SPAWN = mp.get_context("spawn")


@pytest.fixture
def region(make_config):
    r = SharedOffloadRegion.create(make_config())
    yield r
    r.close()


def test_create_writes_a_ready_header_owned_by_us_with_mode_0600(region, make_config):
    info = region.info()
    assert info.state is RegionState.READY and info.generation == 1
    assert info.owner_pid == os.getpid() and region.owner_alive()
    assert info.layout == RegionLayout.from_config(make_config())
    assert os.stat(region.path).st_mode & 0o777 == 0o600
    assert os.stat(region.path).st_size == region.layout.total_bytes
    # reserved before create returned (its default; `serve` reserves in the background:
    # tests/region/test_reservation.py)
    assert (info.reservation, info.reserved_rows) == (Reservation.COMPLETE,
                                                      region.layout.num_blocks)
    assert os.stat(region.path).st_blocks * 512 >= region.layout.total_bytes


def test_two_workers_see_their_own_writes_only_in_their_own_slices(region):
    done = [SPAWN.Event() for _ in range(2)]
    procs = [SPAWN.Process(target=write_rank_pattern, args=(region.path.split("tiercache-", 1)[1],
                                                           rank, 11 * (rank + 1), done[rank]))
             for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert np.all(region.rank_array(0) == 11) and np.all(region.rank_array(1) == 22)
    # header and padding between slices untouched by the workers' slice writes
    layout = region.layout
    gap0 = region._bytes[layout.slice_offset(0) + layout.slice_used_bytes: layout.slice_offset(1)]
    assert not gap0.any()
    assert region.info().state is RegionState.READY


def test_attach_refusals_are_specific(region, make_config, instance_name):
    with pytest.raises(RegionNotFoundError, match="no region /dev/shm/tiercache-nope"):
        SharedOffloadRegion.attach("nope")
    with pytest.raises(RankError, match="rank 2 is outside 0..1"):
        SharedOffloadRegion.attach(instance_name, 2)
    other = RegionLayout.from_config(make_config(world_size=3))
    with pytest.raises(LayoutMismatchError, match="this worker expects"):
        SharedOffloadRegion.attach(instance_name, 0, layout=other)
    region.header.set_state(RegionState.CREATING)
    with pytest.raises(RegionNotReadyError, match="state: creating"):
        SharedOffloadRegion.attach(instance_name, 0)
    region.header.set_state(RegionState.READY)
    SharedOffloadRegion.attach(instance_name, 0, layout=region.layout).close()


def test_attach_to_a_missing_region_suggests_the_instance_name_not_the_shm_name(make_config):
    """A worker attaches by ``config.shm_name``: the hint said ``instance.name =
    'tiercache-default'`` for an instance named ``default``, a name the config refuses."""
    cfg = make_config()
    for name in (cfg.shm_name, cfg.name):
        with pytest.raises(RegionNotFoundError) as refused:
            SharedOffloadRegion.attach(name, 0)
        assert str(refused.value).endswith(f"(is `tiercache serve` running with "
                                           f"instance.name = {cfg.name!r}?)"), refused.value


def test_a_too_small_dev_shm_is_advised_as_the_hosts_tmpfs_never_an_emptydir():
    """The region must outlive the coordinator's pod (docs/deploy.md: a hostPath of the
    host's /dev/shm); the advice used to be an emptyDir of medium Memory, which dies with
    the pod and loses the warm restart."""
    from tiercache.region.hostmem import check_space

    with pytest.raises(InsufficientMemoryError) as refused:
        check_space(1 << 60, "/dev/shm", check_host_memory=False)
    said = str(refused.value)
    assert "hostPath" in said and "size the host's tmpfs" in said, said
    assert "medium: Memory" not in said


def test_attach_waits_for_ready_within_its_timeout(region, instance_name):
    import threading

    region.header.set_state(RegionState.CREATING)
    timer = threading.Timer(0.2, region.header.set_state, args=(RegionState.READY,))
    timer.start()
    attached = SharedOffloadRegion.attach(instance_name, 1, timeout_s=10)
    assert attached.info().state is RegionState.READY
    attached.close()
    timer.join()


def test_a_second_coordinator_is_refused_while_the_first_lives(region, make_config):
    with pytest.raises(RegionExistsError, match=f"live coordinator \\(pid {os.getpid()}\\)"):
        SharedOffloadRegion.create(make_config())
    assert [r.live for r in list_regions() if r.path == region.path] == [True]
    assert remove_stale(names=[region.path.split("tiercache-", 1)[1]]) == []
    assert os.path.exists(region.path)


def _create_and_get_killed(config_toml: str, ready) -> None:  # pragma: no cover - child
    import tomllib

    from tiercache.config import config_from_dict

    region = SharedOffloadRegion.create(config_from_dict(tomllib.loads(config_toml)))
    region.rank_array(0)[0, :4] = 99
    ready.set()
    signal.pause()


def _kill_a_creator(make_config, **overrides):
    from tiercache.config import config_to_toml

    cfg = make_config(**overrides)
    ready = SPAWN.Event()
    p = SPAWN.Process(target=_create_and_get_killed, args=(config_to_toml(cfg), ready))
    p.start()
    assert ready.wait(30)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    return cfg


def test_sigkilled_coordinator_leaves_a_stale_region_that_clean_removes(make_config):
    cfg = _kill_a_creator(make_config)
    listing = [r for r in list_regions() if r.name == cfg.name]
    assert len(listing) == 1 and not listing[0].live
    assert [r.name for r in remove_stale(dry_run=True, names=[cfg.name])] == [cfg.name]
    assert os.path.exists(listing[0].path)
    assert [r.name for r in remove_stale(names=[cfg.name])] == [cfg.name]
    assert not os.path.exists(listing[0].path)


def test_stale_region_of_same_geometry_is_readopted_keeping_its_bytes(make_config):
    cfg = _kill_a_creator(make_config)
    messages = []
    region = SharedOffloadRegion.create(cfg, log_step=messages.append)
    try:
        assert region.setup_times.adopted
        assert "re-adopted stale region" in messages[0]
        info = region.info()
        assert info.generation == 2 and info.owner_pid == os.getpid()
        assert list(region.rank_array(0)[0, :4]) == [99] * 4
    finally:
        region.close()
    assert not os.path.exists(region.path)


def test_stale_region_of_other_geometry_is_replaced(make_config):
    _kill_a_creator(make_config)
    bigger = make_config(region=RegionConfig(capacity_bytes=None, num_blocks=32, prefault_threads=2))
    messages = []
    region = SharedOffloadRegion.create(bigger, log_step=messages.append)
    try:
        assert "replacing stale region" in messages[0] and "a different geometry" in messages[0]
        assert region.setup_times.replaced_stale and region.info().generation == 1
        assert region.layout.num_blocks == 32 and not region.rank_array(0)[0, :4].any()
    finally:
        region.close()


def test_sigkilled_worker_leaves_the_region_and_other_ranks_intact(region, instance_name):
    attached = [SPAWN.Event() for _ in range(2)]
    release = [SPAWN.Event() for _ in range(2)]  # a killed waiter would wedge a shared Event
    procs = [SPAWN.Process(target=attach_and_hold, args=(instance_name, r, attached[r], release[r]))
             for r in range(2)]
    for p in procs:
        p.start()
    assert all(e.wait(30) for e in attached)
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(10)
    assert procs[0].exitcode == -signal.SIGKILL
    release[1].set()
    procs[1].join(30)
    assert procs[1].exitcode == 0
    assert region.info().state is RegionState.READY
    assert list(region.rank_array(0)[0, :16]) == [1] * 16
    assert list(region.rank_array(1)[0, :16]) == [2] * 16
    from tiercache.region.hostmem import process_alive

    dead = region.stats(0).snapshot()
    assert dead.pid == procs[0].pid and not process_alive(dead.pid, dead.pid_start_ns)
    assert region.stats(1).snapshot().pid == 0  # detached cleanly
    # the killed rank re-attaches
    again = SharedOffloadRegion.attach(instance_name, 0, layout=region.layout)
    assert list(again.rank_array(0)[0, :16]) == [1] * 16
    again.close()


def test_region_larger_than_dev_shm_is_refused_with_both_numbers(make_config, instance_name):
    huge = make_config(region=RegionConfig(capacity_bytes=1 << 50, prefault_threads=2))
    with pytest.raises(InsufficientMemoryError, match=r"/dev/shm has .* free; the region needs "
                                                      r".*\(\d+ bytes\)"):
        SharedOffloadRegion.create(huge)
    assert not os.path.exists(f"/dev/shm/tiercache-{instance_name}")


def test_region_larger_than_host_memory_is_refused(make_config, monkeypatch):
    import psutil

    layout = RegionLayout.from_config(make_config())
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: real._replace(available=layout.total_bytes - 1))
    with pytest.raises(InsufficientMemoryError, match=r"host memory has .* available"):
        SharedOffloadRegion.create(make_config())


# Run in a private mount namespace over a small tmpfs mounted on /dev/shm (shm_open always
# uses /dev/shm). The child prints one JSON line of what happened.
_SMALL_SHM_CHILD = r"""
import json, os, sys
from tiercache.config import RegionConfig, config_from_dict
import tiercache.region.hostmem as hostmem
from tiercache.errors import InsufficientMemoryError
from tiercache.region.layout import RegionLayout
from tiercache.region.shared import SharedOffloadRegion

base = {"instance": {"name": "small", "world_size": 2},
        "kv": {"page_bytes": [4096, 8192, 4096]}, "region": {"prefault_threads": 2}}
out = {}
# 32768 blocks: a header (its ledger) over 8 MiB; 512: a 2 MiB header, 16 MiB of slices
for case, blocks in (("check", 512), ("fallocate", 32768)):
    cfg = config_from_dict({**base, "region": {**base["region"], "num_blocks": blocks}})
    out[case + "_bytes"] = RegionLayout.from_config(cfg).total_bytes
    if case == "fallocate":  # the free-space check passes, as if another tenant filled
        hostmem.shm_free_bytes = lambda d: out["fallocate_bytes"]  # tmpfs right after it
    try:
        SharedOffloadRegion.create(cfg).close()
        out[case] = "created"
    except InsufficientMemoryError as e:
        out[case] = str(e)
    out[case + "_left"] = os.listdir("/dev/shm")
print(json.dumps(out))
"""


def test_a_small_dev_shm_is_refused_at_startup_and_fallocate_is_the_backstop(tmp_path):
    out = run_on_small_dev_shm(_SMALL_SHM_CHILD, tmp_path)
    assert out["check_bytes"] > 8 << 20
    # the space check names both numbers ...
    assert out["check"].startswith("/dev/shm has 8.00 MiB (8388608 bytes) free; the region needs")
    assert f"({out['check_bytes']} bytes)" in out["check"]
    # ... and when it passes wrongly, posix_fallocate turns the shortage into an error, not SIGBUS
    # (the header's here; the slices' in the background: tests/region/test_reservation.py)
    assert out["fallocate"].startswith("cannot allocate")
    assert out["check_left"] == out["fallocate_left"] == []  # nothing half-created is left


def test_pinning_without_cuda_follows_the_policy(region, instance_name):
    worker = SharedOffloadRegion.attach(instance_name, 1)
    try:
        with pytest.raises(PinError, match="no CUDA device|cuda-bindings"):
            worker.pin(PinningPolicy.REQUIRED, HostPinner())
        assert worker.stats(1).snapshot().pin_state is PinState.FAILED
        assert worker.pin(PinningPolicy.ALLOW_UNPINNED, HostPinner()) is PinState.UNPINNED
        assert worker.stats(1).snapshot().pin_state is PinState.UNPINNED
        assert not worker.pinned
    finally:
        worker.close()


def test_worker_cannot_unlink(region, instance_name):
    from tiercache.errors import RegionError

    worker = SharedOffloadRegion.attach(instance_name, 0)
    with pytest.raises(RegionError, match="only the coordinator"):
        worker.close(unlink=True)
    worker.close()
    assert os.path.exists(region.path)


def test_a_writer_killed_mid_update_does_not_wedge_the_next_one(region):
    stats = region.stats(0)
    stats._words[0] += 1  # as if a worker died between the two sequence bumps
    with pytest.raises(StatsStuckError, match="mid-update"):
        stats.snapshot()
    stats.mark_attached(1234, 0)  # the restarted worker's first write
    snap = stats.snapshot()
    assert snap.pid == 1234 and snap.attach_count == 1


def test_worker_prefaults_only_its_own_slice_and_records_the_time(region, instance_name):
    worker = SharedOffloadRegion.attach(instance_name, 1)
    try:
        seconds = worker.prefault_slice(3)
        assert seconds > 0
        assert worker.stats(1).snapshot().prefault_seconds == pytest.approx(seconds, abs=1e-6)
        assert worker.stats(0).snapshot().prefault_seconds == 0
        assert not worker.rank_array(1).any()  # populating keeps the (zero) bytes
    finally:
        worker.close()
    unranked = SharedOffloadRegion.attach(instance_name)
    try:
        with pytest.raises(RegionError, match="needs a region attached with a rank"):
            unranked.prefault_slice(2)
    finally:
        unranked.close()


def test_close_releases_everything_even_when_unpinning_fails(make_config):
    region = SharedOffloadRegion.create(make_config())
    fd = region._fd

    class FailingPinner:
        def unpin(self):
            raise PinError("cuMemHostUnregister failed (simulated)")

    region._pinner = FailingPinner()
    with pytest.raises(PinError, match="simulated"):
        region.close()
    assert not os.path.exists(region.path)  # the owner still unlinked it
    with pytest.raises(OSError):
        os.fstat(fd)  # and closed its descriptor
    region.close()  # idempotent afterwards


def test_a_region_that_is_not_ours_with_mode_0600_is_neither_attached_nor_adopted(make_config,
                                                                               instance_name):
    cfg = _kill_a_creator(make_config)
    path = f"/dev/shm/{cfg.shm_name}"
    os.chmod(path, 0o640)
    with pytest.raises(RegionTrustError, match=r"with mode 0640; tiercache uses a region only "
                                               r"if .* with mode 0600"):
        SharedOffloadRegion.create(cfg)
    with pytest.raises(RegionTrustError, match="mode 0640"):
        SharedOffloadRegion.attach(instance_name, 0)
    [listing] = [r for r in list_regions() if r.name == cfg.name]
    assert not listing.live and "mode 0640" in listing.problem
    assert remove_stale(names=[cfg.name]) == [] and os.path.exists(path)
    os.chmod(path, 0o600)  # ours again: adopted
    region = SharedOffloadRegion.create(cfg)
    assert region.setup_times.adopted
    region.close()


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_name_that_holds_no_regular_file_is_refused_at_once(make_config, instance_name,
                                                             tmp_path, kind):
    cfg = make_config()
    path = f"/dev/shm/{cfg.shm_name}"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    else:
        region = SharedOffloadRegion.create(make_config(name=instance_name + "t"))
        os.symlink(region.path, path)  # a live region of ours: following it would be wrong
    try:
        words = {"fifo": "a FIFO", "directory": "a directory", "symlink": "a symlink"}[kind]
        with pytest.raises(RegionTrustError, match=f"{path} is {words} owned by"):
            SharedOffloadRegion.create(cfg)
        with pytest.raises(RegionTrustError, match=f"{path} is {words}"):
            SharedOffloadRegion.attach(instance_name, 0, timeout_s=5)
        [listing] = [r for r in list_regions() if r.name == cfg.name]
        assert listing.found.startswith(words) and listing.problem and not listing.live
        assert remove_stale(names=[cfg.name]) == []
    finally:
        if kind == "directory":
            os.rmdir(path)
        else:
            os.unlink(path)
        if kind == "symlink":
            region.close()
