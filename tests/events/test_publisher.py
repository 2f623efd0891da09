"""The publisher on real ZMQ sockets, read by a subscriber written for vLLM 0.33 (its own
``KVEventBatch`` decoder, in ``.venv-vllm``): the wire format, sequence numbers, topics per
namespace, replay over a DEALER, drops under a slow subscriber and an overflowing queue,
the stop's last word, and the counters behind the metrics."""

from __future__ import annotations

import random
import threading

import pytest
import zmq

from tiercache.config.events import EventsConfig, HashFormat
from tiercache.errors import ServiceError
from tiercache.events import NodeEventStream
from tiercache.link.namespaces import EngineFamily
from tiercache.specs import Medium

from event_support import namespace, vllm_int_hash, vllm_key


@pytest.fixture
def start_stream():
    streams = []

    def start(**overrides) -> NodeEventStream:
        fields = dict(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                      batch_interval_s=0.02)
        fields.update(overrides)
        stream = NodeEventStream(EventsConfig(**fields))
        stream.start()
        streams.append(stream)
        return stream

    yield start
    for stream in streams:
        stream.close()


def _connect(subscriber, stream, topic="", rcvhwm=0):
    pub = stream.publisher
    return subscriber.connect(pub.endpoint, pub.replay_endpoint, topic, rcvhwm)


def _published(stream, kind, count):
    """Until the publisher has sent ``count`` events of ``kind`` (a condition, not a time)."""
    while stream.stats().publisher.events[kind] < count:
        threading.Event().wait(0.01)


