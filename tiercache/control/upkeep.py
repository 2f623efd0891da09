"""The control server's timed duties, run by its loop between requests: detached sessions
past their grace period end, connections past their HELLO or idle deadline are closed,
and every ``tick_s`` the liveness tick: restored sessions whose process is gone or that
did not come back, silent sessions (declared dead: their connection is closed), and
reservations never completed. Also the bound on detached sessions per process.

One thread (the server's loop); what to close is closed through the server (``drop``).
"""

from __future__ import annotations

import logging

from tiercache.control.admission import Drop
from tiercache.control.connections import Connection, ConnectionTable
from tiercache.control.options import ControlOptions
from tiercache.control.sessions import Session, SessionTable
from tiercache.errors import ControlSocketError
from tiercache.index.manager import OffloadingManager
from tiercache.loglimit import LogLimiter


class Upkeep:
    """See the module docstring; ``now`` is the loop's clock at construction."""

    def __init__(self, options: ControlOptions, manager: OffloadingManager,
                 sessions: SessionTable, connections: ConnectionTable, warn: LogLimiter,
                 drop: Drop, now: float):
        self.options = options
        self._manager = manager
        self._sessions = sessions
        self._connections = connections
        self._warn = warn
        self._drop = drop
        self._next_tick = now + options.tick_s

    def next_deadline(self) -> float | None:
        """When something is next due: a session's expiry, a tick, a HELLO or idle deadline
        (None: nothing)."""
        due = [t for t in (self._sessions.next_deadline(), self._tick_due(),
                           self._connections.next_deadline()) if t is not None]
        return min(due) if due else None

    def run(self, now: float) -> None:
        """Do what is due at ``now``."""
        for session, released in self._sessions.expire(now):
            self._log_end(session, released, f"gone for {self._sessions.grace_s:.1f} s")
        self._close_overdue(now)
        if now >= self._next_tick:
            self._next_tick = now + self.options.tick_s
            self._tick(now)

    def bound_detached(self, pid: int) -> None:
        """End the oldest detached sessions of ``pid`` beyond ``max_detached_sessions_per_peer``."""
        keep = self.options.max_detached_sessions_per_peer
        for session, released in self._sessions.end_detached_beyond(pid, keep):
            self._warn.warn("detached_bound", "pid %d closed more than %d client sessions "
                            "within the grace period (control.max_detached_sessions_per_peer): "
                            "ended its oldest, %d (%r), at once: freed %d reserved slot(s), "
                            "dropped %d pin(s)", pid, keep, session.owner, session.name,
                            released.freed_writing, released.dropped_pins)

    def _tick_due(self) -> float | None:
        """When the next liveness tick is due; None when there is nothing to check."""
        opts = self.options
        if opts.session_timeout_s or opts.reservation_timeout_s or self._sessions.num_restored:
            return self._next_tick
        return None

    def _tick(self, now: float) -> None:
        """Liveness: restored sessions whose process is gone or that did not come back,
        silent sessions (declared dead: their connection is closed), stale reservations."""
        for session, released in self._sessions.expire_restored(now):
            self._log_end(session, released, "restored from the region but its process is "
                          "gone or it did not come back")
        for session in self._sessions.silent(now):
            conn = session.conn
            released = self._sessions.end(session)
            if isinstance(conn, Connection):
                conn.session = None
                self._drop(conn, "session declared dead")
            self._warn.warn("silent", "client session %d (%r, %s) sent nothing for %.1f s "
                            "(index.session_timeout_s) while holding %d reserved slot(s) and "
                            "%d pin(s): declared dead, its holdings given back", session.owner,
                            session.name, getattr(conn, "peer", "?"), now - session.last_seen,
                            released.freed_writing, released.dropped_pins)
        if self.options.reservation_timeout_s:
            expired = self._manager.expire_reservations(self.options.reservation_timeout_s)
            if expired:
                self._warn.warn("reservations", "%d reservation(s) not completed within %.0f s "
                                "(index.reservation_timeout_s) were freed", expired,
                                self.options.reservation_timeout_s)

    def _log_end(self, session: Session, released, why: str) -> None:
        if released.freed_writing or released.dropped_pins:
            self._warn.log(logging.INFO, "session_end",
                           "client session %d (%r) %s: freed %d reserved slot(s), dropped %d "
                           "pin(s)", session.owner, session.name, why, released.freed_writing,
                           released.dropped_pins)

    def _close_overdue(self, now: float) -> None:
        """Close the connections past their HELLO deadline, and the idle ones holding
        nothing."""
        late, idle = self._connections.overdue(now)
        hello_s, idle_s = self.options.hello_timeout_s, self.options.idle_timeout_s
        for conn in late:
            why = ControlSocketError(f"no HELLO within {hello_s} s (control.hello_timeout_s); "
                                     "a connection's first request must be HELLO")
            self._warn.warn("hello_timeout", "closing the control connection of %s: %s",
                            conn.peer, why)
            self._drop(conn, str(why), tell=why)
        for conn in idle:
            self._warn.log(logging.INFO, "idle", "closing the control connection of %s: it "
                           "held nothing and sent nothing for %.0f s (control.idle_timeout_s); "
                           "its client reconnects on its next call", conn.peer, idle_s)
            self._drop(conn, "idle")



__all__ = ["Upkeep"]
