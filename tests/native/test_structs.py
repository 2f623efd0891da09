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
