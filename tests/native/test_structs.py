"""The Python mirrors of the native structs and constants against the compiled C's own
report.

The library lists ``sizeof`` and ``offsetof`` of every field of every struct the Python
side mirrors (``tc_layout``) and the value of every constant of ``codes.h``
(``tc_constant``), built here with the system compiler; a field or a value that drifts,
appears or disappears on either side is a failure, and the binding refuses such a
library, naming what differs, instead of misreading it.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest

from tiercache.device.driver import MemcpyAttributes
from tiercache.errors import BackendError
from tiercache.native import build, codes, structs
from tiercache.native.library import bind, library


def _drifted(tmp_path, header: str, old: str, new: str):
    """The library built from a copy of the sources with ``old`` replaced in ``header``."""
    sources = tmp_path / "src"
    shutil.copytree(build.SOURCES, sources)
    text = (sources / header).read_text()
    assert old in text
    (sources / header).write_text(text.replace(old, new))
    return build.build(sources, tmp_path / "out")


def _reporting(path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.tc_layout.argtypes = [ctypes.c_int32] + [ctypes.POINTER(ctypes.c_char_p)] * 2 \
        + [ctypes.POINTER(ctypes.c_int64)] * 2
    lib.tc_constant.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p),
                                ctypes.POINTER(ctypes.c_int64)]
    return lib


def test_every_mirrored_struct_matches_the_c_layout():
    assert structs.layout_mismatches(library()) == []
    reported = structs.c_layout(library())
    assert {name for name, field in reported if not field} == set(structs.MIRRORS)
    assert reported[("tc_config", "attrs")][1] == 2 * ctypes.sizeof(MemcpyAttributes)


def test_every_code_and_limit_is_one_value_on_both_sides():
    assert codes.constant_mismatches(library()) == []
    reported = codes.c_constants(library())
    assert {f"TC_{code.name}" for code in codes.TransferCode} <= set(reported)
    assert reported["TC_ATTRS_BYTES"] == ctypes.sizeof(MemcpyAttributes)


def test_a_drifted_mirror_is_reported(tmp_path):
    """The same check over sources whose job struct has one field wider: the mismatch
    names the field, and everything after it moves."""
    path = _drifted(tmp_path, "structs.h", "    int32_t store, num_works;\n",
                    "    int64_t store;\n    int32_t num_works;\n")
    lines = structs.layout_mismatches(_reporting(path))
    assert any(line.startswith("tc_job.store:") for line in lines)
    assert any(line.startswith("tc_job.num_works:") for line in lines)
    assert not any(line.startswith("tc_config") for line in lines)
    with pytest.raises(BackendError, match="tc_job.store"):
        bind(str(path))


def test_a_drifted_code_is_reported_and_the_library_refused(tmp_path):
    """A transfer code changed on the C side alone: the mismatch names it with both
    values, and binding that library is refused (a FENCED answer read as something else
    would copy what the fence refused, or report it wrongly)."""
    path = _drifted(tmp_path, "codes.h", "TC_FENCED = 100,", "TC_FENCED = 103,")
    assert codes.constant_mismatches(_reporting(path)) == ["TC_FENCED: 103 in C, 100 in Python"]
    with pytest.raises(BackendError, match="TC_FENCED: 103 in C, 100 in Python"):
        bind(str(path))


def test_numpys_array_head_reads_as_the_c_reads_it_and_a_wrong_reading_is_reported():
    """``tc_transfer`` reads id arrays through numpy's object layout (tc_ndarray); the
    check behind it passes for this numpy and names what a mis-declared head gets wrong
    (here: a pointer too many before the data, as a free-threaded CPython would have)."""
    assert structs.ndarray_mismatches() == ()

    class Shifted(ctypes.Structure):
        _fields_ = [("pad", ctypes.c_void_p)] + structs.NdarrayHead._fields_

    lines = structs.ndarray_mismatches(Shifted)
    assert len(lines) == 2 and all("numpy says" in line for line in lines)
