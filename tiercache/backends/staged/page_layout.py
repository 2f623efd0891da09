"""How ``staged`` lays one transfer out in its staging ring: pure numpy, no CUDA.

The host side of a plan (destinations of a store, sources of a load) is cut into
*runs*: maximal ranges of host bytes that neighbouring descriptors cover back to back.
Descriptors are placed one after another in a *packed stream* in plan order, so each
run's bytes follow its host bytes exactly: one copy-engine DMA moves a whole run between
staging and host memory and never touches a host byte outside the plan (padding between
pages stays untouched). Every run starts at an address congruent to its host address
modulo ``RUN_ALIGN``, so packing keeps the plan's alignment (16-byte accesses stay 16-byte).

Runs are only as long as the plan's order lets them be: the planner emits host order
(``tiercache.planning.page_groups``), and a plan that is not in ascending host order is sorted
first (one sort of packed (address, index) keys; ~0.1-0.3 ms for 16 k descriptors).

Chunk k holds the descriptors whose packed start lies in ``[k * chunk_bytes,
(k + 1) * chunk_bytes)`` (empty windows dropped); descriptors are never split, so a
slot is ``chunk_bytes`` plus the largest staged descriptor. Per chunk there are
*pieces* (one per descriptor: GPU page bytes <-> slot, the GPU-local pack/unpack) and
*DMAs* (the runs, cut where a chunk starts: slot <-> host bytes, the copy-engine part)::

    packed:  |run 0 ..........|run 1 .......|pad|run 2 ...
    chunks:  |chunk 0 (pages starting here) |chunk 1 ...

A piece's place in its slot is ``packed[i] - chunk_start[k]``: the pack kernel adds one
per-chunk shift instead of the host computing a slot address per descriptor.
Descriptors of at least ``direct_bytes`` are not staged at all: the copy engines move
such units at the PCIe ceiling by themselves (``direct``).

Cost matters here (it is host time before the first byte moves): on a plan already in
host order this is ~10 numpy passes over the descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache.errors import BackendError

RUN_ALIGN = 256
_U64 = np.uint64
_EMPTY = np.zeros(0, dtype=_U64)


@dataclass(frozen=True, eq=False)
class Pieces:
    """The GPU-local half: descriptor i moves ``num_bytes[i]`` between GPU address
    ``gpu[i]`` and offset ``packed[i] - chunk_start[k]`` of chunk k's slot, for i in
    ``first[k]:first[k+1]``."""

    gpu: np.ndarray  # uint64
    packed: np.ndarray  # uint64, ascending
    num_bytes: np.ndarray  # uint64
    first: np.ndarray  # int64, num_chunks + 1 boundaries
    chunk_start: np.ndarray  # uint64, packed offset where each chunk's slot begins

    def chunk(self, k: int) -> slice:
        return slice(int(self.first[k]), int(self.first[k + 1]))

    def slot_offset(self, k: int) -> np.ndarray:
        """Offsets inside chunk k's slot of its pieces (what the pack kernel computes)."""
        return self.packed[self.chunk(k)] - self.chunk_start[k]


@dataclass(frozen=True, eq=False)
class Segments:
    """The copy-engine half: ``num_bytes[j]`` between host ``address[j]`` and offset
    ``slot_offset[j]`` of its chunk's slot; entries ``first[k]:first[k+1]`` are chunk k's."""

    address: np.ndarray  # uint64
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
    num_runs: int
    pieces: Pieces  # GPU page bytes <-> slot
    dmas: Segments  # slot <-> host run bytes
    direct: Direct

    @property
    def num_chunks(self) -> int:
        return int(self.pieces.first.size) - 1

    @property
    def max_slot_bytes(self) -> int:
        """Bytes a slot must hold (a chunk's last piece may run past ``chunk_bytes``)."""
        p = self.pieces
        if self.num_chunks == 0:
            return 0
        last = p.first[1:] - 1  # packed is ascending without overlap: the last piece ends last
        return int((p.packed[last] + p.num_bytes[last] - p.chunk_start).max())


class Scratch:
    """Reusable arrays for ``plan_staging`` (one per backend, one transfer at a time).

    Fresh 128 KiB numpy arrays cost page faults on every call (16 k descriptors: most
    of a millisecond); these grow once and are reused. A layout built with a scratch is
    valid until the next call with the same scratch.
    """

    _NAMES_U64 = ("keys", "host", "gpu", "sizes", "end", "packed")
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


