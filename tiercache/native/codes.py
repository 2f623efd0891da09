"""The values Python and the native code share, mirrored from ``src/codes.h``: one set.

``codes.h`` is the source of truth. Each of its constants has exactly one Python mirror
(``MIRRORS``), and ``constant_mismatches`` compares the two through the library's own
report (``tc_constant``); the binding refuses a library that disagrees
(``tiercache.native.library``), so a code or a limit that drifts on either side fails at
the first use instead of being misread.

``TransferCode`` is what a transfer came to, for the native call (``tc_transfer``) and
for both transfer paths (``tiercache.transfer.path``): queued, refused by the validation
(the ``SPEC_*`` codes: nothing queued; the planner re-checks the transfer so that its
``SpecError`` says why, ``SPEC_ERRORS`` names each briefly), or kept in the order but
copying nothing (``FENCED``, ``MARK_FAILED``, ``SUBMIT_FAILED``). ``Outcome`` carries it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from enum import IntEnum
from typing import Any, NamedTuple, Protocol

from tiercache.device.driver import ABI_12_8
from tiercache.region.ledger import LedgerState


class TransferCode(IntEnum):
    """``TC_*`` of ``codes.h``: what one transfer came to (``Outcome.code``)."""

    QUEUED = 0
    SPEC_GROUPS = 1
    SPEC_GPU_COUNT = 2
    SPEC_CPU_COUNT = 3
    SPEC_GPU_RANGE = 4
    SPEC_CPU_RANGE = 5
    SPEC_REPEATED = 6
    SPEC_NO_MEMORY = 7
    NOT_FLAT = 8  # an id array not 1-d and C-contiguous (the caller's bug: nothing queued)
    FENCED = 100  # the fence refused the slots (or the region): ordering events only
    MARK_FAILED = 101  # the compute stream's mark could not be recorded (``cu`` says why)
    SUBMIT_FAILED = 102  # the backend could not take the job (the Python paths set it)

    @property
    def refused(self) -> bool:
        """A validation refusal: nothing was queued, not even the mark."""
        return TransferCode.SPEC_GROUPS <= self <= TransferCode.SPEC_NO_MEMORY


# What the validation refuses, briefly (the planner's re-check says why in full).
SPEC_ERRORS: dict[int, str] = {
    TransferCode.SPEC_GROUPS: "not one group_sizes entry per KV-cache group",
    TransferCode.SPEC_GPU_COUNT: "group_sizes do not add up to the GPU block ids",
    TransferCode.SPEC_CPU_COUNT: "the region slots are not as many as the groups need",
    TransferCode.SPEC_GPU_RANGE: "a GPU block id out of range",
    TransferCode.SPEC_CPU_RANGE: "a region slot out of range",
    TransferCode.SPEC_REPEATED: "a destination block twice",
    TransferCode.SPEC_NO_MEMORY: "out of memory",
}

STATUS_PENDING = -1  # a job's status cell before its issuer made every call of it
MAX_RING_SLOTS = 64  # ring slots a loop may have
MAX_PARAMS = 16  # the pack kernel's parameters, at most
KERNEL_ARGS = 9  # pairs, pair_stride, first, count, slot_base, tensors, tensor_stride,
#                  groups, num_groups: the first parameters of the pack kernel
ATTRS_BYTES = 24  # sizeof(CUmemcpyAttributes), copied raw into tc_config.attrs
C_CONTIGUOUS_FLAG = 0x0001  # NPY_ARRAY_C_CONTIGUOUS

# C name -> its Python mirror: every constant of codes.h
MIRRORS: dict[str, int] = {
    **{f"TC_{code.name}": int(code) for code in TransferCode},
    "TC_STATUS_PENDING": STATUS_PENDING,
    "TC_LEDGER_WRITING": int(LedgerState.WRITING),
    "TC_LEDGER_READY": int(LedgerState.READY),
    "TC_MAX_RING_SLOTS": MAX_RING_SLOTS,
    "TC_MAX_PARAMS": MAX_PARAMS,
    "TC_KERNEL_ARGS": KERNEL_ARGS,
    "TC_ATTRS_BYTES": ATTRS_BYTES,
    "TC_ABI_12_8": ABI_12_8,
    "TC_NPY_C_CONTIGUOUS": C_CONTIGUOUS_FLAG,
}


class Outcome(NamedTuple):
    """What one transfer came to, on either path: its ``TransferCode`` (an int: the native
    call answers the C's value as it is), the CUresult of a failed mark (0 otherwise), the
    bytes the transfer moves, the ``Ticket`` of what was queued on a backend's thread
    (None: issued already, or nothing was queued), and what its path holds until the
    transfer is reported (``TransferPath.release``; None: nothing). A tuple: one is made
    per transfer."""

    code: int
    cu: int
    num_bytes: int
    ticket: Any
    held: object = None


class _Reports(Protocol):
    @property
    def tc_constant(self) -> Callable[..., int]: ...


def c_constants(lib: _Reports) -> dict[str, int]:
    """Every constant the compiled C reports (``tc_constant``), by name."""
    name, value = ctypes.c_char_p(), ctypes.c_int64()
    out: dict[str, int] = {}
    i = 0
    while lib.tc_constant(i, ctypes.byref(name), ctypes.byref(value)):
        out[(name.value or b"").decode()] = value.value
        i += 1
    return out


def constant_mismatches(lib: _Reports, mirrors: dict[str, int] | None = None) -> list[str]:
    """Every difference between ``mirrors`` (default: ``MIRRORS``) and the C's constants,
    one line each (none: [])."""
    c, py = c_constants(lib), MIRRORS if mirrors is None else mirrors
    lines = []
    for name in sorted(c.keys() | py.keys()):
        if name not in py:
            lines.append(f"{name}: {c[name]} in C, not mirrored in Python")
        elif name not in c:
            lines.append(f"{name}: {py[name]} in Python, not in C")
        elif c[name] != py[name]:
            lines.append(f"{name}: {c[name]} in C, {py[name]} in Python")
    return lines
