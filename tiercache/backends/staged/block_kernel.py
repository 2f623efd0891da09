"""Triton pack/unpack over a ``BlockLayout``: the device expands pairs into pages.

The static tensor table of a ``BlockStaging`` (``tensors``, int64 (4, T): GPU base,
GPU block stride, page bytes, row offset; ``groups``, int64 (2, G): first table entry
and tensor count of each group) is uploaded once (``BlockKernel``). A transfer uploads
its pair table (int64 (4, P): GPU id, row slot offset, sub-page, group) into pinned host
memory that the kernels read through UVA (``PairTables``); each chunk is then one launch
over its pair range::

    program (i, t):  for pairs p = first + i, first + i + grid0, ... < first + count:
        g = pairs[3, p]; if t < count of g:  e = first entry of g + t
        gpu  = gpu_base[e] + pairs[0, p] * gpu_stride[e]
        slot = slot_base + pairs[1, p] + row_offset[e] + pairs[2, p] * page_bytes[e]
        copy page_bytes[e] bytes gpu -> slot (store, ``pack``) or slot -> gpu (load, ``unpack``)

The grid is (pairs, largest group's tensor count): one program per (pair, tensor)
unless ``max_programs`` bounds the first dimension (programs then stride over pairs).
Accesses are ``BlockStaging.access_bytes`` wide (16 bytes as two int64 with a 16-byte
alignment hint, as in ``triton_copy``), which is static: every address and size the
kernel touches is a sum of table entries, row slot offsets (multiples of SLOT_ALIGN)
and the slot base, which must be a multiple of SLOT_ALIGN. Every address is passed as
an int (the pair table may live in device memory or in pinned host memory read
through UVA). The launch arguments that do not change per chunk are bound once, so a
launch is one Triton call with no allocation.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

from tiercache.backends.staged.block_layout import SLOT_ALIGN, BlockStaging
from tiercache.device.driver import CudaDriver
from tiercache.native.chunk_loop import LoopKernel
from tiercache.native.codes import KERNEL_ARGS
from tiercache.errors import BackendError

# parameter bytes of _move_pages as the native loop passes them: addresses i64, the rest i32
LOOP_PARAM_BYTES = (8, 4, 4, 4, 8, 8, 4, 8, 4)

_THREAD_BYTES_PER_STEP = 128  # bytes each thread moves per step: 8 x 16-byte accesses in flight
_ELEMENT = {16: (tl.int64, 8), 8: (tl.int64, 8), 4: (tl.int32, 4), 2: (tl.int16, 2),
            1: (tl.int8, 1)}


@triton.jit(do_not_specialize=["pairs", "pair_stride", "first", "count", "slot_base", "tensors",
                               "tensor_stride", "groups", "num_groups"])
def _move_pages(pairs, pair_stride, first, count, slot_base, tensors, tensor_stride, groups,
                num_groups, STORE: tl.constexpr, DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr,
                ALIGN_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    pair_table = pairs.to(tl.int64).to(tl.pointer_type(tl.int64))
    table = tensors.to(tl.int64).to(tl.pointer_type(tl.int64))
    group_table = groups.to(tl.int64).to(tl.pointer_type(tl.int64))
    t = tl.program_id(1)
    for p in range(first + tl.program_id(0), first + count, tl.num_programs(0)):
        g = tl.load(pair_table + 3 * pair_stride + p)
        if t < tl.load(group_table + num_groups + g):
            e = tl.load(group_table + g) + t
            page = tl.load(table + 2 * tensor_stride + e)
            gpu = tl.load(table + e) + tl.load(pair_table + p) * tl.load(table + tensor_stride + e)
            slot = slot_base + tl.load(pair_table + pair_stride + p) \
                + tl.load(table + 3 * tensor_stride + e) \
                + tl.load(pair_table + 2 * pair_stride + p) * page
            if STORE:
                src, dst = gpu, slot
            else:
                src, dst = slot, gpu
            src = tl.multiple_of(src.to(tl.pointer_type(DTYPE)), ALIGN_BYTES)
            dst = tl.multiple_of(dst.to(tl.pointer_type(DTYPE)), ALIGN_BYTES)
            num = tl.multiple_of(page // ELEM_BYTES, ALIGN_BYTES // ELEM_BYTES)
            for start in range(0, num, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < num
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


class BlockKernel:
    """Pack and unpack launches for one ``BlockStaging`` on ``device`` (the static table
    is uploaded here, once). ``max_programs`` bounds the programs per launch (None: one
    per (pair, tensor)).

    ``compiled_launch``: after the first launch of each direction, call the compiled
    kernel's launcher directly instead of the public ``kernel[grid](...)`` path, which
    re-binds and re-specialises the arguments every time (docs/benchmarks.md, "Host
    path"). The launcher then keeps the first launch's argument types (i64 addresses, i32
    counts); a value outside them raises in the launcher. ``staged`` turns it on.
    """

    def __init__(self, staging: BlockStaging, device: torch.device | str, num_warps: int = 4,
                 max_programs: int | None = None, compiled_launch: bool = False):
        if num_warps not in (1, 2, 4, 8, 16):
            raise BackendError(f"num_warps = {num_warps}: must be 1, 2, 4, 8 or 16")
        if max_programs is not None and max_programs < 1:
            raise BackendError(f"max_programs = {max_programs}: must be >= 1 or None")
        self.staging = staging
        self.tensors = torch.as_tensor(np.ascontiguousarray(staging.tensors), device=device)
        self.groups = torch.as_tensor(
            np.ascontiguousarray(np.stack([staging.group_first, staging.group_count])),
            device=device)
        self.num_tensor_columns = int(staging.group_count.max())
        self.max_pair_programs = None if max_programs is None else \
            max(1, max_programs // self.num_tensor_columns)
        dtype, elem = _ELEMENT[staging.access_bytes]
        self._static = (self.tensors.data_ptr(), staging.tensors.shape[1],
                        self.groups.data_ptr(), staging.num_groups)
        self._constexprs = (dtype, elem, staging.access_bytes,
                            num_warps * 32 * _THREAD_BYTES_PER_STEP // elem)
        self._meta = dict(zip(("DTYPE", "ELEM_BYTES", "ALIGN_BYTES", "BLOCK"), self._constexprs),
                          num_warps=num_warps)
        self.compiled_launch = compiled_launch
        self._compiled: dict[bool, CompiledKernel] = {}  # STORE -> kernel, compiled_launch only

    def pack(self, pairs: int, num_pairs: int, first: int, count: int, slot_base: int) -> None:
        """Store half: copy pages of pairs ``[first, first + count)`` of the pair table at
        address ``pairs`` ((4, num_pairs) int64) into the slot at ``slot_base``, on the
        current stream."""
        self._launch(pairs, num_pairs, first, count, slot_base, True)

    def unpack(self, pairs: int, num_pairs: int, first: int, count: int, slot_base: int) -> None:
        """Load half: the reverse of ``pack`` (slot -> GPU pages)."""
        self._launch(pairs, num_pairs, first, count, slot_base, False)

    def loop_kernel(self, slot_base: int) -> LoopKernel:
        """Both directions compiled now (one launch over no pairs each, on the current
        stream: the addresses passed are only typed, never read) and described for the
        native chunk loop, which launches them with ``cuLaunchKernel``. The parameter
        list is read from the PTX: the loop's nine arguments first, in the sizes it
        passes (``LOOP_PARAM_BYTES``), then Triton's own (scratch pointers), passed as
        zero. Anything else (a different Triton ABI, an interpreted kernel, clusters)
        raises ``BackendError``: the loop would launch it wrongly."""
        if slot_base % SLOT_ALIGN:
            raise BackendError(f"slot_base = {slot_base:#x}: must be a multiple of {SLOT_ALIGN}")
        functions, shared, sizes, warps = [], [], None, None
        for store in (False, True):
            grid = (1, self.num_tensor_columns, 1)
            kernel = _move_pages[grid](self.tensors.data_ptr(), 0, 0, 0, slot_base, *self._static,
                                       STORE=store, **self._meta)
            if not isinstance(kernel, CompiledKernel):
                raise BackendError("the native chunk loop needs the compiled kernel (it was "
                                   "interpreted: TRITON_INTERPRET is set)")
            meta = kernel.metadata
            if getattr(meta, "num_ctas", 1) != 1 \
                    or getattr(meta, "launch_cooperative_grid", False) \
                    or getattr(meta, "launch_pdl", False):
                raise BackendError(f"the pack kernel needs launch attributes the native loop does "
                                   f"not set ({meta})")
            if self.compiled_launch:
                self._compiled[store] = kernel
            params = ptx_param_bytes(kernel.asm["ptx"], kernel.name)
            if tuple(params[:KERNEL_ARGS]) != LOOP_PARAM_BYTES or sizes not in (None, params):
                raise BackendError(f"the pack kernel's parameters are {params} bytes: the native "
                                   f"loop passes {list(LOOP_PARAM_BYTES)} first (Triton ABI "
                                   "changed?)")
            kernel._init_handles()
            functions.append(int(kernel.function))
            shared.append(int(meta.shared))
            sizes, warps = params, int(meta.num_warps)
        assert sizes is not None and warps is not None  # both directions were compiled
        return LoopKernel((functions[0], functions[1]), 32 * warps, (shared[0], shared[1]),
                          self.num_tensor_columns, self.max_pair_programs or 0, len(sizes),
                          self._static)

    def _launch(self, pairs: int, num_pairs: int, first: int, count: int, slot_base: int,
                store: bool) -> None:
        if count <= 0:
            return
        if slot_base % SLOT_ALIGN:
            raise BackendError(f"slot_base = {slot_base:#x}: must be a multiple of {SLOT_ALIGN}")
        grid = (count if self.max_pair_programs is None else min(count, self.max_pair_programs),
                self.num_tensor_columns, 1)
        args = (pairs, num_pairs, first, count, slot_base, *self._static)
        compiled = self._compiled.get(store)
        if compiled is not None:  # every argument of the signature, constexprs included
            compiled[grid](*args, store, *self._constexprs)
            return
        kernel = _move_pages[grid](*args, STORE=store, **self._meta)
        if self.compiled_launch and isinstance(kernel, CompiledKernel):  # None if interpreted
            self._compiled[store] = kernel


def ptx_param_bytes(ptx: str, name: str) -> list[int]:
    """The bytes of each parameter of kernel ``name`` in ``ptx``, in order."""
    found = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.DOTALL)
    if found is None:
        raise BackendError(f"no .entry {name} in the kernel's PTX")
    return [int(bits) // 8 for bits in re.findall(r"\.param\s+\.[a-z]+?(\d+)\b", found.group(1))]


class PairTables:
    """Per-transfer pair tables in pinned host memory, read by the kernels through UVA, for
    block plans issued from Python (the chunk loop keeps tables of its own, the same way:
    ``tiercache.native.chunk_loop.TableDriver``).

    Why host memory: copying each transfer's table to the device costs a torch copy and an
    event of host time per transfer (docs/benchmarks.md, "Host path"); the kernels read
    each pair's 32 bytes once, over PCIe, a negligible share of a launch. ``upload`` writes
    the pairs into a reused pinned buffer and returns its address; ``release`` (after the
    transfer's last launch was enqueued on ``stream``) records the buffer's event, and a
    buffer is reused only once its event has completed, so a table is never overwritten
    while a launch may still read it. Buffers in use are never waited for: a new one is
    allocated instead.
    """

    def __init__(self, device: torch.device | str, driver: CudaDriver | None = None):
        self.device = torch.device(device)
        self.driver = driver or CudaDriver()
        self._idle: list[tuple[torch.Tensor, int]] = []  # (pinned buffer, event)
        self._events: list[int] = []

    def upload(self, pairs: np.ndarray, stream: Any) -> tuple[int, Any]:
        """(address of the (4, P) int64 table the kernels read, token for ``release``)."""
        n = pairs.size
        for i, (host, event) in enumerate(self._idle):
            if host.numel() >= n and self.driver.event_done(event):
                entry = self._idle.pop(i)
                break
        else:
            entry = (torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True),
                     self.driver.event_create())
            self._events.append(entry[1])
        entry[0].numpy()[:n] = pairs.reshape(-1)
        return entry[0].data_ptr(), entry

    def release(self, token: Any, stream: Any) -> None:
        self.driver.event_record(token[1], int(stream.cuda_stream))
        self._idle.append(token)

    def close(self) -> None:
        """Call once nothing in flight reads a table (the backend's close)."""
        for event in self._events:
            self.driver.event_destroy(event)
        self._events, self._idle = [], []
