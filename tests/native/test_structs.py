"""The ctypes mirrors of the native structs against the compiled C's own report.

``chunk_loop.c`` lists ``sizeof`` and ``offsetof`` of every field of every struct the
Python side mirrors (``tc_layout``), built here with the system compiler; a field that
drifts, appears or disappears on either side is a failure, not silent corruption.
"""

from __future__ import annotations

import ctypes

from tiercache.device.driver import MemcpyAttributes
from tiercache.native import build, structs
from tiercache.native.library import library


def test_every_mirrored_struct_matches_the_c_layout():
    assert structs.layout_mismatches(library()) == []
    reported = structs.c_layout(library())
    assert {name for name, field in reported if not field} == set(structs.MIRRORS)
    assert reported[("tc_config", "attrs")][1] == 2 * ctypes.sizeof(MemcpyAttributes)


def test_a_drifted_mirror_is_reported(tmp_path):
    """The same check over a C file whose job struct has one field wider: the mismatch
    names the field, and everything after it moves."""
    source = build.SOURCE.read_text().replace("    int32_t store, num_works;\n",
                                              "    int64_t store;\n    int32_t num_works;\n")
    assert source != build.SOURCE.read_text()
    drifted = tmp_path / "chunk_loop.c"
    drifted.write_text(source)
    lib = ctypes.CDLL(str(build.build(drifted, tmp_path / "out")))
    lib.tc_layout.argtypes = [ctypes.c_int32] + [ctypes.POINTER(ctypes.c_char_p)] * 2 \
        + [ctypes.POINTER(ctypes.c_int64)] * 2
    lines = structs.layout_mismatches(lib)
    assert any(line.startswith("tc_job.store:") for line in lines)
    assert any(line.startswith("tc_job.num_works:") for line in lines)
    assert not any(line.startswith("tc_config") for line in lines)


def test_numpys_array_head_reads_as_the_c_reads_it_and_a_wrong_reading_is_reported():
    """``tc_transfer`` reads id arrays through numpy's object layout (tc_ndarray); the
    check behind it passes for this numpy and names what a mis-declared head gets wrong
    (here: a pointer too many before the data, as a free-threaded CPython would have)."""
    assert structs.ndarray_mismatches() == ()

    class Shifted(ctypes.Structure):
        _fields_ = [("pad", ctypes.c_void_p)] + structs.NdarrayHead._fields_

    lines = structs.ndarray_mismatches(Shifted)
    assert len(lines) == 2 and all("numpy says" in line for line in lines)
