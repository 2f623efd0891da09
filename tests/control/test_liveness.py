"""Sessions prove they are alive, one session holds at most its share, reservations that
are never completed expire, and an idle client does not fail its first call after a
coordinator restart. Real coordinators (``tiercache serve``) and real clients."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from control_support import ClientProcess, SPAWN, wait_for
from index_scenarios import k, store
from tiercache.config import RegionConfig
from tiercache.errors import SessionLimitError
from tiercache.link.client import Client
from tiercache.index.manager import OffloadingManager
from tiercache.service.process import CoordinatorProcess


def small(make_config, **kw):
    return make_config(region=RegionConfig(capacity_bytes=None, num_blocks=16,
                                           prefault_threads=1), **kw)


def test_one_session_holds_at_most_its_share_of_the_cache_under_contention(make_config,
                                                                          tmp_path):
    """The default share (half) bites once a session of another process holds something or
    was refused room: alone, an engine may fill the cache whatever sessions its process
    opens (a long prompt, issue 33); beside another engine, a greedy client cannot reserve
    or pin more than half."""
    config = small(make_config, index_max_session_share=0.5)
    with CoordinatorProcess(config, tmp_path), Client(config) as greedy, \
            Client(config) as sibling, ClientProcess(config) as other:
        assert sibling.prepare_store(k(300)) is not None  # its own process's other session
        alone = greedy.prepare_store(k(*range(15)))  # no other engine wants room: all of it
        assert alone is not None and len(alone.keys_to_store) == 15
        greedy.complete_store(k(*range(15)), success=False)
        sibling.complete_store(k(300), success=False)
        assert other.call("prepare_store", k(200)) is not None  # another engine holds one
        assert greedy.prepare_store(k(*range(9))) is None  # 9 of 16: past the share
        ahead = greedy.prepare_store(k(*range(50, 59)), max_evictions=0)  # free slots only:
        assert len(ahead.keys_to_store) == 8 and ahead.no_room_keys == tuple(k(58))  # to the share
        greedy.complete_store(list(ahead.keys_to_store), success=False)
        store(greedy, *range(8))
        assert greedy.lease(k(*range(8))).num_hit == 8  # it holds 8 pins now
        assert greedy.prepare_store(k(100)) is None  # one more would pass the share
        out = other.call("prepare_store", k(*range(100, 107)))  # the other half is there
        other.call("complete_store", list(out.keys_to_store))  # for everyone else
        assert greedy.lease(k(100)).num_hit == 0  # a lease stops short of the share
        with pytest.raises(SessionLimitError, match="at most 8"):
            greedy.prepare_load(k(100))
        assert other.call("stats").session_limit_rejections >= 2


def test_a_live_idle_client_keeps_what_it_holds_past_the_liveness_deadline(make_config,
                                                                          tmp_path):
    """The client heartbeats while its process runs: a session that holds a reservation and
    makes no call for three liveness deadlines is not declared dead (a frozen one is:
    tests/service/test_integrity.py)."""
    config = small(make_config, index_session_timeout_s=1.0)
    with CoordinatorProcess(config, tmp_path), Client(config) as client:
        client.prepare_store(k(1))
        time.sleep(3.0)  # idle on purpose: only the heartbeat speaks for the session
        client.complete_store(k(1))  # its reservation is still its own
        assert client.lookup(k(1)) == 1 and client.resumed is False
        assert client.stats().sessions_ended == 0


def test_a_reservation_never_completed_expires(make_config, tmp_path):
    config = small(make_config, index_reservation_timeout_s=1.0)
    with CoordinatorProcess(config, tmp_path), Client(config) as client:
        client.prepare_store(k(1, 2))
        wait_for(lambda: client.stats().expired_reservations == 2, "the reservations expire")
        assert client.stats().writing_blocks == 0
        client.complete_store(k(1, 2))  # too late: ignored
        assert client.lookup(k(1)) == 0


def test_expire_reservations_frees_those_older_than_the_deadline():
    m = OffloadingManager(4)
    store(m, 3)
    m.prepare_store(k(1), owner=1)
    m.prepare_store(k(2), owner=2)
    now = time.monotonic()
    assert m.expire_reservations(50, now=now + 10) == 0
    assert m.expire_reservations(50, now=now + 60) == 2
    assert m.stats().free_blocks == 3 and not m.holds(1) and not m.holds(2)
    assert m.lookup(k(3)) == 1  # READY blocks never expire


def test_an_idle_client_does_not_fail_its_first_call_after_a_restart(make_config, tmp_path):
    """The coordinator is SIGKILLed and back while the client sends nothing: its next call
    finds its connection closed before sending, reconnects and resumes its session (was:
    that call failed with "went away", and vLLM's next request lost its hits)."""
    config = small(make_config)
    first = CoordinatorProcess(config, tmp_path / "c1")
    client = Client(config)
    try:
        store(client, 1)
        out = client.prepare_store(k(2))
        first.kill()
        first = CoordinatorProcess(config, tmp_path / "c2")
        assert client.lookup(k(1)) == 1
        assert client.resumed  # the session came back from the region's session table
        client.complete_store(list(out.keys_to_store))  # its reservation survived too
        assert client.lookup(k(2)) == 1
    finally:
        client.close()
        first.cleanup()


def hold_then_wait(config_toml: str, holding) -> None:
    """Child: lease and load two keys, then wait to be killed or frozen."""
    import threading
    import tomllib

    from tiercache.config import config_from_dict

    config = config_from_dict(tomllib.loads(config_toml))
    client = Client(config)
    assert client.lease(k(1, 2)).num_hit == 2
    client.prepare_load(k(1, 2))
    holding.set()
    threading.Event().wait(600)


def test_a_restarted_coordinator_keeps_a_live_clients_pins_and_drops_a_dead_ones(
        make_config, tmp_path):
    from tiercache.config import config_to_toml

    config = small(make_config)
    coordinator = CoordinatorProcess(config, tmp_path / "c1")
    children = []
    try:
        with Client(config) as client:
            store(client, 1, 2)
        for _ in range(2):
            holding = SPAWN.Event()
            child = SPAWN.Process(target=hold_then_wait, args=(config_to_toml(config), holding),
                                  daemon=True)
            child.start()
            assert holding.wait(60)
            children.append(child)
        coordinator.kill()
        children[0].kill()  # proven gone: its pins are released at once
        children[0].join(30)
        coordinator = CoordinatorProcess(config, tmp_path / "c2")
        # the killed child's process is gone: its session is not kept, the live child's is
        # (the test's own, holding nothing, is kept too unless its grace ran out meanwhile)
        kept = re.search(r"(\d+) of the previous coordinator's (\d+) session\(s\) have live "
                         r"processes and are kept \((\d+) holding", coordinator.output())
        assert kept is not None, coordinator.output()
        live, total, holding = map(int, kept.groups())
        assert (live, holding) == (total - 1, 1)
        with Client(config) as client:
            stats = client.stats()
            assert (stats.loading_blocks, stats.recovered_pins) == (2, 4)  # the live one's
        children[1].kill()
        children[1].join(30)
        with Client(config) as client:  # the live one dies later: checked on the tick
            wait_for(lambda: client.stats().loading_blocks == 0, "the dead client's pins go")
    finally:
        for child in children:
            if child.is_alive():
                os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        coordinator.cleanup()
