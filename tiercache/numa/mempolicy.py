"""The kernel's NUMA memory-policy calls, through ctypes: ``mbind``, ``get_mempolicy`` and
``move_pages``. No libnuma: glibc has no wrappers for them, so they go through
``syscall(2)`` with each architecture's numbers, and libnuma would be one more system
package for three calls.

Decisions and their reasons:

* **MPOL_PREFERRED, not MPOL_BIND.** Pages of a tmpfs file that a bound policy cannot
  place on its node are an allocation failure: ``posix_fallocate`` fails, or a fault
  invokes the OOM killer constrained to the policy's nodes. A preferred node falls back
  to the others when it is full, so the region's promise (``/dev/shm`` shortages are a
  start-up error, never a SIGBUS or an OOM kill later) stays whole; a slice that spilled
  is not hidden: the fraction of its pages on the node is measured and exported.
* **On a tmpfs mapping the policy is the file's, not the mapping's.** ``mbind`` over a
  ``MAP_SHARED`` mapping of ``/dev/shm`` sets a *shared policy* on that range of the file
  (the kernel's ``shmem_set_policy``): every later allocation of those pages, by any
  process, through a fault or ``posix_fallocate``, follows it, and any process mapping
  the file reads it back with ``get_mempolicy(MPOL_F_ADDR)`` (measured:
  docs/benchmarks.md, "NUMA placement of rank slices").
* **Counting with move_pages in query mode** (a null nodes array): exact, per page, for
  a range of this process's mapping, and safe to run from several threads at once (it
  takes the mapping lock for reading). ``/proc/self/numa_maps`` counts the same pages but
  walks every mapping of the process, and an engine's process maps a lot.
* **Errors are values of** ``NumaError`` naming the call, the range or node and the errno.
  In a container ``EPERM`` is common (Docker's default seccomp profile allows these calls
  only with ``CAP_SYS_NICE``); the callers decide whether that stops anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
from enum import IntEnum

import numpy as np

from tiercache.errors import ArgumentError, NumaError

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # what move_pages counts in
MAX_NODES = 1024  # bits of the node masks passed (the kernel's largest MAX_NUMNODES)
_MASK_WORDS = MAX_NODES // 64
_QUERY_CHUNK_PAGES = 1 << 16  # per move_pages call: 768 KiB of address and status arrays
# (mbind, get_mempolicy, move_pages) per architecture (asm/unistd.h)
_SYSCALLS = {"x86_64": (237, 239, 279), "aarch64": (235, 236, 239)}
_MPOL_F_ADDR = 2  # get_mempolicy: the policy of the mapping at addr
MPOL_MF_MOVE = 2  # move_pages / mbind: move pages mapped by this process only

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.syscall.restype = ctypes.c_long


class PolicyMode(IntEnum):
    """The kernel's ``MPOL_*`` modes (linux/mempolicy.h)."""

    DEFAULT = 0
    PREFERRED = 1
    BIND = 2
    INTERLEAVE = 3
    LOCAL = 4
    PREFERRED_MANY = 5
    WEIGHTED_INTERLEAVE = 6

    @property
    def label(self) -> str:
        return self.name.lower()


def _numbers() -> tuple[int, int, int]:
    machine = platform.machine()
    if machine not in _SYSCALLS:
        raise NumaError(f"NUMA calls are not wired for this architecture ({machine!r}); "
                        f"known: {', '.join(_SYSCALLS)}")
    return _SYSCALLS[machine]


