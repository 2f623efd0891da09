"""The staged chunk loop in native code, on a thread of its own (``native/chunk_loop.c``).

Why: a staged transfer of 256 blocks is 16 chunks, and each chunk costs a kernel launch,
a ``cuMemcpyBatchAsync`` and four event calls. Issued from Python on the engine's thread
that was ~35-50 µs a chunk, 0.6-0.8 ms a transfer (docs/benchmarks.md, "Host path"). A
Python thread cannot take it over: under the GIL it waits a switch interval per step
while the engine's thread runs Python. A native thread needs no GIL: the engine's
thread validates the transfer (``validate``, in C) and hands it over in one call
(``submit``); the loop lays it out and issues the chunks while the first DMA already runs.

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
from collections.abc import Sequence
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


class LoopGeometry(ctypes.Structure):
    """``tc_geometry``: a BlockStaging's static tables (the arrays stay the caller's)."""

    _fields_ = [
        ("factor", ctypes.c_int32), ("num_groups", ctypes.c_int32),
        ("whole_rows", ctypes.c_int32), ("_pad", ctypes.c_int32),
        ("chunk_bytes", ctypes.c_uint64),
        ("num_gpu_blocks", _vp), ("num_cpu_blocks", _vp),
        ("cpu_stride", _vp), ("row_origin", _vp), ("pitch", _vp),
        ("tpl_first", _vp), ("tpl_count", _vp), ("run_offset", _vp), ("run_bytes", _vp),
    ]


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
        ("geometry", ctypes.POINTER(LoopGeometry)),
    ]


class LoopJob(ctypes.Structure):
    """``tc_job``: one transfer (its arrays must live until it is issued)."""

    _fields_ = [
        ("stream", _vp), ("after", _vp), ("prev_end", _vp), ("start_ev", _vp),
        ("end_ev", _vp), ("table_ev", _vp),
        ("store", ctypes.c_int32), ("num_works", ctypes.c_int32),
        ("validated", _vp), ("work_meta", _vp),
        ("pairs", _vp), ("num_pairs", ctypes.c_int64),
        ("dma_host", _vp), ("dma_slot", _vp), ("dma_bytes", _vp), ("stage", _vp),
        ("max_dmas", ctypes.c_int64),
        ("status", _vp),
    ]


# what tc_validate refuses: its codes, named
SPEC_ERRORS = {1: "not one group_sizes entry per KV-cache group",
               2: "group_sizes do not add up to the GPU block ids",
               3: "the CPU block ids are not as many as the groups need",
               4: "a GPU block id out of range", 5: "a CPU block id out of range",
               6: "a destination block twice", 7: "out of memory"}


@dataclass(frozen=True, eq=False)
class Geometry:
    """What the loop validates and lays transfers out with: the planner's block counts per
    group, a BlockStaging's static tables (block factor, groups' CPU strides, row origins
    and pitches, run templates), the chunk size and whether loads read whole row images.
    ``of`` takes them from a BlockStaging and the planner it was built for."""

    factor: int
    chunk_bytes: int
    whole_rows: bool
    num_gpu_blocks: np.ndarray
    num_cpu_blocks: np.ndarray
    cpu_stride: np.ndarray
    row_origin: np.ndarray
    pitch: np.ndarray
    tpl_first: np.ndarray
    tpl_count: np.ndarray
    run_offset: np.ndarray
    run_bytes: np.ndarray

    @classmethod
    def of(cls, staging: Any, planner: Any) -> Geometry:
        i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
        groups = planner.groups
        if len(groups) != staging.num_groups or planner.block_size_factor != staging.factor:
            raise BackendError("a BlockStaging and a planner of different geometries")
        return cls(int(staging.factor), int(staging.chunk_bytes), bool(staging.load_whole_rows),
                   i64([g.num_gpu_blocks for g in groups]),
                   i64([g.num_cpu_blocks for g in groups]),
                   i64(staging.cpu_stride), i64(staging.row_origin), i64(staging.pitch),
                   i64(staging.tpl_first), i64(staging.tpl_count), i64(staging.runs[0]),
                   i64(staging.runs[1]))

    @property
    def max_runs(self) -> int:
        """The most runs one row's template has."""
        return max(int(self.tpl_count.max()), 1)

    def struct(self) -> LoopGeometry:
        g = LoopGeometry(self.factor, int(self.pitch.size), int(self.whole_rows), 0,
                         self.chunk_bytes)
        for name in ("num_gpu_blocks", "num_cpu_blocks", "cpu_stride", "row_origin", "pitch",
                     "tpl_first", "tpl_count", "run_offset", "run_bytes"):
            setattr(g, name, getattr(self, name).ctypes.data)
        return g


def _address(array: np.ndarray) -> int:
    """The address of a C-contiguous array's first byte (``.ctypes.data`` builds an object
    per call; the array interface is a dict lookup)."""
    return array.__array_interface__["data"][0]


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
                           "not found (install gcc or set CC; or configure transfer.backend = "
                           "'ce', which needs none)")
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
            lib.tc_validate.argtypes = [_vp, ctypes.c_int32, ctypes.c_int32, _vp, _vp,
                                        ctypes.c_int64, _vp, ctypes.c_int64, _vp]
            lib.tc_validate.restype = ctypes.c_int
            _library = lib
        return _library


