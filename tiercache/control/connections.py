"""The control server's connections, and which of them to close when: HELLO and idle
deadlines, the one that makes room at the cap, the hog over the partial-request budget.

Pure bookkeeping, one thread (the control server's loop): the table decides, the server
closes; ``now`` is passed in. Whether a connection's session holds reservations or pins is
asked of the index through ``holds`` (a connection that holds something is never chosen:
closing it would start the end of what its client holds).

Decisions:

* Connections are kept least recently active first (an ordered dict, moved to the end on
  every read), so the next idle deadline is the head's, and so are the HELLO deadlines of
  the connections still without a session (accept order). The loop's timeout is the
  earlier head; nothing is scanned while nothing is due.
* A connection that holds something when its idle deadline comes is treated as just
  active: it is looked at again one idle timeout later, not on every turn of the loop.
* "Mid-request" (part of a request read, or answers waiting) protects a connection at the
  cap only while bytes keep coming: after ``stall_s`` (the server passes its HELLO timeout)
  without any it counts as quiet, so stalled half-requests cannot keep every slot.
* The hog over the budget is looked for per process (pid from ``SO_PEERCRED``): the one
  holding the most partial bytes gives way, its largest partial request first. Counting
  per connection would let one process with many small partial requests close another's
  single large one.
* A connection's first frame is checked as soon as its header is in (``request``): a
  header that cannot be trusted closes the connection before its payload is awaited.
"""

from __future__ import annotations

import selectors
import socket
from collections import OrderedDict
from collections.abc import Callable, Iterator

from tiercache.link.protocol import (
    HEADER_BYTES, MAX_REQUEST_BYTES, PROTOCOL_VERSION, FrameHeader, Status, frame_version,
)
from tiercache.link.versions import check_served
from tiercache.control.sessions import Session
from tiercache.errors import ProtocolError


class Connection:
    """One client connection: its socket, buffers and session."""

    __slots__ = ("sock", "inbuf", "header", "need_bytes", "outbuf", "events", "session", "pid",
                 "opened_s", "active_s", "finish_tag", "turn", "version")

    def __init__(self, sock: socket.socket, pid: int, now: float):
        self.sock = sock
        self.inbuf = bytearray()  # requests received and not served yet (the last one partial)
        self.header: FrameHeader | None = None  # the first request's, once checked
        self.need_bytes = HEADER_BYTES  # how long inbuf must get for its first request
        self.outbuf = bytearray()
        self.events = selectors.EVENT_READ  # what the selector watches for (0: nothing)
        # Fair turns between connections (``tiercache.control.turns``): the finish tag of
        # its latest request, and its place in the queue while one waits.
        self.finish_tag = 0.0
        self.turn: int | None = None
        self.session: Session | None = None  # set by HELLO
        # the protocol version of its first frame, which every later frame and every
        # answer carries (``tiercache.link.versions``); None before that frame
        self.version: int | None = None
        self.pid = pid  # of the peer (SO_PEERCRED): per-peer bounds, logs
        self.opened_s = now  # its HELLO deadline counts from here
        # When it last sent bytes or read answers that waited (or was last found holding
        # something at its idle deadline): its idle deadline counts from here.
        self.active_s = now

    @property
    def peer(self) -> str:
        return f"pid {self.pid}"

    @property
    def answer_version(self) -> int:
        """The protocol version its answers carry: its first frame's, else ours."""
        return PROTOCOL_VERSION if self.version is None else self.version

    def watch(self, selector: selectors.BaseSelector, events: int) -> None:
        """Have the selector watch this connection for ``events`` (0: nothing, while its
        request waits its turn)."""
        if self.events == events:
            return
        if not events:
            selector.unregister(self.sock)
        elif not self.events:
            selector.register(self.sock, events, self)
        else:
            selector.modify(self.sock, events, self)
        self.events = events

    def request(self) -> FrameHeader | None:
        """The header of the first request in ``inbuf`` once the whole request is in (None
        before). Raises ``ProtocolError`` as soon as a header is in that cannot be trusted
        (bad magic or version, a response's status, more than ``MAX_REQUEST_BYTES``):
        ``ProtocolVersionError`` for a first frame of a version not served, with
        ``version`` set to it so the refusal is sent in it."""
        if self.header is None:
            if len(self.inbuf) < HEADER_BYTES:
                return None
            if self.version is None:
                self.version = frame_version(self.inbuf)
                check_served(self.version)
            header = FrameHeader.unpack(self.inbuf, self.version)
            if header.status is not Status.OK:
                raise ProtocolError(f"a request frame with status {header.status.name}")
            if header.payload_bytes > MAX_REQUEST_BYTES:
                raise ProtocolError(f"a request of {header.payload_bytes} bytes; requests "
                                    f"are at most {MAX_REQUEST_BYTES}")
            self.header = header
            self.need_bytes = HEADER_BYTES + header.payload_bytes
        return self.header if len(self.inbuf) >= self.need_bytes else None

    def take_request(self) -> tuple[FrameHeader, memoryview]:
        """Remove the first request (``request()`` returned its header) from ``inbuf``:
        its header and payload (a view of bytes no longer in ``inbuf``)."""
        header, end = self.header, self.need_bytes
        assert header is not None and len(self.inbuf) >= end
        raw = self.inbuf
        self.inbuf = raw[end:]  # usually empty: a client sends one request at a time
        self.header, self.need_bytes = None, HEADER_BYTES
        return header, memoryview(raw)[HEADER_BYTES:end]


