"""``HostCopyPool``: native multi-threaded memcpy for host-to-host transfers.

What moves bytes between an engine's host memory (SGLang's host KV pool) and the region's
rows when neither side is a GPU: ``tiercache/native/src/host_copy.c``, compiled into the
one native library with the rest of ``src/`` (``tiercache.native.build``; its ``hc_*``
functions are its own) and bound with ctypes. One call copies a whole transfer
(every piece of every page): the pieces are one byte stream cut into equal shares, the
calling thread copies one and the pool's threads the others. The call runs without the
GIL, so the engine's other threads go on meanwhile; calls on one pool are serialised (a
pool per direction lets a load pass a store).

Why native threads and not per-page Python or torch copies: one ``ctypes.memmove`` per
piece holds the GIL between pieces and runs on one core; a single memcpy stream of one
core reaches a fraction of the memory bandwidth (docs/benchmarks.md, "SGLang backend":
the ceiling is this same pool over one contiguous buffer). Small copies use fewer workers
(``min_share_bytes`` per worker): waking a thread costs more than copying a few KiB.

Torch-free; the pieces are numpy arrays of addresses that the caller vouches for (this
module only refuses what it can see: arrays of other shapes or types, a null address
with bytes to copy). Which addresses are right — region rows of the slots a fenced spec
names, pages of the engine's pool — is ``tiercache.transfer.host_transfer``'s business.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from tiercache.errors import ArgumentError, BackendError
from tiercache.native.build import build

MAX_THREADS = 256  # HC_MAX_THREADS
DEFAULT_MIN_SHARE_BYTES = 256 << 10  # below this per worker, fewer workers
_CODES = {1: "a negative piece count", 2: "a null address with bytes to copy",
          3: "no memory for the prefix table"}
_vp = ctypes.c_void_p
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def _bind() -> ctypes.CDLL:
    global _library
    with _lock:
        if _library is None:
            lib = ctypes.CDLL(str(build()))  # CDLL: the GIL is released in every call
            lib.hc_open.argtypes = [ctypes.c_int32]
            lib.hc_open.restype = _vp
            lib.hc_num_threads.argtypes = [_vp]
            lib.hc_num_threads.restype = ctypes.c_int32
            lib.hc_copy.argtypes = [_vp, ctypes.c_int64, _vp, _vp, _vp, ctypes.c_uint64]
            lib.hc_copy.restype = ctypes.c_int
            lib.hc_close.argtypes = [_vp]
            lib.hc_close.restype = None
            _library = lib
        return _library


def default_threads() -> int:
    """Threads besides the caller: the cores this process may run on, up to 8, minus the
    caller (memcpy bandwidth of one socket flattens out by then)."""
    return max(0, min(len(os.sched_getaffinity(0)), 8) - 1)


def _pieces(name: str, array: np.ndarray, n: int) -> np.ndarray:
    if not isinstance(array, np.ndarray) or array.dtype != np.uint64 or array.ndim != 1 \
            or array.size != n or not array.flags.c_contiguous:
        got = (f"{array.dtype} of shape {array.shape}" if isinstance(array, np.ndarray)
               else type(array).__name__)
        raise ArgumentError(f"host copy: {name} must be a contiguous 1-d uint64 array of "
                            f"{n} entries (one per piece); got {got}")
    return array


class HostCopyPool:
    """``num_threads`` copy threads besides the caller (default ``default_threads()``).
    ``copy`` may be called from any thread; calls run one at a time. ``close`` joins the
    threads (a call in progress finishes first)."""

    def __init__(self, num_threads: int | None = None,
                 min_share_bytes: int = DEFAULT_MIN_SHARE_BYTES):
        threads = default_threads() if num_threads is None else num_threads
        if isinstance(threads, bool) or not isinstance(threads, int) \
                or not 0 <= threads <= MAX_THREADS:
            raise ArgumentError(f"host copy threads = {num_threads!r}: allowed 0..{MAX_THREADS}")
        if isinstance(min_share_bytes, bool) or not isinstance(min_share_bytes, int) \
                or min_share_bytes < 1:
            raise ArgumentError(f"min_share_bytes = {min_share_bytes!r}: must be >= 1")
        self._lib = _bind()
        handle = self._lib.hc_open(threads)
        if not handle:
            raise BackendError(f"host copy: could not start {threads} copy thread(s)")
        self._handle: int | None = handle
        self._use = threading.Lock()  # a call and close never overlap (close frees the pool)
        self.min_share_bytes = min_share_bytes
        self.num_threads = int(self._lib.hc_num_threads(handle))

    def copy(self, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> int:
        """``dst[i] <- src[i]`` for ``lengths[i]`` bytes each; returns the bytes copied.
        Addresses are the caller's to vouch for (mapped, not overlapping)."""
        n = int(lengths.size) if isinstance(lengths, np.ndarray) else -1
        lengths = _pieces("lengths", lengths, n)
        dst, src = _pieces("dst", dst, n), _pieces("src", src, n)
        with self._use:
            if self._handle is None:
                raise BackendError("host copy: the pool is closed")
            code = self._lib.hc_copy(self._handle, n, dst.ctypes.data, src.ctypes.data,
                                     lengths.ctypes.data, self.min_share_bytes)
        if code:
            raise ArgumentError(f"host copy refused {n} piece(s): {_CODES.get(code, code)}")
        return int(lengths.sum())

    def close(self) -> None:
        with self._use:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.hc_close(handle)

    def __enter__(self) -> HostCopyPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
