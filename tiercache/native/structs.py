"""ctypes mirrors of the structs the native library reads (``src/structs.h``), and the
layout check.

A mirror that drifts from its C struct is silent memory corruption, so the C side
reports ``sizeof``/``offsetof`` of every field of every mirrored struct (``tc_layout``)
and ``layout_mismatches`` compares that with these classes: the binding refuses a
library that disagrees (``tiercache.native.library``), and a CPU test shows a drifted
field is named. Field names are the C names.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Protocol

from tiercache.native.codes import ATTRS_BYTES, C_CONTIGUOUS_FLAG, MAX_RING_SLOTS

_vp = ctypes.c_void_p


def address_of(array) -> int:
    """The address of a C-contiguous numpy array's first byte (``.ctypes.data`` builds an
    object per call; the array interface is a dict lookup)."""
    return array.__array_interface__["data"][0]


class BoundsStruct(ctypes.Structure):
    """``tc_bounds``: what ``tc_validate`` checks ids against (the arrays stay the caller's)."""

    _fields_ = [
        ("factor", ctypes.c_int32), ("num_groups", ctypes.c_int32),
        ("num_gpu_blocks", _vp), ("num_slots", _vp),
    ]


class GeometryStruct(ctypes.Structure):
    """``tc_geometry``: a block layout's static tables (the arrays stay the caller's)."""

    _fields_ = [
        ("factor", ctypes.c_int32), ("num_groups", ctypes.c_int32),
        ("whole_rows", ctypes.c_int32), ("max_runs", ctypes.c_int32),
        ("chunk_bytes", ctypes.c_uint64),
        ("cpu_stride", _vp), ("row_origin", _vp), ("pitch", _vp),
        ("tpl_first", _vp), ("tpl_count", _vp), ("run_offset", _vp), ("run_bytes", _vp),
        ("break_rows", ctypes.c_int64),
    ]


class ConfigStruct(ctypes.Structure):
    """``tc_config``: one loop's constant part (ring, events, kernels, driver)."""

    _fields_ = [
        ("launch", _vp), ("record", _vp), ("wait", _vp), ("batch", _vp), ("ctx_set", _vp),
        ("ctx_get", _vp), ("host_alloc", _vp), ("host_free", _vp), ("event_create", _vp),
        ("event_destroy", _vp), ("event_query", _vp),
        ("batch_abi", ctypes.c_int32), ("num_ring_slots", ctypes.c_int32),
        ("ctx", _vp), ("dma_stream", _vp),
        ("ring_base", ctypes.c_uint64), ("ring_slot_bytes", ctypes.c_uint64),
        ("free_ev", _vp * MAX_RING_SLOTS), ("ready_ev", _vp * MAX_RING_SLOTS),
        ("begin_ev", _vp), ("done_ev", _vp),
        ("function", _vp * 2),
        ("block_x", ctypes.c_uint32), ("shared", ctypes.c_uint32 * 2),
        ("grid_y", ctypes.c_uint32), ("max_grid_x", ctypes.c_uint32),
        ("num_params", ctypes.c_int32),
        ("static_args", ctypes.c_uint64 * 4),
        ("attrs", (ctypes.c_uint8 * ATTRS_BYTES) * 2),
        ("geometry", ctypes.POINTER(GeometryStruct)),
    ]


class JobStruct(ctypes.Structure):
    """``tc_job``: one transfer (its arrays must live until it is issued; ``tc_submit``
    copies the struct itself)."""

    _fields_ = [
        ("stream", _vp), ("after", _vp), ("prev_end", _vp), ("start_ev", _vp),
        ("end_ev", _vp), ("table_ev", _vp),
        ("store", ctypes.c_int32), ("num_works", ctypes.c_int32), ("owns", ctypes.c_int32),
        ("validated", _vp), ("pairs", _vp), ("num_pairs", ctypes.c_int64),
        ("status", _vp),
    ]


class CallerStruct(ctypes.Structure):
    """``tc_caller``: what ``tc_transfer`` checks a transfer against (the validator's
    bounds, each group's bytes per pair, the fence's ledger records; the memory stays
    the caller's)."""

    _fields_ = [
        ("bounds", _vp), ("pair_bytes", _vp), ("ledger", _vp),
        ("ledger_slots", ctypes.c_int64), ("record_bytes", ctypes.c_int64),
        ("gen_offset", ctypes.c_int64), ("state_offset", ctypes.c_int64),
        ("region_id", ctypes.c_uint64),
    ]


class OutcomeStruct(ctypes.Structure):
    """``tc_outcome``: what one ``tc_transfer`` did."""

    _fields_ = [
        ("code", ctypes.c_int32), ("cu", ctypes.c_int32), ("num_bytes", ctypes.c_int64),
        ("seq", ctypes.c_uint64), ("spans_ns", ctypes.c_int64 * 4),
    ]


class NdarrayHead(ctypes.Structure):
    """``tc_ndarray``: the head of numpy's ``PyArrayObject_fields`` as the C reads an array
    passed by its object's address (``ndarray_mismatches`` checks it against numpy)."""

    _fields_ = [
        ("ob_refcnt", ctypes.c_ssize_t), ("ob_type", _vp), ("data", _vp),
        ("nd", ctypes.c_int32), ("dimensions", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)), ("base", _vp), ("descr", _vp),
        ("flags", ctypes.c_int32),
    ]