def _empty_layout(chunk_bytes: int, direct: Direct) -> StagingLayout:
    none = np.zeros(1, np.int64)
    return StagingLayout(chunk_bytes, 0, Pieces(_EMPTY, _EMPTY, _EMPTY, none, _EMPTY),
                         Segments(_EMPTY, _EMPTY, _EMPTY, none), direct)


def plan_staging(host: np.ndarray, gpu: np.ndarray, sizes: np.ndarray, chunk_bytes: int,
                 direct_bytes: int | None = None, scratch: Scratch | None = None
                 ) -> StagingLayout:
    """Lay a transfer out in chunks of ``chunk_bytes``.

    ``host[i]``/``gpu[i]`` are the two ends of descriptor i (whatever the direction),
    ``sizes[i]`` its bytes (uint64 arrays). Host ranges a store writes must not overlap.
    """
    if chunk_bytes < RUN_ALIGN or chunk_bytes % RUN_ALIGN:
        raise BackendError(f"chunk_bytes = {chunk_bytes}: must be a positive multiple of "
                           f"{RUN_ALIGN}")
    host, gpu, sizes = (np.asarray(a, dtype=_U64) for a in (host, gpu, sizes))
    host, gpu, sizes, direct = _split_direct(host, gpu, sizes, direct_bytes)
    if sizes.size == 0:
        return _empty_layout(chunk_bytes, direct)
    w = (scratch or Scratch()).take(int(sizes.size))
    order = _host_order(host, w)
    if order is not None:
        host = np.take(host, order, out=w["host"])
        gpu = np.take(gpu, order, out=w["gpu"])
        sizes = np.take(sizes, order, out=w["sizes"])
    starts_run = w["starts_run"]  # descriptor i begins a run: its host bytes follow no one's
    starts_run[0] = True
    np.not_equal(np.add(host, sizes, out=w["end"])[:-1], host[1:], out=starts_run[1:])
    packed = _packed_starts(host, sizes, starts_run, w["packed"])
    windows = int(packed[-1]) // chunk_bytes + 1
    first = np.unique(np.searchsorted(packed, np.arange(windows + 1, dtype=_U64)
                                      * _U64(chunk_bytes)).astype(np.int64))
    pieces = Pieces(gpu, packed, sizes, first, packed[first[:-1]])
    return StagingLayout(chunk_bytes, int(np.count_nonzero(starts_run)), pieces,
                         _dma_segments(host, pieces, starts_run, w["starts_seg"]), direct)


def _split_direct(host: np.ndarray, gpu: np.ndarray, sizes: np.ndarray,
                  direct_bytes: int | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Direct]:
    """The descriptors to stage, and those of ``direct_bytes`` or more (moved unstaged)."""
    if direct_bytes is None or not sizes.size or int(sizes.max()) < direct_bytes:
        return host, gpu, sizes, Direct(_EMPTY, _EMPTY, _EMPTY)
    big = sizes >= direct_bytes
    return host[~big], gpu[~big], sizes[~big], Direct(host[big], gpu[big], sizes[big])


def _packed_starts(host: np.ndarray, sizes: np.ndarray, starts_run: np.ndarray,
                   out: np.ndarray) -> np.ndarray:
    """Where each descriptor starts in the packed stream: back to back (an exclusive
    prefix sum), unless runs need padding to keep their host alignment (``_padded``)."""
    out[0] = 0
    np.cumsum(sizes[:-1], out=out[1:])
    size_bits = int(np.bitwise_or.reduce(sizes))
    if (size_bits | int(np.bitwise_or.reduce(host))) % RUN_ALIGN and \
            (size_bits | int(np.bitwise_or.reduce(host[starts_run]))) % RUN_ALIGN:
        return _padded(host, sizes, starts_run)
    return out


def _dma_segments(host: np.ndarray, pieces: Pieces, starts_run: np.ndarray,
                  starts_seg: np.ndarray) -> Segments:
    """One DMA per run, cut where a chunk begins."""
    packed, sizes, first = pieces.packed, pieces.num_bytes, pieces.first
    np.copyto(starts_seg, starts_run)
    starts_seg[first[:-1]] = True
    seg = np.flatnonzero(starts_seg)
    last = np.empty_like(seg)
    last[:-1] = seg[1:] - 1
    last[-1] = sizes.size - 1
    seg_first = np.searchsorted(seg, first).astype(np.int64)
    seg_chunk_start = np.repeat(pieces.chunk_start, np.diff(seg_first))
    return Segments(host[seg], packed[seg] - seg_chunk_start,
                    packed[last] + sizes[last] - packed[seg], seg_first)


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