@dataclass(frozen=True, eq=False)
class Validated:
    """One transfer's validated works, as the loop lays them out, in one int64 buffer:
    ``pairs`` (3, P) (GPU ids, CPU rows, sub-pages; each group's pairs back to back),
    then ``meta`` (G, 2) (group, count of each non-empty group, in group order; the
    first ``num_works`` rows are used)."""

    buffer: np.ndarray
    num_pairs: int
    num_works: int

    @property
    def pairs(self) -> np.ndarray:
        return self.buffer[:3 * self.num_pairs].reshape(3, -1)

    @property
    def meta(self) -> np.ndarray:
        return self.buffer[3 * self.num_pairs:].reshape(-1, 2)

    @classmethod
    def of_items(cls, items: Sequence[tuple[int, np.ndarray, np.ndarray, Any]]) -> Validated:
        """From GroupWork already validated by the planner (``BlockStaging.work_items``)."""
        n = sum(int(np.size(ids)) for _, ids, _, _ in items)
        buffer = np.zeros(3 * n + 2 * max(len(items), 1), dtype=np.int64)
        pairs, meta = buffer[:3 * n].reshape(3, n), buffer[3 * n:].reshape(-1, 2)
        at = 0
        for w, (group, ids, rows, subs) in enumerate(items):
            k = int(np.size(ids))
            pairs[0, at:at + k], pairs[1, at:at + k] = ids, rows
            if subs is not None:
                pairs[2, at:at + k] = subs
            meta[w] = group, k
            at += k
        return cls(buffer, n, len(items))


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

    def __init__(self, driver: LoopDriver, kernel: LoopKernel, geometry: Geometry, *,
                 dma_stream: int, ring_base: int, slot_bytes: int, free_events: list[int],
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
        if geometry.factor < 1 or int(geometry.pitch.max()) > geometry.chunk_bytes:
            raise BackendError(f"a geometry of factor {geometry.factor} and row pitches "
                               f"{geometry.pitch.tolist()} for chunks of {geometry.chunk_bytes} "
                               "bytes: a row must fit a chunk")
        self.geometry = geometry
        self._geometry = geometry.struct()
        self._geometry_ref = ctypes.addressof(self._geometry)
        self._num_groups = int(geometry.pitch.size)
        self._groups_type = ctypes.c_int64 * (2 * self._num_groups)
        c.geometry = ctypes.pointer(self._geometry)
        self._config = c  # function pointers and events stay alive with the loop
        self._lib = library()
        self._queue = self._lib.tc_open(ctypes.byref(c))
        if not self._queue:
            raise BackendError("the staged chunk loop could not start its thread")
        self.num_slots = n
        self._pending: deque[tuple[ctypes.c_int32, Any]] = deque()  # alive until issued

    def validate(self, store: bool, gpu_ids: np.ndarray, group_sizes: Sequence[int],
                 block_indices: Sequence[int], cpu_ids: np.ndarray) -> Validated | int:
        """Check one transfer's ids as the planner does (``tc_validate``), on the calling
        thread: its ``Validated`` works, or the refusal's code (``SPEC_ERRORS``). The ids
        are int64 (a spec's ``block_ids``); anything else is converted first."""
        g = len(group_sizes)
        if g != self._num_groups:
            return 1
        groups = self._groups_type(*group_sizes, *block_indices)
        if gpu_ids.dtype != np.int64 or not gpu_ids.flags.c_contiguous:
            gpu_ids = np.ascontiguousarray(gpu_ids, dtype=np.int64)
        if cpu_ids.dtype != np.int64 or not cpu_ids.flags.c_contiguous:
            cpu_ids = np.ascontiguousarray(cpu_ids, dtype=np.int64)
        n = gpu_ids.size
        out = np.empty(3 * n + 2 * g, dtype=np.int64)
        rc = self._lib.tc_validate(self._geometry_ref, int(store), g, groups, _address(gpu_ids),
                                   n, _address(cpu_ids), cpu_ids.size, _address(out))
        return -rc if rc < 0 else Validated(out, n, rc)

    def submit(self, *, stream: int, after: int = 0, prev_end: int = 0, start_event: int = 0,
               end_event: int = 0, table_event: int = 0, store: bool = False,
               validated: Validated | None = None, pairs: int = 0, keep: Any = None) -> Ticket:
        """Queue one transfer: ``validated`` works, laid out by the loop into the pair
        table at ``pairs`` ((4, P) int64: the memory the kernels read) and DMA arrays the
        ticket holds. None: only the ordering events (wait for ``after``, then
        ``prev_end``; record ``start_event``, ``end_event``)."""
        if self._queue is None:
            raise BackendError("the staged chunk loop is closed")
        status = ctypes.c_int32(STATUS_PENDING)
        j = LoopJob(stream, after or None, prev_end or None, start_event or None,
                    end_event or None, table_event or None, int(store))
        j.status = ctypes.addressof(status)
        held: tuple[Any, ...] = (keep,)
        if validated is not None and validated.num_works:
            num_pairs = validated.num_pairs
            # rows <= pairs + 1 per work (a partial first row), DMAs <= runs per row
            max_dmas = (num_pairs + validated.num_works) * self.geometry.max_runs
            dmas = np.empty((4, max_dmas), dtype=np.uint64)  # host, slot offset, bytes, stage
            base = _address(dmas)
            at = _address(validated.buffer)
            j.num_works, j.validated, j.work_meta = validated.num_works, at, at + 24 * num_pairs
            j.pairs, j.num_pairs, j.max_dmas = pairs, num_pairs, max_dmas
            j.dma_host, j.dma_slot, j.dma_bytes, j.stage = (base + i * 8 * max_dmas
                                                            for i in range(4))
            held = (keep, validated, dmas)
        pending = self._pending
        while pending and pending[0][0].value != STATUS_PENDING:
            pending.popleft()  # issued: the loop no longer reads its arrays or status cell
        seq = self._lib.tc_submit(self._queue, ctypes.byref(j))
        if not seq:
            raise BackendError("the staged chunk loop refused a job (closing, or out of memory)")
        pending.append((status, held))  # whatever the caller drops, the loop's memory lives
        return Ticket(self, int(seq), status, held)

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
