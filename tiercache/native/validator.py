"""``tc_validate``: a transfer's ids checked and laid out as block pairs, in C.

The planner's accelerator (``tiercache.planning.planner``): the same rules as the
planner's own validation, on the calling thread, without a numpy call per group. Its
output is the block-plan buffer (``tiercache.planning.plans.BlockPlan``): int64, first
(3, P) — GPU ids, region slots, sub-pages, each non-empty group's pairs back to back
(block_size_factor 1: in ascending slot, stable) — then (G, 2) — group index and pair
count of each non-empty group, in group order (the first ``num_works`` rows are used).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from tiercache.native.codes import TransferCode
from tiercache.native.library import library
from tiercache.native.structs import BoundsStruct, address_of
from tiercache.specs import Direction


class NativeValidator:
    """``tc_validate`` over one geometry: ``factor`` (block_size_factor) and, per KV-cache
    group, its GPU block count and its slot count (the ids' bounds). Builds the library
    at construction (``BackendError`` when it cannot)."""

    def __init__(self, factor: int, num_gpu_blocks: Sequence[int], num_slots: Sequence[int]):
        self._lib = library()
        self._num_gpu_blocks = np.ascontiguousarray(num_gpu_blocks, dtype=np.int64)
        self._num_slots = np.ascontiguousarray(num_slots, dtype=np.int64)
        self.num_groups = int(self._num_gpu_blocks.size)
        self._bounds = BoundsStruct(int(factor), self.num_groups,
                                    address_of(self._num_gpu_blocks), address_of(self._num_slots))
        self._bounds_ref = ctypes.addressof(self._bounds)
        self.groups_type = ctypes.c_int64 * (2 * self.num_groups)  # group_sizes, block_indices

    @property
    def bounds_address(self) -> int:
        """The address of its ``tc_bounds`` (alive as long as this validator)."""
        return self._bounds_ref

    def validate(self, direction: Direction, gpu_ids: np.ndarray, group_sizes: Sequence[int],
                 block_indices: Sequence[int], slots: np.ndarray
                 ) -> tuple[np.ndarray, int] | int:
        """(the block-plan buffer, its number of works), or the refusal's code (a
        ``TransferCode``, ``tiercache.native.codes.SPEC_ERRORS``). Ids are int64 (a spec's
        ``block_ids``); anything else is converted first (the C reads them as such)."""
        g = len(group_sizes)
        if g != self.num_groups:
            return TransferCode.SPEC_GROUPS
        if gpu_ids.dtype != np.int64 or not gpu_ids.flags.c_contiguous:
            gpu_ids = np.ascontiguousarray(gpu_ids, dtype=np.int64)
        if slots.dtype != np.int64 or not slots.flags.c_contiguous:
            slots = np.ascontiguousarray(slots, dtype=np.int64)
        n = gpu_ids.size
        out = np.empty(3 * n + 2 * g, dtype=np.int64)
        rc = self._lib.tc_validate(self._bounds_ref, direction.stores, g,
                                   self.groups_type(*group_sizes, *block_indices),
                                   address_of(gpu_ids), n, address_of(slots), slots.size,
                                   address_of(out))
        return -rc if rc < 0 else (out, rc)
