"""Namespaces one client cannot squat, on a real ``tiercache serve`` read by a subscriber
written for vLLM: a session stores only under namespaces it described, keys under none are
never published (counted), a full namespace table makes room once sessions go away, and
model names are printable."""

from __future__ import annotations

import time

import pytest

from tiercache.config import KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.errors import ConfigError, NamespaceError, StateError
from tiercache.link.namespaces import EngineFamily
from tiercache.events.namespace_table import MAX_NAMESPACES
from tiercache.service.process import CoordinatorProcess

from e2e_support import metrics_url, sample, scrape
from event_support import (
    WAIT_S, hashes_of, namespace, ns_keys, store_keys, stream_endpoints, topic_of,
)


def _events(**kw):
    from tiercache.config import EventsConfig

    return EventsConfig(**{"endpoint": "tcp://127.0.0.1:0",
                           "replay_endpoint": "tcp://127.0.0.1:0", "batch_interval_s": 0.02,
                           **kw})


def _unpublished(coordinator, reason):
    return sample(scrape(metrics_url(coordinator)), "tiercache_events_unpublished_keys_total",
                  reason=reason)


def test_a_second_client_cannot_store_under_the_first_ones_namespace(
        make_config, tmp_path, subscriber):
    config = make_config(world_size=1, events=_events())
    ns, guessed = namespace("org/victim"), namespace("org/not-yet-started")
    with CoordinatorProcess(config, tmp_path) as coordinator:
        seen = subscriber.connect(*stream_endpoints(coordinator))
        with Client(config) as engine, Client(config) as squatter:
            engine.describe(EngineFamily.VLLM, ns.description)
            store_keys(engine, ns_keys(ns, 0, 2))
            # the digest is on every topic: storing under it is refused, nothing changes
            with pytest.raises(NamespaceError, match=ns.digest.hex()):
                squatter.prepare_store(ns_keys(ns, 100, 3))
            squatter.describe(EngineFamily.VLLM, namespace("org/mine").description)
            with pytest.raises(NamespaceError, match="did not describe"):
                squatter.prepare_store(ns_keys(ns, 100, 3))  # its own namespace is no licence
            assert squatter.lookup(ns_keys(ns, 100, 1)) == 0
            # a reservation made before the engine described is refused at completion
            early = squatter.prepare_store(ns_keys(guessed, 0, 1))
            assert early is not None
            # ahead of the engine, under a digest it guessed: stored, never published
            store_keys(squatter, ns_keys(guessed, 1, 2))
            store_keys(squatter, [b"a client key without any namespace"])
            with Client(config) as late_engine:
                late_engine.describe(EngineFamily.VLLM, guessed.description)
                with pytest.raises(NamespaceError, match=guessed.digest.hex()):
                    squatter.complete_store(list(early.keys_to_store))
                squatter.complete_store(list(early.keys_to_store), success=False)  # frees it
                store_keys(late_engine, ns_keys(guessed, 10, 1))
                want = {(topic_of(ns), "CPU"): hashes_of(ns_keys(ns, 0, 2)),
                        (topic_of(guessed), "CPU"): hashes_of(ns_keys(guessed, 10, 1))}
                subscriber.until(lambda s: s.held() == want)
        stored = {h for _, e in seen.events("BlockStored") for h in e["block_hashes"]}
        assert stored == hashes_of(ns_keys(ns, 0, 2) + ns_keys(guessed, 10, 1))  # no fake event
        assert _unpublished(coordinator, "no_namespace") == 3


def test_a_full_namespace_table_makes_room_once_its_sessions_went_away(
        make_config, tmp_path, subscriber):
    """256 sessions each describe a namespace, store a block and go away (the probe's way
    of filling the table: every namespace holds a block). A new engine's DESCRIBE
    succeeds; the namespace it displaced (the oldest of those holding fewest blocks) is
    withdrawn from subscribers: its block's BlockRemoved, on its topic."""
    config = make_config(world_size=1, events=_events(), index_session_grace_s=0.0,
                         kv=KVGeometry(page_bytes=(256,), block_size_factor=1),
                         region=RegionConfig(capacity_bytes=None, num_blocks=MAX_NAMESPACES + 8,
                                             prefault_threads=1))
    spaces = [namespace(f"org/model-{i}") for i in range(MAX_NAMESPACES)]
    first = topic_of(spaces[0])
    with CoordinatorProcess(config, tmp_path) as coordinator:
        endpoint, replay = stream_endpoints(coordinator)
        seen = subscriber.connect(endpoint, replay, topic=first)  # one topic: a few batches
        for ns in spaces:
            with Client(config, heartbeat=False) as gone:
                gone.describe(EngineFamily.VLLM, ns.description)
                store_keys(gone, ns_keys(ns, 0, 1))
        subscriber.until(lambda s: s.held() == {(first, "CPU"): hashes_of(ns_keys(spaces[0], 0, 1))})
        newcomer = namespace("org/newcomer")
        with Client(config) as engine:
            deadline = time.monotonic() + WAIT_S
            while True:  # until the last sessions' ends reach the coordinator
                try:
                    engine.describe(EngineFamily.VLLM, newcomer.description)
                    break
                except StateError:
                    assert time.monotonic() < deadline, "the table never made room"
                    time.sleep(0.05)
            subscriber.until(lambda s: s.events("BlockRemoved"))
            assert seen.held() == {}
            removed = [(b["topic"], e["block_hashes"]) for b, e in seen.events("BlockRemoved")]
            assert removed == [(first, list(hashes_of(ns_keys(spaces[0], 0, 1))))]
            store_keys(engine, ns_keys(newcomer, 0, 1))  # published: its namespace is in the table
            assert engine.lookup(ns_keys(spaces[0], 0, 1)) == 1  # the node still holds it
        samples = scrape(metrics_url(coordinator))
        assert sample(samples, "tiercache_events_namespaces") == MAX_NAMESPACES


def test_a_table_full_of_live_sessions_refuses_naming_the_bound(make_config, tmp_path):
    config = make_config(world_size=1, events=_events())
    with CoordinatorProcess(config, tmp_path), Client(config) as holder:
        clients = [Client(config, heartbeat=False) for _ in range(MAX_NAMESPACES // 16)]
        try:
            for c, client in enumerate(clients):
                for i in range(16):
                    client.describe(EngineFamily.VLLM, namespace(f"m-{c}-{i}").description)
            with pytest.raises(StateError, match=f"{MAX_NAMESPACES} namespaces"):
                holder.describe(EngineFamily.VLLM, namespace("late").description)
        finally:
            for client in clients:
                client.close()


@pytest.mark.parametrize("model", ["evil\x1b[2J", "carriage\rreturn", "right\u202eleft"])
def test_a_model_name_that_is_not_printable_is_refused_in_one_line(make_config, tmp_path,
                                                                   model):
    config = make_config(world_size=1, events=_events())
    with CoordinatorProcess(config, tmp_path), Client(config) as client:
        with pytest.raises(ConfigError) as refused:
            client.describe(EngineFamily.VLLM, namespace(model).description)
        assert "printable characters" in str(refused.value)
        assert str(refused.value).isprintable()
        client.ping()  # the connection stays