def _mask(node: int) -> ctypes.Array[ctypes.c_ulong]:
    if not isinstance(node, int) or not 0 <= node < MAX_NODES:
        raise ArgumentError(f"NUMA node {node!r}: allowed 0..{MAX_NODES - 1}")
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    mask[node // 64] = 1 << (node % 64)
    return mask


def _failed(call: str, what: str) -> NumaError:
    err = ctypes.get_errno()
    hint = (" (a container without CAP_SYS_NICE: Docker's default seccomp profile refuses "
            "NUMA policy calls)" if err == errno.EPERM else "")
    return NumaError(f"{call} {what} failed: {errno.errorcode.get(err, err)} "
                     f"({os.strerror(err)}){hint}")


def bind_preferred(address: int, length: int, node: int, move: bool = False) -> None:
    """``mbind(address, length, MPOL_PREFERRED, {node})``: pages of the range allocated from
    now on come from ``node`` while it has room; on a tmpfs mapping the policy is the
    file's (module docstring). ``move`` adds ``MPOL_MF_MOVE``. Raises ``NumaError``."""
    if address % PAGE_BYTES or length <= 0:
        raise ArgumentError(f"mbind range {address:#x}+{length}: the address must be "
                            f"{PAGE_BYTES}-byte aligned and the length positive")
    mask = _mask(node)
    number = _numbers()[0]
    rc = _libc.syscall(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(length),
                       ctypes.c_int(PolicyMode.PREFERRED), mask, ctypes.c_ulong(MAX_NODES + 1),
                       ctypes.c_uint(MPOL_MF_MOVE if move else 0))
    if rc != 0:
        raise _failed("mbind", f"(MPOL_PREFERRED, node {node}) over {length} bytes at "
                               f"{address:#x}")


def policy_at(address: int) -> tuple[PolicyMode, tuple[int, ...]]:
    """The policy that governs the page at ``address`` of this process's mappings (for a
    tmpfs mapping: the file's shared policy there): its mode and nodes."""
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    number = _numbers()[1]
    rc = _libc.syscall(ctypes.c_long(number), ctypes.byref(mode), mask,
                       ctypes.c_ulong(MAX_NODES), ctypes.c_void_p(address),
                       ctypes.c_ulong(_MPOL_F_ADDR))
    if rc != 0:
        raise _failed("get_mempolicy", f"(MPOL_F_ADDR) at {address:#x}")
    nodes = tuple(n for n in range(MAX_NODES) if mask[n // 64] >> (n % 64) & 1)
    return PolicyMode(mode.value), nodes


def _move_pages(addresses: np.ndarray, nodes: np.ndarray | None) -> np.ndarray:
    status = np.empty(len(addresses), dtype=np.int32)
    number = _numbers()[2]
    rc = _libc.syscall(ctypes.c_long(number), ctypes.c_int(0), ctypes.c_ulong(len(addresses)),
                       ctypes.c_void_p(addresses.ctypes.data),
                       None if nodes is None else ctypes.c_void_p(nodes.ctypes.data),
                       ctypes.c_void_p(status.ctypes.data),
                       ctypes.c_int(0 if nodes is None else MPOL_MF_MOVE))
    if rc < 0:
        what = "(query)" if nodes is None else "(move)"
        raise _failed("move_pages", f"{what} of {len(addresses)} pages from "
                                    f"{int(addresses[0]):#x}")
    return status


def _page_addresses(address: int, length: int) -> np.ndarray:
    if address % PAGE_BYTES or length < 0:
        raise ArgumentError(f"page range {address:#x}+{length}: the address must be "
                            f"{PAGE_BYTES}-byte aligned and the length >= 0")
    return np.arange(address, address + length, PAGE_BYTES, dtype=np.uint64)


def page_nodes(address: int, length: int) -> np.ndarray:
    """The node of every page of ``[address, address + length)`` in this process's
    mapping (int32; a negative value is ``-errno``: ``-ENOENT`` for a page not mapped
    here yet). Raises ``NumaError`` when the call itself fails."""
    addresses = _page_addresses(address, length)
    parts = [_move_pages(addresses[i:i + _QUERY_CHUNK_PAGES], None)
             for i in range(0, len(addresses), _QUERY_CHUNK_PAGES)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)


def move_to_node(addresses: np.ndarray, node: int) -> np.ndarray:
    """Move the pages at ``addresses`` (uint64, page-aligned) to ``node`` (``MPOL_MF_MOVE``:
    pages another process also maps stay, with status ``-EACCES``); returns each page's
    node afterwards, or ``-errno``."""
    _mask(node)  # the node's range check
    targets = np.full(min(len(addresses), _QUERY_CHUNK_PAGES), node, dtype=np.int32)
    parts = [_move_pages(addresses[i:i + _QUERY_CHUNK_PAGES],
                         targets[:len(addresses[i:i + _QUERY_CHUNK_PAGES])])
             for i in range(0, len(addresses), _QUERY_CHUNK_PAGES)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
