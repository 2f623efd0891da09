"""Races between `serve` and the probes of `status`/`clean`: a probe is never mistaken for
a live coordinator, and `clean` unlinks only the region it checked."""

from __future__ import annotations

import os
import threading

from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stale import list_maps, list_regions, remove_stale, remove_stale_maps
from tiercache.service.process import CoordinatorProcess

RESTARTS = 8


def _probe_until(stop: threading.Event, name: str, counts: list[int]) -> None:
    """What `tiercache status` and `tiercache clean --dry-run` do, as fast as possible
    (regions and key presence maps: each probe holds an object's lock shared)."""
    while not stop.is_set():
        list_regions()
        remove_stale(dry_run=True, name_prefix=name)
        list_maps([name])
        remove_stale_maps(dry_run=True, names=[name])
        counts[0] += 1


def test_probes_during_restarts_over_a_stale_region_never_make_serve_refuse(make_config,
                                                                            tmp_path):
    cfg = make_config()
    CoordinatorProcess(cfg, tmp_path / "first").kill()  # a stale region to re-adopt
    stop, counts = threading.Event(), [0]
    prober = threading.Thread(target=_probe_until, args=(stop, cfg.name, counts))
    prober.start()
    try:
        for restart in range(RESTARTS):
            before = counts[0]
            coordinator = CoordinatorProcess(cfg, tmp_path / str(restart))  # raises if refused
            out = coordinator.output()
            assert "re-adopted stale region" in out, out
            assert f"generation {restart + 2}" in out
            coordinator.kill()
            assert counts[0] > before  # the probes really ran during this restart
    finally:
        stop.set()
        prober.join()
        remove_stale(name_prefix=cfg.name)
        if os.path.exists(cfg.socket_path):
            os.unlink(cfg.socket_path)


def test_clean_never_unlinks_a_region_that_replaced_the_one_it_checked(make_config):
    """`clean` locked a stale region's descriptor; meanwhile the name came to hold a live
    region (a serve replaced the stale one). Unlinking by name would delete the live one."""
    from tiercache.region.shm import open_entry, take_owner_lock, unlink_if_same

    cfg = make_config()
    stale = SharedOffloadRegion.create(cfg)
    stale.close(unlink=False)  # as if its coordinator died: the lock is free
    checked = open_entry(cfg.shm_name, writable=False)
    try:
        assert take_owner_lock(checked.fd)  # what clean checked: stale
        os.unlink(checked.path)  # a serve replaces it ...
        live = SharedOffloadRegion.create(cfg)  # ... with a live one under the same name
        try:
            assert not unlink_if_same(checked)
            assert os.path.exists(live.path) and live.info().owner_pid == os.getpid()
            assert [r.live for r in list_regions() if r.name == cfg.name] == [True]
        finally:
            live.close()
    finally:
        os.close(checked.fd)
