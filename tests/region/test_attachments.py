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
import urllib.request

import pytest
import torch

from e2e_support import scrape, sample
from metrics_support import promtool_check
from tiercache.config import RegionConfig
from tiercache.errors import ConfigError, RankError
from tiercache.index.jobs import RankMonitor
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
                         capture_output=True, text=True, timeout=60)
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
        assert "rank 0: worker DOWN" in _status(config.name)
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
