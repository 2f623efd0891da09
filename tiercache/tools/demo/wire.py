"""Messages between the demo's scheduler and its rank workers (a ``multiprocessing`` pipe).

Fixed-size binary records (``send_bytes``), never pickle. A command is::

    offset  bytes  field
    0       1      op            Op (STORE, LOAD, STALL, RELEASE, BENCH, CLOSE)
    1       1      direction     Direction (BENCH only)
    2       2      -             zero
    4       4      count         CPU blocks in the job
    8       8      job_id        (BENCH: the first of ``repetitions`` consecutive ids)
    16      8      repetitions   BENCH only
    24      8*n    cpu_ids       int64, n = count
    ...     8*n*f  gpu_ids       int64, f = block_size_factor GPU blocks per CPU block
    ...     8*n    seeds         uint64 content seeds (``tiercache.tools.demo.content``)

A report (worker → scheduler) is one ``REPORT`` record; ERROR appends a UTF-8 message::

    op u8, direction u8, success u8, backend_g2c u8, backend_c2g u8, pin_state u8, 2 zero,
    rank u32, pid i64, incarnation i64, job_id i64, transfer_bytes i64, transfer_s f64,
    num_blocks i64, mismatched_blocks i64, started_ns i64, ended_ns i64
    (84 bytes, little-endian)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from tiercache.errors import ProtocolError
from tiercache.backend_kind import BackendKind
from tiercache.region.stats import PinState
from tiercache.specs import Direction


class Op(IntEnum):
    STORE = 1  # fill GPU blocks with the seeds' pages, then store them
    LOAD = 2  # clear the GPU blocks, load them, check them against the seeds
    STALL = 3  # fault injection: block the compute stream (transfers wait behind it)
    RELEASE = 4  # unblock it
    BENCH = 5  # ``repetitions`` back-to-back transfers of one direction, timed
    CLOSE = 6  # drain, report, detach, exit
    ATTACHED = 10
    DONE = 11  # one transfer job finished
    BENCH_DONE = 12
    CLOSED = 13
    ERROR = 14  # the worker failed; the message follows the record


_COMMAND = struct.Struct("<BBxxIqq")
_REPORT = struct.Struct("<BBBBBBxxIqqqqdqqqq")


@dataclass(frozen=True, eq=False)
class Command:
    op: Op
    job_id: int = 0
    cpu_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    gpu_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seeds: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    direction: Direction = Direction.GPU_TO_CPU
    repetitions: int = 0

    def pack(self) -> bytes:
        return b"".join((
            _COMMAND.pack(self.op, self.direction, len(self.cpu_ids), self.job_id,
                          self.repetitions),
            np.ascontiguousarray(self.cpu_ids, np.int64).tobytes(),
            np.ascontiguousarray(self.gpu_ids, np.int64).tobytes(),
            np.ascontiguousarray(self.seeds, np.uint64).tobytes(),
        ))

    @classmethod
    def unpack(cls, data: bytes, block_size_factor: int) -> Command:
        op, direction, count, job_id, repetitions = _COMMAND.unpack_from(data)
        want = _COMMAND.size + 8 * count * (2 + block_size_factor)
        if len(data) != want:
            raise ProtocolError(f"command of {len(data)} bytes; op {op} with {count} blocks "
                                f"needs {want}")
        arrays = np.frombuffer(data, np.int64, offset=_COMMAND.size)
        cut = count + count * block_size_factor
        return cls(Op(op), job_id, arrays[:count], arrays[count:cut],
                   arrays[cut:].view(np.uint64), Direction(direction), repetitions)


@dataclass(frozen=True)
class Report:
    op: Op
    rank: int
    pid: int = 0
    incarnation: int = 0
    job_id: int = 0
    direction: Direction = Direction.GPU_TO_CPU
    success: bool = True
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    num_blocks: int = 0  # CPU blocks the job moved (and, for a load, checked)
    mismatched_blocks: int = 0
    started_ns: int = 0
    ended_ns: int = 0
    backends: tuple[BackendKind, BackendKind] = (BackendKind.NONE, BackendKind.NONE)
    pin_state: PinState = PinState.NONE
    message: str = ""

    def pack(self) -> bytes:
        return _REPORT.pack(
            self.op, self.direction, self.success, self.backends[0], self.backends[1],
            self.pin_state, self.rank, self.pid, self.incarnation, self.job_id,
            self.transfer_bytes, self.transfer_s, self.num_blocks, self.mismatched_blocks,
            self.started_ns,
            self.ended_ns) + self.message.encode()

    @classmethod
    def unpack(cls, data: bytes) -> Report:
        if len(data) < _REPORT.size:
            raise ProtocolError(f"report of {len(data)} bytes; at least {_REPORT.size} expected")
        (op, direction, success, g2c, c2g, pin, rank, pid, incarnation, job_id, nbytes,
         seconds, blocks, mismatched, started, ended) = _REPORT.unpack_from(data)
        return cls(Op(op), rank, pid, incarnation, job_id, Direction(direction), bool(success),
                   nbytes, seconds, blocks, mismatched, started, ended,
                   (BackendKind(g2c), BackendKind(c2g)), PinState(pin),
                   data[_REPORT.size:].decode(errors="replace"))
