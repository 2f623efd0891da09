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

Namespaces (``describe``): keys are published only once an engine described their
namespace. The publisher ``take``s, atomically with the queue, the namespaces described
since, with a snapshot of what each holds; queued changes of those namespaces are in the
snapshot and are dropped from the queue, so nothing is announced twice. At most
``MAX_NAMESPACES`` are kept; a new one takes the place of one that holds no block.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.errors import StateError
from tiercache.events.namespaces import NAMESPACE_BYTES, NamespaceInfo
from tiercache.specs import Medium

MAX_NAMESPACES = 256

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
    evicted_namespaces: int = 0  # forgotten to make room (they held no block)


@dataclass
class _State:
    held: dict[Medium, Held] = field(default_factory=dict)
    queue: list[Change] = field(default_factory=list)
    queued_keys: int = 0
    resync: bool = True  # the first batch of a new stream clears every subscriber's view
    described: dict[bytes, NamespaceInfo] = field(default_factory=dict)
    pending: dict[bytes, NamespaceInfo] = field(default_factory=dict)  # not yet taken


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
            held = self._state.held.setdefault(medium, {})
            new = []
            for key in keys:
                prefix = key[:NAMESPACE_BYTES]
                bucket = held.get(prefix)
                if bucket is None:
                    held[prefix] = bucket = set()
                if key not in bucket:
                    bucket.add(key)
                    new.append(key)
            if new:
                self._enqueue(Change(False, medium, tuple(new)))

    def removed(self, keys: Sequence[bytes], medium: Medium) -> None:
        """``keys`` are gone from ``medium``."""
        if not keys:
            return
        with self._lock:
            held = self._state.held.get(medium, {})
            gone = []
            for key in keys:
                prefix = key[:NAMESPACE_BYTES]
                bucket = held.get(prefix)
                if bucket is not None and key in bucket:
                    bucket.remove(key)
                    gone.append(key)
                    if not bucket:
                        del held[prefix]
            if gone:
                self._enqueue(Change(True, medium, tuple(gone)))

    def cleared(self, medium: Medium) -> None:
        """``medium`` was emptied (a reset)."""
        with self._lock:
            self._state.held.pop(medium, None)
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
    def describe(self, info: NamespaceInfo) -> None:
        """Publish the keys of ``info``'s namespace from now on (idempotent).
        ``StateError`` if ``MAX_NAMESPACES`` are described and each holds blocks."""
        with self._lock:
            state = self._state
            if info.digest in state.described or info.digest in state.pending:
                return
            if len(state.described) + len(state.pending) >= MAX_NAMESPACES:
                idle = next((d for d in state.described
                             if not any(d in held for held in state.held.values())), None)
                if idle is None:
                    raise StateError(
                        f"the event stream knows {MAX_NAMESPACES} namespaces, each holding "
                        f"blocks; namespace {info.hex} ({info.model}) is not published")
                del state.described[idle]
                self._stats.evicted_namespaces += 1
            state.pending[info.digest] = info

    # ------------------------------------------------------------------ the publisher's side
    def take(self) -> Taken:
        """Everything since the last call, atomically (see the module docstring)."""
        with self._lock:
            state = self._state
            new, state.pending = state.pending, {}
            state.described.update(new)
            changes, state.queue, state.queued_keys = state.queue, [], 0
            resync, state.resync = state.resync, False
            fresh = state.described if resync else new
            announce = [(medium, fresh[prefix], list(keys))
                        for medium, held in state.held.items()
                        for prefix, keys in held.items() if prefix in fresh]
            namespaces = dict(state.described)
        if resync:
            changes = []
        elif new:
            changes = [c for c in (_without(c, new) for c in changes) if c.keys]
        return Taken(resync, announce, changes, namespaces)

    def stats(self) -> SinkStats:
        with self._lock:
            self._stats.queued_keys = self._state.queued_keys
            self._stats.namespaces = len(self._state.described) + len(self._state.pending)
            return SinkStats(**vars(self._stats))

    def held_keys(self, medium: Medium) -> set[bytes]:
        """Every key ``medium`` holds now (tests, tools)."""
        with self._lock:
            return set().union(*self._state.held.get(medium, {}).values())


def _without(change: Change, prefixes: dict[bytes, NamespaceInfo]) -> Change:
    """``change`` less the keys of ``prefixes`` (their snapshot shows them already)."""
    keys = tuple(k for k in change.keys if k[:NAMESPACE_BYTES] not in prefixes)
    return change if len(keys) == len(change.keys) else Change(change.removed, change.medium,
                                                                keys)
