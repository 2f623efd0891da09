"""Host memory preparation: space checks, fallocate, parallel pre-fault, process identity.

Both long steps go in pieces (``FALLOCATE_PIECE_BYTES``, ``PREFAULT_PIECE_BYTES``) and
tell a ``tiercache.region.progress.Progress`` after each, so a large region's start-up
reports GiB done, rate and ETA while it runs; a piece is small enough to take well under the
progress interval at the slowest rates measured (docs/benchmarks.md, "Region set-up and
pinning"), and large enough that the extra calls cost nothing measurable.

Pre-faulting runs ``madvise(MADV_POPULATE_WRITE)`` through ctypes (which releases the
GIL, so threads over disjoint ranges really run in parallel); on kernels without it
(EINVAL) it touches one byte per page instead, preserving the bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil

from tiercache.sizes import format_bytes
from tiercache.errors import InsufficientMemoryError, RegionError
from tiercache.region.progress import Progress
from tiercache.region.layout import OS_PAGE  # touching every 4 KiB touches every page

log = logging.getLogger(__name__)

# the region must outlive the coordinator's container (a restart re-adopts it warm): the
# host's /dev/shm, never a per-pod tmpfs (docs/deploy.md)
SHM_ADVICE = ("the host's /dev/shm tmpfs (mount -o remount,size=... /dev/shm; in Kubernetes "
              "mount the host's /dev/shm into the pod as a hostPath and size the host's "
              "tmpfs, not an emptyDir, which dies with the pod; in Docker --ipc=host or a "
              "bind mount of the host's /dev/shm)")
FALLOCATE_PIECE_BYTES = 1 << 30
PREFAULT_PIECE_BYTES = 256 << 20  # a multiple of OS_PAGE: pieces stay page-aligned

MADV_POPULATE_WRITE = 23  # linux >= 5.14; Python < 3.13 lacks the constant
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def shm_free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_space(num_bytes: int, directory: str, check_host_memory: bool) -> None:
    """Refuse, naming both numbers, when /dev/shm or host memory is too small."""
    free = shm_free_bytes(directory)
    if num_bytes > free:
        raise InsufficientMemoryError(
            f"{directory} has {format_bytes(free)} ({free} bytes) free; the region needs "
            f"{format_bytes(num_bytes)} ({num_bytes} bytes). Shrink region.capacity or grow "
            f"{SHM_ADVICE}"
        )
    if check_host_memory:
        available = psutil.virtual_memory().available
        if num_bytes > available:
            raise InsufficientMemoryError(
                f"host memory has {format_bytes(available)} ({available} bytes) available; the "
                f"region needs {format_bytes(num_bytes)} ({num_bytes} bytes). Shrink "
                "region.capacity (or set region.check_host_memory = false on hosts whose "
                "memory grows on use)"
            )


def fallocate(fd: int, num_bytes: int, path: str, progress: Progress | None = None,
              piece_bytes: int = FALLOCATE_PIECE_BYTES, offset: int = 0) -> None:
    """Back ``[offset, offset + num_bytes)`` of the file now, so a later overflow of tmpfs
    is an error here, not a SIGBUS; ``piece_bytes`` at a time, each told to ``progress``.
    A failed call leaves the pieces before it reserved (tmpfs undoes the failed piece)."""
    end = offset + num_bytes
    try:
        for start in range(offset, end, piece_bytes):
            length = min(piece_bytes, end - start)
            os.posix_fallocate(fd, start, length)
            if progress is not None:
                progress.advance(length)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise InsufficientMemoryError(
                f"cannot allocate {format_bytes(num_bytes)} ({num_bytes} bytes) at offset "
                f"{offset} of {path}: {os.strerror(e.errno)}; "
                f"{format_bytes(shm_free_bytes(os.path.dirname(path)))} free there now"
            ) from e
        raise RegionError(f"posix_fallocate({path}, {offset}, {num_bytes}) failed: {e}") from e


def _populate(address: int, length: int, view: np.ndarray, offset: int) -> None:
    if _libc.madvise(address + offset, length, MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.ENOMEM, errno.EFAULT):  # what would have been a SIGBUS on first touch
        raise InsufficientMemoryError(
            f"cannot populate {length} bytes at offset {offset} of the region: "
            f"{os.strerror(err)} (/dev/shm or host memory ran out)")
    if err != errno.EINVAL:
        raise RegionError(f"madvise(MADV_POPULATE_WRITE) over {length} bytes at offset {offset} "
                          f"failed: {os.strerror(err)}")
    view[offset:offset + length:OS_PAGE] |= 0  # kernel < 5.14: touch a byte per page


def prefault(address: int, view: np.ndarray, ranges: list[tuple[int, int]], num_threads: int,
             progress: Progress | None = None, piece_bytes: int = PREFAULT_PIECE_BYTES
             ) -> float:
    """Pre-fault disjoint, page-aligned (offset, length) ranges in parallel (a thread per
    range, ``piece_bytes`` at a time, each piece told to ``progress``); returns seconds."""
    def populate(offset: int, length: int) -> None:
        for piece in range(offset, offset + length, piece_bytes):
            n = min(piece_bytes, offset + length - piece)
            _populate(address, n, view, piece)
            if progress is not None:
                progress.advance(n)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="prefault") as pool:
        for future in [pool.submit(populate, off, n) for off, n in ranges]:
            future.result()
    return time.perf_counter() - start


_NS_PER_TICK = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in ns after boot) from /proc/<pid>/stat, None if gone.

    The start time is counted in clock ticks since boot by the kernel, so it is exact and
    does not move when the wall clock is stepped (psutil's create_time does)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # comm may hold spaces and parentheses
    return fields[0].decode(), int(fields[19]) * _NS_PER_TICK


def process_start_ns(pid: int) -> int:
    """Start time of ``pid`` in ns after boot, 0 if it does not exist."""
    stat = _proc_stat(pid)
    return 0 if stat is None else stat[1]


def process_alive(pid: int, start_ns: int) -> bool:
    """True if ``pid`` runs, is not a zombie and (when ``start_ns`` is given) is the same
    process that started at ``start_ns``, not a later one that reuses the pid."""
    stat = _proc_stat(pid) if pid > 0 else None
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return start_ns == 0 or stat[1] == start_ns
