"""Entry points that tests spawn in child processes (multiprocessing ``spawn`` imports this
module by name, so it sits on the test ``pythonpath``)."""

from __future__ import annotations

import os

from tiercache.region.shared import SharedOffloadRegion


def write_rank_pattern(name: str, rank: int, value: int, done) -> None:
    """Child: attach ``rank``, fill its whole slice with ``value``, then signal ``done``."""
    region = SharedOffloadRegion.attach(name, rank, timeout_s=10)
    region.rank_array(rank)[:] = value
    stats = region.stats(rank)
    stats.mark_attached(os.getpid(), 0)
    region.close()
    done.set()


def attach_and_hold(name: str, rank: int, attached, release) -> None:
    """Child: attach ``rank``, mark it attached, signal, wait (to be SIGKILLed or released)."""
    from tiercache.region.hostmem import process_start_ns

    region = SharedOffloadRegion.attach(name, rank, timeout_s=10)
    region.stats(rank).mark_attached(os.getpid(), process_start_ns(os.getpid()))
    region.rank_array(rank)[0, :16] = rank + 1
    attached.set()
    release.wait(60)
    region.stats(rank).mark_detached()
    region.close()


def attach_fork_and_hold(name: str, rank: int) -> None:
    """A subprocess (multiprocessing's join would wait for the grandchild too: it inherits
    the sentinel pipe): attach ``rank``, fork a grandchild that only sleeps, print
    ``slot grandchild-pid``, wait to be SIGKILLed. The grandchild keeps whatever it
    inherited; whoever started this kills it."""
    import signal
    import time

    from tiercache.region.hostmem import process_start_ns

    region = SharedOffloadRegion.attach(name, rank, timeout_s=10)
    region.stats(rank).mark_attached(os.getpid(), process_start_ns(os.getpid()))
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(120)
        os._exit(0)
    print(region.slot, grandchild, flush=True)
    signal.pause()


def close_region_and_live_on(config_toml: str) -> None:
    """A subprocess: create the region of a config, close it without unlinking (its lock
    is free, its header names this process), print ``closed``, wait to be SIGKILLed."""
    import signal
    import tomllib

    from tiercache.config import config_from_dict

    SharedOffloadRegion.create(config_from_dict(tomllib.loads(config_toml))).close(unlink=False)
    print("closed", flush=True)
    signal.pause()
