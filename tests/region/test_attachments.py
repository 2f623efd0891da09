"""Several processes attach one rank (one per engine): slots, per-attachment stats, totals.

Real spawned workers (cpu backend, host tensors), a real region, the real collector behind
the real exporter (scraped over HTTP, checked by promtool), the real ``tiercache status``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from e2e_support import scrape, sample
from metrics_support import promtool_check
from tiercache.config import RegionConfig
from tiercache.errors import ConfigError, RankError
from tiercache.link.jobs import RankMonitor
from tiercache.metrics.collector import TiercacheCollector, start_exporter
from tiercache.region.attachments import (
    AttachmentSlotsFullError, incarnation, slot_held, try_lock_slot, unlock_slot,
)
from tiercache.region.layout import RegionLayout
from tiercache.region.shared import SharedOffloadRegion
from tiercache.sizes import format_bytes
from tiercache.region.shm import open_entry, owner_lock_held, take_owner_lock
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiercache.transfer.worker import attach
from spawned import attach_and_hold

NUM_GPU_BLOCKS = 8
WAIT_S = 60


def _expect(conn, tag: str):
    assert conn.poll(WAIT_S), f"no {tag!r} from the attachment within {WAIT_S} s"
    message = conn.recv()
    assert message[0] == tag, message
    return message[1:]


def attachment_main(config, rank: int, conn) -> None:
    """A worker process attaching ``rank``: stores a byte value, loads a block, on command."""
    gpu = [torch.zeros(NUM_GPU_BLOCKS, p, dtype=torch.uint8) for p in config.kv.page_bytes]
    worker = attach(config, rank, gpu, backend="cpu")
    conn.send(("attached", os.getpid(), worker.slot, worker.incarnation))
    job = 0
    while True:
        op, block, value = conn.recv()
        job += 1
        if op == "store":  # GPU block 0 filled with value -> CPU block ``block``
            for t in gpu:
                t[0] = value
            worker.submit_store(job, GPULoadStoreSpec([0]), CPULoadStoreSpec([block]))
        elif op == "load":  # CPU block ``block`` -> GPU block 1
            worker.submit_load(job, CPULoadStoreSpec([block]), GPULoadStoreSpec([1]))
        else:
            worker.close()
            conn.send(("closed",))
            return
        worker.wait([job])
        (result,) = worker.get_finished()
        conn.send(("done", result.success, result.transfer_size,
                   sorted({int(v) for t in gpu for v in torch.unique(t[1]).tolist()})))


class Attached:
    def __init__(self, ctx, config, rank: int = 0):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=attachment_main, args=(config, rank, child))
        self.proc.start()
        self.pid, self.slot, self.incarnation = _expect(self.conn, "attached")

    def run(self, op: str, block: int, value: int = 0):
        self.conn.send((op, block, value))
        return list(_expect(self.conn, "done"))

    def close(self) -> None:
        self.conn.send(("close", 0, 0))
        _expect(self.conn, "closed")
        self.proc.join(WAIT_S)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(WAIT_S)


def _status(name: str) -> str:
    run = subprocess.run([sys.executable, "-m", "tiercache", "status", "--name", name],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout


def _bytes(samples, rank: str, **labels) -> float:
    return sum(sample(samples, "tiercache_transfer_bytes_total", rank=rank, direction=d, **labels)
               for d in ("gpu_to_cpu", "cpu_to_gpu"))


def _attachment_bytes(samples, slot: int) -> float:
    return sum(sample(samples, "tiercache_attachment_transfer_bytes_total", rank="0",
                      attachment=str(slot), direction=d) for d in ("gpu_to_cpu", "cpu_to_gpu"))


def test_two_processes_attach_one_rank_and_a_killed_ones_slot_is_reclaimed(make_config):
    config = make_config(world_size=1)
    row = sum(config.kv.page_bytes)
    ctx = mp.get_context("spawn")
    region = SharedOffloadRegion.create(config)
    exporter = start_exporter(config.exporter, TiercacheCollector(region))
    monitor = RankMonitor(region, 1)
    attached: list[Attached] = []
    try:
        a, b = Attached(ctx, config), Attached(ctx, config)
        attached += [a, b]
        assert (a.slot, b.slot) == (0, 1)
        assert a.run("store", 3, 7)[:2] == [True, row]
        assert b.run("load", 3) == [True, row, [7]]  # b reads what a wrote into the region
        assert b.run("store", 5, 9)[:2] == [True, row]
        assert a.run("load", 5) == [True, row, [9]]

        samples = scrape(exporter.url)
        for who in (a, b):
            assert sample(samples, "tiercache_attachment_up", rank="0",
                          attachment=str(who.slot)) == 1
            assert sample(samples, "tiercache_attachment_pid", rank="0",
                          attachment=str(who.slot)) == who.pid
            assert sample(samples, "tiercache_attachment_pin_state", rank="0",
                          attachment=str(who.slot), state="unpinned") == 1
            assert _attachment_bytes(samples, who.slot) == 2 * row
        assert sample(samples, "tiercache_worker_up", rank="0") == 1
        assert sample(samples, "tiercache_worker_attaches_total", rank="0") == 2
        assert _bytes(samples, "0") == 4 * row == _attachment_bytes(samples, 0) + \
            _attachment_bytes(samples, 1)
        assert sample(samples, "tiercache_transfers_total", rank="0", direction="gpu_to_cpu",
                      outcome="ok") == 2
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:
            promtool_check(resp.read())

        out = _status(config.name)
        assert "rank 0: 2 attachment(s) up, attached 2x" in out
        for who in (a, b):
            assert (f"attachment {who.slot}: worker pid {who.pid} up, attached 1x, pin unpinned "
                    f"0 B; gpu_to_cpu {format_bytes(row)} in 1 ok/0 failed (cpu), cpu_to_gpu "
                    f"{format_bytes(row)} in 1 ok/0 failed (cpu)") in out
        rank_line = next(line for line in out.splitlines() if "rank 0:" in line)
        assert f"gpu_to_cpu {format_bytes(2 * row)} in 2 ok/0 failed (cpu)" in rank_line

        # the engine following a keeps a's incarnation whatever b does
        assert monitor.incarnations([a.incarnation]) == [a.incarnation]
        assert monitor.incarnations([b.incarnation]) == [b.incarnation]

        a.kill()
        attached.remove(a)
        samples = scrape(exporter.url)
        assert sample(samples, "tiercache_attachment_up", rank="0", attachment="0") == 0
        assert sample(samples, "tiercache_worker_up", rank="0") == 1  # b is still up
        assert _bytes(samples, "0") == 4 * row  # a's counters stay
        assert monitor.incarnations([a.incarnation]) == [b.incarnation]
        assert f"attachment 0: worker pid {a.pid} DOWN" in _status(config.name)

        c = Attached(ctx, config)  # the kernel freed a's slot lock: c takes slot 0
        attached.append(c)
        assert c.slot == 0 and c.incarnation == incarnation(0, 2) != a.incarnation
        assert c.run("load", 5) == [True, row, [9]]
        samples = scrape(exporter.url)
        assert _attachment_bytes(samples, 0) == 3 * row  # continues from a's counters
        assert _bytes(samples, "0") == 5 * row
        assert sample(samples, "tiercache_attachment_pid", rank="0", attachment="0") == c.pid
        assert sample(samples, "tiercache_worker_attaches_total", rank="0") == 3

        for who in (b, c):
            who.close()
        attached.clear()
        samples = scrape(exporter.url)
        assert sample(samples, "tiercache_worker_up", rank="0") == 0
        assert sample(samples, "tiercache_attachment_pid", rank="0", attachment="1") == 0
        assert _bytes(samples, "0") == 5 * row  # nothing went backwards
        assert monitor.incarnations() == [None]
        # both closed cleanly (a's slot is c's now): nobody is DOWN
        assert "rank 0: no worker (every worker detached cleanly)" in _status(config.name)
    finally:
        for who in attached:
            who.kill()
        exporter.close()
        region.close()


def test_all_slots_held_is_a_clear_error_and_a_freed_slot_is_taken_again(make_config):
    config = make_config(world_size=2, region=RegionConfig(
        capacity_bytes=None, num_blocks=4, prefault_threads=1, attachments_per_rank=2))
    region = SharedOffloadRegion.create(config)
    held = []
    try:
        held = [SharedOffloadRegion.attach(config.name, 1) for _ in range(2)]  # one process
        assert [r.slot for r in held] == [0, 1]  # OFD locks exclude within a process too
        with pytest.raises(AttachmentSlotsFullError,
                           match=r"rank 1: all 2 attachment slots are held .*attachments_per_rank"):
            SharedOffloadRegion.attach(config.name, 1)
        other = SharedOffloadRegion.attach(config.name, 0)  # another rank has its own slots
        assert other.slot == 0
        other.close()
        held.pop(0).close()
        again = SharedOffloadRegion.attach(config.name, 1)
        held.append(again)
        assert again.slot == 0
    finally:
        for r in held:
            r.close()
        region.close()


def test_slot_locks_and_the_owner_flock_do_not_interfere(make_config):
    """Linux keeps flock and fcntl (OFD) locks apart; tiercache relies on it both ways."""
    config = make_config(world_size=1)
    region = SharedOffloadRegion.create(config)  # holds the owner flock
    layout = region.layout
    entries = []
    try:
        worker = SharedOffloadRegion.attach(config.name, 0)  # takes a slot lock beside it
        probe = open_entry(config.shm_name, writable=True)
        entries.append(probe)
        assert owner_lock_held(probe.fd)  # the flock is still seen, slot lock or not
        assert slot_held(probe.fd, layout, 0, worker.slot)
        unrelated = open_entry(config.shm_name, writable=True)
        unrelated.close()  # a POSIX (process) lock would have been dropped by this close
        assert slot_held(probe.fd, layout, 0, worker.slot)
        worker.close()
        assert not slot_held(probe.fd, layout, 0, 0)
        region.close(unlink=False)  # the coordinator's flock is gone; the name stays
        assert try_lock_slot(probe.fd, layout, 0, 0)  # a worker holds a slot ...
        owner = open_entry(config.shm_name, writable=True)
        entries.append(owner)
        assert take_owner_lock(owner.fd)  # ... and a coordinator still gets the owner lock
        unlock_slot(probe.fd, layout, 0, 0)
    finally:
        for entry in entries:
            entry.close()
        region.close()
        if os.path.exists(f"/dev/shm/{config.shm_name}"):
            os.unlink(f"/dev/shm/{config.shm_name}")


def test_attachments_per_rank_is_part_of_the_geometry():
    four = RegionLayout(2, 8, (4096,))
    two = RegionLayout(2, 8, (4096,), attachments_per_rank=2)
    assert four.digest != two.digest and RegionLayout.decode(two.encode()) == two
    assert four.ledger_offset - two.ledger_offset == 2 * 2 * 4096
    assert two.stats_offset(1, 1) == two.stats_offset(0, 0) + 3 * 4096
    with pytest.raises(RankError, match=r"attachment slot 2 is outside 0..1"):
        two.stats_offset(0, 2)
    with pytest.raises(ConfigError, match=r"attachments_per_rank = 17: allowed 1..16"):
        RegionConfig(attachments_per_rank=17)
    with pytest.raises(ConfigError, match=r"attachments_per_rank = 0: allowed 1..16"):
        RegionLayout(1, 1, (4096,), attachments_per_rank=0)


def _one_slot_per_rank(make_config):
    return make_config(world_size=1, region=RegionConfig(
        capacity_bytes=None, num_blocks=4, prefault_threads=1, attachments_per_rank=1))


def _kill_orphan(pid: int) -> None:
    """SIGKILL a process that is not our child (reparented), and wait until it is gone."""
    import psutil

    try:
        os.kill(pid, signal.SIGKILL)
        proc = psutil.Process(pid)
        deadline = time.monotonic() + WAIT_S
        while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"pid {pid} outlived SIGKILL"
            time.sleep(0.01)
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass


def test_a_child_forked_by_a_worker_does_not_keep_its_slot_after_the_worker_dies(make_config):
    """fork shares the open file description that holds a slot's OFD lock: a worker's
    sleeping child used to keep the slot after the worker was SIGKILLed, so attach said
    every slot was held while status showed the worker DOWN."""
    import spawned

    config = _one_slot_per_rank(make_config)
    region = SharedOffloadRegion.create(config)
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(spawned.__file__)!r}); "
              f"import spawned; spawned.attach_fork_and_hold({config.name!r}, 0)")
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        slot, grandchild = map(int, worker.stdout.readline().split())
        assert slot == 0
        # the child's copy of the descriptor is closed, but the worker's lock is not freed
        with pytest.raises(AttachmentSlotsFullError, match="rank 0: all 1 attachment slots"):
            SharedOffloadRegion.attach(config.name, 0)
        worker.kill()
        worker.wait(WAIT_S)
        out = _status(config.name)
        assert f"attachment 0: worker pid {worker.pid} DOWN, attached 1x" in out, out
        assert "held" not in out
        again = SharedOffloadRegion.attach(config.name, 0)  # status and attach agree
        assert again.slot == 0
        again.close()
    finally:
        worker.kill()
        worker.wait(WAIT_S)
        worker.stdout.close()
        if grandchild is not None:
            _kill_orphan(grandchild)
        region.close()


def test_status_reports_a_slot_held_past_its_workers_death_as_held(make_config):
    """A lock the fork hook cannot drop (a C library's fork) keeps a dead worker's slot:
    status used to show the worker DOWN and the slot free while attach refused it."""
    config = _one_slot_per_rank(make_config)
    region = SharedOffloadRegion.create(config)
    ctx = mp.get_context("spawn")
    attached, release = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=attach_and_hold, args=(config.name, 0, attached, release))
    holder = None
    try:
        worker.start()
        assert attached.wait(WAIT_S)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(WAIT_S)
        holder = open_entry(config.shm_name, writable=True)  # another process, to status
        assert try_lock_slot(holder.fd, region.layout, 0, 0)
        out = _status(config.name)
        assert (f"attachment 0: worker pid {worker.pid} DOWN, but its slot is held by another "
                "process") in out, out
        assert "rank 0: worker DOWN (1 slot(s) of DOWN workers still held by other processes)" \
            in out
        with pytest.raises(AttachmentSlotsFullError):  # what attach says agrees
            SharedOffloadRegion.attach(config.name, 0)
        unlock_slot(holder.fd, region.layout, 0, 0)
        out = _status(config.name)
        assert f"worker pid {worker.pid} DOWN, attached 1x" in out and "held" not in out
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join(WAIT_S)
        if holder is not None:
            holder.close()
        region.close()