def _hashes(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_every_event_decodes_with_vllms_classes_exactly_as_vllm_publishes_them(
        subscriber, start_stream):
    stream = start_stream()
    ns = namespace("org/model")
    stream.describe(EngineFamily.VLLM, ns.description)
    seen = _connect(subscriber, stream)
    subscriber.until(lambda s: s.seqs)  # the stream's first batch
    hashes = _hashes(4)
    keys = [vllm_key(ns, h, group=i % 2) for i, h in enumerate(hashes)]
    stream.sink.stored(keys[:3], Medium.CPU)
    stream.sink.stored(keys[3:], Medium.STORAGE)
    stream.sink.removed(keys[:2], Medium.CPU)
    topic = f"org/model@{ns.digest.hex()}"
    want = {(topic, "CPU"): {vllm_int_hash(hashes[2])},
            (topic, "STORAGE"): {vllm_int_hash(hashes[3])}}
    subscriber.until(lambda s: s.held() == want)
    assert not seen.errors and seen.seqs == list(range(len(seen.seqs)))  # from 0, no gap
    first = seen.batches[0]
    assert first["seq"] == 0 and first["topic"] == "" and first["events"] == [
        {"type": "AllBlocksCleared"}]
    assert all(b["dp_rank"] == 0 for b in seen.batches)
    stored = seen.events("BlockStored")
    assert len(stored) == 4  # one per key, as vLLM's offloading connector does
    for batch, event in stored:
        i = [vllm_int_hash(h) for h in hashes].index(event["block_hashes"][0])
        assert batch["topic"] == topic
        assert event == {"type": "BlockStored", "block_hashes": [vllm_int_hash(hashes[i])],
                         "parent_block_hash": None, "token_ids": [], "block_size": 0,
                         "lora_id": None, "medium": "STORAGE" if i == 3 else "CPU",
                         "lora_name": None, "group_idx": i % 2}
    removed = sorted((e["group_idx"], e["block_hashes"]) for _, e in seen.events("BlockRemoved"))
    assert removed == [(0, [vllm_int_hash(hashes[0])]), (1, [vllm_int_hash(hashes[1])])]
    assert {e["medium"] for _, e in seen.events("BlockRemoved")} == {"CPU"}


def test_bytes_hashes_when_engines_publish_bytes(subscriber, start_stream):
    stream = start_stream(hash_format=HashFormat.BYTES)
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    block_hash = _hashes(1)[0]
    stream.sink.stored([vllm_key(ns, block_hash)], Medium.CPU)
    _connect(subscriber, stream)
    subscriber.until(lambda s: s.held() == {(f"m@{ns.digest.hex()}", "CPU"): {block_hash.hex()}})


def test_two_namespaces_are_told_apart_by_topic(subscriber, start_stream):
    stream = start_stream()
    a, b = namespace("model-a"), namespace("model-a", salt="other-weights")
    for ns in (a, b):
        stream.describe(EngineFamily.VLLM, ns.description)
    _connect(subscriber, stream)
    subscriber.until(lambda s: s.seqs)  # the stream's first batch
    same = _hashes(1)[0]  # the same tokens hash alike in both: only the topic tells
    stream.sink.stored([vllm_key(a, same), vllm_key(b, same)], Medium.CPU)
    stream.sink.removed([vllm_key(b, same)], Medium.CPU)
    subscriber.until(lambda s: s.held() == {(f"model-a@{a.digest.hex()}", "CPU"):
                                            {vllm_int_hash(same)}}
                     and s.events("BlockRemoved"))
    only_b = _connect(subscriber, stream, topic=f"model-a@{b.digest.hex()}")
    subscriber.until(lambda s: s.events("BlockRemoved"))
    assert {batch["topic"] for batch in only_b.batches} == {f"model-a@{b.digest.hex()}"}


def test_keys_wait_for_their_namespace_and_are_announced_once(subscriber, start_stream):
    stream = start_stream()
    ns = namespace()
    hashes = _hashes(3)
    keys = [vllm_key(ns, h) for h in hashes]
    stream.sink.stored(keys, Medium.CPU)
    stream.sink.removed(keys[:1], Medium.CPU)
    seen = _connect(subscriber, stream)
    subscriber.until(lambda s: s.seqs)
    assert not seen.events("BlockStored")  # nobody described the namespace yet
    stream.describe(EngineFamily.VLLM, ns.description)
    subscriber.until(lambda s: len(s.events("BlockStored")) == 2)
    stream.sink.removed(keys[1:2], Medium.CPU)
    subscriber.until(lambda s: s.events("BlockRemoved"))
    assert sorted(e["block_hashes"][0] for _, e in seen.events("BlockStored")) == sorted(
        vllm_int_hash(h) for h in hashes[1:])
    assert stream.stats().publisher.undescribed_keys == 0  # dropped from the queue, announced


def test_a_late_subscriber_replays_what_it_missed(subscriber, start_stream):
    stream = start_stream()
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    for h in _hashes(5):
        stream.sink.stored([vllm_key(ns, h)], Medium.CPU)
    _published(stream, ("BlockStored", "CPU"), 5)  # all of it went out before we connect
    seen = _connect(subscriber, stream)
    held = {(f"m@{ns.digest.hex()}", "CPU"): {vllm_int_hash(h) for h in _hashes(5)}}
    subscriber.until(lambda s: s.held() == held)
    replayed = [b for b in seen.batches if b["replayed"]]
    assert replayed and replayed[0]["seq"] == 0
    stats = stream.stats().publisher
    assert stats.replay_requests >= 1 and stats.replayed_batches >= len(replayed)
    stream.sink.stored([vllm_key(ns, b"late" * 8)], Medium.CPU)  # then it reads live
    subscriber.until(lambda s: any(not b["replayed"] for b in s.batches))


def test_a_slow_subscriber_loses_batches_then_replays_and_never_holds_the_hook(
        subscriber, start_stream):
    stream = start_stream(hwm=1, replay_batches=100_000)
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    seen = _connect(subscriber, stream, rcvhwm=1)
    subscriber.send("pause")
    subscriber.wait_for(lambda line: line.get("paused") is True)
    keys = [vllm_key(ns, i.to_bytes(32, "big")) for i in range(200 * 1024)]
    for i in range(0, len(keys), 1024):
        stream.sink.stored(keys[i:i + 1024], Medium.CPU)  # returns at once, reader or not
        threading.Event().wait(0.005)  # one batch per round: many batches in flight
    _published(stream, ("BlockStored", "CPU"), len(keys))
    subscriber.send("resume")
    want = {vllm_int_hash(k[8:-4]) for k in keys}
    subscriber.until(lambda s: s.held().get((f"m@{ns.digest.hex()}", "CPU")) == want)
    assert seen.gaps  # ZMQ dropped batches for this subscriber; the replay filled them
    assert seen.seqs == list(range(len(seen.seqs)))


def test_an_overflowing_queue_drops_counts_and_resyncs(subscriber, start_stream):
    stream = start_stream(queue_keys=1024, batch_interval_s=1.0)
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    _published(stream, ("AllBlocksCleared", ""), 1)  # the stream's first batch is out
    keys = [vllm_key(ns, i.to_bytes(32, "big")) for i in range(3000)]
    for i in range(0, 3000, 500):
        stream.sink.stored(keys[i:i + 500], Medium.CPU)
    stream.sink.removed(keys[:100], Medium.CPU)
    seen = _connect(subscriber, stream)
    want = {vllm_int_hash(k[8:-4]) for k in keys[100:]}
    subscriber.until(lambda s: s.held().get((f"m@{ns.digest.hex()}", "CPU")) == want)
    stats = stream.stats()
    assert stats.sink.overflows >= 1 and stats.sink.dropped_keys >= 1024
    assert stats.publisher.resyncs >= 1
    assert not seen.gaps


def test_a_clear_reannounces_the_disk_tier_and_the_stop_clears_last(subscriber, start_stream):
    stream = start_stream()
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    a, b, c = _hashes(3)
    stream.sink.stored([vllm_key(ns, a), vllm_key(ns, b)], Medium.CPU)
    stream.sink.stored([vllm_key(ns, c)], Medium.STORAGE)
    seen = _connect(subscriber, stream)
    topic = f"m@{ns.digest.hex()}"
    subscriber.until(lambda s: len(s.held()) == 2)
    stream.sink.cleared(Medium.CPU)
    subscriber.until(lambda s: s.held() == {(topic, "STORAGE"): {vllm_int_hash(c)}}
                     and len(s.events("AllBlocksCleared")) == 2)
    stream.close()
    subscriber.until(lambda s: len(s.events("AllBlocksCleared")) == 3)
    assert seen.batches[-1]["events"] == [{"type": "AllBlocksCleared"}] and not seen.held()


def test_replay_requests_that_are_not_are_ignored_and_counted(start_stream):
    stream = start_stream()
    with zmq.Context() as context:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 30_000)
        dealer.connect(stream.publisher.replay_endpoint)
        dealer.send_multipart([b"", b"short"])
        dealer.send_multipart([b"", b"x" * 8, b"extra"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # a real one is still answered
        frames = dealer.recv_multipart()
        while frames[2] != (-1).to_bytes(8, "big", signed=True):
            frames = dealer.recv_multipart()
        dealer.close()
    stats = stream.stats().publisher
    assert stats.bad_replay_requests == 2 and stats.replay_requests == 1


def test_an_endpoint_in_use_is_a_start_error_naming_it(start_stream):
    with zmq.Context() as context:
        squatter = context.socket(zmq.PUB)
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.bind("tcp://127.0.0.1:0")
        endpoint = squatter.getsockopt_string(zmq.LAST_ENDPOINT)
        with pytest.raises(ServiceError, match=endpoint.replace(".", r"\.")):
            start_stream(endpoint=endpoint)
        squatter.close()


def test_the_counters_say_what_subscribers_saw(subscriber, start_stream):
    stream = start_stream()
    ns = namespace()
    stream.describe(EngineFamily.VLLM, ns.description)
    seen = _connect(subscriber, stream)
    subscriber.until(lambda s: s.seqs)  # the stream's first batch
    keys = [vllm_key(ns, h) for h in _hashes(6)]
    stream.sink.stored(keys, Medium.CPU)
    stream.sink.stored(keys[:2], Medium.STORAGE)
    stream.sink.removed(keys[:3], Medium.CPU)
    stream.sink.stored([b"undescribed-namespace-key-0123456789"], Medium.CPU)
    subscriber.until(lambda s: len(s.events("BlockRemoved")) >= 1 and len(s.events(
        "BlockStored")) == 8)
    stats = stream.stats().publisher
    counted = {}
    for batch in seen.batches:
        for event in batch["events"]:
            kind = (event["type"], event.get("medium") or "")
            counted[kind] = counted.get(kind, 0) + 1
    assert dict(stats.events) == counted
    assert stats.batches == len(seen.batches) == stats.next_seq
    assert stats.undescribed_keys == 1
