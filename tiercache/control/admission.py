"""Who gets a control connection: the peer's uid (``SO_PEERCRED``: ours or the trusted
one), at most ``max_connections_per_peer`` of one process, and room at ``max_connections``
(the connection quiet longest among those holding nothing makes room: one without HELLO
first; a newcomer is refused only when every connection holds reservations or pins or is
mid-request). A refusal is answered with an error frame naming the limit, then closed.

One thread (the control server's loop); the table (``tiercache.control.connections``)
decides which connection is quietest, the server closes it (``drop``).
"""

from __future__ import annotations

import socket
from typing import Protocol

from tiercache.control.connections import Connection, ConnectionTable
from tiercache.control.options import ControlOptions
from tiercache.link.payloads import encode_error
from tiercache.link.protocol import PROTOCOL_VERSION, Status, Verb, frame
from tiercache.link.sockets import check_peer, peer_credentials
from tiercache.errors import ControlSocketError
from tiercache.loglimit import LogLimiter

class Drop(Protocol):
    """How the loop's helpers close a connection: ``why`` for the log, ``tell`` the error
    to answer one without HELLO first."""

    def __call__(self, conn: Connection, why: str, tell: Exception | None = None) -> None: ...


def refuse(sock: socket.socket, why: Exception, version: int = PROTOCOL_VERSION) -> None:
    """Answer no request (id 0) with the reason, best effort, and close; in the peer's
    protocol ``version`` when its first frame told it (``tiercache.link.versions``)."""
    sock.setblocking(False)
    try:
        sock.send(frame(Verb.HELLO, 0, encode_error(why, version), Status.ERROR, version))
    except OSError:
        pass
    sock.close()


class Admission:
    """Admits accepted sockets into ``connections``; ``drop(conn, why, tell)`` closes a
    connection that makes room (``tell``: the error to answer one without HELLO)."""

    def __init__(self, options: ControlOptions, connections: ConnectionTable,
                 trusted: frozenset[int], warn: LogLimiter, drop: Drop):
        self._options = options
        self._connections = connections
        self._trusted = trusted
        self._warn = warn
        self._drop = drop

    def admit(self, sock: socket.socket, now: float) -> Connection | None:
        """The new connection (added to the table, non-blocking), or None: refused, and
        the socket answered and closed."""
        try:
            pid = peer_credentials(sock)[0]
            check_peer(sock, self._trusted, "control client")
        except (ControlSocketError, OSError) as e:
            self._warn.warn("refused", "refusing a control connection: %s", e)
            refuse(sock, e)
            return None
        refusal = self._make_room(pid, now)
        if refusal is not None:
            kind, error = refusal
            self._warn.warn(kind, "refusing a control connection of pid %d: %s", pid, error)
            refuse(sock, error)
            return None
        sock.setblocking(False)
        conn = Connection(sock, pid, now)
        self._connections.add(conn)
        return conn

    def _make_room(self, pid: int, now: float) -> tuple[str, ControlSocketError] | None:
        """Make room for one more connection of ``pid`` (closing the quietest connection that
        holds nothing, at the cap), or say why not: (log kind, the error to answer)."""
        opts = self._options
        held = self._connections.num_of(pid)
        if held >= opts.max_connections_per_peer:
            return "refused_peer", ControlSocketError(
                f"pid {pid} has {held} control connections open, the most one process may "
                f"have (control.max_connections_per_peer = {opts.max_connections_per_peer}); "
                "close one, or share connections between threads")
        if len(self._connections) < opts.max_connections:
            return None
        victim = self._connections.quietest_idle(now, stall_s=opts.hello_timeout_s)
        if victim is None:
            return "refused", ControlSocketError(
                f"the coordinator serves its maximum of {opts.max_connections} control "
                "connections (control.max_connections), each holding reservations or pins "
                "or in the middle of a request; retry later")
        self._warn.warn("make_room", "at the maximum of %d control connections: closing the one "
                        "of %s (%s, quiet for %.1f s) to serve a new one", opts.max_connections,
                        victim.peer, "no HELLO yet" if victim.session is None else
                        "holding nothing", now - victim.active_s)
        why = ControlSocketError(f"closed without HELLO to serve another connection (at the "
                                 f"maximum of {opts.max_connections}, control.max_connections)")
        self._drop(victim, "made room for a new connection",
                   why if victim.session is None else None)
        return None


__all__ = ["Admission", "refuse"]
