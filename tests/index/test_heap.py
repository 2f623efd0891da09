"""The index's C heap (``tiercache.index.heap``): once an index exists, a large block is a
mapping of its own whichever thread allocates it and whatever was freed before, so that
freeing it (a rebuilt key dict's old table) returns it to the system."""

from __future__ import annotations

import ctypes
import threading

import pytest

from tiercache.index.heap import MAPPED_BLOCK_BYTES
from tiercache.index.manager import OffloadingManager

IS_MMAPPED = 0x2  # glibc: the bit of a chunk's size field that marks a mapped chunk


def _glibc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        pytest.skip("not glibc")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _is_mapping(address: int) -> bool:
    return bool(ctypes.c_size_t.from_address(address - ctypes.sizeof(ctypes.c_size_t)).value
                & IS_MMAPPED)


def test_a_large_block_of_a_thread_is_a_mapping_after_a_larger_one_was_freed():
    libc = _glibc()
    OffloadingManager(16)
    mapped: list[bool] = []

    def serving_thread() -> None:  # the control server's: an arena of its own
        # By default, freeing a mapped 16 MiB block raises glibc's mmap threshold to
        # 16 MiB, and the next 2 MiB block comes from this thread's arena, whose top
        # malloc_trim never gives back.
        big = libc.malloc(16 << 20)
        assert big
        libc.free(big)
        block = libc.malloc(2 * MAPPED_BLOCK_BYTES)
        assert block
        mapped.append(_is_mapping(block))
        libc.free(block)
        small = libc.malloc(MAPPED_BLOCK_BYTES // 8)  # a request's buffer stays in the heap
        assert small
        mapped.append(_is_mapping(small))
        libc.free(small)

    thread = threading.Thread(target=serving_thread)
    thread.start()
    thread.join()
    assert mapped == [True, False]
