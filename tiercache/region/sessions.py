"""The session table: the control plane's client sessions, kept in the region so that a
restarted coordinator knows who held the reservations and pins the index ledger records.

One fixed-size record per session, after the index ledger (``RegionLayout.sessions_offset``),
little-endian::

    offset  size  field
    0       8     seq           u64: odd while the record is rewritten (as the ledger's)
    8       4     state         u32: FREE 0, LIVE 1
    12      4     owner         u32: the session's owner number (record index + 1)
    16      16    token         the session's token (what a client resumes it with)
    32      8     pid           u64: the process that holds it (its latest connection)
    40      8     pid_start_ns  u64: that process's start time (pid reuse check)
    48      8     checksum      u64: ``record_checksums`` of bytes 8..48, salted by the index
    56      8     seq_end       u64: equal to ``seq`` once the record is whole

Decisions and reasons:

* **Owner numbers are record indexes.** An owner is the number the index ledger stores with
  a reservation or a pin; tying it to the record keeps the two tables in step and bounds
  it (``MAX_SESSIONS``), so the ledger can store it in 16 bits.
* **A pid and its start time.** A session whose process is proven gone (no such pid, or a
  pid reused by a younger process) can be ended at once by a restarted coordinator; a live
  one keeps its reservations and pins until it resumes or its liveness deadline passes.
* Torn (seq bracket) and damaged (checksum) records are dropped on recovery and counted:
  their owner's reservations and pins are then given back, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache.region.checksum import record_checksums

TOKEN_BYTES = 16
MAX_SESSIONS = 4096
RECORD = np.dtype([
    ("seq", "<u8"), ("state", "<u4"), ("owner", "<u4"), ("token", "u1", (TOKEN_BYTES,)),
    ("pid", "<u8"), ("pid_start_ns", "<u8"), ("checksum", "<u8"), ("seq_end", "<u8"),
])
RECORD_BYTES = RECORD.itemsize
assert RECORD_BYTES == 64
_BODY = slice(1, 6)
_FREE, _LIVE = 0, 1


@dataclass(frozen=True)
class SessionRecord:
    owner: int
    token: bytes
    pid: int
    pid_start_ns: int


class SessionTableFullError(Exception):
    """Every record is in use (the control server turns it into a refused HELLO)."""


class SessionLedger:
    """The session records over ``buffer`` (``MAX_SESSIONS * RECORD_BYTES`` bytes, 8-byte
    aligned). Single writer (the coordinator's control thread)."""

    def __init__(self, buffer: np.ndarray):
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size % RECORD_BYTES:
            raise ValueError(f"session table buffer of {buffer.size} {buffer.dtype} bytes; "
                             f"needs a multiple of {RECORD_BYTES} uint8")
        self._table = buffer.view(RECORD)
        self._words = buffer.view(np.uint64).reshape(-1, RECORD_BYTES // 8)
        self._free = list(range(self._table.size - 1, -1, -1))  # lowest index first

    @property
    def capacity(self) -> int:
        return self._table.size

    def open(self, token: bytes, pid: int, pid_start_ns: int) -> int:
        """A record for a new session; returns its owner number."""
        if not self._free:
            raise SessionTableFullError(f"all {self.capacity} session records are in use")
        index = self._free.pop()
        self._rewrite(index, _LIVE, token, pid, pid_start_ns)
        return index + 1

    def moved(self, owner: int, pid: int, pid_start_ns: int) -> None:
        """The session resumed from ``pid``."""
        index = owner - 1
        token = self._table["token"][index].tobytes()
        self._rewrite(index, _LIVE, token, pid, pid_start_ns)

    def close(self, owner: int) -> None:
        index = owner - 1
        self._rewrite(index, _FREE, bytes(TOKEN_BYTES), 0, 0)
        self._free.append(index)

    def _rewrite(self, index: int, state: int, token: bytes, pid: int, start_ns: int) -> None:
        t = self._table
        odd = int(t["seq"][index]) | 1
        t["seq"][index] = odd
        t["state"][index] = state
        t["owner"][index] = index + 1
        t["token"][index] = np.frombuffer(token, np.uint8)
        t["pid"][index] = pid
        t["pid_start_ns"][index] = start_ns
        t["checksum"][index] = record_checksums(self._words[index:index + 1, _BODY],
                                                np.array([index]))[0]
        t["seq_end"][index] = odd + 1
        t["seq"][index] = odd + 1

    def recover(self) -> tuple[list[SessionRecord], int]:
        """The LIVE sessions a previous coordinator left, and how many records were torn or
        damaged (rewritten FREE). The free list is rebuilt around the live ones."""
        t = self._table
        ids = np.arange(t.size)
        fresh = (t["seq"] == 0) & (t["seq_end"] == 0)
        good = ((t["seq"] == t["seq_end"]) & (t["seq"] % 2 == 0)
                & (t["checksum"] == record_checksums(self._words[:, _BODY], ids))
                & (t["owner"] == ids + 1) & (t["state"] <= _LIVE))
        live = np.flatnonzero(good & (t["state"] == _LIVE))
        bad = np.flatnonzero(~good & ~fresh)
        for index in bad.tolist():
            top = max(int(t["seq"][index]), int(t["seq_end"][index]))
            t["seq"][index] = t["seq_end"][index] = top + (top % 2)
            self._rewrite(index, _FREE, bytes(TOKEN_BYTES), 0, 0)
        records = [SessionRecord(int(t["owner"][i]), t["token"][i].tobytes(), int(t["pid"][i]),
                                 int(t["pid_start_ns"][i])) for i in live.tolist()]
        in_use = set(live.tolist())
        self._free = [i for i in range(t.size - 1, -1, -1) if i not in in_use]
        return records, int(bad.size)
