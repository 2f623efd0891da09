"""The C heap under the index: what the index frees in bulk goes back to the system."""

from __future__ import annotations

import ctypes
from functools import cache

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MAPPED_BLOCK_BYTES = 1 << 20  # blocks of at least this size are mappings of their own


@cache
def _libc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def map_large_blocks() -> None:
    """Make every C block of ``MAPPED_BLOCK_BYTES`` or more a mapping of its own, in every
    thread, so that freeing one (a rebuilt ``slot_of``'s old table, a recovery's arrays)
    returns it to the system at once.

    By default glibc raises its mmap threshold to the size of each mapped block freed (up
    to 32 MiB), after which such blocks come from the heap of the allocating thread; the
    index runs on the control server's thread, whose heap is a glibc arena of its own, and
    ``malloc_trim`` never shrinks the top of a thread's arena (only the main arena's). In
    ``tiercache serve`` at 0.5 M slots the first rebuild freed the filled table (a 21 MB
    mapping), which raised the threshold to its size; every later copy then came from
    the thread's arena, the one freed last lay on that arena's top, and 16 MiB stayed
    resident after 0.5 M churned stores: 212 B a slot instead of the filled index's 182
    (docs/benchmarks.md, "Rebuilding the key dict after churn").
    Setting the threshold fixes it for the process (glibc then stops raising it, and the
    trim threshold, as blocks are freed): 1 MiB keeps a request's buffers (a 4,096-key
    call: 128 KiB of keys) in the heap. Idempotent; without glibc, nothing to do."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MAPPED_BLOCK_BYTES)


def give_back_freed_heap() -> None:
    """Return the C heap's free pages to the system, after the index freed much at once.
    glibc keeps freed memory in the middle of the heap unless asked. A recovery frees about
    as much as it keeps (each chunk's arrays, the dict's outgrown tables, the recovery's
    arrays): 32 B a slot of RssAnon after recovering 2 M READY records (201 -> 169 B a
    slot); a rebuild of ``slot_of`` frees the old table (21 MB at 0.5 M keys: 42 MiB of
    RssAnon kept after 0.5 M churned stores in-process, 1 MiB once trimmed;
    docs/benchmarks.md). Blocks of ``MAPPED_BLOCK_BYTES`` or more are mappings once
    ``map_large_blocks`` ran, and go back when freed; this returns the smaller ones.
    Without glibc, nothing to do."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
