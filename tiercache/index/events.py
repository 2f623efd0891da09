"""``EventLog``: the index's stored/removed events, kept until an engine takes them.

Engines read them in batches bounded in keys (a larger event is split, its rest first in
line). Not thread-safe: the index calls it under its lock."""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.index.results import OffloadingEvent


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