@functools.cache
def ndarray_mismatches(head_type: type[ctypes.Structure] = NdarrayHead) -> tuple[str, ...]:
    """Where numpy's arrays, read as ``head_type`` at their object's address, disagree
    with what numpy says of them (none: ()): type, data address, dimension count, length
    and the C-contiguous flag, of a contiguous array and of a strided view. Checked once
    per process and head type."""
    import numpy as np

    base = np.arange(8, dtype=np.int64)
    lines = []
    for name, a in (("contiguous", base), ("strided", base[::2])):
        head = head_type.from_address(id(a))
        seen = (head.ob_type, head.data, head.nd, head.dimensions[0],
                bool(head.flags & C_CONTIGUOUS_FLAG))
        want = (id(type(a)), address_of(a), a.ndim, a.shape[0], bool(a.flags.c_contiguous))
        if seen != want:
            lines.append(f"a {name} numpy array read as tc_ndarray: (type, data, nd, length, "
                         f"C-contiguous) {seen}, numpy says {want}")
    return tuple(lines)


# C name -> mirror: every struct the Python side passes to the library
MIRRORS: dict[str, type[ctypes.Structure]] = {
    "tc_bounds": BoundsStruct, "tc_geometry": GeometryStruct, "tc_config": ConfigStruct,
    "tc_job": JobStruct, "tc_caller": CallerStruct, "tc_outcome": OutcomeStruct,
    "tc_ndarray": NdarrayHead,
}

Layout = dict[tuple[str, str], tuple[int, int]]  # (struct, field or "") -> (offset, size)


def python_layout() -> Layout:
    """Offset and size of every mirrored field, and each struct's size (field "")."""
    out: Layout = {}
    for name, mirror in MIRRORS.items():
        out[(name, "")] = (0, ctypes.sizeof(mirror))
        for field, *_ in mirror._fields_:
            descriptor = getattr(mirror, field)
            out[(name, field)] = (descriptor.offset, descriptor.size)
    return out


class _Reports(Protocol):
    @property
    def tc_layout(self) -> Callable[..., int]: ...


def c_layout(lib: _Reports) -> Layout:
    """The same table as the compiled C reports it (``tc_layout``)."""
    strct, field = ctypes.c_char_p(), ctypes.c_char_p()
    offset, size = ctypes.c_int64(), ctypes.c_int64()
    out: Layout = {}
    i = 0
    while lib.tc_layout(i, ctypes.byref(strct), ctypes.byref(field), ctypes.byref(offset),
                        ctypes.byref(size)):
        out[((strct.value or b"").decode(), (field.value or b"").decode())] = \
            (offset.value, size.value)
        i += 1
    return out


def layout_mismatches(lib: _Reports) -> list[str]:
    """Every difference between the mirrors and the C structs, one line each (none: [])."""
    c, py = c_layout(lib), python_layout()
    lines = []
    for key in sorted(c.keys() | py.keys()):
        strct, field = key
        what = f"{strct}.{field}" if field else f"sizeof({strct})"
        if key not in py:
            lines.append(f"{what}: in C (offset, size {c[key]}), not mirrored in Python")
        elif key not in c:
            lines.append(f"{what}: mirrored in Python (offset, size {py[key]}), not in C")
        elif c[key] != py[key]:
            lines.append(f"{what}: C (offset, size) {c[key]}, Python {py[key]}")
    return lines
