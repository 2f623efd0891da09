"""Chaos: engines keep storing and loading while the coordinator is restarted cleanly,
SIGKILLed (also with loads prepared and copied only after the restart), engines are frozen
past the liveness deadline and thawed, ledger records are damaged while no coordinator
runs, and the index is reset under a load in flight and the disk tier's demotions and
promotions (a disk tier below a host tier half the key space's size). Engines are separate processes, two ranks each, with the real handlers; a key's
bytes are a function of the key, so any engine verifies any other's blocks.

Bounded (a fixed number of rounds, seeded), it asserts: 0 wrong bytes over every load,
full capacity once the engines are gone, the coordinator's fds and threads back to an idle
one's, and (via the suite's leak check) no /dev/shm entry left.
"""

from __future__ import annotations

import mmap
import os
import random

import psutil
import pytest

from control_support import wait_for
from engine_child import EngineProcess
from tiercache.config import DiskConfig, KVGeometry, RegionConfig, config_to_toml
from tiercache.link.client import Client
from tiercache.region.layout import RegionLayout
from tiercache.region.ledger import RECORD_BYTES
from tiercache.service.process import CoordinatorProcess
from tiercache.tiers.disk_file import HEADER_BYTES as DISK_HEADER_BYTES

FAULTS = ("kill", "kill_in_flight", "restart", "freeze", "damage", "reset", "none")
ROUNDS = 4 * len(FAULTS)  # each fault four times, in a seeded order
NUM_BLOCKS = 48
KEY_SPACE = 96
ENGINES = 3
TIMEOUT_S = 1.0  # index.session_timeout_s: a frozen engine is declared dead after this


class Tally:
    def __init__(self) -> None:
        self.loaded = self.wrong = self.refused = self.lost = self.stored = 0

    def load(self, result: dict) -> None:
        self.loaded += result["hits"]
        self.wrong += result.get("wrong_bytes", 0)
        self.refused += not result["ok"]

    def __repr__(self) -> str:
        return (f"stored {self.stored}, loaded {self.loaded}, wrong bytes {self.wrong}, "
                f"refused transfers {self.refused}, calls that found a session lost or the "
                f"coordinator gone {self.lost}")


def attempt(tally: Tally, call, *args):
    """An engine's call; a lost session or a coordinator between lives is a retry later,
    never a wrong byte."""
    try:
        return call(*args)
    except RuntimeError as e:
        if "SessionLostError" in str(e) or "CoordinatorGoneError" in str(e):
            tally.lost += 1
            return None
        raise


def damage_a_record(config, rng: random.Random) -> None:
    """Flip one random bit of one random ledger record in the region file (no coordinator
    is running: what a stray write or bad RAM would leave for the next one to read)."""
    layout = RegionLayout.from_config(config)
    path = f"/dev/shm/{config.shm_name}"
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, layout.header_bytes) as m:
            offset = layout.ledger_offset + rng.randrange(NUM_BLOCKS) * RECORD_BYTES
            byte = offset + rng.randrange(8, RECORD_BYTES - 16)  # inside the checked body
            m[byte] ^= 1 << rng.randrange(8)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_chaos_never_serves_a_wrong_byte_and_gives_everything_back(make_config, tmp_path):
    (tmp_path / "disk").mkdir()
    config = make_config(kv=KVGeometry(page_bytes=(4096, 1024)),
                         region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS,
                                             prefault_threads=1),
                         disk=DiskConfig(path=str(tmp_path / "disk"), low_watermark=0.25,
                                         capacity_bytes=KEY_SPACE * (DISK_HEADER_BYTES
                                                                     + 2 * 8192)),
                         index_session_grace_s=0.5, index_session_timeout_s=TIMEOUT_S)
    rng = random.Random(20261124)
    tally = Tally()
    keys = [b"chaos-%d" % i for i in range(KEY_SPACE)]
    lives = 0
    coordinator = CoordinatorProcess(config, tmp_path / "c0")
    idle = (psutil.Process(coordinator.pid).num_fds(), psutil.Process(coordinator.pid).num_threads())
    engines = [EngineProcess(config_to_toml(config)) for _ in range(ENGINES)]
    events = list(FAULTS) * (ROUNDS // len(FAULTS))
    rng.shuffle(events)
    try:
        for round_, fault in enumerate(events):
            for engine in engines:  # the workload: every engine stores and loads
                run = rng.sample(keys, rng.randint(1, 6))
                out = attempt(tally, engine.store, run)
                tally.stored += out["stored"] if out else 0
                result = attempt(tally, engine.load, rng.sample(keys, rng.randint(1, 8)))
                if result:
                    tally.load(result)
            if fault in ("kill", "kill_in_flight", "restart", "damage"):
                holder = rng.choice(engines)
                held = attempt(tally, holder.hold_load, rng.sample(keys, 8)) \
                    if fault == "kill_in_flight" else None
                if fault == "restart":
                    coordinator.stop()  # SIGTERM, engines attached: the region stays
                else:
                    coordinator.kill()
                if fault == "damage":
                    damage_a_record(config, rng)
                lives += 1
                coordinator = CoordinatorProcess(config, tmp_path / f"c{lives}")
                if held is not None:
                    others = [e for e in engines if e is not holder]
                    for engine in others:  # stores that would evict the held blocks
                        out = attempt(tally, engine.store, rng.sample(keys, 6))
                        tally.stored += out["stored"] if out else 0
                    result = attempt(tally, holder.finish_load)
                    if result:
                        tally.load(result)
            elif fault == "reset":  # under a load in flight and the disk tier's I/O
                holder = rng.choice(engines)
                held = attempt(tally, holder.hold_load, rng.sample(keys, 8))
                with Client(config) as client:
                    client.reset()
                for engine in engines:  # stores into whatever slots the index hands out
                    if engine is not holder:
                        out = attempt(tally, engine.store, rng.sample(keys, 6))
                        tally.stored += out["stored"] if out else 0
                if held is not None:
                    result = attempt(tally, holder.finish_load)
                    if result:
                        tally.load(result)
            elif fault == "freeze":
                frozen = rng.choice(engines)
                attempt(tally, frozen.hold_load, rng.sample(keys, 8))
                frozen.freeze()
                with Client(config) as watcher:
                    ended = watcher.stats().sessions_ended
                    wait_for(lambda: watcher.stats().sessions_ended > ended
                             or not watcher.stats().loading_blocks,
                             "the frozen engine is declared dead", timeout_s=30)
                frozen.thaw()
                result = attempt(tally, frozen.finish_load)
                if result:
                    tally.load(result)
            assert tally.wrong == 0, f"round {round_} ({events[:round_ + 1]}): {tally}"
        for engine in engines:
            engine.stop()
        with Client(config) as client:
            wait_for(lambda: (client.stats().writing_blocks, client.stats().loading_blocks)
                     == (0, 0), "every reservation and pin is given back", timeout_s=60)
            stats = client.stats()
            assert stats.free_blocks + stats.ready_blocks == NUM_BLOCKS
        server = psutil.Process(coordinator.pid)
        wait_for(lambda: (server.num_fds(), server.num_threads()) == idle,
                 f"the coordinator's fds and threads back to an idle one's {idle}", timeout_s=60)
    finally:
        for engine in engines:
            engine.kill()
        coordinator.cleanup()
    assert tally.wrong == 0, tally
    assert tally.loaded > 0 and tally.stored > 0, tally
