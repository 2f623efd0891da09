"""The lease book, on its own (no vLLM, no coordinator): narrated scenarios with tiny keys.

The coordinator's answers are written out by hand here (``LeaseAnswer``); what they mean
is tested against a real coordinator in test_manager.py.
"""

from __future__ import annotations

import pytest

from tiercache.errors import StateError
from tiercache.vllm.batch import Answers, LeaseAnswer
from tiercache.vllm.leases import LeaseBook

HIT, MISS, PENDING, RETRY = "hit", "miss", "pending", "retry"
P = b"ns000000"  # the namespace prefix


class Book(LeaseBook):
    """The book with requests named by their ReqContext stand-in, as the manager uses it."""

    def new_request(self, req_id):  # noqa: D102 - returns the context the calls take
        ctx = Ctx()
        ctx.leases = super().new_request(req_id, ctx)
        return ctx

    def prepare_load(self, keys, ctx):
        return super().prepare_load(keys, ctx.leases)

    def request_finished(self, ctx):
        return super().request_finished(ctx.leases)

    def take_reserved(self, keys, ctx):
        return super().take_reserved(keys, ctx.leases)


def book() -> LeaseBook:
    return Book(Answers(HIT, MISS, PENDING, RETRY), P)


def k(i: int) -> bytes:
    return bytes([i]) * 4


class Ctx:
    """Stands for vLLM's ReqContext (the book only uses its identity)."""


def test_unknown_keys_are_retried_then_answered_from_one_batched_probe():
    b = book()
    r = b.new_request("r")
    assert [b.lookup(k(i), r) for i in range(4)] == [RETRY] * 4
    batch = b.take_batch()
    assert [keys for _, keys in batch.probes] == [[k(0), k(1), k(2), k(3)]]
    assert batch.prefix == P and b.has_pending_work
    assert [b.lookup(k(i), r) for i in range(4)] == [RETRY] * 4  # asked while out: not queued
    assert not b.take_batch().probes
    b.apply(batch, [LeaseAnswer(2, False, [10, 11])])
    assert not b.has_pending_work
    assert [b.lookup(k(i), r) for i in range(4)] == [HIT, HIT, MISS, MISS]
    assert b.prepare_load([k(0), k(1)], r) == [10, 11]


def test_a_pending_key_is_hit_pending_and_probed_again_after_a_step():
    b = book()
    r = b.new_request("r")
    b.lookup(k(0), r)
    b.lookup(k(1), r)
    batch = b.take_batch()
    b.apply(batch, [LeaseAnswer(1, True, [5])])
    assert (b.lookup(k(0), r), b.lookup(k(1), r)) == (HIT, PENDING)
    b.take_batch()  # the step in which the answers were used ends
    assert b.lookup(k(1), r) == RETRY  # not known any more: probed again
    assert [keys for _, keys in b.take_batch().probes] == [[k(1)]]


def test_a_key_held_for_one_request_is_a_hit_for_another_without_a_probe():
    b = book()
    r1, r2 = b.new_request("r1"), b.new_request("r2")
    b.lookup(k(0), r1)
    b.apply(b.take_batch(), [LeaseAnswer(1, False, [3])])
    assert b.lookup(k(0), r2) == HIT
    assert not b.take_batch()  # nothing to send
    b.request_finished(r1)
    assert not b.take_batch(), "r2 still holds the key: no release"
    b.request_finished(r2)
    assert b.take_batch().releases == [P + k(0)]


def test_a_load_keeps_its_keys_after_the_request_lease_ends():
    b = book()
    r = b.new_request("r")
    b.lookup(k(0), r)
    b.lookup(k(1), r)
    b.apply(b.take_batch(), [LeaseAnswer(2, False, [7, 8])])
    b.lookup(k(0), r)
    b.lookup(k(1), r)
    assert b.prepare_load([k(0)], r) == [7]  # the lease of k(1) ends: not loaded
    assert b.take_batch().releases == [P + k(1)]
    b.request_finished(r)
    assert not b.take_batch(), "the load still holds k(0)"
    b.complete_load([k(0)])
    assert b.take_batch().releases == [P + k(0)]


def test_prepare_load_of_a_key_never_answered_hit_is_refused():
    b = book()
    r = b.new_request("r")
    with pytest.raises(StateError, match="never answered"):
        b.prepare_load([k(9)], r)


def test_own_stores_are_pending_and_completions_are_queued_once():
    b = book()
    r = b.new_request("r")
    b.stores_prepared([k(0), k(1)], [4, 5])
    assert b.lookup(k(0), r) == PENDING
    assert b.complete_store([k(0), k(0), k(7)], success=True) == [k(0)]  # repeats, strangers
    assert b.complete_store([k(1)], success=False) == [k(1)]
    batch = b.take_batch()
    assert (batch.stores_done, batch.stores_failed) == ([P + k(0)], [P + k(1)])


def test_answers_for_a_request_that_finished_meanwhile_are_released():
    b = book()
    r = b.new_request("r")
    b.lookup(k(0), r)
    batch = b.take_batch()
    b.request_finished(r)
    b.apply(batch, [LeaseAnswer(1, False, [2])])
    assert b.take_batch().releases == [P + k(0)]
    assert not b.held


