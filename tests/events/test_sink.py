"""``NodeEventSink``: the mirror, the bounded queue, resyncs and namespace descriptions, as
the publisher takes them (no sockets here; tests/events/test_publisher.py has them)."""

from __future__ import annotations

import random
import threading

import pytest

from tiercache.errors import StateError
from tiercache.link.namespaces import EngineFamily, parse_description
from tiercache.events.namespace_table import MAX_NAMESPACES_PER_SESSION
from tiercache.events.sink import MAX_NAMESPACES, NodeEventSink, Taken
from tiercache.specs import Medium

from event_support import namespace


def _info(model: str = "m"):
    return parse_description(EngineFamily.VLLM, namespace(model).description)


def _key(info, i: int) -> bytes:
    return info.digest + i.to_bytes(32, "big") + b"\0\0\0\0"


class Model:
    """What a subscriber would believe after applying everything taken, by medium."""

    def __init__(self) -> None:
        self.held: dict[Medium, set[bytes]] = {}

    def apply(self, taken: Taken) -> None:
        if taken.resync:
            self.held = {}
        for medium, _, keys in taken.announce:
            self.held.setdefault(medium, set()).update(keys)
        for change in taken.changes:
            keys = {k for k in change.keys if k[:8] in taken.namespaces}
            place = self.held.setdefault(change.medium, set())
            if change.removed:
                place -= keys
            else:
                assert not keys & place, "a block announced twice"
                place |= keys


def test_changes_come_out_in_order_and_only_described_namespaces_are_announced():
    sink, model = NodeEventSink(1 << 16), Model()
    a, b = _info("a"), _info("b")
    sink.describe(a)
    sink.stored([_key(a, 1), _key(a, 2), _key(b, 1)], Medium.CPU)
    sink.removed([_key(a, 1)], Medium.CPU)
    first = sink.take()
    assert first.resync and first.changes == []  # a new stream starts with a clear
    model.apply(first)
    assert model.held == {Medium.CPU: {_key(a, 2)}}  # b is not described: not announced
    sink.stored([_key(a, 3)], Medium.STORAGE)
    second = sink.take()
    assert not second.resync and [c.keys for c in second.changes] == [(_key(a, 3),)]
    sink.describe(b)  # b's held key is announced once, its queued changes not again
    sink.stored([_key(b, 2)], Medium.CPU)
    third = sink.take()
    model.apply(second)
    model.apply(third)
    assert {info.model for _, info, _ in third.announce} == {"b"}
    assert model.held == {Medium.CPU: {_key(a, 2), _key(b, 1), _key(b, 2)},
                          Medium.STORAGE: {_key(a, 3)}}


def test_an_overflow_drops_counts_and_resyncs_from_the_mirror():
    sink, model = NodeEventSink(1024), Model()
    info = _info()
    sink.describe(info)
    model.apply(sink.take())
    keys = [_key(info, i) for i in range(1500)]
    sink.stored(keys[:1000], Medium.CPU)
    sink.stored(keys[1000:], Medium.CPU)  # passes the bound: everything queued goes
    sink.removed(keys[:10], Medium.CPU)
    stats = sink.stats()
    assert stats.dropped_keys == 1500 and stats.overflows == 1 and stats.queued_keys == 0
    taken = sink.take()
    assert taken.resync and taken.changes == []
    model.apply(taken)
    assert model.held == {Medium.CPU: set(keys[10:])}


def test_cleared_reannounces_what_the_other_media_still_hold():
    sink, model = NodeEventSink(1 << 16), Model()
    info = _info()
    sink.describe(info)
    sink.stored([_key(info, 1), _key(info, 2)], Medium.CPU)
    sink.stored([_key(info, 3)], Medium.STORAGE)
    model.apply(sink.take())
    sink.cleared(Medium.CPU)
    taken = sink.take()
    assert taken.resync
    model.apply(taken)
    assert model.held == {Medium.STORAGE: {_key(info, 3)}}
    assert sink.stats().clears == 1


