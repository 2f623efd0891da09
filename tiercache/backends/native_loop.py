"""The staged chunk loop in native code, on a thread of its own (``native/chunk_loop.c``).

Why: a staged transfer of 256 blocks is 16 chunks, and each chunk costs a kernel launch,
a ``cuMemcpyBatchAsync`` and four event calls. Issued from Python on the engine's thread
that was ~35-50 µs a chunk, 0.6-0.8 ms a transfer (docs/benchmarks.md, "Host path"). A
Python thread cannot take it over: under the GIL it waits a switch interval per step
while the engine's thread runs Python. A native thread needs no GIL: the engine's
thread lays the transfer out and hands it over in one call, and the loop issues the
chunks while the first DMA already runs.

This module is torch-free: it builds the C file with the system's C compiler (``$CC``,
else ``cc``) into a per-user cache, once per source version, and binds it with ctypes.
The loop takes the driver's entry points as function pointers, so tests drive it with
recording functions where no GPU exists. A missing compiler or a failed build is a
``BackendError`` naming the compiler's message; nothing falls back quietly.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.errors import BackendError

SOURCE = Path(__file__).with_name("native") / "chunk_loop.c"
MAX_SLOTS = 64
MAX_PARAMS = 16
KERNEL_ARGS = 9  # pairs, pair_stride, first, count, slot_base, tensors, tensor_stride,
#                  groups, num_groups: the first parameters of block_kernel's kernel
STATUS_PENDING = -1

_vp = ctypes.c_void_p
_i64p = ctypes.POINTER(ctypes.c_int64)
_u64p = ctypes.POINTER(ctypes.c_uint64)


class LoopConfig(ctypes.Structure):
    """``tc_config``: one backend's constant part (ring, events, kernels, driver)."""

    _fields_ = [
        ("launch", _vp), ("record", _vp), ("wait", _vp), ("batch", _vp), ("ctx_set", _vp),
        ("batch_abi", ctypes.c_int32), ("num_slots", ctypes.c_int32),
        ("ctx", _vp), ("dma_stream", _vp),
        ("ring_base", ctypes.c_uint64), ("slot_bytes", ctypes.c_uint64),
        ("free_ev", _vp * MAX_SLOTS), ("ready_ev", _vp * MAX_SLOTS),
        ("begin_ev", _vp), ("done_ev", _vp),
        ("function", _vp * 2),
        ("block_x", ctypes.c_uint32), ("shared", ctypes.c_uint32 * 2),
        ("grid_y", ctypes.c_uint32), ("max_grid_x", ctypes.c_uint32),
        ("num_params", ctypes.c_int32),
        ("static_args", ctypes.c_uint64 * 4),
        ("attrs", (ctypes.c_uint8 * 24) * 2),
    ]


class LoopJob(ctypes.Structure):
    """``tc_job``: one transfer (its arrays must live until it is issued)."""

    _fields_ = [
        ("stream", _vp), ("prev_end", _vp), ("start_ev", _vp), ("end_ev", _vp),
        ("table_ev", _vp),
        ("store", ctypes.c_int32), ("num_chunks", ctypes.c_int32), ("cursor", ctypes.c_int32),
        ("num_pairs", ctypes.c_int32),
        ("pairs", ctypes.c_uint64),
        ("pair_first", _vp), ("dma_host", _vp), ("dma_slot", _vp), ("dma_bytes", _vp),
        ("dma_first", _vp), ("stage", _vp), ("status", _vp),
    ]


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def cache_dir() -> Path:
    """Where built libraries live: ``$TIERCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``tiercache/native``."""
    root = os.environ.get("TIERCACHE_CACHE_DIR")
    if root:
        return Path(root) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiercache" / "native"


