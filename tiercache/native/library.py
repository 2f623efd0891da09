"""The compiled ``chunk_loop.c``, bound once per process with its argument types."""

from __future__ import annotations

import ctypes
import threading

from tiercache.native.build import build
from tiercache.native.structs import ConfigStruct, JobStruct

_vp = ctypes.c_void_p
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The built library (compiled at the first call of the process: ``build``)."""
    global _library
    with _lock:
        if _library is None:
            lib = ctypes.CDLL(str(build()))
            lib.tc_open.argtypes = [ctypes.POINTER(ConfigStruct)]
            lib.tc_open.restype = _vp
            lib.tc_submit.argtypes = [_vp, ctypes.POINTER(JobStruct)]
            lib.tc_submit.restype = ctypes.c_uint64
            lib.tc_wait.argtypes = [_vp, ctypes.c_uint64]
            lib.tc_wait.restype = None
            lib.tc_issued.argtypes = [_vp]
            lib.tc_issued.restype = ctypes.c_uint64
            lib.tc_close.argtypes = [_vp]
            lib.tc_close.restype = None
            lib.tc_validate.argtypes = [_vp, ctypes.c_int32,  # tc_bounds *: its address
                                        ctypes.c_int32, _vp, _vp, ctypes.c_int64, _vp,
                                        ctypes.c_int64, _vp]
            lib.tc_validate.restype = ctypes.c_int
            lib.tc_layout.argtypes = [ctypes.c_int32] + [ctypes.POINTER(ctypes.c_char_p)] * 2 \
                + [ctypes.POINTER(ctypes.c_int64)] * 2
            lib.tc_layout.restype = ctypes.c_int
            _library = lib
        return _library
