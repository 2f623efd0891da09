"""``PeerTable``: the connections of one event port, counted, capped and watched.

ZMQ has no bound on the connections a socket accepts, and what it queued for a peer that
stopped reading stays until that peer goes. So the table watches its port's socket through
a ZMQ socket monitor (``ACCEPTED`` and ``DISCONNECTED``, each naming the connection's file
descriptor) and keeps, per connection, a duplicate of that descriptor: a handle on the TCP
connection itself, which ZMQ's API does not give. With it the table

* **caps** the connections: one accepted while ``max_peers`` are connected is shut down at
  once (``DropReason.OVER_CAP``);
* **drops peers that stopped reading**: ``check()`` reads the kernel's view of each
  connection (``TCP_INFO``'s bytes acknowledged, ``SIOCOUTQ``'s bytes not yet
  acknowledged); a peer that had bytes waiting and acknowledged none of them for
  ``timeout_s`` is shut down (``DropReason.STALLED``), and what ZMQ queued for it is freed;
* on the PUB port, **drops peers that send too much**: a subscriber sends a few
  subscriptions, yet each one it sends grows the PUB's subscription trie (~9 bytes of
  memory per byte of topic) for as long as it stays; one that sent more than
  ``INBOUND_BYTES`` plus ``INBOUND_BYTES_PER_S`` for each second connected is shut down
  (``DropReason.INBOUND``).

Dropping shuts the duplicate down (``shutdown(2)``, never ``close``): ZMQ's I/O thread
reads the end, closes its descriptor and reports ``DISCONNECTED``; the table closes its
duplicate then. The peer sees the connection end (a ZMQ peer reconnects: a router that
stalled comes back, sees the gap and replays).

Descriptor numbers are reused: the number an event names may have been closed and given to
another file by the time the table looks. A duplicate is kept only if it is a TCP socket
whose local port is this port's and that has a peer; and one socket's events come in the
order they happened (the context has one I/O thread), so a reused number's ``ACCEPTED``
follows its predecessor's ``DISCONNECTED``. ``check()`` also forgets a connection whose
number no longer names its socket (an event lost would otherwise hold a place forever).

Not thread-safe: the publisher's thread owns the table, as it owns the sockets.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import socket
import struct
import termios
import time
from collections import Counter
from dataclasses import dataclass
from enum import Enum

import zmq

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.5
INBOUND_BYTES = 64 << 10
INBOUND_BYTES_PER_S = 16  # a subscriber's heartbeats (a PING is ~10 bytes)
# ZMQ's monitor queue: events wait here until the publisher's thread reads them (each
# round); an accept/close flood past it stalls ZMQ's I/O thread until then, not memory
MONITOR_RCVHWM = 100_000
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_TCP_INFO_BYTES = 232
_BYTES_ACKED_AT = 120  # struct tcp_info: tcpi_bytes_acked (u64), Linux >= 4.1
_BYTES_RECEIVED_AT = 128  # tcpi_bytes_received (u64), Linux >= 4.1
_ids = itertools.count()


class DropReason(Enum):
    """Why the publisher ended a peer's connection (the metric's ``reason`` label)."""

    OVER_CAP = "over_cap"  # accepted while max_peers were connected
    STALLED = "stalled"  # bytes waiting, none acknowledged for peer_timeout_s
    INBOUND = "inbound"  # sent more than a subscriber's allowance (subscriptions)


@dataclass
class _Peer:
    handle: socket.socket  # our duplicate of ZMQ's descriptor
    inode: int  # the socket's, to tell a reused descriptor number
    since: float
    acked: int
    progress_at: float
    dropped: bool = False


class PeerTable:
    """The connections of ``zsock``'s port (see the module docstring). Create it before
    the socket binds, so that no connection goes unseen; ``bound(port)`` once it did."""

    def __init__(self, context: zmq.Context, zsock: zmq.Socket, max_peers: int,
                 timeout_s: float, limit_inbound: bool):
        self.max_peers = max_peers
        self.timeout_s = timeout_s
        self._limit_inbound = limit_inbound
        self._port = -1
        self._peers: dict[int, _Peer] = {}
        self.dropped: Counter[DropReason] = Counter()
        self.accepted = 0
        address = f"inproc://tiercache-events-peers-{os.getpid()}-{next(_ids)}"
        zsock.monitor(address, _EVENTS)
        self._zsock = zsock
        self.monitor = context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.setsockopt(zmq.RCVHWM, MONITOR_RCVHWM)
        self.monitor.connect(address)

    def bound(self, port: int) -> None:
        self._port = port

    def __len__(self) -> int:
        return len(self._peers)

    # ------------------------------------------------------------------ events
    def read_events(self, now: float | None = None) -> None:
        """Everything the monitor reported since the last call."""
        now = time.monotonic() if now is None else now
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event, fd = struct.unpack_from("=HI", frames[0])
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(fd, now)
            elif event == zmq.EVENT_DISCONNECTED:
                self._forget(fd)

    def _accepted(self, fd: int, now: float) -> None:
        handle = self._adopt(fd)
        if handle is None:
            return  # already gone: its DISCONNECTED follows
        self.accepted += 1
        if len(self._peers) >= self.max_peers:
            _shut(handle)
            handle.close()
            self.dropped[DropReason.OVER_CAP] += 1
            return
        stale = self._peers.pop(fd, None)
        if stale is not None:  # its DISCONNECTED was lost (check() would have seen it)
            stale.handle.close()
        try:
            self._peers[fd] = _Peer(handle, os.fstat(handle.fileno()).st_ino, now,
                                    _tcp_counters(handle)[0], now)
        except OSError:
            handle.close()  # ended already: its DISCONNECTED follows

    def _adopt(self, fd: int) -> socket.socket | None:
        """A duplicate of ``fd`` if it is a connection accepted on this port, else None."""
        try:
            copy = os.dup(fd)
        except OSError:
            return None  # closed already
        try:
            handle = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            return None  # the number names no socket any more
        try:
            if (handle.family in (socket.AF_INET, socket.AF_INET6)
                    and handle.type == socket.SOCK_STREAM
                    and handle.getsockname()[1] == self._port):
                handle.getpeername()  # a listener has none
                return handle
        except OSError:
            pass
        handle.close()
        return None

    def _forget(self, fd: int) -> None:
        peer = self._peers.pop(fd, None)
        if peer is not None:
            peer.handle.close()

    # ------------------------------------------------------------------ checks
    def check(self, now: float | None = None) -> None:
        """Drop the peers that stalled or sent too much (see the module docstring)."""
        now = time.monotonic() if now is None else now
        for fd, peer in list(self._peers.items()):
            if not _names(fd, peer.inode):
                self._forget(fd)
                continue
            if peer.dropped:
                continue
            try:
                acked, received = _tcp_counters(peer.handle)
                waiting = _unacknowledged(peer.handle)
            except OSError:
                continue  # ending: its DISCONNECTED comes
            if acked != peer.acked or not waiting:
                peer.acked, peer.progress_at = acked, now
            elif now - peer.progress_at >= self.timeout_s:
                self._drop(peer, DropReason.STALLED)
                continue
            if (self._limit_inbound
                    and received > INBOUND_BYTES + INBOUND_BYTES_PER_S * (now - peer.since)):
                self._drop(peer, DropReason.INBOUND)

    def _drop(self, peer: _Peer, reason: DropReason) -> None:
        _shut(peer.handle)
        peer.dropped = True
        self.dropped[reason] += 1

    def close(self) -> None:
        """Stop the monitor and let go of every handle (the socket closes after)."""
        self.read_events()
        try:
            self._zsock.disable_monitor()
        except zmq.ZMQError as e:  # the socket's own close stops it too: go on closing
            log.warning("event publisher: stopping a socket monitor failed: %s", e)
        self.monitor.close(linger=0)
        for peer in self._peers.values():
            peer.handle.close()
        self._peers.clear()


def _shut(handle: socket.socket) -> None:
    try:
        handle.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already ended


def _names(fd: int, inode: int) -> bool:
    """Whether descriptor ``fd`` still names the socket of ``inode``."""
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


def _tcp_counters(handle: socket.socket) -> tuple[int, int]:
    """(bytes the peer acknowledged, bytes received from it) over the connection's life."""
    info = handle.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    if len(info) < _BYTES_RECEIVED_AT + 8:
        raise OSError("TCP_INFO without byte counters (Linux >= 4.1 has them)")
    return (struct.unpack_from("=Q", info, _BYTES_ACKED_AT)[0],
            struct.unpack_from("=Q", info, _BYTES_RECEIVED_AT)[0])


def _unacknowledged(handle: socket.socket) -> int:
    """Bytes in the send queue not yet acknowledged (SIOCOUTQ)."""
    out = fcntl.ioctl(handle.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int(struct.unpack("=i", out)[0])
