"""The flusher: one thread that sends each step's ``Batch`` to the coordinator.

``on_schedule_end`` hands the step's batch over and returns at once; this thread sends it
while the engine runs the model, then files the answers in the ``LeaseBook`` under the
manager's lock (vLLM's own async lookups work the same way: one queue item per step, a
background thread, a real lock). Filing goes through a mailbox: the thread posts the
filing, then takes the lock to run it; a scheduler that holds the lock and needs a
request's answer now (``await_answers``, from a lookup) runs what is posted itself, so
it never waits on this thread for the lock it holds. Only answers go through the mailbox:
a failed batch and a lost session drop leases, so they are filed between steps (the
thread takes the lock), never inside a step whose HITs still wait for their
``prepare_load``. Per batch, in order: completed stores, failed stores
(both on the *writer* session, which made those reservations), releases, the batch's
retries (one ``prepare_store``, writer session, for keys of earlier probes that found no
room), then one ``lease_batch`` for every probed request (*bulk* session, which owns the
leases; each lease answers its hit run's fenced slots, so no ``prepare_load`` follows: a
load reads them under the lease's pin), then, with ``reserve``, one ``prepare_store``
(writer session) for the keys past each request's leased run: the chunks it is about to
compute, so vLLM's ``prepare_store`` for them is answered without an RPC (see
``tiercache.vllm.leases``). A key two requests miss is reserved for the first; a probe
whose run ends at a pending key reserves nothing (it will be asked again).

**A lookup takes nothing**: these reservations are made ahead of stores that may never
happen (a request may be aborted before it computes a token), so they take free slots
and evict at most ``batch.num_stored`` blocks in all, as many as the engine really
stored during the step (``prepare_store(max_evictions=...)``, in request order while
room lasts). Keys that found no room are retried in a later batch, or stored at vLLM's
``prepare_store`` on the spot (one RPC, which may evict: the request computes them).

Two sessions, because the scheduler thread itself calls ``prepare_store`` on the writer
while this thread may be in a long lease RPC on the bulk one; a client serves one call at
a time, and a store must not wait behind a lookup batch.

When the coordinator is gone a batch fails as a whole: the book re-queues its
completions and releases, answers unknown keys MISS, and this thread pings every
``reconnect_interval_s`` until it answers. Then a resumed session carries on; a new one
(the coordinator restarted) means our pins and reservations are gone, so the book forgets
them before the next answers are filed.

Any other error in this thread (a bug, a refused call) is kept and raised in the
scheduler at its next ``submit``: the engine stops with it instead of waiting forever
for answers that will not come.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tiercache.errors import AdapterError, CoordinatorGoneError, SessionLostError
from tiercache.link.protocol import MAX_KEYS_PER_CALL
from tiercache.vllm.batch import Batch, LeaseAnswer, Probe
from tiercache.vllm.fenced_slot import FencedSlot, fenced_slots
from tiercache.vllm.leases import LeaseBook

log = logging.getLogger(__name__)

RECONNECT_INTERVAL_S = 1.0


class IndexSession(Protocol):
    """The part of ``tiercache.Client`` the adapter uses."""

    @property
    def resumed(self) -> bool: ...

    def lease_batch(self, key_lists: Sequence[Sequence[bytes]]) -> list[Any]: ...
    def release(self, keys: Sequence[bytes]) -> int: ...
    def prepare_store(self, keys: Sequence[bytes], *,
                      max_evictions: int | None = None) -> Any: ...
    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None: ...
    def ping(self) -> float: ...
    def close(self) -> None: ...


def _chunks(keys: Sequence[bytes], size: int = MAX_KEYS_PER_CALL):
    for start in range(0, len(keys), size):
        yield keys[start:start + size]


def _list_groups(key_lists: list[list[bytes]]):
    """Consecutive groups of lists with at most MAX_KEYS_PER_CALL keys in all (a longer
    list is cut: keys past the cut are answered MISS, never leased)."""
    group: list[list[bytes]] = []
    total = 0
    for keys in key_lists:
        keys = keys[:MAX_KEYS_PER_CALL]
        if group and total + len(keys) > MAX_KEYS_PER_CALL:
            yield group
            group, total = [], 0
        group.append(keys)
        total += len(keys)
    if group:
        yield group


class Flusher:
    """See the module docstring. ``lock`` is the manager's lock."""

    def __init__(self, book: LeaseBook, lock: threading.Lock, bulk: IndexSession,
                 writer: IndexSession, *, reserve: bool = True,
                 reconnect_interval_s: float = RECONNECT_INTERVAL_S,
                 on_flush: Callable[[float], None] | None = None,
                 on_evicted: Callable[[list[bytes]], object] | None = None):
        self._book = book
        self._lock = lock
        self._bulk = bulk
        self._writer = writer
        self._reconnect_interval_s = reconnect_interval_s
        self._on_flush = on_flush
        self._on_evicted = on_evicted  # wire keys evicted by reservations (under the lock)
        self._reserve = reserve
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        # What the thread files in the book, in order, run by whoever holds the manager's
        # lock first: this thread, or the scheduler waiting for a probe's answer.
        self._mail: deque[Callable[[], None]] = deque()
        self._mail_cv = threading.Condition()
        self._slow = False  # a wait ran out: no more waits until something is filed
        self._idle = threading.Condition()
        self._pending = 0  # batches submitted and not yet filed
        self._down_since: float | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tiercache-flusher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the scheduler's side
    def submit(self, batch: Batch) -> None:
        self.raise_if_failed()
        with self._idle:
            self._pending += 1
        self._queue.put(batch)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise AdapterError(f"tiercache flusher thread failed: {self._error!r}") \
                from self._error

    def coordinator_lost(self) -> None:
        """The scheduler thread saw the coordinator gone: start pinging for it."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("tiercache: coordinator gone; lookups answer MISS and stores are "
                        "skipped until it is back (transfers in flight finish)")
            self._queue.put(None)  # wake the thread to ping

    def drain(self) -> None:
        """File what the thread has answered (call with the manager's lock held)."""
        mail = self._mail
        while mail:
            with self._mail_cv:
                if not mail:
                    return
                filing = mail.popleft()
            self._slow = False
            filing()

    def await_answers(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """File answers as they come (manager's lock held) until ``done()``; False after
        ``timeout_s``, while the coordinator is down, or while an earlier wait ran out and
        nothing was filed since (a frozen coordinator costs one wait, not one per step)."""
        self.drain()
        if done():
            return True
        if self._slow or self._down_since is not None or self._error is not None:
            return False
        deadline = time.monotonic() + timeout_s
        while True:
            with self._mail_cv:
                if not self._mail:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._slow = True
                        return False
                    self._mail_cv.wait(remaining)
            self.drain()
            if done():
                return True
            if self._down_since is not None or self._error is not None:
                return False

    def _file(self, filing: Callable[[], None]) -> None:
        """Hand ``filing`` over (a scheduler waiting for it runs it) and run it here if
        nobody did."""
        with self._mail_cv:
            self._mail.append(filing)
            self._mail_cv.notify_all()
        with self._lock:
            self.drain()

    def _file_between_steps(self, filing: Callable[[], None]) -> None:
        """Run ``filing`` under the manager's lock, after what is posted, never from a
        waiting lookup: it drops leases, and vLLM holds the lock for its whole step, so a
        HIT this step answered keeps its lease until the step's ``prepare_load``."""
        with self._lock:
            self.drain()
            filing()

    @property
    def coordinator_up(self) -> bool:
        return self._down_since is None

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every submitted batch is filed (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._closed:
            timeout = self._reconnect_interval_s if self._down_since is not None else None
            try:
                batch = self._queue.get(timeout=timeout)
            except queue.Empty:
                batch = None
            if self._closed:
                break
            if self._down_since is not None and not self._try_reconnect():
                if batch is not None:
                    self._fail(batch)
                continue
            if batch is not None:
                self._flush(batch)
        while True:  # closing: whatever is left is not sent
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                break
            if batch is not None:
                self._fail(batch)

    def _flush(self, batch: Batch) -> None:
        start = time.perf_counter()
        try:
            answers, retried, evicted = self._send(batch)

            def filing() -> None:
                self._book.apply(batch, answers, retried)
                if evicted and self._on_evicted is not None:
                    self._on_evicted(evicted)

            self._file(filing)
        except CoordinatorGoneError as e:
            log.warning("tiercache: a batch was not sent (%s)", e)
            self.coordinator_lost()
            self._fail(batch)
            return
        except BaseException as e:
            log.exception("tiercache: flusher failed")
            self._error = e
            self._done()
            return
        self._done()
        if self._on_flush is not None:
            self._on_flush(time.perf_counter() - start)

    def _fail(self, batch: Batch) -> None:
        self._file_between_steps(lambda: self._book.batch_failed(batch))
        self._done()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _try_reconnect(self) -> bool:
        try:
            for session in (self._bulk, self._writer):
                try:
                    session.ping()
                except SessionLostError:  # said once; the new session is connected now
                    session.ping()
        except CoordinatorGoneError:
            return False
        resumed = self._bulk.resumed and self._writer.resumed
        self._file_between_steps(self._book.reconnected if resumed else self._book.session_lost)
        log.warning("tiercache: coordinator back after %.1f s (%s)",
                    time.monotonic() - (self._down_since or 0.0),
                    "session resumed" if resumed else "new session: earlier leases are gone")
        self._down_since = None
        return True

    def _send(self, batch: Batch
              ) -> tuple[list[LeaseAnswer], list[LeaseAnswer], list[bytes]]:
        """(answers to the probes, answers to the retries, keys evicted by reservations)."""
        for keys in _chunks(batch.stores_done):
            self._writer.complete_store(keys, True)
        for keys in _chunks(batch.stores_failed):
            self._writer.complete_store(keys, False)
        for keys in _chunks(batch.releases):
            self._bulk.release(keys)
        prefix = batch.prefix
        cut = len(prefix)
        ahead = _Reservations(self._writer, batch.num_stored, cut)
        retried: list[LeaseAnswer] = []
        lists = [[prefix + key for key in keys] for _, keys in batch.retries]
        for group in _list_groups(lists):
            retried += [LeaseAnswer(0, False, (), *mine) for mine in ahead.reserve(group)]
        answers: list[LeaseAnswer] = []
        if batch.probes:
            # A key asked twice in one step (vLLM's bridge lookups) is probed once; the
            # batch is this thread's now, and apply() reads the same lists.
            batch.probes[:] = [Probe(r, list(dict.fromkeys(keys))) for r, keys in batch.probes]
            wire_lists = [[prefix + key for key in keys] for _, keys in batch.probes]
            for group in _list_groups(wire_lists):
                results = self._bulk.lease_batch(group)
                rests = [keys[r.num_hit:] if self._reserve and not r.pending else []
                         for keys, r in zip(group, results)]
                for r, mine in zip(results, ahead.reserve(rests)):
                    answers.append(LeaseAnswer(r.num_hit, r.pending, fenced_slots(r.spec), *mine,
                                               promoted=r.promoted, sources=r.sources))
        return answers, retried, ahead.evicted


class _Reservations:
    """A batch's reservations ahead of its stores (writer session): free slots, and at
    most ``max_evictions`` evictions over all of its calls."""

    def __init__(self, writer: IndexSession, max_evictions: int, cut: int):
        self._writer = writer
        self._max_evictions = max_evictions
        self._cut = cut  # the namespace prefix's length: wire key -> vLLM key
        self.evicted: list[bytes] = []

    def reserve(self, lists: list[list[bytes]]) -> list[tuple[list, list, list]]:
        """Per list of wire keys: (reserved (key, slot), held already, no room), as vLLM
        keys. A key in two lists is reserved for the first (the second gets neither)."""
        wanted = list(dict.fromkeys(k for keys in lists for k in keys))
        if not wanted:
            return [([], [], []) for _ in lists]
        out = self._writer.prepare_store(wanted, max_evictions=self._max_evictions)
        self._max_evictions -= len(out.evicted_keys)
        self.evicted += out.evicted_keys
        reserved: dict[bytes, FencedSlot] = dict(zip(out.keys_to_store,
                                                     fenced_slots(out.store_spec)))
        no_room = set(out.no_room_keys)
        held = set(wanted).difference(reserved, no_room)
        cut = self._cut
        return [([(k[cut:], reserved.pop(k)) for k in keys if k in reserved],
                 [k[cut:] for k in keys if k in held],
                 [k[cut:] for k in keys if k in no_room]) for keys in lists]
