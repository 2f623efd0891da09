"""``ReplayBuffer``: the last batches, for subscribers that missed some (vLLM's replay).

Bounded twice: at most ``max_batches`` batches and ``max_bytes`` of payload (the oldest
go first), so a burst of large batches cannot grow the coordinator. A request names the
first sequence number it wants (``parse_request``); the answer is every buffered batch from
there on, then the end marker (``tiercache.events.wire`` has the frames).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

from tiercache.events.wire import SEQ_BYTES

REPLAY_BUFFER_BYTES = 64 << 20


class Buffered(NamedTuple):
    seq: int
    topic: bytes
    payload: bytes


class ReplayBuffer:
    def __init__(self, max_batches: int, max_bytes: int = REPLAY_BUFFER_BYTES):
        self._batches: deque[Buffered] = deque()
        self._max_batches = max_batches
        self._max_bytes = max_bytes
        self._bytes = 0

    def append(self, seq: int, topic: bytes, payload: bytes) -> None:
        self._batches.append(Buffered(seq, topic, payload))
        self._bytes += len(payload)
        while self._batches and (len(self._batches) > self._max_batches
                                 or self._bytes > self._max_bytes):
            self._bytes -= len(self._batches.popleft().payload)

    def since(self, start_seq: int) -> Iterator[Buffered]:
        return (b for b in self._batches if b.seq >= start_seq)

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
