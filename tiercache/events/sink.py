"""``NodeEventSink``: what the node holds, and what changed since the publisher last looked.

The index and the tier chain call it for every change to what the node holds, whoever
caused it (``stored``, ``removed``, ``cleared``: the ``NodeEvents`` hook), under their own
locks, from the control server's thread and tier threads. So each call is thread-safe,
O(len(keys)), takes one short lock, never blocks on anything else and does no I/O:

* it keeps a **mirror** of the keys each medium holds, by namespace prefix (so a namespace
  described later, or a resynchronisation, can announce exactly what is held), and only
  what changes the mirror is a change: a key stored twice is announced once, a key removed
  that was not held is not announced (consumers that count announcements stay right);
* it appends the change to a **bounded queue** (``queue_keys`` keys). When a change would
  pass the bound, the queue is dropped (its keys counted in ``dropped_keys``) and the stream
  is marked for a **resync**: the publisher's next batch is ``AllBlocksCleared`` and then
  every block held, from the mirror. So a slow publisher costs events, never the index's
  time, and the stream is right again as soon as it catches up.

``cleared(medium)`` empties that medium and marks a resync (vLLM's ``AllBlocksCleared``
names no medium: the re-announcement brings back what the other tiers still hold). A new
sink starts marked, so a (re)started coordinator's first batch is ``AllBlocksCleared``:
no subscriber keeps believing in a block the previous coordinator held.

Namespaces (``describe``; ``tiercache.events.namespace_table``): keys are published only
once a session described their namespace. The publisher ``take``s, atomically with the
queue, the namespaces described since, with a snapshot of what each holds; queued changes
of those namespaces are in the snapshot and are dropped from the queue, so nothing is
announced twice. A namespace the table gives up to make room is *withdrawn*: its blocks'
removal is queued (subscribers stop believing in them) and it stays known to the publisher
for that one take.

**Keys without a namespace.** A key stored while no namespace of its prefix is described
(``Client`` and ``tiercache demo`` keys, an engine whose DESCRIBE was refused, or a client
storing ahead of the engine under a digest it guessed) is mirrored apart and never
published while held, even if its prefix is described later: counted
(``no_namespace_keys``). Stores under a described namespace come only from sessions that
hold it (``foreign_namespace``: the control plane refuses the others). Keys the node held
when the stream started (``adopted()`` ends that phase: a restarted coordinator's
re-adopted region and rebuilt disk tier) are announced once an engine describes their
namespace again, and so is a key stored in one medium that another medium holds as a
published key (a promotion or a demotion).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.errors import StateError
from tiercache.events.namespace_table import MAX_NAMESPACES, Entry, NamespaceTable
from tiercache.link.namespaces import NAMESPACE_BYTES, NamespaceInfo
from tiercache.index.manager import LOCAL_OWNER
from tiercache.specs import Medium

__all__ = ["MAX_NAMESPACES", "Change", "NodeEventSink", "SinkStats", "Taken"]

Held = dict[bytes, set[bytes]]  # namespace prefix -> keys


@dataclass(frozen=True)
class Change:
    """One call of the hook, in order."""

    removed: bool
    medium: Medium
    keys: tuple[bytes, ...]


@dataclass
class Taken:
    """What the publisher takes in one go (see the module docstring)."""

    resync: bool  # publish AllBlocksCleared first, then ``announce``
    announce: list[tuple[Medium, NamespaceInfo, list[bytes]]]  # held keys to announce
    changes: list[Change]
    namespaces: dict[bytes, NamespaceInfo]  # every described namespace, by prefix


@dataclass
class SinkStats:
    changes: int = 0  # hook calls that changed something
    dropped_keys: int = 0  # keys of changes dropped by the bounded queue
    overflows: int = 0  # times the queue overflowed (each one a resync)
    clears: int = 0  # cleared() calls
    queued_keys: int = 0  # waiting now
    namespaces: int = 0  # described now
    held_namespaces: int = 0  # of those, held by a live session
    evicted_namespaces: int = 0  # given up to make room (no session held them)
    no_namespace_keys: int = 0  # stored while no session held their namespace: unpublished
    undescribed_keys: int = 0  # changes of a namespace withdrawn in the same round


@dataclass
class _State:
    held: dict[Medium, Held] = field(default_factory=dict)  # published once described
    unowned: dict[Medium, set[bytes]] = field(default_factory=dict)  # never published
    queue: list[Change] = field(default_factory=list)
    queued_keys: int = 0
    resync: bool = True  # the first batch of a new stream clears every subscriber's view
    adopting: bool = True  # until ``adopted()``: what the node held when the stream began
    table: NamespaceTable = field(default_factory=NamespaceTable)
    withdrawn: dict[bytes, NamespaceInfo] = field(default_factory=dict)  # until the take


class NodeEventSink:
    """Implements the index's ``NodeEvents`` hook (see the module docstring)."""

    def __init__(self, queue_keys: int):
        if queue_keys < 1:
            raise StateError(f"queue_keys = {queue_keys}: must be >= 1")
        self._limit = queue_keys
        self._lock = threading.Lock()
        self._state = _State()
        self._stats = SinkStats()

    # ------------------------------------------------------------------ the hook
    def stored(self, keys: Sequence[bytes], medium: Medium) -> None:
        """``keys`` are now readable in ``medium``."""
        if not keys:
            return
        with self._lock:
            state = self._state
            held = state.held.setdefault(medium, {})
            unowned = state.unowned.setdefault(medium, set())
            elsewhere = [u for m, u in state.unowned.items() if u and m is not medium]
            described: dict[bytes, bool] = {}  # by prefix, for this call
            new = []
            for key in keys:
                prefix = key[:NAMESPACE_BYTES]
                bucket = held.get(prefix)
                if bucket is not None and key in bucket or key in unowned:
                    continue
                ok = described.get(prefix)
                if ok is None:
                    ok = described[prefix] = state.adopting or prefix in state.table
                if elsewhere and any(key in u for u in elsewhere) or not (
                        ok or self._published_elsewhere(key, prefix)):
                    unowned.add(key)
                    self._stats.no_namespace_keys += 1
                    continue
                if bucket is None:
                    held[prefix] = bucket = set()
                bucket.add(key)
                if state.withdrawn and prefix in state.withdrawn:
                    self._stats.undescribed_keys += 1
                else:
                    new.append(key)
            if new:
                self._enqueue(Change(False, medium, tuple(new)))

    def _published_elsewhere(self, key: bytes, prefix: bytes) -> bool:
        """Whether a medium holds ``key`` as a key to publish (it moves between media)."""
        return any(key in held.get(prefix, ()) for held in self._state.held.values())

    def removed(self, keys: Sequence[bytes], medium: Medium) -> None:
        """``keys`` are gone from ``medium``."""
        if not keys:
            return
        with self._lock:
            state = self._state
            held = state.held.get(medium, {})
            unowned = state.unowned.get(medium, set())
            withdrawn = state.withdrawn
            gone = []
            for key in keys:
                prefix = key[:NAMESPACE_BYTES]
                bucket = held.get(prefix)
                if bucket is not None and key in bucket:
                    bucket.remove(key)
                    if not bucket:
                        del held[prefix]
                    if withdrawn and prefix in withdrawn:
                        self._stats.undescribed_keys += 1
                    else:
                        gone.append(key)
                elif unowned:
                    unowned.discard(key)
            if gone:
                self._enqueue(Change(True, medium, tuple(gone)))

    def adopted(self) -> None:
        """Everything the node held when the stream began has been stored: from now on a
        key stored under a namespace nobody holds is never published while held."""
        with self._lock:
            self._state.adopting = False

    def cleared(self, medium: Medium) -> None:
        """``medium`` was emptied (a reset)."""
        with self._lock:
            self._state.held.pop(medium, None)
            self._state.unowned.pop(medium, None)
            self._stats.clears += 1
            self._mark_resync()

    def _enqueue(self, change: Change) -> None:
        state = self._state
        self._stats.changes += 1
        if state.resync:
            return  # the resync's snapshot will show it
        if state.queued_keys + len(change.keys) > self._limit:
            self._stats.dropped_keys += state.queued_keys + len(change.keys)
            self._stats.overflows += 1
            self._mark_resync()
            return
        state.queue.append(change)
        state.queued_keys += len(change.keys)

    def _mark_resync(self) -> None:
        state = self._state
        state.resync = True
        state.queue = []
        state.queued_keys = 0

    # ------------------------------------------------------------------ namespaces
    def describe(self, info: NamespaceInfo, owner: int = LOCAL_OWNER) -> None:
        """Session ``owner`` describes ``info``: its keys are published from the next take
        on, and ``owner`` may store under it (idempotent). ``StateError`` if
        ``MAX_NAMESPACES`` are described and a live session holds each."""
        with self._lock:
            state = self._state
            known = info.digest in state.table
            entry, displaced = state.table.add(info, owner, self._blocks_of)
            if displaced is not None:
                self._withdraw(displaced)
            if not known and info.digest in state.withdrawn:  # back before its withdrawal went
                del state.withdrawn[info.digest]
                entry.published = True
                for medium, held in state.held.items():  # after the queued removal
                    if keys := held.get(info.digest):
                        self._enqueue(Change(False, medium, tuple(keys)))

    def _blocks_of(self, digest: bytes) -> int:
        return sum(len(held.get(digest, ())) for held in self._state.held.values())

    def _withdraw(self, entry: Entry) -> None:
        """Subscribers stop believing in ``entry``'s blocks (they stay mirrored, for a
        description that brings the namespace back)."""
        self._stats.evicted_namespaces += 1
        if not entry.published:
            return  # nothing of it was announced
        state = self._state
        for medium, held in state.held.items():
            if keys := held.get(entry.info.digest):
                self._enqueue(Change(True, medium, tuple(keys)))
        state.withdrawn[entry.info.digest] = entry.info

    def foreign_namespace(self, keys: Sequence[bytes], owner: int) -> NamespaceInfo | None:
        """The first described namespace among ``keys``' that session ``owner`` does not
        hold (it may not store under it), or None."""
        with self._lock:
            table = self._state.table
            for prefix in {key[:NAMESPACE_BYTES] for key in keys}:
                entry = table.get(prefix)
                if entry is not None and owner not in entry.holders:
                    return entry.info
        return None

    def session_ended(self, owner: int) -> None:
        """Session ``owner`` ended: it holds no namespace any more."""
        with self._lock:
            self._state.table.release(owner)

    # ------------------------------------------------------------------ the publisher's side
    def take(self) -> Taken:
        """Everything since the last call, atomically (see the module docstring)."""
        with self._lock:
            state = self._state
            new = state.table.take_new()
            changes, state.queue, state.queued_keys = state.queue, [], 0
            resync, state.resync = state.resync, False
            published = state.table.published()
            fresh = published if resync else new
            announce = [(medium, fresh[prefix], list(keys))
                        for medium, held in state.held.items()
                        for prefix, keys in held.items() if prefix in fresh]
            namespaces = {**state.withdrawn, **published}
            state.withdrawn = {}
        if resync:
            changes = []
        elif new:
            changes = [c for c in (_without(c, new) for c in changes) if c.keys]
        return Taken(resync, announce, changes, namespaces)

    def stats(self) -> SinkStats:
        with self._lock:
            self._stats.queued_keys = self._state.queued_keys
            self._stats.namespaces = len(self._state.table)
            self._stats.held_namespaces = self._state.table.num_held
            return SinkStats(**vars(self._stats))

    def held_keys(self, medium: Medium) -> set[bytes]:
        """Every key ``medium`` holds now that is published once described (tests, tools)."""
        with self._lock:
            return set().union(*self._state.held.get(medium, {}).values())


def _without(change: Change, prefixes: dict[bytes, NamespaceInfo]) -> Change:
    """``change`` less the keys of ``prefixes`` (their snapshot shows them already)."""
    keys = tuple(k for k in change.keys if k[:NAMESPACE_BYTES] not in prefixes)
    return change if len(keys) == len(change.keys) else Change(change.removed, change.medium,
                                                                keys)
