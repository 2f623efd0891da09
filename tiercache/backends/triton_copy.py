"""One Triton kernel that copies a table of (src, dst, bytes) descriptors, and its launcher.

Addresses are raw process addresses: GPU memory, or pinned host memory that the GPU
reaches through UVA (``cudaHostRegister`` with default flags maps it at the same
address). ``kernel`` runs it over PCIe; ``staged`` runs it GPU-local to pack and
unpack its staging buffer.

The table is one int64 tensor ``[3, table_stride]`` (row 0 sources, row 1
destinations, row 2 byte counts), built in pinned host memory and copied to the GPU
on the caller's stream (no host sync); a launch covers descriptors
``[first, first + count)`` of it and adds ``src_shift``/``dst_shift`` to every source
and destination (``staged`` keeps slot-relative offsets in the table and passes the
slot's address per launch). Each program strides over descriptors (a persistent
grid of at most ``num_programs``); inside a descriptor it moves ``BLOCK`` elements per
step. The element is the widest access every address and size allows: 16 bytes
(two int64 with a 16-byte alignment hint, so loads and stores are ``v2.b64``), else 8,
4, 2 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from tiercache.errors import BackendError

MAX_ACCESS_BYTES = 16
_THREAD_BYTES_PER_STEP = 128  # bytes each thread moves per step: 8 x 16-byte accesses in flight


@triton.jit(do_not_specialize=["table_stride", "first", "count", "src_shift", "dst_shift"])
def _copy_descriptors(table, table_stride, first, count, src_shift, dst_shift,
                      DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, ALIGN_BYTES: tl.constexpr,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    for i in range(first + pid, first + count, step):
        src = (tl.load(table + i) + src_shift).to(tl.pointer_type(DTYPE))
        dst = (tl.load(table + table_stride + i) + dst_shift).to(tl.pointer_type(DTYPE))
        num = tl.load(table + 2 * table_stride + i) // ELEM_BYTES
        src = tl.multiple_of(src, ALIGN_BYTES)
        dst = tl.multiple_of(dst, ALIGN_BYTES)
        num = tl.multiple_of(num, ALIGN_BYTES // ELEM_BYTES)
        for start in range(0, num, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < num
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


_ELEMENT = {16: (tl.int64, 8), 8: (tl.int64, 8), 4: (tl.int32, 4), 2: (tl.int16, 2),
            1: (tl.int8, 1)}


def access_bytes(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> int:
    """Widest access (16, 8, 4, 2 or 1 bytes) that every address and size is a multiple of."""
    bits = int(np.bitwise_or.reduce(src)) | int(np.bitwise_or.reduce(dst)) \
        | int(np.bitwise_or.reduce(sizes)) | MAX_ACCESS_BYTES
    return bits & -bits


@dataclass(frozen=True)
class DescriptorTable:
    """A descriptor table on the GPU; ``host`` is its pinned source (the caching host
    allocator keeps it until the stream passes the copy, ``device`` lives as long as
    this object is kept)."""

    host: torch.Tensor
    device: torch.Tensor
    num_descriptors: int
    access_bytes: int


def upload_table(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream,
                 access: int | None = None) -> DescriptorTable:
    """Pack the arrays into pinned memory and enqueue their copy to the GPU on ``stream``.

    Call inside ``torch.cuda.stream(stream)`` so the device table belongs to that stream.
    """
    n = int(sizes.size)
    host = torch.empty((3, n), dtype=torch.int64, pin_memory=True)
    view = host.numpy()
    view[0] = src.view(np.int64)
    view[1] = dst.view(np.int64)
    view[2] = sizes.view(np.int64)
    device = torch.empty((3, n), dtype=torch.int64, device=stream.device)
    device.copy_(host, non_blocking=True)
    return DescriptorTable(host, device, n,
                           access_bytes(src, dst, sizes) if access is None else access)


@dataclass(frozen=True)
class CopyKernel:
    """Launch settings: ``num_programs`` bounds the grid (how many SMs the copy may hold)."""

    num_programs: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.num_programs < 1:
            raise BackendError(f"num_programs = {self.num_programs}: must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise BackendError(f"num_warps = {self.num_warps}: must be 1, 2, 4, 8 or 16")

    def block_elements(self, access: int) -> int:
        return self.num_warps * 32 * _THREAD_BYTES_PER_STEP // _ELEMENT[access][1]

    def launch(self, table: DescriptorTable, first: int = 0, count: int | None = None,
               src_shift: int = 0, dst_shift: int = 0) -> None:
        """Enqueue the copy of descriptors ``[first, first + count)`` on the current stream,
        ``src_shift``/``dst_shift`` bytes added to their sources/destinations (multiples of
        the table's ``access_bytes``)."""
        count = table.num_descriptors - first if count is None else count
        if count <= 0:
            return
        dtype, elem_bytes = _ELEMENT[table.access_bytes]
        grid = (min(self.num_programs, count),)
        _copy_descriptors[grid](table.device, table.num_descriptors, first, count,
                                src_shift, dst_shift, DTYPE=dtype, ELEM_BYTES=elem_bytes,
                                ALIGN_BYTES=table.access_bytes,
                                BLOCK=self.block_elements(table.access_bytes),
                                num_warps=self.num_warps)