def build(source: Path = SOURCE, directory: Path | None = None) -> Path:
    """The shared library of ``source``, compiled once per content (atomic rename, so
    concurrent builders never see half a file)."""
    text = source.read_bytes()
    directory = directory or cache_dir()
    target = directory / f"{source.stem}-{hashlib.sha256(text).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise BackendError(f"the staged backend's chunk loop needs a C compiler: {compiler!r} "
                           "not found (install gcc, or set CC)")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", "-o", tmp,
                               str(source)], capture_output=True, text=True)
        if done.returncode:
            raise BackendError(f"building {source.name} with {compiler} failed "
                               f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL:
    """The built loop library, bound once per process."""
    global _library
    with _lock:
        if _library is None:
            lib = ctypes.CDLL(str(build()))
            lib.tc_open.argtypes = [ctypes.POINTER(LoopConfig)]
            lib.tc_open.restype = _vp
            lib.tc_submit.argtypes = [_vp, ctypes.POINTER(LoopJob)]
            lib.tc_submit.restype = ctypes.c_uint64
            lib.tc_wait.argtypes = [_vp, ctypes.c_uint64]
            lib.tc_wait.restype = None
            lib.tc_issued.argtypes = [_vp]
            lib.tc_issued.restype = ctypes.c_uint64
            lib.tc_close.argtypes = [_vp]
            lib.tc_close.restype = None
            _library = lib
        return _library


class Ticket:
    """One submitted job: ``issued()`` once the loop has enqueued all of it (its events
    mean something only then), ``status`` the first failing CUresult (0: none)."""

    __slots__ = ("_loop", "seq", "_status", "_keep")

    def __init__(self, loop: ChunkLoop, seq: int, status: ctypes.c_int32, keep: Any):
        self._loop, self.seq, self._status, self._keep = loop, seq, status, keep

    def issued(self) -> bool:
        return self._status.value != STATUS_PENDING

    def wait(self) -> None:
        if not self.issued():
            self._loop.wait(self.seq)

    @property
    def status(self) -> int:
        """The job's CUresult once issued (STATUS_PENDING before)."""
        return self._status.value


@dataclass(frozen=True)
class LoopKernel:
    """How the loop launches the pack / unpack kernel: CUfunction handles ([0] unpack,
    [1] pack), threads per program, shared bytes ([0], [1]), the grid's second dimension,
    the first dimension's bound (0: one program per pair), the kernel's parameter count
    (the first ``KERNEL_ARGS`` are the loop's, the rest are passed as zero) and its four
    static arguments (tensor table, its stride, group table, group count)."""

    functions: tuple[int, int]
    block_x: int
    shared: tuple[int, int]
    grid_y: int
    max_grid_x: int
    num_params: int
    static_args: tuple[int, int, int, int]


@dataclass(frozen=True)
class LoopDriver:
    """Driver entry points as C function addresses (``cuLaunchKernel``, ``cuEventRecord``,
    ``cuStreamWaitEvent``, ``cuMemcpyBatchAsync`` of ``batch_abi``, ``cuCtxSetCurrent``)
    and the context to make current on the loop's thread (0: none)."""

    launch: int
    record: int
    wait: int
    batch: int
    ctx_set: int
    batch_abi: int
    ctx: int


class ChunkLoop:
    """One backend's loop thread (``close`` issues what is queued, then stops it)."""

    def __init__(self, driver: LoopDriver, kernel: LoopKernel, *, dma_stream: int,
                 ring_base: int, slot_bytes: int, free_events: list[int],
                 ready_events: list[int], begin_event: int, done_event: int,
                 attrs: tuple[bytes, bytes]):
        n = len(free_events)
        if not 1 <= n <= MAX_SLOTS or len(ready_events) != n:
            raise BackendError(f"{n} ring slots ({len(ready_events)} ready events): need "
                               f"1..{MAX_SLOTS}, one event of each kind per slot")
        if not KERNEL_ARGS <= kernel.num_params <= MAX_PARAMS:
            raise BackendError(f"a pack kernel of {kernel.num_params} parameters: the loop "
                               f"passes {KERNEL_ARGS}..{MAX_PARAMS}")
        c = LoopConfig()
        c.launch, c.record, c.wait = driver.launch, driver.record, driver.wait
        c.batch, c.ctx_set, c.batch_abi, c.ctx = driver.batch, driver.ctx_set, \
            driver.batch_abi, driver.ctx or None
        c.num_slots, c.dma_stream = n, dma_stream
        c.ring_base, c.slot_bytes = ring_base, slot_bytes
        for i in range(n):
            c.free_ev[i], c.ready_ev[i] = free_events[i], ready_events[i]
        c.begin_ev, c.done_ev = begin_event, done_event
        c.function[0], c.function[1] = kernel.functions
        c.block_x, c.grid_y, c.max_grid_x = kernel.block_x, kernel.grid_y, kernel.max_grid_x
        c.shared[0], c.shared[1] = kernel.shared
        c.num_params = kernel.num_params
        for i, value in enumerate(kernel.static_args):
            c.static_args[i] = value
        for i, raw in enumerate(attrs):
            ctypes.memmove(c.attrs[i], raw, min(len(raw), 24))
        self._config = c  # function pointers and events stay alive with the loop
        self._lib = library()
        self._queue = self._lib.tc_open(ctypes.byref(c))
        if not self._queue:
            raise BackendError("the staged chunk loop could not start its thread")
        self.num_slots = n
        self._pending: deque[tuple[ctypes.c_int32, Any]] = deque()  # alive until issued

    def submit(self, *, stream: int, prev_end: int, start_event: int, end_event: int,
               table_event: int, store: bool, cursor: int, pairs: int, num_pairs: int,
               pair_first: np.ndarray, dma_host: np.ndarray, dma_slot: np.ndarray,
               dma_bytes: np.ndarray, dma_first: np.ndarray, keep: Any = None) -> Ticket:
        """Queue one transfer; the arrays (int64 ``*_first``, uint64 ``dma_*``, C order)
        are held by the ticket until it is issued. ``num_chunks`` is ``pair_first.size -
        1``; zero chunks queue only the ordering events."""
        if self._queue is None:
            raise BackendError("the staged chunk loop is closed")
        pair_first, dma_first = (np.ascontiguousarray(a, dtype=np.int64)
                                 for a in (pair_first, dma_first))
        dma_host, dma_slot, dma_bytes = (np.ascontiguousarray(a, dtype=np.uint64)
                                         for a in (dma_host, dma_slot, dma_bytes))
        num_chunks = max(int(pair_first.size) - 1, 0)
        if num_chunks and (dma_first.size != pair_first.size
                           or int(dma_first[-1]) != dma_host.size):
            raise BackendError(f"a job of {num_chunks} chunks with {dma_first.size - 1} DMA "
                               f"ranges over {dma_host.size} DMAs")
        stage = np.empty(int(dma_host.size), dtype=np.uint64)
        status = ctypes.c_int32(STATUS_PENDING)
        j = LoopJob()
        j.stream, j.prev_end, j.start_ev, j.end_ev = stream, prev_end or None, \
            start_event or None, end_event or None
        j.table_ev = table_event or None
        j.store, j.num_chunks, j.cursor, j.num_pairs = int(store), num_chunks, cursor, num_pairs
        j.pairs = pairs
        if num_chunks:
            for name, array in (("pair_first", pair_first), ("dma_first", dma_first),
                                ("dma_host", dma_host), ("dma_slot", dma_slot),
                                ("dma_bytes", dma_bytes), ("stage", stage)):
                setattr(j, name, array.ctypes.data)
        j.status = ctypes.addressof(status)
        arrays = (pair_first, dma_host, dma_slot, dma_bytes, dma_first, stage, keep)
        pending = self._pending
        while pending and pending[0][0].value != STATUS_PENDING:
            pending.popleft()  # issued: the loop no longer reads its arrays or status cell
        seq = self._lib.tc_submit(self._queue, ctypes.byref(j))
        if not seq:
            raise BackendError("the staged chunk loop refused a job (closing, or out of memory)")
        pending.append((status, arrays))  # whatever the caller drops, the loop's memory lives
        return Ticket(self, int(seq), status, arrays)

    def wait(self, seq: int = 0) -> None:
        """Block (GIL released) until job ``seq`` (0: every job so far) was issued."""
        if self._queue is not None:
            self._lib.tc_wait(self._queue, seq)

    @property
    def num_issued(self) -> int:
        return 0 if self._queue is None else int(self._lib.tc_issued(self._queue))

    def close(self) -> None:
        if self._queue is not None:
            self._lib.tc_close(self._queue)
            self._queue = None
            self._pending.clear()
