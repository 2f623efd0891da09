"""The compiled native library (``src/``), bound once per process with its argument types
and checked against its Python mirrors.

Two bindings of the one library: ``tc_validate``, ``tc_submit``, ``tc_transfer``,
``tc_set_inline``, ``tc_set_zero_copy``, ``tc_stamps``, ``tc_layout`` and ``tc_constant``
return in microseconds and keep the GIL (``PyDLL``; ``tc_submit`` and ``tc_transfer``
may issue a small job's driver calls themselves, and ``tc_transfer`` records the compute
stream's mark); ``tc_open``, ``tc_wait`` and ``tc_close`` wait for the loop's thread and
release it (``CDLL``). Why: a released GIL is taken back only when the process's other
Python threads let go, up to the switch interval (5 ms) later in a busy process
(``tiercache.device.driver``).

Before the library is handed out, every mirrored struct layout (``structs``) and every
mirrored constant (``codes``) is compared with what the C reports: a disagreement is a
``BackendError`` naming each difference, never a misread struct or answer.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiercache.errors import BackendError
from tiercache.native.build import build
from tiercache.native.codes import constant_mismatches
from tiercache.native.structs import (
    CallerStruct, ConfigStruct, JobStruct, OutcomeStruct, layout_mismatches,
)

_vp = ctypes.c_void_p
_lock = threading.Lock()
_library: Library | None = None


@dataclass(frozen=True)
class Library:
    """The library's functions, each bound as its GIL rule says (module docstring)."""

    tc_validate: Callable[..., Any]
    tc_submit: Callable[..., Any]
    tc_transfer: Callable[..., Any]
    tc_set_inline: Callable[..., Any]
    tc_set_zero_copy: Callable[..., Any]
    tc_stamps: Callable[..., Any]
    tc_layout: Callable[..., Any]
    tc_constant: Callable[..., Any]
    tc_open: Callable[..., Any]
    tc_wait: Callable[..., Any]
    tc_close: Callable[..., Any]


def _bind(path: str) -> Library:
    keep, wait = ctypes.PyDLL(path), ctypes.CDLL(path)
    keep.tc_validate.argtypes = [_vp, ctypes.c_int32,  # tc_bounds *: its address
                                 ctypes.c_int32, _vp, _vp, ctypes.c_int64, _vp,
                                 ctypes.c_int64, _vp]
    keep.tc_validate.restype = ctypes.c_int
    keep.tc_submit.argtypes = [_vp, ctypes.POINTER(JobStruct)]
    keep.tc_submit.restype = ctypes.c_uint64
    # the three arrays by their objects' addresses (tc_ndarray)
    keep.tc_transfer.argtypes = [_vp, ctypes.POINTER(CallerStruct), ctypes.POINTER(JobStruct),
                                 _vp, ctypes.c_int32, _vp, _vp, _vp, _vp, ctypes.c_uint64,
                                 ctypes.POINTER(OutcomeStruct)]
    keep.tc_transfer.restype = ctypes.c_int
    keep.tc_set_inline.argtypes = [_vp, ctypes.c_int64]
    keep.tc_set_inline.restype = None
    keep.tc_set_zero_copy.argtypes = [_vp, ctypes.c_int64]
    keep.tc_set_zero_copy.restype = None
    keep.tc_stamps.argtypes = [_vp, ctypes.POINTER(ctypes.c_int64)]
    keep.tc_stamps.restype = None
    keep.tc_layout.argtypes = [ctypes.c_int32] + [ctypes.POINTER(ctypes.c_char_p)] * 2 \
        + [ctypes.POINTER(ctypes.c_int64)] * 2
    keep.tc_layout.restype = ctypes.c_int
    keep.tc_constant.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p),
                                 ctypes.POINTER(ctypes.c_int64)]
    keep.tc_constant.restype = ctypes.c_int
    wait.tc_open.argtypes = [ctypes.POINTER(ConfigStruct)]
    wait.tc_open.restype = _vp
    wait.tc_wait.argtypes = [_vp, ctypes.c_uint64]
    wait.tc_wait.restype = None
    wait.tc_close.argtypes = [_vp]
    wait.tc_close.restype = None
    return Library(tc_validate=keep.tc_validate, tc_submit=keep.tc_submit,
                   tc_transfer=keep.tc_transfer,
                   tc_set_inline=keep.tc_set_inline,
                   tc_set_zero_copy=keep.tc_set_zero_copy, tc_stamps=keep.tc_stamps,
                   tc_layout=keep.tc_layout, tc_constant=keep.tc_constant,
                   tc_open=wait.tc_open, tc_wait=wait.tc_wait, tc_close=wait.tc_close)


def bind(path: str) -> Library:
    """The library at ``path``, bound, once its structs and constants agree with the
    Python mirrors (``BackendError`` naming every difference otherwise)."""
    lib = _bind(path)
    lines = layout_mismatches(lib) + constant_mismatches(lib)
    if lines:
        raise BackendError(f"the native library {path} disagrees with its Python mirrors "
                           "(tiercache.native.structs, tiercache.native.codes): "
                           + "; ".join(lines))
    return lib


def library() -> Library:
    """The built library (compiled at the first call of the process: ``build``)."""
    global _library
    with _lock:
        if _library is None:
            _library = bind(str(build()))
        return _library
