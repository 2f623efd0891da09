"""The engine's thread keeps the GIL through the native calls of a transfer.

A ctypes call that releases the GIL gets it back only when no other Python thread holds
it; in a process whose other threads are busy that is up to the switch interval (5 ms)
later, and whether it happens depends on a race with those threads' wake-up, so a timed
test cannot pin it down. What decides it is how each function is bound: these tests
check the binding of every function of the native library (and, on a GPU machine, of the
driver's entry points on the transfer path) against the rule: calls that return at once
keep the GIL, calls that wait release it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from tiercache.native.library import Library, library

KEEP = {"tc_validate", "tc_submit", "tc_transfer", "tc_set_inline", "tc_set_zero_copy", "tc_stamps",
        "tc_layout", "tc_constant"}
RELEASE = {"tc_open", "tc_wait", "tc_close"}


def keeps_gil(function) -> bool:
    return bool(function._flags_ & ctypes._FUNCFLAG_PYTHONAPI)


def test_the_library_binds_every_function_by_the_gil_rule():
    lib = library()
    names = set(Library.__dataclass_fields__)
    assert names == KEEP | RELEASE
    assert {n for n in names if keeps_gil(getattr(lib, n))} == KEEP


@pytest.mark.gpu
@pytest.mark.skipif(ctypes.util.find_library("cuda") is None, reason="needs the CUDA driver")
def test_the_drivers_transfer_path_keeps_the_gil():
    from tiercache.device.driver import CudaDriver

    driver = CudaDriver()
    for function in (driver._event_record, driver._stream_wait_event, driver._event_query,
                     driver._ctx_get_current, driver._elapsed, driver._batch,
                     driver._memcpy_async):
        assert keeps_gil(function), function
    assert not keeps_gil(driver._lib.cuEventSynchronize)