def test_namespaces_are_bounded_and_one_no_session_holds_makes_room():
    """Each of 256 sessions describes a namespace and stores a block: the table is full of
    held namespaces and a new description is refused; once a session ends, its namespace
    makes room (its block withdrawn from subscribers: a removal, then forgotten)."""
    sink, model = NodeEventSink(1 << 16), Model()
    infos = [_info(f"model-{i}") for i in range(MAX_NAMESPACES)]
    for i, info in enumerate(infos):
        sink.describe(info, owner=100 + i)
        sink.stored([_key(info, i)], Medium.CPU)
    sink.describe(infos[0], owner=100)  # known: nothing changes
    model.apply(sink.take())
    with pytest.raises(StateError, match=str(MAX_NAMESPACES)):
        sink.describe(_info("one-too-many"), owner=1)
    sink.session_ended(107)  # model-7's session ends; its block stays held by the node
    sink.describe(_info("one-too-many"), owner=1)
    taken = sink.take()
    assert [(c.removed, c.keys) for c in taken.changes] == [(True, (_key(infos[7], 7),))]
    assert infos[7].digest in taken.namespaces  # for its withdrawal, this once
    model.apply(taken)
    assert _key(infos[7], 7) not in model.held[Medium.CPU]
    later = sink.take()
    assert infos[7].digest not in later.namespaces and len(later.namespaces) == MAX_NAMESPACES
    assert sink.stats().evicted_namespaces == 1
    sink.session_ended(1)
    sink.describe(infos[7], owner=107)  # back in the place of one holding nothing
    back = sink.take()
    assert [(i.model, keys) for _, i, keys in back.announce] == [("model-7", [_key(infos[7], 7)])]
    assert sink.stats().namespaces == MAX_NAMESPACES


def test_a_session_holds_its_newest_namespaces_and_one_it_let_go_makes_room():
    sink = NodeEventSink(1 << 16)
    infos = [_info(f"model-{i}") for i in range(MAX_NAMESPACES)]
    for i, info in enumerate(infos[:-MAX_NAMESPACES_PER_SESSION]):
        sink.describe(info, owner=100 + i)
    for info in infos[-MAX_NAMESPACES_PER_SESSION:]:  # one session, every cache reset anew
        sink.describe(info, owner=1)
    assert sink.stats().held_namespaces == MAX_NAMESPACES
    sink.describe(_info("epoch-next"), owner=1)  # its oldest is let go, then makes room
    stats = sink.stats()
    assert stats.namespaces == MAX_NAMESPACES and stats.evicted_namespaces == 1
    assert sink.foreign_namespace([_key(infos[-1], 0)], owner=1) is None
    assert sink.foreign_namespace([_key(infos[-1], 0)], owner=2) == infos[-1]


def test_keys_stored_under_no_described_namespace_are_never_announced():
    """After the stream adopted what the node held, a key stored under a prefix nobody
    described stays unpublished even once the namespace is described (a client storing
    ahead of an engine under a digest it guessed); what was held at the start is
    announced, and so is a published key that moves to another medium."""
    sink, model = NodeEventSink(1 << 16), Model()
    info = _info()
    sink.stored([_key(info, 0)], Medium.STORAGE)  # held when the stream began
    sink.adopted()
    sink.stored([_key(info, 1)], Medium.CPU)  # nobody described it: no namespace
    sink.stored([b"client-key-1", b"client-key-2"], Medium.CPU)
    assert sink.stats().no_namespace_keys == 3
    sink.describe(info)
    sink.stored([_key(info, 2), _key(info, 0)], Medium.CPU)  # its own; a promotion
    sink.stored([_key(info, 1)], Medium.STORAGE)  # the squatted key moves: still not
    model.apply(sink.take())
    assert model.held == {Medium.CPU: {_key(info, 0), _key(info, 2)},
                          Medium.STORAGE: {_key(info, 0)}}
    sink.removed([_key(info, 1), b"client-key-1"], Medium.CPU)  # gone quietly
    assert sink.take().changes == []
    assert sink.stats().no_namespace_keys == 4


def test_concurrent_callers_and_a_taker_agree_with_the_mirror():
    """Four threads store, remove and clear at random while another takes: applying what
    was taken gives exactly what the sink says each medium holds."""
    sink, model = NodeEventSink(4096), Model()
    infos = [_info("a"), _info("b")]
    for info in infos:
        sink.describe(info)
    stop = threading.Event()

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(3000):
            info = rng.choice(infos)
            keys = [_key(info, rng.randrange(200)) for _ in range(rng.randint(1, 40))]
            medium = rng.choice([Medium.CPU, Medium.STORAGE])
            roll = rng.random()
            if roll < 0.002:
                sink.cleared(medium)
            elif roll < 0.5:
                sink.stored(keys, medium)
            else:
                sink.removed(keys, medium)

    def taker() -> None:
        while not stop.is_set():
            model.apply(sink.take())

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    drain = threading.Thread(target=taker)
    drain.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    drain.join()
    model.apply(sink.take())
    for medium in (Medium.CPU, Medium.STORAGE):
        assert model.held.get(medium, set()) == sink.held_keys(medium)
