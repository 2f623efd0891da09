"""How ``staged`` lays one transfer out in its staging ring: pure numpy, no CUDA.

The host side of a plan (destinations of a store, sources of a load) is sorted and cut
into *runs*: maximal ranges of host bytes that descriptors cover back to back. Each run
gets a place in a *packed stream* whose bytes follow the run's host bytes exactly, so
one copy-engine DMA moves a whole run between staging and host memory and never
touches a host byte outside the plan (padding between pages stays untouched).
Every run starts at an address congruent to its host address modulo ``RUN_ALIGN``,
so packing keeps the plan's alignment (16-byte accesses stay 16-byte).

The packed stream is cut into chunks of ``chunk_bytes``; chunk k goes to one slot of
the ring. Descriptors and runs that cross a chunk boundary are split there, so each
chunk has its own *pieces* (GPU page bytes ↔ slot offset: the GPU-local pack/unpack)
and *DMAs* (slot offset ↔ host run bytes: the copy-engine part)::

    packed:  |run 0 ......|pad|run 1 .......|pad|run 2 ...
    chunks:  |chunk 0          |chunk 1          |chunk 2 ...
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache.errors import BackendError

RUN_ALIGN = 256


@dataclass(frozen=True, eq=False)
class Segments:
    """Copies between a slot and one side, grouped by chunk: entries
    ``first[k]:first[k+1]`` belong to chunk k; ``slot_offset`` is inside the slot."""

    address: np.ndarray  # uint64, on the GPU side (pieces) or the host side (DMAs)
    slot_offset: np.ndarray  # uint64
    num_bytes: np.ndarray  # uint64
    first: np.ndarray  # int64, num_chunks + 1 boundaries

    def chunk(self, k: int) -> slice:
        return slice(int(self.first[k]), int(self.first[k + 1]))


@dataclass(frozen=True, eq=False)
class StagingLayout:
    chunk_bytes: int
    num_chunks: int
    packed_bytes: int  # includes alignment padding between runs
    num_runs: int
    pieces: Segments  # GPU page bytes <-> slot
    dmas: Segments  # slot <-> host run bytes


def _split(start: np.ndarray, length: np.ndarray, chunk_bytes: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut ranges ``[start, start+length)`` of the packed stream at multiples of
    ``chunk_bytes``. Returns (range index, packed start, bytes, chunk) per piece."""
    first_chunk = start // chunk_bytes
    last_chunk = (start + length - 1) // chunk_bytes
    count = last_chunk - first_chunk + 1
    index = np.repeat(np.arange(start.size), count)
    # m-th piece of its range: position within the repeat group
    group_start = np.repeat(np.cumsum(count) - count, count)
    m = np.arange(index.size) - group_start
    chunk = first_chunk[index] + m
    piece_start = np.maximum(start[index], chunk * chunk_bytes)
    piece_end = np.minimum(start[index] + length[index], (chunk + 1) * chunk_bytes)
    return index, piece_start, piece_end - piece_start, chunk


def _boundaries(chunk: np.ndarray, num_chunks: int) -> np.ndarray:
    return np.searchsorted(chunk, np.arange(num_chunks + 1), side="left").astype(np.int64)


def plan_staging(host: np.ndarray, gpu: np.ndarray, sizes: np.ndarray, chunk_bytes: int
                 ) -> StagingLayout:
    """Lay a transfer out in chunks of ``chunk_bytes``.

    ``host[i]``/``gpu[i]`` are the two ends of descriptor i (whatever the direction),
    ``sizes[i]`` its bytes. Descriptors must not overlap on the host side.
    """
    if chunk_bytes < RUN_ALIGN or chunk_bytes % RUN_ALIGN:
        raise BackendError(f"chunk_bytes = {chunk_bytes}: must be a positive multiple of "
                           f"{RUN_ALIGN}")
    host = np.asarray(host, dtype=np.uint64).astype(np.int64)
    gpu = np.asarray(gpu, dtype=np.uint64).astype(np.int64)
    sizes = np.asarray(sizes, dtype=np.uint64).astype(np.int64)
    if sizes.size == 0:
        empty = Segments(*(np.zeros(0, np.uint64) for _ in range(3)), np.zeros(1, np.int64))
        return StagingLayout(chunk_bytes, 0, 0, 0, empty, empty)
    if int(sizes.min()) <= 0:
        raise BackendError(f"descriptor sizes must be > 0, got {int(sizes.min())}")
    if not bool(np.all(host[1:] > host[:-1])):  # planners usually emit host order already
        order = np.argsort(host, kind="stable")
        host, gpu, sizes = host[order], gpu[order], sizes[order]
    end = host + sizes
    if bool(np.any(end[:-1] > host[1:])):
        i = int(np.flatnonzero(end[:-1] > host[1:])[0])
        raise BackendError(f"host ranges overlap: {host[i]:#x}+{sizes[i]} and {host[i + 1]:#x}")

    # runs: a new one wherever the previous descriptor does not end where this one starts
    starts_run = np.ones(host.size, dtype=bool)
    starts_run[1:] = end[:-1] != host[1:]
    run_first = np.flatnonzero(starts_run)
    run_host = host[run_first]
    run_bytes = np.add.reduceat(sizes, run_first)
    run_of = np.cumsum(starts_run) - 1

    # each run: an aligned allocation, started at its host address modulo RUN_ALIGN
    lead = run_host % RUN_ALIGN
    alloc = -(-(lead + run_bytes) // RUN_ALIGN) * RUN_ALIGN
    run_packed = np.cumsum(alloc) - alloc + lead
    packed_bytes = int(alloc.sum())
    num_chunks = -(-packed_bytes // chunk_bytes)

    desc_packed = run_packed[run_of] + (host - run_host[run_of])
    i, p_start, p_bytes, p_chunk = _split(desc_packed, sizes, chunk_bytes)
    pieces = Segments(
        address=(gpu[i] + (p_start - desc_packed[i])).astype(np.uint64),
        slot_offset=(p_start - p_chunk * chunk_bytes).astype(np.uint64),
        num_bytes=p_bytes.astype(np.uint64),
        first=_boundaries(p_chunk, num_chunks),
    )
    r, d_start, d_bytes, d_chunk = _split(run_packed, run_bytes, chunk_bytes)
    dmas = Segments(
        address=(run_host[r] + (d_start - run_packed[r])).astype(np.uint64),
        slot_offset=(d_start - d_chunk * chunk_bytes).astype(np.uint64),
        num_bytes=d_bytes.astype(np.uint64),
        first=_boundaries(d_chunk, num_chunks),
    )
    return StagingLayout(chunk_bytes, num_chunks, packed_bytes, int(run_first.size), pieces, dmas)
