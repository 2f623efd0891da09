"""Stats blocks in the region header, one per attachment slot of each rank: one writer (the
worker process holding the slot, ``tiercache.region.attachments``), many readers.

Each block is ``STATS_BLOCK_BYTES`` of little-endian, 8-byte aligned uint64 words,
viewed as a numpy array (one aligned 8-byte store per word, so no word tears).
Multi-word consistency comes from a sequence lock: the writer makes ``seq`` odd,
writes, then makes it even again; a reader copies the block and retries if ``seq``
was odd or changed. Counters live in the region, so they survive a worker restart
and only ever go up: the next holder of the slot continues from them.

Word layout (index = byte offset / 8)::

    word  field            meaning
    0     seq              sequence lock (odd while the writer is mid-update)
    1     pid              pid of the attached worker, 0 when none
    2     pid_start_ns     that process's start time, ns after boot (tiercache.region.hostmem):
                           the pid reuse check
    3     attach_count     how many times a worker attached this rank
    4     heartbeat_ns     wall-clock ns of the writer's last update
    5     pin_state        PinState code
    6     backend_g2c      BackendKind code of the gpu_to_cpu handler
    7     backend_c2g      BackendKind code of the cpu_to_gpu handler
    8     pinned_bytes     bytes registered with the GPU driver
    9     pin_ns           time the registration took, ns
    10    prefault_ns      time the worker took to pre-fault its slice at attach, ns
    11    numa_state       NumaState code of the slice's placement (tiercache.region.placement)
    12    numa_node        the node of the worker's device, as int64 (-1: unknown)
    13    numa_pages       OS pages of the slice's rows the worker counted (0: none counted)
    14    numa_local_pages of those, the pages on numa_node
    15    numa_ns          time binding, counting and moving took at attach, ns
    16..  direction gpu_to_cpu, then cpu_to_gpu, DIRECTION_WORDS each:
          +0 bytes_total, +1 busy_ns_total (GPU-timed), +2 transfers_ok, +3 transfers_failed,
          +4 .. duration histogram counts (len(DURATION_BUCKETS_S) + 1, last is +Inf),
          then size histogram counts (len(SIZE_BUCKETS_BYTES) + 1, last is +Inf)
    then  engine           EngineKind code of the attached process (0: a GPU worker)
    +1    engine_rank      its rank in its engine (SGLang: the TP rank)
    +2    engine_ranks     its engine's ranks (SGLang: the TP size; 0 unknown)

Histogram counts are per bucket (not cumulative); readers accumulate them. Words 11-15
were reserved (zero) before the NUMA fields: a block an older worker wrote reads as
``NumaState.NONE``; the engine words after the direction blocks were zero too: such a
block reads as ``EngineKind.WORKER``.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from tiercache.backend_kind import BackendKind
from tiercache.numa.placement import NumaPlacement, NumaState
from tiercache.specs import Direction
from tiercache.errors import StatsStuckError

STATS_BLOCK_BYTES = 4096
DURATION_BUCKETS_S: tuple[float, ...] = (
    1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3,
    1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)
SIZE_BUCKETS_BYTES: tuple[int, ...] = tuple(4096 * 4**k for k in range(12))  # 4 KiB .. 16 GiB

_SEQ, _PID, _PID_START, _ATTACH, _HEARTBEAT, _PIN_STATE, _BACKEND_G2C, _BACKEND_C2G = range(8)
_PINNED_BYTES, _PIN_NS, _PREFAULT_NS = 8, 9, 10
_NUMA_STATE, _NUMA_NODE, _NUMA_PAGES, _NUMA_LOCAL, _NUMA_NS = 11, 12, 13, 14, 15
_INT64 = 1 << 64
_DIR_BASE = 16
_N_DUR = len(DURATION_BUCKETS_S) + 1
_N_SIZE = len(SIZE_BUCKETS_BYTES) + 1
DIRECTION_WORDS = 4 + _N_DUR + _N_SIZE
_ENGINE = _DIR_BASE + 2 * DIRECTION_WORDS
_ENGINE_RANK, _ENGINE_RANKS = _ENGINE + 1, _ENGINE + 2
_WORDS = _ENGINE + 3
assert _WORDS * 8 <= STATS_BLOCK_BYTES
_READ_TIMEOUT_S = 0.002  # a write takes microseconds; longer means its writer died mid-update


class PinState(IntEnum):
    NONE = 0  # no worker has tried to pin (or it detached)
    PINNED = 1
    UNPINNED = 2  # pinning failed or is unavailable and the policy allowed running unpinned
    FAILED = 3  # pinning failed and the worker refused to run
    NOT_NEEDED = 4  # host-to-host copies only (an SGLang host pool): no GPU to pin for
    PINNING = 5  # page-locking the slice chunk by chunk; pinned_bytes says how far
    UNKNOWN = 255  # read only: a value this version does not know (a newer worker wrote it)

    @classmethod
    def _missing_(cls, value: object) -> PinState:
        return cls.UNKNOWN  # a stats block another version wrote is read, never a traceback

    @property
    def label(self) -> str:
        return self.name.lower()


class EngineKind(IntEnum):
    """What kind of process holds an attachment: a GPU worker (``tiercache.attach``: vLLM's
    ranks, the demo) or an SGLang rank copying host to host (``tiercache.sglang``)."""

    WORKER = 0
    SGLANG = 1
    UNKNOWN = 255  # read only: a value this version does not know (a newer worker wrote it)

    @classmethod
    def _missing_(cls, value: object) -> EngineKind:
        return cls.UNKNOWN

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class DirectionStats:
    bytes_total: int
    busy_seconds_total: float
    transfers_ok: int
    transfers_failed: int
    duration_counts: tuple[int, ...]  # per bucket, last is +Inf
    size_counts: tuple[int, ...]


@dataclass(frozen=True)
class RankStatsSnapshot:
    rank: int
    pid: int
    pid_start_ns: int
    attach_count: int
    heartbeat_ns: int
    pin_state: PinState
    backends: tuple[BackendKind, BackendKind]  # indexed by Direction
    pinned_bytes: int
    pin_seconds: float
    prefault_seconds: float
    directions: tuple[DirectionStats, DirectionStats]  # indexed by Direction
    numa: NumaPlacement = field(default_factory=NumaPlacement)
    engine: EngineKind = EngineKind.WORKER
    engine_rank: int = 0
    engine_ranks: int = 0


class RankStats:
    """A view of one rank's stats block: ``snapshot()`` for readers, the rest for the writer."""

    def __init__(self, buffer: np.ndarray | bytearray | memoryview, offset: int, rank: int):
        self.rank = rank
        self._words = np.frombuffer(buffer, dtype="<u8", count=_WORDS, offset=offset)
        self._lock = threading.Lock()  # the writer's threads take turns; readers never lock

    # ---------------------------------------------------------------- reader side
    def snapshot(self) -> RankStatsSnapshot:
        deadline = time.monotonic() + _READ_TIMEOUT_S
        while True:
            before = int(self._words[_SEQ])
            if before % 2 == 0:
                words = self._words.copy()
                if int(self._words[_SEQ]) == before:
                    return self._decode(words)
            if time.monotonic() > deadline:
                raise StatsStuckError(f"rank {self.rank} stats block stayed mid-update "
                                      f"(seq {before})")
            time.sleep(0)

    def _decode(self, w: np.ndarray) -> RankStatsSnapshot:
        dirs = []
        for d in Direction:
            b = _DIR_BASE + d * DIRECTION_WORDS
            dirs.append(DirectionStats(
                bytes_total=int(w[b]), busy_seconds_total=int(w[b + 1]) / 1e9,
                transfers_ok=int(w[b + 2]), transfers_failed=int(w[b + 3]),
                duration_counts=tuple(int(x) for x in w[b + 4: b + 4 + _N_DUR]),
                size_counts=tuple(int(x) for x in w[b + 4 + _N_DUR: b + DIRECTION_WORDS]),
            ))
        return RankStatsSnapshot(
            rank=self.rank, pid=int(w[_PID]), pid_start_ns=int(w[_PID_START]),
            attach_count=int(w[_ATTACH]), heartbeat_ns=int(w[_HEARTBEAT]),
            pin_state=PinState(int(w[_PIN_STATE])),
            backends=(BackendKind(int(w[_BACKEND_G2C])), BackendKind(int(w[_BACKEND_C2G]))),
            pinned_bytes=int(w[_PINNED_BYTES]), pin_seconds=int(w[_PIN_NS]) / 1e9,
            prefault_seconds=int(w[_PREFAULT_NS]) / 1e9,
            directions=(dirs[0], dirs[1]), numa=self._decode_numa(w),
            engine=EngineKind(int(w[_ENGINE])), engine_rank=int(w[_ENGINE_RANK]),
            engine_ranks=int(w[_ENGINE_RANKS]),
        )

    @staticmethod
    def _decode_numa(w: np.ndarray) -> NumaPlacement:
        node = int(w[_NUMA_NODE])
        node = node - _INT64 if node >= _INT64 >> 1 else node
        try:
            state = NumaState(int(w[_NUMA_STATE]))
        except ValueError:  # a newer worker's state: not ours to name
            state = NumaState.NONE
        if state is NumaState.NONE:  # nothing recorded (or an older worker's zero words)
            return NumaPlacement()
        return NumaPlacement(state, node if node >= 0 else None, int(w[_NUMA_PAGES]),
                             int(w[_NUMA_LOCAL]), int(w[_NUMA_NS]) / 1e9)

    # ---------------------------------------------------------------- writer side
    def _update(self, sets: dict[int, int], adds: dict[int, int] | None = None) -> None:
        with self._lock:
            w = self._words
            if w[_SEQ] % 2:  # the previous writer of this rank died mid-update
                w[_SEQ] += 1
            w[_SEQ] += 1
            for index, value in sets.items():
                w[index] = value
            for index, value in (adds or {}).items():
                w[index] += value
            w[_HEARTBEAT] = time.time_ns()
            w[_SEQ] += 1

    def mark_attached(self, pid: int, pid_start_ns: int) -> None:
        self._update({_PID: pid, _PID_START: pid_start_ns, _PIN_STATE: PinState.NONE,
                      _PINNED_BYTES: 0, _PIN_NS: 0, _PREFAULT_NS: 0,
                      _ENGINE: EngineKind.WORKER, _ENGINE_RANK: 0, _ENGINE_RANKS: 0,
                      **self._numa_words(NumaPlacement())}, adds={_ATTACH: 1})

    def set_engine(self, engine: EngineKind, rank: int, ranks: int) -> None:
        """Name the attached process's engine and its rank there (status and metrics)."""
        self._update({_ENGINE: engine, _ENGINE_RANK: rank, _ENGINE_RANKS: ranks})

    def mark_detached(self) -> None:
        self._update({_PID: 0, _PID_START: 0, _PIN_STATE: PinState.NONE, _PINNED_BYTES: 0,
                      _BACKEND_G2C: BackendKind.NONE, _BACKEND_C2G: BackendKind.NONE})

    def set_pin(self, state: PinState, pinned_bytes: int = 0, seconds: float = 0.0) -> None:
        self._update({_PIN_STATE: state, _PINNED_BYTES: pinned_bytes, _PIN_NS: int(seconds * 1e9)})

    def set_prefault(self, seconds: float) -> None:
        self._update({_PREFAULT_NS: int(seconds * 1e9)})

    def set_numa(self, placement: NumaPlacement) -> None:
        """The slice's placement as this attachment found and left it (kept after detach:
        the pages stay where they are)."""
        self._update(self._numa_words(placement))

    @staticmethod
    def _numa_words(p: NumaPlacement) -> dict[int, int]:
        node = -1 if p.node is None else p.node
        return {_NUMA_STATE: p.state, _NUMA_NODE: node % _INT64, _NUMA_PAGES: p.slice_pages,
                _NUMA_LOCAL: p.local_pages, _NUMA_NS: int(p.seconds * 1e9)}

    def set_backend(self, direction: Direction, backend: BackendKind) -> None:
        self._update({_BACKEND_G2C if direction.stores else _BACKEND_C2G: backend})

    def record_transfer(self, direction: Direction, num_bytes: int, seconds: float,
                        success: bool) -> None:
        """Account one finished transfer (failed ones count only in transfers_failed)."""
        b = _DIR_BASE + direction * DIRECTION_WORDS
        if not success:
            self._update({}, adds={b + 3: 1})
            return
        dur = b + 4 + bisect.bisect_left(DURATION_BUCKETS_S, seconds)
        size = b + 4 + _N_DUR + bisect.bisect_left(SIZE_BUCKETS_BYTES, num_bytes)
        self._update({}, adds={b: num_bytes, b + 1: int(round(seconds * 1e9)), b + 2: 1,
                               dur: 1, size: 1})

    def release(self) -> None:
        """Drop the view so the underlying mmap can close."""
        self._words = None  # type: ignore[assignment]  # released: a later use fails loudly
