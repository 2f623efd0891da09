"""Whose request the control server serves next: fair turns between connections, by the
work requests carry, not by the order bytes arrive.

The server answers every request on one thread, so a request's work is time everybody
else waits. Measured on the development VM (docs/benchmarks.md, "One heavy request
stalling everyone"): a lease costs about 1.3 µs per key and 10 µs per key list, so a
request is charged ``1 + keys + LIST_UNITS * lists`` *units* (``request_units``), read from
its frame before it is served (``tiercache.link.payloads.request_size``).

The connections share the loop by units with weighted fair queueing's rule: a
connection whose whole request has arrived waits with a *finish tag*, the later of the
virtual time and its previous request's finish tag, plus the request's units; the
waiting request with the smallest finish tag is served next (of equals, the one that has
waited longest). The virtual time follows the fluid ideal (every waiting connection
served at once, at an equal share): serving a request of ``u`` units while ``n``
connections wait advances it by ``u / n``.

So a small call waits for the request in progress, not behind other connections' heavy
requests, however many stream at once (its tag is the virtual time plus a few units, a
heavy request's a whole heavy request later); connections that all send heavy requests
share the loop equally by work; and a connection that was idle earns no credit (its tag
never starts below the virtual time), so it cannot burst past the others after a pause.
(Tags that start at the virtual time but are served by start tag, as in start-time fair
queueing, let a small call wait behind one request of every heavy connection, since those
all start at the same virtual time; measured: 4 streams of 1,024-list batches held
another client's calls at 56 ms p50.) A connection has one request waiting at most: the
server reads nothing more from it until that request is served and its answer taken.
What bounds the wait for the request in progress is the per-request bound
(``tiercache.link.protocol``: ``MAX_KEYS_PER_CALL`` keys, ``MAX_LISTS_PER_BATCH``
lists).

Pure bookkeeping, one thread (the server's loop): a heap of (finish tag, arrival, units,
conn); an entry whose connection was closed since is skipped when it comes up.
"""

from __future__ import annotations

import heapq
import itertools

from tiercache.control.connections import Connection

LIST_UNITS = 8  # a key list costs the index about as much as 8 keys (see the docstring)


def request_units(keys: int, lists: int) -> int:
    """The work of a request that carries ``keys`` keys in ``lists`` key lists."""
    return 1 + keys + LIST_UNITS * lists


class Turns:
    """The connections whose next request has arrived whole, in the order to serve them."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Connection]] = []
        self._arrivals = itertools.count()
        self._virtual = 0.0
        self._waiting = 0

    def __len__(self) -> int:
        return self._waiting

    def wait(self, conn: Connection, units: int) -> None:
        """``conn``'s next request, of ``units``, has arrived whole."""
        assert conn.turn is None, "one request per connection waits at a time"
        conn.finish_tag = max(self._virtual, conn.finish_tag) + units
        conn.turn = next(self._arrivals)
        heapq.heappush(self._heap, (conn.finish_tag, conn.turn, units, conn))
        self._waiting += 1

    def next(self) -> tuple[Connection, int] | None:
        """The connection to serve now (no longer waiting) and its request's units, or None
        if none waits."""
        while self._heap:
            _, turn, units, conn = heapq.heappop(self._heap)
            if conn.turn != turn:
                continue  # closed since it started waiting
            conn.turn = None
            self._virtual += units / self._waiting
            self._waiting -= 1
            return conn, units
        return None

    def forget(self, conn: Connection) -> None:
        """``conn`` is being closed: its waiting request, if any, is not served."""
        if conn.turn is not None:
            conn.turn = None
            self._waiting -= 1
            if not self._waiting:
                self._heap.clear()  # only entries of closed connections were left


__all__ = ["LIST_UNITS", "Turns", "request_units"]
