"""The CUDA driver entry points tiercache calls, through ctypes, and what the GPU
backends share on top of them (descriptor arrays, device and stream entry).

One binding for the package: the copy backends, the native chunk loop (by address,
``entry_point``) and the region's page-locking all call libcuda through ctypes. This
module imports nothing of tiercache but errors: registering host memory never loads
the copy backends or the native build step. Why ctypes and the driver, not
cuda-bindings: the copy path passes numpy arrays of 16 k pointers per call, and a ctypes
call hands the driver the arrays' own memory (zero copy) where cuda-bindings converts
Python lists; and ctypes needs no package beyond the driver itself. The
driver API (not the runtime) also leaves the runtime's last-error state alone, so a
failed call here never resurfaces as a bogus error in a later torch call.

The GIL: calls that only enqueue work or ask about it (event record and query, stream
waits, async copies, the current context) keep the GIL; only calls that wait for the
device or the OS (event and stream synchronisation, host registration, creation and
destruction) release it. A released GIL is taken back only when every other Python
thread that wants it lets go, which in a busy process takes up to the interpreter's
switch interval (5 ms) per call: the engine's thread must not pay that a few times per
transfer for calls of a few microseconds.

``cuMemcpyBatchAsync`` changed ABI in CUDA 13 (``failIdx`` dropped); the header
remaps the name to ``_v2`` at compile time, so the symbol is looked up with
``cuGetProcAddress`` by ABI version: 12.8 first (nine arguments, with ``failIdx``),
then 13.0 (eight). A driver without either (older than R570) has no batch API:
``CudaDriver.memcpy_batch`` is then None and callers must say so (no quiet fallback).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from tiercache.errors import BackendError

log = logging.getLogger(__name__)

CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_FOUND = 500
LEGACY_STREAM_HANDLES = (0, 1)  # NULL (legacy default) and cudaStreamLegacy
ABI_12_8 = 12080  # cuMemcpyBatchAsync with failIdx (the native loop mirrors it: TC_ABI_12_8)
ABI_13_0 = 13000  # without it (CUDA 13)
_GET_PROC_DEFAULT = 0
_SYMBOL_FOUND = 0
_EVENT_DISABLE_TIMING = 0x2


class SrcAccessOrder(IntEnum):
    """``CUmemcpySrcAccessOrder``: when the copy engine may read the source."""

    STREAM = 1  # in stream order: sees every earlier write on the stream
    DURING_API_CALL = 2
    ANY = 3  # any time after the call: only for sources nothing is still writing


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (24 bytes). Location hints stay zero: they only matter for
    managed or pageable memory, and the region is pinned."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_u64p = ctypes.c_void_p
_BATCH_12_8 = ctypes.PYFUNCTYPE(ctypes.c_int, _u64p, _u64p, _u64p, ctypes.c_size_t,
                               ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t),
                               ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p)
_BATCH_13_0 = ctypes.PYFUNCTYPE(ctypes.c_int, _u64p, _u64p, _u64p, ctypes.c_size_t,
                               ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t),
                               ctypes.c_size_t, ctypes.c_void_p)
_MEMCPY_ASYNC = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                 ctypes.c_void_p)


@dataclass(frozen=True)
class BatchFailure:
    code: int
    fail_index: int | None  # None on the 13.0 ABI, which does not report it


class CudaDriver:
    """libcuda entry points, resolved once per process user (cheap to build: a few µs)."""

    def __init__(self) -> None:
        try:  # one library, two bindings: GIL released (waits) and kept (module docstring)
            self._lib = ctypes.CDLL("libcuda.so.1")
            self._fast = ctypes.PyDLL("libcuda.so.1")
        except OSError as e:
            raise BackendError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from e
        lib, fast = self._lib, self._fast
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        fast.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        version = ctypes.c_int(0)
        self._check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.driver_version = version.value
        self._batch_abi: int | None = None
        self._batch: Any = None  # the found ABI's prototype over its address
        self._batch_address = 0
        for abi, proto in ((ABI_12_8, _BATCH_12_8), (ABI_13_0, _BATCH_13_0)):
            address = self._proc_address(b"cuMemcpyBatchAsync", abi)
            if address:
                self._batch, self._batch_abi = proto(address), abi
                self._batch_address = address
                break
        address = self._proc_address(b"cuMemcpyAsync", 4000)
        if not address:
            raise BackendError(f"CUDA driver {self.driver_version} has no cuMemcpyAsync")
        self._memcpy_async = _MEMCPY_ASYNC(address)
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
        fast.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fast.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        fast.cuEventQuery.argtypes = [ctypes.c_void_p]
        lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
        elapsed = getattr(fast, "cuEventElapsedTime_v2", None) or fast.cuEventElapsedTime
        elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        self._elapsed = elapsed
        self._event_record = fast.cuEventRecord
        self._stream_wait_event = fast.cuStreamWaitEvent
        self._event_query = fast.cuEventQuery
        self._ctx_get_current = fast.cuCtxGetCurrent
        self._fail_index = ctypes.c_size_t(0)
        self._attr_index = ctypes.c_size_t(0)

    # ------------------------------------------------------------ lookup and errors
    def _proc_address(self, symbol: bytes, abi: int) -> int:
        pfn = ctypes.c_void_p(0)
        status = ctypes.c_int(-1)
        getter = getattr(self._lib, "cuGetProcAddress_v2", None)
        if getter is not None:
            getter.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                               ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
            rc = getter(symbol, ctypes.byref(pfn), abi, _GET_PROC_DEFAULT, ctypes.byref(status))
            found = rc == CUDA_SUCCESS and status.value == _SYMBOL_FOUND
        else:  # drivers before CUDA 12.0 export only the four-argument form
            getter = self._lib.cuGetProcAddress
            getter.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                               ctypes.c_uint64]
            rc = getter(symbol, ctypes.byref(pfn), abi, _GET_PROC_DEFAULT)
            found = rc == CUDA_SUCCESS
        if not found and rc not in (CUDA_SUCCESS, CUDA_ERROR_NOT_FOUND):
            log.debug("cuGetProcAddress(%s, %d) -> %s", symbol.decode(), abi, self.error_name(rc))
        return int(pfn.value or 0) if found else 0

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUresult {code}"
        return f"{name.value.decode()} ({code})"

    def _check(self, code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            raise BackendError(f"{what} failed: {self.error_name(code)}")

    # ------------------------------------------------------------ capabilities
    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    @property
    def batch_abi(self) -> int | None:
        """12080 or 13000: which ``cuMemcpyBatchAsync`` ABI was found; None: none."""
        return self._batch_abi

    def has_current_context(self) -> bool:
        ctx = ctypes.c_void_p(0)
        return self._ctx_get_current(ctypes.byref(ctx)) == CUDA_SUCCESS and bool(ctx.value)

    # ------------------------------------------------------------ copies
    def memcpy_batch(self, dsts: int, srcs: int, sizes: int, count: int,
                     attrs: MemcpyAttributes, stream_handle: int) -> BatchFailure | None:
        """One ``cuMemcpyBatchAsync`` over ``count`` descriptors; the three arguments are
        addresses of uint64 arrays. Returns None on success, else the failure."""
        if self._batch_abi == ABI_12_8:
            self._fail_index.value = 0
            rc = self._batch(dsts, srcs, sizes, count, ctypes.byref(attrs),
                             ctypes.byref(self._attr_index), 1, ctypes.byref(self._fail_index),
                             stream_handle)
            return None if rc == CUDA_SUCCESS else BatchFailure(rc, int(self._fail_index.value))
        if self._batch_abi == ABI_13_0:
            rc = self._batch(dsts, srcs, sizes, count, ctypes.byref(attrs),
                             ctypes.byref(self._attr_index), 1, stream_handle)
            return None if rc == CUDA_SUCCESS else BatchFailure(rc, None)
        raise BackendError(f"CUDA driver {self.driver_version} has no cuMemcpyBatchAsync "
                           "(needs R570 / CUDA 12.8 or newer)")

    def memcpy_async(self, dst: int, src: int, num_bytes: int, stream_handle: int) -> int:
        """One ``cuMemcpyAsync`` (direction from UVA); returns the CUresult."""
        return self._memcpy_async(dst, src, num_bytes, stream_handle)

    # ------------------------------------------------------------ host registration
    def mem_host_register(self, address: int, num_bytes: int) -> int:
        """``cuMemHostRegister`` with flags 0 (on UVA systems: mapped and portable) in the
        current context; returns the CUresult."""
        return self._lib.cuMemHostRegister_v2(address, num_bytes, 0)

    def mem_host_unregister(self, address: int) -> int:
        """``cuMemHostUnregister``; returns the CUresult."""
        return self._lib.cuMemHostUnregister(address)

    # ------------------------------------------------------------ devices
    def pci_bus_id(self, ordinal: int) -> str:
        """The PCI bus id of device ``ordinal`` (this process's numbering, so after
        ``CUDA_VISIBLE_DEVICES``) as the driver prints it, e.g. ``00000000:3B:00.0``."""
        device = ctypes.c_int(0)
        self._check(self._lib.cuDeviceGet(ctypes.byref(device), ctypes.c_int(ordinal)),
                    f"cuDeviceGet({ordinal})")
        text = ctypes.create_string_buffer(64)
        self._check(self._lib.cuDeviceGetPCIBusId(text, ctypes.c_int(len(text)), device),
                    f"cuDeviceGetPCIBusId(cuda:{ordinal})")
        return text.value.decode()

    # ------------------------------------------------------------ events
    def event_create(self, timing: bool = False) -> int:
        event = ctypes.c_void_p(0)
        self._check(self._lib.cuEventCreate(ctypes.byref(event),
                                            0 if timing else _EVENT_DISABLE_TIMING),
                    "cuEventCreate")
        return int(event.value or 0)

    def event_synchronize(self, event: int) -> None:
        self._check(self._lib.cuEventSynchronize(event), "cuEventSynchronize")

    def event_elapsed_ms(self, start: int, end: int) -> float:
        ms = ctypes.c_float(0.0)
        self._check(self._elapsed(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        return float(ms.value)

    def event_destroy(self, event: int) -> None:
        self._check(self._lib.cuEventDestroy_v2(event), "cuEventDestroy")

    def event_record(self, event: int, stream_handle: int) -> None:
        self._check(self._event_record(event, stream_handle), "cuEventRecord")

    def event_done(self, event: int) -> bool:
        """``cuEventQuery``: True once the work before the recorded event has finished."""
        rc = self._event_query(event)
        if rc == _CUDA_ERROR_NOT_READY:
            return False
        self._check(rc, "cuEventQuery")
        return True

    def stream_wait_event(self, stream_handle: int, event: int) -> None:
        self._check(self._stream_wait_event(stream_handle, event, 0), "cuStreamWaitEvent")

    # ------------------------------------------------------------ raw entry points
    @property
    def batch_address(self) -> int:
        """The address of ``cuMemcpyBatchAsync`` of ``batch_abi`` (0: none)."""
        return self._batch_address

    def entry_point(self, name: str) -> int:
        """The address of the driver function ``name`` (e.g. ``cuLaunchKernel``), for
        native code that calls the driver without the GIL."""
        return int(ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value or 0)

    def current_context(self) -> int:
        """The calling thread's current ``CUcontext``; ``BackendError`` when none is."""
        ctx = ctypes.c_void_p(0)
        self._check(self._ctx_get_current(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise BackendError("no CUDA context is current on this thread")
        return int(ctx.value)

    # ------------------------------------------------------------ stream entry
    def enter(self, stream: Any, device: int) -> int:
        """The raw handle of ``stream`` (see ``stream_handle``), with ``device``'s primary
        context current on the calling thread (driver calls act on the current context,
        and a fresh thread has none)."""
        handle = stream_handle(stream)
        if not self.has_current_context():
            import torch

            torch.cuda.set_device(device)  # makes the primary context current
        return handle


def stream_handle(stream) -> int:
    """The raw ``CUstream`` of a torch.cuda.Stream; the legacy default stream is refused
    (``cuMemcpyBatchAsync`` rejects it, and it would serialise with every other stream)."""
    handle = int(stream.cuda_stream)
    if handle in LEGACY_STREAM_HANDLES:
        raise BackendError(
            f"copy on the legacy default stream (handle {handle:#x}) is not allowed: pass a "
            "created stream, e.g. torch.cuda.Stream(), ordered after the compute stream")
    return handle


def device_index(device: Any) -> int:
    """The CUDA device ordinal of a torch device ('cuda' alone means the current one)."""
    import torch

    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else int(device.index)


@dataclass(frozen=True, eq=False)
class DescriptorArrays:
    """Three C-contiguous uint64 arrays with their addresses read once, so that ranges of
    them can be submitted without re-reading (``ndarray.ctypes`` costs ~1.5 µs each)."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    src_ptr: int
    dst_ptr: int
    sizes_ptr: int

    @classmethod
    def of(cls, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> DescriptorArrays:
        src, dst, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (src, dst, sizes))
        return cls(src, dst, sizes, src.ctypes.data, dst.ctypes.data, sizes.ctypes.data)
