"""Client sessions of the control server: who owns which reservations and pins, whether
they are alive, and when what a gone or silent client held is given back.

Every connection opens (HELLO) or resumes (HELLO with a token) a session; the session's
``owner`` number is what the index records on every reservation and pin it makes.

**A session lives while its client proves it, not while a socket is open.**

* *Detached* (its connection closed): a client that reconnects within ``grace_s`` with its
  token gets the same owner back, its reservations and pins intact (a broken connection
  or a client library's reconnect is not a client's death). Still detached after
  ``grace_s``: ended.
* *Silent* (attached, but no request for ``timeout_s`` while it holds something): ended,
  and its connection closed. The client library heartbeats (a PING) well within the
  deadline while its process runs, so only a frozen, hung or stopped process goes silent.
  Its next call finds the session gone (``SessionLostError`` in the client).
* *Restored* (recorded in the region by a previous coordinator, which died or stopped):
  kept, with what the ledger says it held, until its client resumes it, its process is
  proven gone (pid and start time), or ``timeout_s`` passes without it coming back.

Ending a session (``manager.end_session``) frees its WRITING slots and drops its pins.

Decisions:

* With a ``store`` (``tiercache.region.sessions.SessionLedger``) every session is recorded
  in the region (token, pid and its start time), and owner numbers are its record numbers,
  so a restarted coordinator knows who held what the index ledger records. Without one
  (an index in memory) owners are numbered from 1 and nothing outlives the server.
* Tokens are 16 random bytes from ``secrets``.
* A HELLO naming a session that another connection holds moves the session to the new
  connection, and the server closes the old one: the usual cause is a client whose old
  connection the server has not seen close yet (both ends belong to one user, checked
  with ``SO_PEERCRED``).
* Detached sessions expire in detach order (one grace period for all), so the table
  keeps them in an insertion-ordered dict and checks only its head.
* A process may keep at most so many detached sessions (``end_detached_beyond``; the
  control server passes ``max_detached_sessions_per_peer``): one that opens and closes
  connections in a loop would otherwise grow the table by a session per close for a whole
  grace period. A session counts against the process that attached it last (``pid``, from
  ``SO_PEERCRED``); beyond the bound its oldest detached one ends at once, as if its grace
  period were over.
* ``on_end(owner)`` hears of every session that ends (the node's event stream: the
  namespaces it described are no longer its own).
* Pure bookkeeping, one thread (the control server's loop); ``now`` is passed in.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from tiercache.errors import ControlSocketError
from tiercache.index.manager import OffloadingManager
from tiercache.link.payloads import Hello
from tiercache.link.protocol import TOKEN_BYTES
from tiercache.results import SessionRelease
from tiercache.region.hostmem import process_alive, process_start_ns
from tiercache.region.sessions import SessionLedger, SessionRecord, SessionTableFullError


@dataclass(eq=False)
class Session:
    owner: int
    token: bytes
    name: str
    conn: Hashable | None = None  # the connection it is attached to; None while detached
    deadline: float | None = None  # while detached: when it ends
    pid: int = 0
    pid_start_ns: int = 0
    last_seen: float = 0.0  # the last request (monotonic seconds)
    restored: bool = False  # recorded by a previous coordinator, not resumed yet


class SessionTable:
    """Sessions by token; see the module docstring."""

    def __init__(self, manager: OffloadingManager, grace_s: float, *, timeout_s: float = 0.0,
                 store: SessionLedger | None = None,
                 restored: Iterable[SessionRecord] = (), now: float = 0.0,
                 on_end: Callable[[int], None] | None = None):
        self._manager = manager
        self._on_end = on_end
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self._store = store
        self._by_token: dict[bytes, Session] = {}
        self._detached: dict[bytes, Session] = {}  # detach order = expiry order
        self._restored: dict[bytes, Session] = {}
        self._detached_of: dict[int, dict[bytes, Session]] = {}  # the same, by pid
        self._owners = itertools.count(1)  # LOCAL_OWNER (0) stays the in-process caller's
        for record in restored:
            session = Session(record.owner, record.token, "restored", pid=record.pid,
                              pid_start_ns=record.pid_start_ns, last_seen=now, restored=True,
                              deadline=now + max(timeout_s, grace_s))
            self._by_token[record.token] = self._restored[record.token] = session
            manager.set_owner_process(record.owner, record.pid)

    def hello(self, conn: Hashable, token: bytes, name: str, pid: int = 0, now: float = 0.0
              ) -> tuple[Session, Hello, Hashable | None]:
        """Open or resume a session for ``conn`` (of process ``pid``): (session, the
        answer, a connection that held the session until now and must be closed, or None).
        Raises ``ControlSocketError`` when the session table is full."""
        session = self._by_token.get(token) if token else None
        if session is None:
            new_token = secrets.token_bytes(TOKEN_BYTES)
            start_ns = process_start_ns(pid) if pid else 0
            session = Session(self._new_owner(new_token, pid, start_ns), new_token, name,
                              pid=pid, pid_start_ns=start_ns)
            self._by_token[new_token] = session
            resumed, displaced = False, None
        else:
            self._undetach(session)
            self._restored.pop(token, None)
            session.restored = False
            displaced = session.conn
            resumed = True
            if pid and pid != session.pid:
                session.pid, session.pid_start_ns = pid, process_start_ns(pid)
                if self._store is not None:
                    self._store.moved(session.owner, session.pid, session.pid_start_ns)
        session.conn, session.deadline, session.last_seen = conn, None, now
        self._manager.set_owner_process(session.owner, session.pid)
        return session, Hello(session.token, resumed, self.grace_s, self.timeout_s), displaced

    def _new_owner(self, token: bytes, pid: int, start_ns: int) -> int:
        if self._store is None:
            return next(self._owners)
        try:
            return self._store.open(token, pid, start_ns)
        except SessionTableFullError as e:
            raise ControlSocketError(f"the coordinator keeps the most sessions it can ({e}); "
                                     "retry once other clients have gone") from None

    def detach(self, session: Session, conn: Hashable, now: float) -> None:
        """``conn`` closed: start ``session``'s grace period (unless it moved on already)."""
        if session.conn is not conn or session.token not in self._by_token:
            return
        session.conn = None
        session.deadline = now + self.grace_s
        self._detached[session.token] = session
        self._detached_of.setdefault(session.pid, {})[session.token] = session

    def expire(self, now: float) -> list[tuple[Session, SessionRelease]]:
        """End every detached session whose grace period is over."""
        ended = []
        while self._detached:
            session = next(iter(self._detached.values()))
            if session.deadline is not None and session.deadline > now:
                break
            self._undetach(session)
            ended.append((session, self._end(session)))
        return ended

    def expire_restored(self, now: float) -> list[tuple[Session, SessionRelease]]:
        """End every restored session whose process is gone or whose deadline passed (the
        server calls it once per tick: it reads /proc)."""
        ended = []
        for token, session in list(self._restored.items()):
            deadline = session.deadline
            assert deadline is not None, "a restored session keeps its deadline until it resumes"
            if now >= deadline or not process_alive(session.pid, session.pid_start_ns):
                del self._restored[token]
                ended.append((session, self._end(session)))
        return ended

    def silent(self, now: float) -> list[Session]:
        """Attached sessions that hold something and sent nothing for ``timeout_s``."""
        if not self.timeout_s:
            return []
        holders = self._manager.owners()
        return [s for s in self._by_token.values()
                if s.conn is not None and s.owner in holders
                and now - s.last_seen > self.timeout_s]

    def end(self, session: Session) -> SessionRelease:
        """End ``session`` now (declared dead): its token is forgotten."""
        self._undetach(session)
        self._restored.pop(session.token, None)
        return self._end(session)

    def next_deadline(self) -> float | None:
        """When the next detached session's grace period ends (restored ones are checked
        by the server's tick)."""
        for session in self._detached.values():
            return session.deadline
        return None

    @property
    def num_restored(self) -> int:
        return len(self._restored)

    def end_all(self) -> list[tuple[Session, SessionRelease]]:
        """End every session (the server stops and its region goes: nobody can resume)."""
        sessions = list(self._by_token.values())
        self._detached.clear()
        self._detached_of.clear()
        self._restored.clear()
        return [(s, self._end(s)) for s in sessions]

    def end_detached_beyond(self, pid: int, keep: int) -> list[tuple[Session, SessionRelease]]:
        """End the detached sessions of process ``pid`` beyond its ``keep`` newest, oldest
        first (see the module docstring)."""
        ended = []
        mine = self._detached_of.get(pid, {})
        while len(mine) > keep:
            session = next(iter(mine.values()))
            self._undetach(session)
            ended.append((session, self._end(session)))
        return ended

    def _undetach(self, session: Session) -> None:
        self._detached.pop(session.token, None)
        mine = self._detached_of.get(session.pid)
        if mine is not None:
            mine.pop(session.token, None)
            if not mine:
                del self._detached_of[session.pid]

    def _end(self, session: Session) -> SessionRelease:
        del self._by_token[session.token]
        session.conn = None
        if self._store is not None:
            self._store.close(session.owner)
        if self._on_end is not None:
            self._on_end(session.owner)
        return self._manager.end_session(session.owner)

    @property
    def num_attached(self) -> int:
        return len(self._by_token) - len(self._detached) - len(self._restored)

    @property
    def num_detached(self) -> int:
        return len(self._detached) + len(self._restored)
