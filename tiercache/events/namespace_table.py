"""``NamespaceTable``: the namespaces the event stream publishes, and the sessions that hold
each one.

A control session *holds* a namespace it described (DESCRIBE) until the session ends, or
until it has described ``MAX_NAMESPACES_PER_SESSION`` newer ones (a vLLM engine moves to a
new namespace at every cache reset and never stores under the old ones again). Only a
session that holds a namespace may store keys under it (the control plane
refuses the others), so a client cannot make the stream announce blocks under a model it
only read off a topic.

Bounded: at most ``MAX_NAMESPACES``. A namespace no session holds makes room for a new one:
one with no block first, else the one with the fewest (the sink withdraws its blocks from
subscribers, and announces them again if a session describes it again). Only when a
session holds every namespace is a description refused (``StateError``, naming the bound).
So engines that come and go never fill the table, whatever blocks they leave behind.

Pure bookkeeping, no lock: the sink (``tiercache.events.sink``) calls it under its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tiercache.errors import StateError
from tiercache.link.namespaces import NamespaceInfo

MAX_NAMESPACES = 256
MAX_NAMESPACES_PER_SESSION = 16


@dataclass
class Entry:
    info: NamespaceInfo
    holders: set[int] = field(default_factory=set)  # sessions (owner numbers)
    published: bool = False  # the publisher has taken it (else: announced at its next take)


class NamespaceTable:
    """See the module docstring."""

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._held_by: dict[int, dict[bytes, None]] = {}  # session -> digests, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def get(self, digest: bytes) -> Entry | None:
        return self._entries.get(digest)

    @property
    def num_held(self) -> int:
        """Namespaces some session holds."""
        return sum(1 for e in self._entries.values() if e.holders)

    def add(self, info: NamespaceInfo, owner: int, blocks: Callable[[bytes], int]
            ) -> tuple[Entry, Entry | None]:
        """Session ``owner`` described ``info``: (its entry, and the entry it displaced to
        make room, or None). ``blocks(digest)`` counts what a namespace holds. ``StateError``
        when every namespace is held by a session (nothing changed)."""
        mine = self._held_by.setdefault(owner, {})
        if info.digest in mine:
            del mine[info.digest]
        else:  # new to it: its oldest beyond the bound are let go first
            while len(mine) >= MAX_NAMESPACES_PER_SESSION:
                oldest = next(iter(mine))
                del mine[oldest]
                self._entries[oldest].holders.discard(owner)
        entry = self._entries.get(info.digest)
        displaced = None
        if entry is None:
            if len(self._entries) >= MAX_NAMESPACES:
                displaced = self._make_room(info, blocks)  # raises only if none was let go
            entry = self._entries[info.digest] = Entry(info)
        mine[info.digest] = None  # the newest last
        entry.holders.add(owner)
        return entry, displaced

    def _make_room(self, info: NamespaceInfo, blocks: Callable[[bytes], int]) -> Entry:
        free = [e for e in self._entries.values() if not e.holders]
        if not free:
            raise StateError(
                f"the event stream keeps {MAX_NAMESPACES} namespaces and a live session holds "
                f"each; namespace {info.hex} ({info.model}) is not published until one ends")
        victim = min(free, key=lambda e: blocks(e.info.digest))  # of equals, the oldest
        del self._entries[victim.info.digest]
        return victim

    def release(self, owner: int) -> None:
        """Session ``owner`` ended: it holds nothing any more."""
        for digest in self._held_by.pop(owner, {}):
            self._entries[digest].holders.discard(owner)

    def take_new(self) -> dict[bytes, NamespaceInfo]:
        """The namespaces added since the last call, now published."""
        new = {}
        for digest, entry in self._entries.items():
            if not entry.published:
                entry.published = True
                new[digest] = entry.info
        return new

    def published(self) -> dict[bytes, NamespaceInfo]:
        return {d: e.info for d, e in self._entries.items() if e.published}
