"""How ``staged`` lays one transfer out in its staging ring: pure numpy, no CUDA.

The host side of a plan (destinations of a store, sources of a load) is sorted and cut
into *runs*: maximal ranges of host bytes that descriptors cover back to back. Each run
gets a place in a *packed stream* whose bytes follow the run's host bytes exactly, so
one copy-engine DMA moves a whole run between staging and host memory and never
touches a host byte outside the plan (padding between pages stays untouched).
Every run starts at an address congruent to its host address modulo ``RUN_ALIGN``,
so packing keeps the plan's alignment (16-byte accesses stay 16-byte).

Chunk k holds the descriptors whose packed start lies in ``[k * chunk_bytes,
(k + 1) * chunk_bytes)``; descriptors are never split, so a slot is ``chunk_bytes``
plus the largest staged descriptor. Each chunk has its *pieces* (one per descriptor:
GPU page bytes <-> slot offset, the GPU-local pack/unpack) and its *DMAs* (the runs,
cut where a chunk starts: slot offset <-> host bytes, the copy-engine part)::

    packed:  |run 0 ..........|run 1 .......|pad|run 2 ...
    chunks:  |chunk 0 (pages starting here) |chunk 1 ...

Descriptors of at least ``direct_bytes`` are not staged at all: the copy engines move
such units at the PCIe ceiling by themselves (``direct``).

Cost matters here (it is host time before the first byte moves): a dozen numpy passes
over the descriptors; host order is restored with one sort of packed (address, index)
keys when the planner's order (tensor by tensor) is not host order already.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache.errors import BackendError

RUN_ALIGN = 256
_U64 = np.uint64
_EMPTY = np.zeros(0, dtype=_U64)


@dataclass(frozen=True, eq=False)
class Segments:
    """Copies between a slot and one side, grouped by chunk: entries
    ``first[k]:first[k+1]`` belong to chunk k; ``slot_offset`` is inside the slot."""

    address: np.ndarray  # uint64, GPU side (pieces) or host side (DMAs)
    slot_offset: np.ndarray  # uint64
    num_bytes: np.ndarray  # uint64
    first: np.ndarray  # int64, num_chunks + 1 boundaries

    def chunk(self, k: int) -> slice:
        return slice(int(self.first[k]), int(self.first[k + 1]))


@dataclass(frozen=True, eq=False)
class Direct:
    """Descriptors moved without staging (host and GPU ends, bytes)."""

    host: np.ndarray
    gpu: np.ndarray
    num_bytes: np.ndarray


@dataclass(frozen=True, eq=False)
class StagingLayout:
    chunk_bytes: int
    num_chunks: int
    num_runs: int
    pieces: Segments  # GPU page bytes <-> slot
    dmas: Segments  # slot <-> host run bytes
    direct: Direct
    piece_chunk: np.ndarray  # chunk of each piece (uint64)

    @property
    def max_slot_bytes(self) -> int:
        """Bytes a slot must hold (a chunk's last piece may run past ``chunk_bytes``)."""
        if self.pieces.num_bytes.size == 0:
            return 0
        ends = self.pieces.slot_offset + self.pieces.num_bytes
        return int(ends.max())


class Scratch:
    """Reusable arrays for ``plan_staging`` (one per backend, one transfer at a time).

    Fresh 128 KiB numpy arrays cost page faults on every call (16 k descriptors: most
    of a millisecond); these grow once and are reused. A layout built with a scratch is
    valid until the next call with the same scratch.
    """

    _NAMES_U64 = ("keys", "host", "gpu", "sizes", "end", "packed", "chunk", "offset", "index")
    _NAMES_BOOL = ("starts_run", "starts_seg")

    def __init__(self) -> None:
        self.capacity = 0
        self.arrays: dict[str, np.ndarray] = {}

    def take(self, n: int) -> dict[str, np.ndarray]:
        if n > self.capacity:
            self.capacity = max(n, 2 * self.capacity)
            self.arrays = {name: np.empty(self.capacity, dtype=_U64) for name in self._NAMES_U64}
            self.arrays.update({name: np.empty(self.capacity, dtype=bool)
                                for name in self._NAMES_BOOL})
            self.arrays["arange"] = np.arange(self.capacity, dtype=_U64)
        return {name: a[:n] for name, a in self.arrays.items()}


def _host_order(host: np.ndarray, work: dict[str, np.ndarray] | None = None
                ) -> np.ndarray | None:
    """Permutation (int64) to ascending host addresses; None when already ascending."""
    if host.size < 2 or bool(np.all(host[1:] > host[:-1])):
        return None
    low = host.min()
    index_bits = max(int(host.size - 1).bit_length(), 1)
    keys = np.subtract(host, low, out=None if work is None else work["keys"])
    granule = int(np.bitwise_or.reduce(keys)) or 1
    shift = (granule & -granule).bit_length() - 1  # common alignment of the offsets
    span = int(host.max() - low) >> shift
    if span.bit_length() + index_bits > 64:
        return np.argsort(host, kind="stable")
    np.right_shift(keys, _U64(shift), out=keys)
    np.left_shift(keys, _U64(index_bits), out=keys)
    np.bitwise_or(keys, np.arange(host.size, dtype=_U64) if work is None else work["arange"],
                  out=keys)
    keys.sort()  # one sort of packed keys: several times faster than argsort
    np.bitwise_and(keys, _U64((1 << index_bits) - 1), out=keys)
    return keys.view(np.int64)


def plan_staging(host: np.ndarray, gpu: np.ndarray, sizes: np.ndarray, chunk_bytes: int,
                 direct_bytes: int | None = None, scratch: Scratch | None = None
                 ) -> StagingLayout:
    """Lay a transfer out in chunks of ``chunk_bytes``.

    ``host[i]``/``gpu[i]`` are the two ends of descriptor i (whatever the direction),
    ``sizes[i]`` its bytes (uint64 arrays). Host ranges must not overlap.
    """
    if chunk_bytes < RUN_ALIGN or chunk_bytes % RUN_ALIGN:
        raise BackendError(f"chunk_bytes = {chunk_bytes}: must be a positive multiple of "
                           f"{RUN_ALIGN}")
    host, gpu, sizes = (np.asarray(a, dtype=_U64) for a in (host, gpu, sizes))
    direct = Direct(_EMPTY, _EMPTY, _EMPTY)
    if direct_bytes is not None and sizes.size and int(sizes.max()) >= direct_bytes:
        big = sizes >= direct_bytes
        direct = Direct(host[big], gpu[big], sizes[big])
        host, gpu, sizes = host[~big], gpu[~big], sizes[~big]
    if sizes.size == 0:
        empty = Segments(_EMPTY, _EMPTY, _EMPTY, np.zeros(1, np.int64))
        return StagingLayout(chunk_bytes, 0, 0, empty, empty, direct, _EMPTY)
    n = int(sizes.size)
    w = (scratch or Scratch()).take(n)
    order = _host_order(host, w)
    if order is not None:
        host = np.take(host, order, out=w["host"])
        gpu = np.take(gpu, order, out=w["gpu"])
        sizes = np.take(sizes, order, out=w["sizes"])
    end = np.add(host, sizes, out=w["end"])  # the plan's ranges never overlap (CopyPlan)
    starts_run = w["starts_run"]
    starts_run[0] = True
    np.not_equal(end[:-1], host[1:], out=starts_run[1:])

    packed = np.cumsum(sizes, out=w["packed"])
    np.subtract(packed, sizes, out=packed)  # exclusive: where each descriptor starts
    if (int(host[0]) | int(np.bitwise_or.reduce(sizes))) % RUN_ALIGN or \
            int(np.bitwise_or.reduce(host[starts_run])) % RUN_ALIGN:
        packed = _padded(host, sizes, starts_run)

    chunk_of = np.floor_divide(packed, _U64(chunk_bytes), out=w["chunk"])
    num_chunks = int(chunk_of[-1]) + 1
    first = np.searchsorted(chunk_of, np.arange(num_chunks + 1, dtype=_U64)).astype(np.int64)
    offset = np.multiply(chunk_of, _U64(chunk_bytes), out=w["offset"])
    np.subtract(packed, offset, out=offset)  # inside the chunk's slot
    pieces = Segments(gpu, offset, sizes, first)

    starts_seg = w["starts_seg"]
    np.copyto(starts_seg, starts_run)
    starts_seg[first[:-1]] = True
    seg = np.flatnonzero(starts_seg)
    dmas = Segments(host[seg], offset[seg], np.add.reduceat(sizes, seg),
                    np.searchsorted(seg, first).astype(np.int64))
    return StagingLayout(chunk_bytes, num_chunks, int(np.count_nonzero(starts_run)), pieces,
                         dmas, direct, chunk_of)


def _padded(host: np.ndarray, sizes: np.ndarray, starts_run: np.ndarray) -> np.ndarray:
    """Packed starts when runs need padding: each run begins at an offset congruent to
    its host address modulo RUN_ALIGN, so packing keeps the plan's alignment."""
    run_first = np.flatnonzero(starts_run)
    run_of = np.cumsum(starts_run) - 1
    run_host = host[run_first]
    run_bytes = np.add.reduceat(sizes, run_first)
    lead = run_host % _U64(RUN_ALIGN)
    alloc = (lead + run_bytes + _U64(RUN_ALIGN - 1)) // _U64(RUN_ALIGN) * _U64(RUN_ALIGN)
    run_packed = np.cumsum(alloc) - alloc + lead
    return run_packed[run_of] + (host - run_host[run_of])
