"""Client sessions of the control server: who owns which reservations and pins, and when a
gone client's are given back.

Every connection opens (HELLO) or resumes (HELLO with a token) a session; the session's
``owner`` number is what the index records on every reservation and pin it makes. When
the connection closes the session is *detached*, not ended: a client that reconnects
within ``grace_s`` with its token gets the same owner back, its reservations and pins
intact (a broken connection or a client library's reconnect is not a client's death).
A session still detached after ``grace_s`` is ended: ``manager.end_session(owner)``
frees its WRITING slots and drops its pins.

Decisions:

* Tokens are 16 random bytes from ``secrets`` and name a session only within this
  server's life: a restarted coordinator knows none of them (a new session, not resumed),
  and its index kept no pins or reservations (the ledger drops them), so nothing dangles.
* A HELLO naming a session that another connection holds moves the session to the new
  connection, and the server closes the old one: the usual cause is a client whose old
  connection the server has not seen close yet (both ends belong to one user, checked
  with ``SO_PEERCRED``).
* Detached sessions expire in detach order (one grace period for all), so the table
  keeps them in an insertion-ordered dict and checks only its head.
* A process may keep at most so many detached sessions (``end_detached_beyond``; the
  control server passes ``max_detached_sessions_per_peer``): one that opens and closes
  connections in a loop would otherwise grow the table by a session per close for a whole
  grace period. A session counts against the process that attached it last
  (``peer_pid``, from ``SO_PEERCRED``); beyond the bound its oldest detached one ends at
  once, as if its grace period were over.
* Pure bookkeeping, one thread (the control server's loop); ``now`` is passed in.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Hashable
from dataclasses import dataclass

from tiercache.index.manager import OffloadingManager
from tiercache.index.payloads import Hello
from tiercache.index.protocol import TOKEN_BYTES
from tiercache.index.results import SessionRelease


@dataclass(eq=False)
class Session:
    owner: int
    token: bytes
    name: str
    conn: Hashable | None = None  # the connection it is attached to; None while detached
    deadline: float | None = None  # while detached: when it ends
    peer_pid: int = 0  # the process that attached it last; its detached ones are bounded


class SessionTable:
    """Sessions by token; see the module docstring."""

    def __init__(self, manager: OffloadingManager, grace_s: float):
        self._manager = manager
        self.grace_s = grace_s
        self._by_token: dict[bytes, Session] = {}
        self._detached: dict[bytes, Session] = {}  # detach order = expiry order
        self._detached_of: dict[int, dict[bytes, Session]] = {}  # the same, by peer_pid
        self._owners = itertools.count(1)  # LOCAL_OWNER (0) stays the in-process caller's

    def hello(self, conn: Hashable, token: bytes, name: str
              ) -> tuple[Session, Hello, Hashable | None]:
        """Open or resume a session for ``conn``: (session, the answer, a connection that
        held the session until now and must be closed, or None)."""
        session = self._by_token.get(token) if token else None
        if session is None:
            new_token = secrets.token_bytes(TOKEN_BYTES)
            session = Session(next(self._owners), new_token, name)
            self._by_token[new_token] = session
            resumed, displaced = False, None
        else:
            self._undetach(session)
            displaced = session.conn
            resumed = True
        session.conn, session.deadline = conn, None
        return session, Hello(session.token, resumed, self.grace_s), displaced

    def detach(self, session: Session, conn: Hashable, now: float) -> None:
        """``conn`` closed: start ``session``'s grace period (unless it moved on already)."""
        if session.conn is not conn or session.token not in self._by_token:
            return
        session.conn = None
        session.deadline = now + self.grace_s
        self._detached[session.token] = session
        self._detached_of.setdefault(session.peer_pid, {})[session.token] = session

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

    def next_deadline(self) -> float | None:
        for session in self._detached.values():
            return session.deadline
        return None

    def end_all(self) -> list[tuple[Session, SessionRelease]]:
        """End every session (the server stops: nobody can resume them)."""
        sessions = list(self._by_token.values())
        self._detached.clear()
        self._detached_of.clear()
        return [(s, self._end(s)) for s in sessions]

    def end_detached_beyond(self, peer_pid: int, keep: int
                            ) -> list[tuple[Session, SessionRelease]]:
        """End the detached sessions of process ``peer_pid`` beyond its ``keep`` newest,
        oldest first (see the module docstring)."""
        ended = []
        mine = self._detached_of.get(peer_pid, {})
        while len(mine) > keep:
            session = next(iter(mine.values()))
            self._undetach(session)
            ended.append((session, self._end(session)))
        return ended

    def _undetach(self, session: Session) -> None:
        self._detached.pop(session.token, None)
        mine = self._detached_of.get(session.peer_pid)
        if mine is not None:
            mine.pop(session.token, None)
            if not mine:
                del self._detached_of[session.peer_pid]

    def _end(self, session: Session) -> SessionRelease:
        del self._by_token[session.token]
        session.conn = None
        return self._manager.end_session(session.owner)

    @property
    def num_attached(self) -> int:
        return len(self._by_token) - len(self._detached)

    @property
    def num_detached(self) -> int:
        return len(self._detached)
