"""A bounded soak of the coordinator: store/load workloads with real bytes, scrapes, engines
that die holding reservations and leases, and a coordinator SIGKILL in the middle. It
ends with full capacity, no stuck slot, no leaked descriptor or thread in the
coordinator, and zero wrong bytes."""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time

import psutil
import pytest

from control_children import check_every_hit, grab_and_wait, store_and_load_forever
from control_support import SPAWN, kill_all, START_TIMEOUT_S, STOP_TIMEOUT_S, wait_for
from e2e_support import metrics_url, scrape
from tiercache.config import ExporterConfig, KVGeometry, RegionConfig, config_to_toml
from tiercache.link.client import Client
from tiercache.service.process import CoordinatorProcess

NUM_BLOCKS = 48
KEY_SPACE = 120
DOOMED_ROUNDS = 6  # per phase: an engine reserves and leases, and is SIGKILLed


class Scraper(threading.Thread):
    """Scrapes the current coordinator's /metrics until stopped (misses while it restarts)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.ok, self.stop = url, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                scrape(self.url)
                self.ok += 1
            except (OSError, http.client.HTTPException, ValueError):  # killed mid-answer
                time.sleep(0.05)


def _doomed_engines(config, first_tag: int) -> int:
    """Engines that reserve 8 slots and lease 4 blocks each, then are SIGKILLed."""
    for tag in range(first_tag, first_tag + DOOMED_ROUNDS):
        holding = SPAWN.Event()
        child = SPAWN.Process(target=grab_and_wait, daemon=True,
                              args=(config_to_toml(config), tag, 8, KEY_SPACE, holding))
        child.start()
        assert holding.wait(START_TIMEOUT_S), f"doomed engine {tag} got nothing"
        os.kill(child.pid, signal.SIGKILL)
        child.join(STOP_TIMEOUT_S)
    return first_tag + DOOMED_ROUNDS


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_soak_ends_with_full_capacity_no_leaks_and_no_wrong_bytes(make_config, tmp_path):
    config = make_config(
        kv=KVGeometry(page_bytes=(4096, 2048)),
        region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS, prefault_threads=1),
        exporter=ExporterConfig(port=0), index_session_grace_s=0.3)
    stored, wrong = SPAWN.Value("q", 0), SPAWN.Value("q", 0)
    coordinator = CoordinatorProcess(config, tmp_path / "first")
    workloads = [SPAWN.Process(target=store_and_load_forever, daemon=True,
                               args=(config_to_toml(config), seed, KEY_SPACE, stored, wrong))
                 for seed in (1, 2)]
    scraper = Scraper(metrics_url(coordinator))
    first = psutil.Process(coordinator.pid)
    idle = (first.num_fds(), first.num_threads())  # a coordinator nobody has talked to yet
    try:
        for proc in workloads:
            proc.start()
        scraper.start()
        wait_for(lambda: stored.value >= 300, "the workloads store")
        tag = _doomed_engines(config, 0)

        # A coordinator SIGKILL while everything runs; the workloads wait and reconnect.
        coordinator.kill()
        coordinator = CoordinatorProcess(config, tmp_path / "second")
        scraper.url = metrics_url(coordinator)
        server = psutil.Process(coordinator.pid)
        after_restart = stored.value
        wait_for(lambda: stored.value >= after_restart + 300, "the workloads store again")
        _doomed_engines(config, tag)

        kill_all(workloads)
        scraper.stop.set()
        scraper.join(STOP_TIMEOUT_S)
        assert scraper.ok > 0 and wrong.value == 0
        with Client(config) as client:
            # This coordinator's doomed engines and both workloads: gone, sessions ended.
            s = wait_for(lambda: (lambda s: s if s.sessions_ended >= DOOMED_ROUNDS + 2 else None)(
                client.stats()), "every gone session ends")
            assert (s.writing_blocks, s.loading_blocks) == (0, 0)
            assert s.free_blocks + s.ready_blocks == NUM_BLOCKS
        hits, wrong_hits = check_every_hit(config, KEY_SPACE)
        assert wrong_hits == 0 and hits > 0
        with Client(config) as client:  # no stuck slot: the whole capacity can be taken
            keys = [b"final-%d" % i for i in range(NUM_BLOCKS)]
            out = client.prepare_store(keys)
            assert out is not None and len(out.keys_to_store) == NUM_BLOCKS
            client.complete_store(keys, success=False)
        # Every connection and scrape is over: the restarted coordinator holds what an idle
        # one does (its region, listener, exporter), no connection or thread more.
        wait_for(lambda: (server.num_fds(), server.num_threads()) == idle,
                 f"the coordinator's fds and threads back to an idle one's {idle}", timeout_s=30)
        assert coordinator.stop() == 0
    finally:
        scraper.stop.set()
        kill_all(workloads)
        coordinator.kill()
        coordinator.cleanup()
