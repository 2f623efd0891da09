"""One native call per transfer: what ``tc_transfer`` checks a transfer against, and what
it answers.

Why: on the engine's thread a staged transfer used to be four steps of Python around
native calls (the planner's ``tc_validate``, the fence's numpy gather, the compute
stream's mark, the chunk loop's ``tc_submit``), each building objects and touching code
that a step of the engine's own Python has pushed out of the caches, so most of a
call's host time was the Python between the calls (measured in docs/benchmarks.md, "The
engine's pattern: host time per call and the GIL"). ``tc_transfer`` does the four in C, in
one call that keeps the GIL, with the same rules: the planner's validation (a refusal
is re-checked in numpy so that the ``SpecError`` says why), the fence's rule
(``tiercache.transfer.fence``), the mark before the copies, and the chunk loop's order.

``TransferChecks`` holds the constant half (``tc_caller``): the validator's bounds, each
group's bytes per pair, and the fence's ledger (``FenceTable``); what the call answers is
an ``Outcome`` with a ``TransferCode`` (``tiercache.native.codes``). Its caller is the
native transfer path (``tiercache.transfer.native_path``). Torch-free.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiercache.errors import BackendError
from tiercache.native.structs import CallerStruct, address_of, ndarray_mismatches
from tiercache.native.validator import NativeValidator


@dataclass(frozen=True)
class FenceTable:
    """The slot fence as the native call reads it: the identity of the region mapped and
    the index ledger's records in this worker's mapping (a structured array with the
    fields ``gen`` (u64) and ``state`` (u32), ``IndexLedger.table``)."""

    region_id: int
    ledger: np.ndarray

    def __post_init__(self) -> None:
        fields = dict(self.ledger.dtype.fields or {})
        want = {"gen": np.dtype("<u8"), "state": np.dtype("<u4")}
        if any(name not in fields or fields[name][0] != dtype for name, dtype in want.items()) \
                or self.ledger.ndim != 1 or not self.ledger.flags.c_contiguous:
            raise BackendError(f"a fence table needs a contiguous 1-d ledger with a u64 "
                               f"'gen' and a u32 'state'; got {self.ledger.dtype} of shape "
                               f"{self.ledger.shape}")


class TransferChecks:
    """``tc_caller`` over a planner's ``validator`` and ``pair_bytes`` (one entry per
    KV-cache group) and, optionally, the fence. Holds what the struct points to."""

    def __init__(self, validator: NativeValidator, pair_bytes: Sequence[int],
                 fence: FenceTable | None = None):
        mismatches = ndarray_mismatches()  # numpy's array head as the C reads it
        if mismatches:
            raise BackendError("the native transfer call cannot read this numpy's arrays: "
                               + "; ".join(mismatches))
        if len(pair_bytes) != validator.num_groups:
            raise BackendError(f"{len(pair_bytes)} pair sizes for {validator.num_groups} "
                               "KV-cache groups: one per group")
        self._pair_bytes = np.ascontiguousarray(pair_bytes, dtype=np.int64)
        self._points_into = (validator, fence)  # the struct reads their memory
        c = CallerStruct()
        c.bounds, c.pair_bytes = validator.bounds_address, address_of(self._pair_bytes)
        if fence is not None:
            fields = dict(fence.ledger.dtype.fields or {})  # checked: gen and state are there
            c.ledger = address_of(fence.ledger)  # never NULL (numpy allocates >= 1 byte)
            c.ledger_slots, c.record_bytes = fence.ledger.size, fence.ledger.dtype.itemsize
            c.gen_offset, c.state_offset = fields["gen"][1], fields["state"][1]
            c.region_id = fence.region_id
        self._struct = c
        self.ref = ctypes.byref(c)
        self.num_groups = validator.num_groups
        self.groups = validator.groups_type()  # a call's group_sizes, then block_indices
