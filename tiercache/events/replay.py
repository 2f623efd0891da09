"""Replay (vLLM's): the last batches, and the answers to subscribers that missed some.

``ReplayBuffer`` keeps the last batches, bounded twice: at most ``max_batches`` batches
and ``max_bytes`` of payload (the oldest go first). Each payload is kept as the
``zmq.Frame`` the PUB sent: libzmq shares a frame's bytes by reference count however many
sockets and peers it is queued for (pyzmq copies ``bytes`` under 64 KiB on every send,
``copy=False`` or not), so answers cost the buffer's memory once, not once per answer.

``Replays`` answers requests (``parse_request``: the first sequence number wanted) with a
**cursor** per requester: the batches from there to the newest buffered when it asked,
then the end marker (``tiercache.events.wire`` has the frames). ``serve`` sends on every
cursor until the requester's queue is full: the ROUTER is ``ROUTER_MANDATORY`` with
``SNDHWM`` = ``hwm``, so a full queue is ``zmq.Again`` and the cursor waits; a requester
that left is ``EHOSTUNREACH`` and its cursor goes. So a requester never has more than
``hwm`` batches queued, however many requests it sends (a new request replaces its cursor),
and one ``serve`` sends at most ``budget`` batches: the publisher's thread shares the
interpreter with the control plane and comes back to it between rounds. A requester that
stops reading is dropped by the port's ``PeerTable`` (its cursor goes at the next send).
"""

from __future__ import annotations

import errno
from collections import OrderedDict, deque
from typing import NamedTuple

import zmq

from tiercache.events.wire import END_SEQ, SEQ_BYTES, seq_bytes

REPLAY_BUFFER_BYTES = 64 << 20


class Buffered(NamedTuple):
    seq: int
    topic: bytes
    payload: zmq.Frame
    num_bytes: int


class ReplayBuffer:
    """Batches in sequence order, consecutive (every batch published is appended)."""

    def __init__(self, max_batches: int, max_bytes: int = REPLAY_BUFFER_BYTES):
        self._batches: deque[Buffered] = deque()
        self._max_batches = max_batches
        self._max_bytes = max_bytes
        self._bytes = 0

    def append(self, seq: int, topic: bytes, payload: zmq.Frame, num_bytes: int) -> None:
        assert not self._batches or seq == self._batches[-1].seq + 1, "sequence numbers"
        self._batches.append(Buffered(seq, topic, payload, num_bytes))
        self._bytes += num_bytes
        while self._batches and (len(self._batches) > self._max_batches
                                 or self._bytes > self._max_bytes):
            self._bytes -= self._batches.popleft().num_bytes

    def get(self, seq: int) -> Buffered | None:
        """Batch ``seq`` if it is still buffered."""
        if not self._batches:
            return None
        i = seq - self._batches[0].seq
        return self._batches[i] if 0 <= i < len(self._batches) else None

    @property
    def first_seq(self) -> int:
        """The oldest buffered sequence number (``next_seq`` of an empty buffer: none)."""
        return self._batches[0].seq if self._batches else self.next_seq

    @property
    def next_seq(self) -> int:
        """One past the newest buffered."""
        return self._batches[-1].seq + 1 if self._batches else 0

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def num_bytes(self) -> int:
        return self._bytes


def parse_request(frames: list[bytes]) -> tuple[bytes, int] | None:
    """(the requester's identity, the first sequence number it wants) from a ROUTER
    message, or None if it is not a replay request (``[identity, "", 8-byte seq]``)."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


class _Cursor:
    __slots__ = ("next_seq", "end_seq")

    def __init__(self, next_seq: int, end_seq: int):
        self.next_seq = next_seq
        self.end_seq = end_seq  # one past the last to send; then the end marker


class Replays:
    """The answers in progress, one cursor per requester (see the module docstring)."""

    def __init__(self, buffer: ReplayBuffer, max_cursors: int):
        self._buffer = buffer
        self._max_cursors = max_cursors
        self._cursors: OrderedDict[bytes, _Cursor] = OrderedDict()

    def request(self, identity: bytes, start_seq: int) -> None:
        """Answer ``identity`` from ``start_seq`` to the newest batch buffered now."""
        self._cursors.pop(identity, None)
        if len(self._cursors) >= self._max_cursors:
            self._cursors.popitem(last=False)  # the oldest: its requester left, likely
        self._cursors[identity] = _Cursor(start_seq, self._buffer.next_seq)

    def __len__(self) -> int:
        return len(self._cursors)

    def serve(self, router: zmq.Socket, budget: int) -> int:
        """Send what the requesters' queues take, at most ``budget`` batches; the number
        sent. Raises what the socket raises but a full queue or a requester gone."""
        sent = 0
        for identity in list(self._cursors):
            if sent >= budget:
                break
            self._cursors.move_to_end(identity)  # the next serve starts with another
            sent += self._advance(router, identity, budget - sent)
        return sent

    def _advance(self, router: zmq.Socket, identity: bytes, budget: int) -> int:
        """Send batches until the queue is full, the budget is spent or the answer is
        complete (end marker sent, cursor gone); the number sent. Batches that left the
        buffer meanwhile are skipped: the requester sees the gap."""
        buffer, cursor, sent = self._buffer, self._cursors[identity], 0
        cursor.next_seq = max(cursor.next_seq, buffer.first_seq)
        try:
            while cursor.next_seq < cursor.end_seq:
                if sent >= budget:
                    return sent
                batch = buffer.get(cursor.next_seq)
                assert batch is not None, "between the buffer's first and next"
                router.send_multipart([identity, b"", batch.topic, seq_bytes(batch.seq),
                                       batch.payload], flags=zmq.NOBLOCK, copy=False)
                cursor.next_seq += 1
                sent += 1
            router.send_multipart([identity, b"", b"", END_SEQ, b""], flags=zmq.NOBLOCK)
        except zmq.Again:
            return sent  # its queue is full: later
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
        del self._cursors[identity]  # answered, or it left
        return sent