def test_a_reset_moves_to_a_new_prefix_and_fences_pins_and_writes_until_flushed():
    b = book()
    r = b.new_request("r")
    b.lookup(k(0), r)
    b.apply(b.take_batch(), [LeaseAnswer(1, False, [2])])
    b.stores_prepared([k(1)], [3])
    b.lookup(k(2), r)
    in_flight = b.take_batch()  # a probe answered only after the reset
    b.reset(b"ns111111")
    assert b.lookup(k(0), r) == RETRY, "the probe still out answers first"
    b.apply(in_flight, [LeaseAnswer(1, False, [9])])
    assert b.lookup(k(0), r) == RETRY and b.lookup(k(1), r) == RETRY
    batch = b.take_batch()
    assert batch.releases == [P + k(2)], "a stale answer's pin goes back under its old prefix"
    assert batch.prefix == b"ns111111" and [keys for _, keys in batch.probes] == [[k(0), k(1)]]
    b.complete_load([k(0)])  # the old load completing changes nothing
    b.reset_flushed()
    batch = b.take_batch()
    assert (batch.releases, batch.stores_failed) == ([P + k(0)], [P + k(1)])


def test_while_the_coordinator_is_down_unknown_keys_miss_and_work_is_kept():
    b = book()
    r = b.new_request("r")
    b.stores_prepared([k(1)], [3])
    b.complete_store([k(1)], success=True)
    b.lookup(k(0), r)
    batch = b.take_batch()
    b.batch_failed(batch)
    assert b.lookup(k(5), r) == MISS
    assert b.take_batch().stores_done == [P + k(1)], "the completion is sent again"
    b.reconnected()
    assert b.lookup(k(5), r) == RETRY


def test_a_lost_session_forgets_leases_and_writes_without_releasing_them():
    b = book()
    r = b.new_request("r")
    b.lookup(k(0), r)
    b.apply(b.take_batch(), [LeaseAnswer(1, False, [2])])
    b.stores_prepared([k(1)], [3])
    b.session_lost()
    assert not b.held and not b.writing and not b.take_batch()
    assert b.lookup(k(0), r) == RETRY
    b.complete_store([k(1)], success=True)
    assert not b.take_batch().stores_done


def test_reservations_answer_prepare_store_and_unused_ones_are_freed():
    b = book()
    r = b.new_request("r")
    for i in range(4):
        b.lookup(k(i), r)
    b.apply(b.take_batch(), [LeaseAnswer(1, False, [0], reserved=[(k(1), 5), (k(3), 6)],
                                         skipped=[k(2)])])
    assert b.lookup(k(1), r) == MISS, "its own reservation is its to compute"
    assert b.take_reserved([k(1), k(2), k(9)], r) == ([k(1)], [5], [k(9)])
    assert b.lookup(k(1), r) == PENDING
    b.request_finished(r)
    assert b.take_batch().stores_failed == [P + k(3)], "the unused reservation is freed"


def test_reservations_of_a_request_that_finished_meanwhile_are_freed():
    b = book()
    r = b.new_request("r")
    b.lookup(k(0), r)
    batch = b.take_batch()
    b.request_finished(r)
    b.apply(batch, [LeaseAnswer(0, False, [], reserved=[(k(0), 4)])])
    assert b.take_batch().stores_failed == [P + k(0)]


def test_keys_that_found_no_room_stay_misses_until_the_request_stores_them():
    b = book()
    r = b.new_request("r")
    for i in range(3):
        b.lookup(k(i), r)
    b.apply(b.take_batch(), [LeaseAnswer(1, False, [0], reserved=[(k(1), 5)], no_room=[k(2)])])
    b.take_batch()  # a step in which r was not scheduled: the probe's answers expire
    assert [b.lookup(k(i), r) for i in range(3)] == [HIT, MISS, MISS], "never probed again"
    assert not b.take_batch().probes
    assert b.take_reserved([k(1), k(2)], r) == ([k(1)], [5], [k(2)])  # 2: asked on the spot
    assert not r.leases.unreserved


def test_a_step_that_stores_lets_its_reservations_evict_that_many_and_retries_no_room_keys():
    b = book()
    old, new = b.new_request("old"), b.new_request("new")
    b.lookup(k(0), old)
    b.lookup(k(1), old)
    b.lookup(k(5), new)
    batch = b.take_batch()
    assert batch.num_stored == 0, "a step that stored nothing: its reservations evict nothing"
    b.apply(batch, [LeaseAnswer(0, False, [], no_room=[k(0), k(1)]),
                    LeaseAnswer(0, False, [], no_room=[k(5)])])
    b.stores_prepared([k(9)], [3])  # a store asked on the spot, in this step
    batch = b.take_batch()
    assert batch.num_stored == 1
    assert [(p.request, p.keys) for p in batch.retries] == [(old.leases, [k(0)])], \
        "oldest request first, at most one key per key stored"
    assert b.take_reserved([k(5)], new) == ([], [], [k(5)])  # new stores on the spot
    batch2 = b.take_batch()
    assert [p.keys for p in batch2.retries] == [], "old's retry is in flight; new has none left"
    b.apply(batch, [], [LeaseAnswer(0, False, (), reserved=[(k(0), 7)])])
    b.apply(batch2, [])
    assert b.take_reserved([k(0)], old) == ([k(0)], [7], [])
    b.request_finished(old)
    assert not b.take_batch().retries, "a finished request's keys are not retried"


def test_retried_reservations_of_a_request_that_finished_meanwhile_are_freed():
    b = book()
    r = b.new_request("r")
    b.lookup(k(0), r)
    b.apply(b.take_batch(), [LeaseAnswer(0, False, [], no_room=[k(0)])])
    b.stores_prepared([k(9)], [3])
    batch = b.take_batch()
    b.request_finished(r)
    b.apply(batch, [], [LeaseAnswer(0, False, (), reserved=[(k(0), 4)])])
    assert b.take_batch().stores_failed == [P + k(0)]
