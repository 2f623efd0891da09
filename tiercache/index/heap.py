"""The C heap under the index: what the index frees in bulk goes back to the system."""

from __future__ import annotations

import ctypes


def give_back_freed_heap() -> None:
    """Return the C heap's free pages to the system, after the index freed much at once.
    glibc keeps freed memory in the middle of the heap unless asked, and a table freed
    below its mmap threshold (which rises to the size of each mapped block freed, up to
    32 MiB) is such memory. A recovery frees about as much as it keeps (each chunk's
    arrays, the dict's outgrown tables, the recovery's arrays): 32 B a slot of RssAnon
    after recovering 2 M READY records (201 -> 169 B a slot); a rebuild of ``slot_of``
    frees the old table (21 MB at 0.5 M keys: 42 MiB of RssAnon kept after 0.5 M churned
    stores in-process, 1 MiB once trimmed; docs/benchmarks.md). Without glibc, nothing
    to do."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc
        return
    trim(0)
