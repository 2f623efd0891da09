"""The engine-side book of leases: what the scheduler may answer without asking anyone.

vLLM asks ``lookup`` once per key, in a Python loop, while it holds the manager lock for
the whole scheduling step (a cached 32k-token prompt is ~2000 calls). One RPC per key
would put ~2000 round trips on that path, so the book answers every lookup from memory:

* a key this engine holds a lease on (``held``) is a HIT: the coordinator keeps the block
  pinned for this engine's session until the book releases it, so it cannot be evicted
  between the HIT and vLLM's ``prepare_load`` (which is answered from the book as well);
* a key this engine is storing right now is HIT_PENDING; one the last probe answered,
  MISS or HIT_PENDING for one step;
* a new request's first key that no tier holds (``maybe_held``: the coordinator's key
  presence map, ``tiercache.region.presence``) is MISS at once: a cold request is
  admitted in the step it is first looked up, with no round trip;
* any other key is RETRY, and is queued: at the end of the step (``take_batch``, from
  ``on_schedule_end``) the queued keys of every request go out in one batched lease RPC
  (``Client.lease_batch``: per request the leading run of READY keys is pinned), sent by
  the flusher thread while the model runs; ``apply`` files the answers under the lock,
  and the request, deferred by vLLM for that step, finds them at its next lookup. If the
  answer is not filed by then (steps shorter than the round trip), that lookup waits for
  it (``await_answers``, bounded), so a hit is loaded in the step after its first lookup.

Refs: a held key counts its local users (request leases, loads in flight); the
coordinator may hold several pins for it, and ``release`` drops them all once the count
reaches zero, so a release never takes a pin another user needs. A load takes no pin of
its own: it reads the lease's fenced slot under the lease's pins.
A request's leases end when its load is prepared or the request finishes.

Reservations: the keys of a probe past its leased run are the chunks the request is about
to compute and store, so the flusher reserves their slots in the same flush (one
``prepare_store`` for the step; see ``tiercache.vllm.flusher``). vLLM's ``prepare_store``
is then answered from ``reserved`` (and ``skip``: keys another engine holds already)
without an RPC; only keys no probe covered (a GPU prefix hit, decode chunks) or that
found no room go to the coordinator on the spot. A request's own reserved keys, and
those that found no room (``unreserved``), answer MISS (they are its to compute); what it
never stores is freed when it finishes.

A lookup takes nothing: reservations take free slots, and evict at most as many blocks
as this engine really stored during the step (``num_stored``, counted in
``take_reserved`` and ``stores_prepared``), so evictions follow stores, never lookups: a
step that stores nothing (all hits, all aborted) evicts nothing, and a request aborted
after its lookup costs the cache nothing it would not have lost to the stores anyway.
Keys that found no room are retried in later steps that stored something (``retries``,
oldest requests first, at most ``num_stored`` keys), so a request waiting its turn gets
its reservations before it computes and a full cache does not put an RPC on the
scheduler's path for every request.

The hot dictionaries are keyed by vLLM's ``OffloadKey`` bytes; what goes to the
coordinator is a wire key (``prefix + key``) or carries its prefix, so a reset that moves
the engine to a new namespace never confuses old and new keys. The four answers are
vLLM's ``LookupResult`` members, passed in: nothing of vLLM is imported, nothing is
translated on the hot path. Not thread safe: called under the manager's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any, cast

from tiercache.errors import StateError
from tiercache.results import BlockSource
from tiercache.vllm.batch import Answers, Batch, LeaseAnswer, Probe, RequestLeases
from tiercache.vllm.fenced_slot import FencedSlot

ABSENT = object()


def always(key: bytes) -> bool:
    return True


class Held:
    """One key the book holds: its fenced slot (id, generation, region), the refs on it."""

    __slots__ = ("slot", "refs", "source")

    def __init__(self, slot: FencedSlot, source: BlockSource = BlockSource.HOST):
        self.slot = slot
        self.refs = 0
        self.source = source  # the tier it was promoted from (vLLM's load source)


class LeaseBook:
    """See the module docstring. ``answers`` are the four lookup results."""

    def __init__(self, answers: Answers, prefix: bytes, *,
                 maybe_held: Callable[[bytes], bool] | None = None,
                 await_answers: Callable[[RequestLeases], bool] | None = None):
        self.answers = answers
        # a request's first key: False means no tier holds it (a cold miss, at once)
        self.maybe_held = maybe_held if maybe_held is not None else always
        # Until the request's probe in flight is answered (filed), or a bound: True if it was.
        self.await_answers = await_answers
        # Plain attributes for the hot path (a NamedTuple field costs a descriptor call).
        self._hit, self._miss, self._pending, self._retry = answers
        self._last_context: object = None  # vLLM asks a request's keys one after another
        self._last_request: RequestLeases | None = None
        self.prefix = prefix
        self.generation = 0  # resets so far: answers of an older generation are stale
        self.held: dict[bytes, Held] = {}
        self.writing: dict[bytes, FencedSlot] = {}  # stores handed to vLLM, not completed yet
        self._requests: dict[str, RequestLeases] = {}
        self._by_context: dict[int, RequestLeases] = {}  # id(ReqContext) -> its leases
        self._probing: dict[str, RequestLeases] = {}  # requests with keys queued to probe
        self._answered: dict[str, RequestLeases] = {}  # requests holding probe answers
        self._short: dict[str, RequestLeases] = {}  # requests with keys that found no room
        self._num_stored = 0  # keys handed out for storing during this step
        self._queued = Batch(prefix)
        self._fenced_pins: list[bytes] = []  # held before a reset: released once flushed
        self._fenced_writes: list[bytes] = []  # written before a reset: failed once flushed
        self._in_flight = 0  # batches taken and not yet applied
        self.step = 0
        self.cold_misses = 0  # first lookups answered MISS at once (no tier holds the key)
        self.down = False  # the coordinator is unreachable: unknown keys are MISS

    # ------------------------------------------------------------------ the hot path
    def lookup(self, key: bytes, req_context: object) -> Any:
        """vLLM's ``lookup(key, req_context)``: the manager hands vLLM's call straight here
        (one Python frame per key; the request is found by its context's identity)."""
        request = self._last_request
        if req_context is not self._last_context or request is None:
            request = self._last_request = self._by_context[id(req_context)]
            self._last_context = req_context
        if request.fresh:  # nothing known for this request yet: its admission step
            if key not in self.held and key not in self.writing:
                if not request.probe and (self.down or not self.maybe_held(key)):
                    self.cold_misses += 1
                    return self._miss  # a cold miss: admitted now, nothing to wait for
                request.probe.append(key)
                return self._retry
            request.fresh = False
        if key in request.leased:
            return self._hit
        held = self.held.get(key)
        if held is not None:
            held.refs += 1
            request.leased[key] = None
            return self._hit
        if key in self.writing:
            return self._pending
        answer = request.answers.get(key)
        if answer is not None:
            return answer
        if self.down or key in request.reserved or key in request.unreserved:
            return self._miss
        if not request.in_flight:
            if not request.probe:
                self._probing[request.req_id] = request
            request.probe.append(key)
            return self._retry
        # A probe in flight covers these keys: its answer is filed by the next step, or
        # waited for now (bounded), so a hit loads in the step after its first lookup
        # however short the steps are.
        if self.await_answers is not None and self.await_answers(request):
            return self.lookup(key, req_context)
        return self._retry

    # ------------------------------------------------------------------ loads
    def prepare_load(self, keys: Iterable[bytes], request: RequestLeases) -> list[FencedSlot]:
        """Slot ids co-indexed with ``keys``; the load holds a ref on each key until
        ``complete_load`` (the request's lease ref passes to the load where it has one), and
        the request's other leases end."""
        keys = list(keys)
        held_map = self.held
        try:
            slots = [held_map[key].slot for key in keys]
        except KeyError as e:
            raise StateError(
                f"prepare_load: key {e.args[0]!r} of request {request.req_id} was never "
                "answered HIT (no lease); vLLM loads only keys its lookup saw as hits") from None
        leased = request.leased
        before = len(leased)
        pop = leased.pop
        leases = [pop(key, ABSENT) for key in keys]
        if before - len(leased) != len(keys):  # some key had no lease of this request
            for key, lease in zip(keys, leases):
                if lease is ABSENT:  # a ref of the load's own
                    held_map[key].refs += 1
        self._end_leases(request)
        return slots

    def complete_load(self, keys: Iterable[bytes]) -> None:
        self._drop_refs(keys)

    # ------------------------------------------------------------------ stores
    def take_reserved(self, keys: Iterable[bytes], request: RequestLeases
                      ) -> tuple[list[bytes], list[FencedSlot], list[bytes]]:
        """Answer a ``prepare_store`` from the request's reservations: (keys to store, their
        slots, keys none of its probes covered). Taken keys become ``writing``."""
        keys = list(keys)
        reserved = request.reserved
        before = len(reserved)
        pop = reserved.pop
        found = [pop(key, None) for key in keys]
        if before - len(reserved) == len(keys):  # the usual case: all of them were reserved
            taken = cast("list[FencedSlot]", found)  # so none of them is None
            self.writing.update(zip(keys, taken))
            self._num_stored += len(keys)
            return keys, taken, []
        skip = request.skip
        to_store, slots, unknown = [], [], []
        for key, slot in zip(keys, found):
            if slot is not None:
                to_store.append(key)
                slots.append(slot)
            elif key not in skip:
                unknown.append(key)
        if request.unreserved:  # asked on the spot now: not retried
            for key in unknown:
                request.unreserved.pop(key, None)
        self.writing.update(zip(to_store, slots))
        self._num_stored += len(to_store)
        return to_store, slots, unknown

    def stores_prepared(self, keys: Sequence[bytes], slots: Sequence[FencedSlot]) -> None:
        self.writing.update(zip(keys, slots))
        self._num_stored += len(keys)

    def complete_store(self, keys: Iterable[bytes], success: bool) -> list[bytes]:
        """Queue the publication (or freeing) of our stores; keys not being written by this
        engine (repeated or stale completions) are ignored. Returns the keys taken."""
        pop = self.writing.pop
        taken = [key for key in keys if pop(key, None) is not None]
        (self._queued.stores_done if success else self._queued.stores_failed).extend(
            map(self.prefix.__add__, taken))
        return taken

    # ------------------------------------------------------------------ requests
    def new_request(self, req_id: str, context: object) -> RequestLeases:
        """``context`` (vLLM's ReqContext) must stay alive until ``request_finished``."""
        request = self._requests[req_id] = RequestLeases(req_id, id(context))
        self._by_context[id(context)] = request
        self._probing[req_id] = request  # fresh: its lookups only queue keys
        return request

    def request_finished(self, request: RequestLeases) -> None:
        request.finished = True
        self._requests.pop(request.req_id, None)
        self._by_context.pop(request.context_id, None)
        if self._last_request is request:
            self._last_context = self._last_request = None
        self._end_leases(request)
        self._free_reserved(request)
        request.probe.clear()
        request.answers.clear()
        request.unreserved.clear()
        self._probing.pop(request.req_id, None)
        self._answered.pop(request.req_id, None)
        self._short.pop(request.req_id, None)

    def _end_leases(self, request: RequestLeases) -> None:
        if request.leased:
            self._drop_refs(request.leased)
            request.leased.clear()

    def _free_reserved(self, request: RequestLeases) -> None:
        """Reservations the request never used: their slots are freed at the next flush."""
        prefix = self.prefix
        self._queued.stores_failed.extend(prefix + key for key in request.reserved)
        request.reserved.clear()
        request.skip.clear()

    def _drop_refs(self, keys: Iterable[bytes]) -> None:
        """One ref less on each key; a key with none left is released at the next flush.
        Keys not held (fenced by a reset, lost with the coordinator) are skipped."""
        held_map, releases, prefix = self.held, self._queued.releases, self.prefix
        for key in keys:
            held = held_map.get(key)
            if held is None:
                continue
            refs = held.refs - 1
            if refs > 0:
                held.refs = refs
            elif refs == 0:
                del held_map[key]
                releases.append(prefix + key)
            else:
                raise StateError(f"key {key!r}: more refs dropped than taken")

    # ------------------------------------------------------------------ the step boundary
    def take_batch(self) -> Batch:
        """End of a step: hand over what is queued; probe answers filed before this step
        have now been visible for a whole step and are dropped."""
        self.step += 1
        for req_id, request in list(self._answered.items()):
            if request.answers_step < self.step:  # visible during the step that just ended
                request.answers.clear()
                del self._answered[req_id]
        batch, self._queued = self._queued, Batch(self.prefix, self.generation)
        batch.prefix, batch.generation = self.prefix, self.generation  # what its probes use
        batch.num_stored, self._num_stored = self._num_stored, 0
        if batch.num_stored and self._short:
            self._queue_retries(batch)
        waiting = {}
        for req_id, request in self._probing.items():
            if request.probe:
                batch.probes.append(Probe(request, request.probe))  # the flusher drops repeats
                request.probe = []
                request.in_flight += 1
                request.fresh = False
            elif request.fresh:  # not looked up yet
                waiting[req_id] = request
        self._probing = waiting
        if batch:
            self._in_flight += 1
        return batch

    def _queue_retries(self, batch: Batch) -> None:
        """Ask again for room for keys that found none, oldest requests first, at most as
        many keys as the step stored (what the reservations may evict)."""
        room = batch.num_stored
        for req_id, request in list(self._short.items()):
            if not request.unreserved:
                del self._short[req_id]
                continue
            if request.retrying:
                continue
            keys = list(islice(request.unreserved, room))
            batch.retries.append(Probe(request, keys))
            request.retrying += 1
            room -= len(keys)
            if room <= 0:
                break

    def apply(self, batch: Batch, leases: Sequence[LeaseAnswer],
              retried: Sequence[LeaseAnswer] = ()) -> None:
        """File the coordinator's answers to ``batch.probes`` and ``batch.retries``
        (co-indexed)."""
        self._in_flight -= 1
        stale = batch.generation != self.generation
        for (request, _), answer in zip(batch.retries, retried, strict=True):
            request.retrying -= 1
            if stale or request.finished:
                self._queued.stores_failed.extend(batch.prefix + k for k, _ in answer.reserved)
                continue
            self._file_reservations(request, answer)
        for (request, keys), answer in zip(batch.probes, leases, strict=True):
            request.in_flight -= 1
            leased = keys[:answer.num_hit]
            if stale or request.finished:
                # Pins taken for a request that ended meanwhile, or under the namespace of
                # before a reset: drop them, unless someone here still holds the key (then
                # the extra pin goes with the holder's release); free its reservations.
                self._queued.releases.extend(
                    batch.prefix + k for k in leased if stale or k not in self.held)
                self._queued.stores_failed.extend(batch.prefix + k for k, _ in answer.reserved)
                continue
            self._file_reservations(request, answer)
            promoted = dict(zip(answer.promoted, answer.sources, strict=True))
            for i, (key, slot) in enumerate(zip(leased, answer.slots, strict=True)):
                held = self.held.get(key)
                if held is None:
                    held = self.held[key] = Held(slot, promoted.get(i, BlockSource.HOST))
                elif held.slot != slot:
                    raise StateError(f"key {key!r} is held at slot {held.slot}, but its "
                                     f"lease says slot {slot}")
                if key not in request.leased:
                    held.refs += 1
                    request.leased[key] = None
            rest = keys[answer.num_hit:]
            if rest:
                request.answers[rest[0]] = (self.answers.pending if answer.pending
                                            else self.answers.miss)
                # Keys past the first non-hit are not known to be absent, but only a leading
                # run is ever leased; a MISS is never wrong, only a lost chance (and a prefix
                # lookup stops at the first MISS anyway).
                for key in rest[1:]:
                    request.answers[key] = self.answers.miss
                request.answers_step = self.step
                self._answered[request.req_id] = request

    def _file_reservations(self, request: RequestLeases, answer: LeaseAnswer) -> None:
        unreserved = request.unreserved
        request.reserved.update(answer.reserved)
        request.skip.update(answer.skipped)
        if unreserved:
            for key, _ in answer.reserved:
                unreserved.pop(key, None)
            for key in answer.skipped:
                unreserved.pop(key, None)
        if answer.no_room:
            unreserved.update(dict.fromkeys(answer.no_room))
            self._short[request.req_id] = request

    def batch_failed(self, batch: Batch) -> None:
        """The coordinator did not answer ``batch`` (it is gone). Its completions and
        releases are queued again (both are idempotent, and they matter if our session is
        resumed); its probes are dropped, and unknown keys are MISS until ``reconnected``
        or ``session_lost``."""
        self._in_flight -= 1
        self.down = True
        for request, _ in batch.probes:
            request.in_flight -= 1
        for request, _ in batch.retries:
            request.retrying -= 1
        queued = self._queued
        queued.stores_done[:0] = batch.stores_done
        queued.stores_failed[:0] = batch.stores_failed
        queued.releases[:0] = batch.releases

    # ------------------------------------------------------------------ resets and losses
    def reset(self, prefix: bytes) -> None:
        """vLLM's ``reset_cache``: move to namespace ``prefix`` and forget every lease and
        answer. Pins and stores still in flight are fenced until ``reset_flushed`` (a worker
        may still be reading or writing those slots, so they must not be reused before);
        answers to probes in flight are stale and released when they arrive."""
        old = self.prefix
        self._fenced_pins.extend(old + key for key in self.held)
        self._fenced_writes.extend(old + key for key in self.writing)
        self.held.clear()
        self.writing.clear()
        for request in self._requests.values():
            request.fresh = False  # the queue of fresh requests is dropped below
            self._fenced_writes.extend(old + key for key in request.reserved)
            request.reserved.clear()
            request.skip.clear()
            request.unreserved.clear()
            request.leased.clear()
            request.answers.clear()
            request.probe.clear()
        self._probing.clear()
        self._answered.clear()
        self._short.clear()
        self.prefix = prefix
        self._queued.prefix = prefix
        self.generation += 1

    def reset_flushed(self) -> None:
        self._queued.releases.extend(self._fenced_pins)
        self._queued.stores_failed.extend(self._fenced_writes)
        self._fenced_pins.clear()
        self._fenced_writes.clear()

    def session_lost(self) -> None:
        """The coordinator restarted: its pins and our write reservations are gone with our
        session, so nothing is released or completed; leases are forgotten."""
        self.held.clear()
        self.writing.clear()
        for request in self._requests.values():
            request.leased.clear()
            request.reserved.clear()
            request.skip.clear()
            request.unreserved.clear()
        self._short.clear()
        self._queued = Batch(self.prefix, self.generation)
        self._fenced_pins.clear()
        self._fenced_writes.clear()
        self.down = False

    def reconnected(self) -> None:
        """The coordinator answers again with our session intact."""
        self.down = False

    # ------------------------------------------------------------------ introspection
    @property
    def has_pending_work(self) -> bool:
        """Something waits for a flush (vLLM keeps stepping while this is True)."""
        return (bool(self._queued) or self._in_flight > 0
                or any(request.probe for request in self._probing.values()))

    @property
    def num_held(self) -> int:
        return len(self.held)
