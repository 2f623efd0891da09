"""What the index tells others about the blocks it holds.

* ``NodeEvents``: the hook every change to what the node holds goes through, whoever caused
  it (a block readable in host memory, stored by any engine or promoted from a lower tier,
  or gone from it; a block a lower tier came to hold or stopped holding, in the tier's
  ``medium``): the node's KV event stream (``tiercache.events``) hangs on it. Calls come
  under the index's lock from the control server's and the tier chain's threads: an
  implementation is thread-safe, O(len(keys)), never blocks and does no I/O.
* ``EventLog``: stored/removed events kept until an engine takes them (``take_events``),
  in batches bounded in keys (a larger event is split, its rest first in line). Not
  thread-safe: the index calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tiercache.results import OffloadingEvent
from tiercache.specs import Medium


class NodeEvents(Protocol):
    def stored(self, keys: Sequence[bytes], medium: Medium) -> None:
        """``keys`` are now readable in ``medium``."""

    def removed(self, keys: Sequence[bytes], medium: Medium) -> None:
        """``keys`` are no longer held in ``medium``."""

    def cleared(self, medium: Medium) -> None:
        """Everything ``medium`` held is gone (host memory's reset)."""


class EventLog:
    def __init__(self) -> None:
        self._events: list[OffloadingEvent] = []

    def emit(self, keys: Sequence[bytes], removed: bool) -> None:
        if keys:
            self._events.append(OffloadingEvent(tuple(keys), removed))

    def take(self, max_keys: int | None = None) -> list[OffloadingEvent]:
        """Events since the last call, oldest first; with ``max_keys``, at most that many
        keys in all (a larger event is split), the rest stay for the next call."""
        if max_keys is None:
            taken, self._events = self._events, []
            return taken
        taken = []
        budget = max_keys
        while self._events and budget > 0:
            event = self._events[0]
            if len(event.keys) <= budget:
                taken.append(self._events.pop(0))
                budget -= len(event.keys)
            else:
                head, rest = event.keys[:budget], event.keys[budget:]
                taken.append(OffloadingEvent(head, event.removed, event.medium))
                self._events[0] = OffloadingEvent(rest, event.removed, event.medium)
                budget = 0
        return taken
