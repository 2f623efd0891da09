"""Whose request the control server serves next: fair turns between connections, by the
work requests carry, not by the order bytes arrive.

The server answers every request on one thread, so a request's work is time everybody
else waits. Measured on the development VM (docs/benchmarks.md, "One heavy request
stalling everyone"): a lease costs about 1.3 µs per key and 10 µs per key list, so a
request is charged ``1 + keys + LIST_UNITS * lists`` *units* (``request_units``), and
the connections share the loop by units with start-time fair queueing:

* a connection whose whole request has arrived waits with a *start tag*: the later of the
  virtual time (the start tag of the request served last) and its own *finish tag* (the
  start tag of its previous request plus that request's units);
* the waiting request with the smallest start tag is served next; of equals, the one
  that has waited longest.

So a connection that sends small calls while another streams heavy ones waits for the
request in progress only, never behind the heavy one's stream (its tag is the virtual
time, the heavy one's next is a whole heavy request later); connections that all send
heavy requests share the loop equally by work; and an idle connection earns no credit
(its tag is never below the virtual time), so it cannot burst past the others after a
pause. A connection has one request waiting at most: the server reads nothing more from
it until that request is served and its answer taken. What bounds the wait for the
request in progress is the per-request bound (``tiercache.control.protocol``:
``MAX_KEYS_PER_CALL`` keys, ``MAX_LISTS_PER_BATCH`` lists).

Pure bookkeeping, one thread (the server's loop): a heap of (start tag, arrival, conn);
an entry whose connection was served or closed since is skipped when it comes up.
"""

from __future__ import annotations

import heapq
import itertools

from tiercache.control.connections import Connection
from tiercache.control.protocol import PayloadReader

LIST_UNITS = 8  # a key list costs the index about as much as 8 keys (see the docstring)


def request_units(reader: PayloadReader) -> int:
    """The work of the request ``reader`` read: one, plus its keys and key lists."""
    return 1 + reader.num_keys + LIST_UNITS * reader.num_key_lists


class Turns:
    """The connections whose next request has arrived whole, in the order to serve them."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Connection]] = []
        self._arrivals = itertools.count()
        self._virtual = 0
        self._waiting = 0

    def __len__(self) -> int:
        return self._waiting

    def wait(self, conn: Connection) -> None:
        """``conn``'s next request has arrived whole: give it its start tag."""
        assert conn.turn is None, "one request per connection waits at a time"
        conn.start_tag = max(self._virtual, conn.finish_tag)
        conn.turn = next(self._arrivals)
        heapq.heappush(self._heap, (conn.start_tag, conn.turn, conn))
        self._waiting += 1

    def next(self) -> Connection | None:
        """The connection to serve now (no longer waiting), or None if none waits."""
        while self._heap:
            start, turn, conn = heapq.heappop(self._heap)
            if conn.turn != turn:
                continue  # closed since it started waiting
            conn.turn = None
            self._waiting -= 1
            self._virtual = start
            return conn
        return None

    def served(self, conn: Connection, units: int) -> None:
        """``conn``'s request (the one ``next`` returned) was served and cost ``units``."""
        conn.finish_tag = conn.start_tag + units

    def forget(self, conn: Connection) -> None:
        """``conn`` is being closed: its waiting request, if any, is not served."""
        if conn.turn is not None:
            conn.turn = None
            self._waiting -= 1
            if not self._waiting:
                self._heap.clear()  # only entries of closed connections were left


__all__ = ["LIST_UNITS", "Turns", "request_units"]
