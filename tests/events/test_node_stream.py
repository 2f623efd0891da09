"""The node's event stream from a real ``tiercache serve``: engines (real clients, their own
sessions) store and evict, the disk tier takes demotions, the coordinator is killed and
restarted; a subscriber written for vLLM (``.venv-vllm``) must end up believing exactly
what the node holds. (tests/vllm/test_node_events.py does it with real vLLM engines.)"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest
import users
import zmq

from tiercache.config import DiskConfig, EventsConfig, ExporterConfig
from tiercache.link.client import Client
from tiercache.errors import ConfigError, CoordinatorGoneError, ProtocolError
from tiercache.link.namespaces import EngineFamily
from tiercache.link.namespaces import MAX_DESCRIPTION_BYTES
from tiercache.region.stale import remove_stale
from tiercache.service.process import CoordinatorProcess

from e2e_support import metrics_url, sample, scrape
from event_support import (
    free_port, hashes_of, namespace, ns_keys, store_keys, stream_endpoints, topic_of,
)


def _held_in_host(client, keys):
    return [k for k in keys if client.lookup([k]) == 1]


def _on_disk(client):
    return client.tier_stats()["disk"].used_blocks


def _events_config(**kw):
    return EventsConfig(**{"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0",
                           "batch_interval_s": 0.02, **kw})


def test_every_engines_stores_and_the_evictions_they_cause_reach_the_stream(
        make_config, tmp_path, subscriber):
    config = make_config(world_size=1, events=_events_config())
    ns = namespace("org/model")
    with CoordinatorProcess(config, tmp_path) as coordinator:
        seen = subscriber.connect(*stream_endpoints(coordinator))
        with Client(config) as a, Client(config) as b:
            assert a.describe(EngineFamily.VLLM, ns.description).node_events is True
            b.describe(EngineFamily.VLLM, ns.description)
            first = ns_keys(ns, 0, 6)
            store_keys(a, first)
            subscriber.until(lambda s: s.held() == {(topic_of(ns), "CPU"): hashes_of(first)})
            store_keys(b, ns_keys(ns, 100, 14))  # 16 slots: B's stores evict A's blocks
            held = _held_in_host(a, first + ns_keys(ns, 100, 14))
            subscriber.until(lambda s: s.held() == {(topic_of(ns), "CPU"): hashes_of(held)})
        removed = {h for _, e in seen.events("BlockRemoved") for h in e["block_hashes"]}
        assert removed == hashes_of(set(first) - set(held)) and removed  # another's eviction
        assert not seen.gaps and seen.seqs == list(range(len(seen.seqs)))


def test_demotion_to_disk_is_storage_and_a_cold_restart_leaves_no_stale_block(
        make_config, tmp_path, subscriber):
    port, replay = free_port(), free_port()
    config = make_config(world_size=1, disk=DiskConfig(str(tmp_path), 1 << 20, io_threads=2,
                                                       low_watermark=0.5),
                         events=_events_config(endpoint=f"tcp://127.0.0.1:{port}",
                                               replay_endpoint=f"tcp://127.0.0.1:{replay}"))
    ns = namespace()
    keys = ns_keys(ns, 0, 14)
    with CoordinatorProcess(config, tmp_path / "first") as coordinator:
        seen = subscriber.connect(*stream_endpoints(coordinator))
        with Client(config) as client:
            client.describe(EngineFamily.VLLM, ns.description)
            store_keys(client, keys)  # 14 of 16 slots: below the watermark, demoted to disk
            subscriber.until(lambda s: len(s.held().get((topic_of(ns), "STORAGE"), ())) == _on_disk(
                client) > 0)
        on_disk = seen.held()[(topic_of(ns), "STORAGE")]
        assert on_disk <= hashes_of(keys)
        coordinator.kill()  # SIGKILL: nothing said goodbye
    remove_stale(name_prefix=config.name)  # and the region is gone: a cold start
    with CoordinatorProcess(config, tmp_path / "second") as coordinator:
        seen = subscriber.connect(*stream_endpoints(coordinator))  # the stream starts over
        with Client(config) as client:  # an engine reconnecting describes again
            client.describe(EngineFamily.VLLM, ns.description)
            subscriber.until(lambda s: s.held() == {(topic_of(ns), "STORAGE"): on_disk})
            assert _on_disk(client) == len(on_disk)  # the disk tier rebuilt from its file
            assert _held_in_host(client, keys) == []  # and the stream says none is in host
        first = seen.batches[0]
        assert first["seq"] == 0 and first["events"] == [{"type": "AllBlocksCleared"}]


def test_a_warm_restart_announces_what_the_region_kept_once_described_again(
        make_config, tmp_path, subscriber):
    config = make_config(world_size=1, events=_events_config())
    ns = namespace()
    keys = ns_keys(ns, 0, 5)
    first = CoordinatorProcess(config, tmp_path / "first")
    with Client(config) as client:
        client.describe(EngineFamily.VLLM, ns.description)
        store_keys(client, keys)
    first.kill()  # its region stays, stale: the next serve re-adopts it
    with CoordinatorProcess(config, tmp_path / "second") as coordinator:
        assert "re-adopted" in coordinator.output()
        seen = subscriber.connect(*stream_endpoints(coordinator))
        subscriber.until(lambda s: s.seqs)
        assert not seen.events("BlockStored")  # nobody described the namespace yet
        with Client(config) as client:
            client.describe(EngineFamily.VLLM, ns.description)
            subscriber.until(lambda s: s.held() == {(topic_of(ns), "CPU"): hashes_of(keys)})
            assert sorted(_held_in_host(client, keys)) == sorted(keys)
    first.cleanup()


def test_a_client_describes_again_on_reconnect(make_config, tmp_path, subscriber):
    config = make_config(world_size=1, events=_events_config())
    ns = namespace()
    with CoordinatorProcess(config, tmp_path / "first") as coordinator:
        client = Client(config)
        client.describe(EngineFamily.VLLM, ns.description)
        coordinator.kill()
    with CoordinatorProcess(config, tmp_path / "second") as coordinator:
        seen = subscriber.connect(*stream_endpoints(coordinator))
        with pytest.raises(CoordinatorGoneError):
            client.ping()  # the old connection is gone: this call finds out
        store_keys(client, ns_keys(ns, 0, 2))  # connects again: HELLO, then DESCRIBE
        subscriber.until(lambda s: s.held() == {(topic_of(ns), "CPU"): hashes_of(ns_keys(ns, 0, 2))})
        client.close()
        assert not seen.errors


def test_descriptions_are_checked_and_bounded(make_config, tmp_path):
    config = make_config(world_size=1, events=_events_config())
    with CoordinatorProcess(config, tmp_path) as coordinator, Client(config) as client:
        with pytest.raises(ConfigError, match="not JSON"):
            client.describe(EngineFamily.VLLM, "{not json")
        client.ping()  # a description that does not parse leaves the connection up
        with pytest.raises(ProtocolError, match=str(MAX_DESCRIPTION_BYTES)):
            client.describe(EngineFamily.VLLM, "x" * (MAX_DESCRIPTION_BYTES + 1))
        assert "tiercache.serve: ready in " in coordinator.output()


def test_without_a_stream_the_answer_says_so_and_nothing_is_kept(make_config, tmp_path):
    config = make_config(world_size=1)
    ns = namespace()
    with CoordinatorProcess(config, tmp_path), Client(config) as client:
        answer = client.describe(EngineFamily.VLLM, ns.description)
        assert answer.digest == ns.digest and answer.node_events is False


def test_garbage_on_the_stream_sockets_is_shed_and_the_stream_goes_on(
        make_config, tmp_path, subscriber):
    config = make_config(world_size=1, events=_events_config())
    ns = namespace()
    with CoordinatorProcess(config, tmp_path) as coordinator:
        endpoint, replay = stream_endpoints(coordinator)
        for address in (endpoint, replay):  # a peer that does not speak ZMTP at all
            host, port = address[len("tcp://"):].rsplit(":", 1)
            with socket.create_connection((host, int(port))) as raw:
                raw.sendall(bytes(range(256)) * 64)
        with zmq.Context() as context:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            dealer.send_multipart([b"", b"x" * (1 << 20)])  # past the inbound bound: dropped
            dealer.send_multipart([b"", b"not a sequence number"])
            dealer.close()
        seen = subscriber.connect(endpoint, replay)
        with Client(config) as client:
            client.describe(EngineFamily.VLLM, ns.description)
            store_keys(client, ns_keys(ns, 0, 3))
        subscriber.until(lambda s: s.held() == {(topic_of(ns), "CPU"): hashes_of(ns_keys(ns, 0, 3))})
        assert not seen.errors


@pytest.fixture(scope="module")
def other_user():
    yield from users.other_user()


def test_another_local_user_can_describe_nothing(make_config, tmp_path, other_user):
    """DESCRIBE is on the control socket: another user (here with a way to the socket
    file) is refused by its mode and the uid check, and the stream learns nothing."""
    public = tempfile.mkdtemp(prefix="tiercache-events-")  # root's, 0755: the socket's 0600
    os.chmod(public, 0o755)  # and the peer uid check are what keep the other user out
    try:
        config = make_config(world_size=1, control_socket=os.path.join(public, "c.sock"),
                             exporter=ExporterConfig(port=0), events=_events_config())
        with CoordinatorProcess(config, tmp_path) as coordinator:
            script = ("import sys; from tiercache.link.client import Client; "
                      f"Client({config.socket_path!r}).describe(1, sys.argv[1])")
            tried = other_user.run([other_user.python, "-c", script, namespace().description])
            assert tried.returncode != 0
            assert "ControlSocketError" in tried.stderr or "Permission" in tried.stderr, tried
            samples = scrape(metrics_url(coordinator))
            assert sample(samples, "tiercache_events_namespaces") == 0
    finally:
        shutil.rmtree(public, ignore_errors=True)
