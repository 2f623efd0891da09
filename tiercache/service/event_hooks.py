"""The node's event stream fed from today's index and disk-tier hooks.

The index and its tier chain are to call one ``NodeEvents`` object for every change to
what the node holds (``stored`` / ``removed`` / ``cleared`` per medium). Until they do,
this module feeds the stream's sink (``tiercache.events.sink``) from the hooks that
exist, and is the one place to replace by those calls:

* **host memory (CPU)**: the index's event log (``OffloadingManager.take_events``, on
  whenever ``[events]`` is): stored when a block becomes READY (an engine's store, a
  promotion from disk or the pool), removed when a READY block leaves (evicted, reset).
  One ordered source, drained by a thread every ``PUMP_INTERVAL_S`` (the index never
  waits on it). The READY blocks a restarted coordinator re-adopted are announced first,
  from the index itself (its unpinned READY keys: a block pinned at that moment is
  announced when next stored, an under-count, never a block the node does not hold).
  While the stream runs it is the log's one reader: ``Client.take_events`` gets nothing.
* **the disk tier (STORAGE)**: its key listener (called under the tier's lock as keys come
  to be held on disk or stop being), shared with the key presence map through
  ``fan_out``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from tiercache.events import NodeEventStream
from tiercache.specs import Medium

log = logging.getLogger(__name__)

PUMP_INTERVAL_S = 0.02
PUMP_KEYS = 16384  # keys taken from the index's log per call (its lock is held that long)

KeyListener = Callable[[Sequence[bytes], bool], None]


def fan_out(*listeners: KeyListener | None) -> KeyListener | None:
    """One key listener calling each of ``listeners`` (None ones left out)."""
    present = [listener for listener in listeners if listener is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def each(keys: Sequence[bytes], removed: bool) -> None:
        for listener in present:
            listener(keys, removed)

    return each


class IndexEventFeed:
    """Feeds ``stream``'s sink from ``manager`` (CPU) and gives the disk tier's listener
    (STORAGE); see the module docstring. ``start()`` announces what the index holds and
    starts the drain; ``close()`` stops it (what is left in the log is drained first)."""

    def __init__(self, stream: NodeEventStream, manager):
        self._stream = stream
        self._sink = stream.sink
        self._manager = manager
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def disk_listener(self, keys: Sequence[bytes], removed: bool) -> None:
        (self._sink.removed if removed else self._sink.stored)(keys, Medium.STORAGE)

    def start(self) -> None:
        held = self._manager.demotion_candidates(self._manager.num_blocks, lambda key: False)
        self._sink.stored([key for key, _ in held], Medium.CPU)
        self._drain()  # what happened since the index was built (announced again: idempotent)
        self._thread = threading.Thread(target=self._run, name="tiercache-event-feed",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._drain()

    def _run(self) -> None:
        while not self._stop.wait(PUMP_INTERVAL_S):
            try:
                self._drain()
            except Exception:  # a bug: keep the feed alive, say so
                log.exception("event feed: draining the index's event log failed")

    def _drain(self) -> None:
        while True:
            events = self._manager.take_events(max_keys=PUMP_KEYS)
            for event in events:
                (self._sink.removed if event.removed else self._sink.stored)(
                    event.keys, Medium.CPU)
            if sum(len(e.keys) for e in events) < PUMP_KEYS:
                return