class ConnectionTable:
    """The open connections; see the module docstring. ``holds(conn)``: whether ``conn``'s
    session holds reservations or pins."""

    def __init__(self, hello_timeout_s: float, idle_timeout_s: float,
                 holds: Callable[[Connection], bool]):
        self.hello_timeout_s = hello_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._holds = holds
        self._by_activity: OrderedDict[Connection, None] = OrderedDict()
        self._greeting: dict[Connection, None] = {}  # without HELLO yet, oldest first
        self._per_pid: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._by_activity)

    def __contains__(self, conn: object) -> bool:
        return conn in self._by_activity

    def __iter__(self) -> Iterator[Connection]:
        return iter(self._by_activity)

    def num_of(self, pid: int) -> int:
        """How many connections process ``pid`` has open."""
        return self._per_pid.get(pid, 0)

    def add(self, conn: Connection) -> None:
        self._by_activity[conn] = None
        self._greeting[conn] = None
        self._per_pid[conn.pid] = self._per_pid.get(conn.pid, 0) + 1

    def remove(self, conn: Connection) -> bool:
        """Forget ``conn``; False if it was not here (closed already)."""
        if conn not in self._by_activity:
            return False
        del self._by_activity[conn]
        self._greeting.pop(conn, None)
        left = self._per_pid[conn.pid] - 1
        if left:
            self._per_pid[conn.pid] = left
        else:
            del self._per_pid[conn.pid]
        return True

    def clear(self) -> None:
        self._by_activity.clear()
        self._greeting.clear()
        self._per_pid.clear()

    def greeted(self, conn: Connection) -> None:
        """``conn`` completed HELLO: no HELLO deadline any more."""
        self._greeting.pop(conn, None)

    def touch(self, conn: Connection, now: float) -> None:
        """``conn`` was active at ``now``: its idle deadline starts over."""
        conn.active_s = now
        self._by_activity.move_to_end(conn)

    # ------------------------------------------------------------------ deadlines

    def next_deadline(self) -> float | None:
        """The earliest HELLO or idle deadline (None: no connection)."""
        due = None
        for conn in self._by_activity:  # the head only: runs on every turn of the loop
            due = conn.active_s + self.idle_timeout_s
            break
        for conn in self._greeting:
            hello_due = conn.opened_s + self.hello_timeout_s
            due = hello_due if due is None else min(due, hello_due)
            break
        return due

    def overdue(self, now: float) -> tuple[list[Connection], list[Connection]]:
        """(connections past their HELLO deadline, idle ones holding nothing): both to close.
        An idle one that holds something is touched (looked at again an idle timeout on)."""
        late = []
        for conn in self._greeting:
            if now < conn.opened_s + self.hello_timeout_s:
                break
            late.append(conn)
        idle: list[Connection] = []
        holding: list[Connection] = []
        closing = set(late)
        for conn in self._by_activity:
            if now < conn.active_s + self.idle_timeout_s:
                break
            if conn not in closing:
                (holding if self._holds(conn) else idle).append(conn)
        for conn in holding:
            self.touch(conn, now)
        return late, idle

    # ------------------------------------------------------------------ whom to close

    def quietest_idle(self, now: float, stall_s: float) -> Connection | None:
        """The connection to close for a newcomer at the cap: the oldest one without HELLO,
        else the one quiet longest of those holding nothing and not mid-request (which it
        stops being after ``stall_s`` without bytes); None if there is none."""
        for conn in self._greeting:
            return conn
        for conn in self._by_activity:
            mid_request = (conn.inbuf or conn.outbuf) and now - conn.active_s < stall_s
            if not mid_request and not self._holds(conn):
                return conn
        return None

    def hog(self, reader: Connection, incoming: int) -> Connection | None:
        """The connection to close over the partial-request budget: of the process holding
        the most partial bytes (``reader`` counted with ``incoming`` more), its connection
        holding the most, quiet longest of equals; never ``reader``. None when no other
        connection holds partial bytes."""
        held = [c for c in self._by_activity if c.inbuf and c is not reader]
        if not held:
            return None
        by_pid = {reader.pid: len(reader.inbuf) + incoming}
        for conn in held:
            by_pid[conn.pid] = by_pid.get(conn.pid, 0) + len(conn.inbuf)
        return max(held, key=lambda c: (by_pid[c.pid], len(c.inbuf), -c.active_s))
