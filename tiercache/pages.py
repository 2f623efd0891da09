"""Where one KV tensor's pages live, as plain addresses (no torch, no CUDA).

A ``PageArray`` describes the pages of one tensor on one side of a transfer::

    page (block b, sub-page j) = base_address + b * block_stride_bytes + j * page_bytes

GPU tensors have one page per block (``pages_per_block = 1``); a rank's slice of the
region has ``block_size_factor`` GPU-sized sub-pages per CPU block, back to back.
``block_stride_bytes`` may exceed the page (padded pages, rows holding other tensors'
pages, K and V halves of one allocation); only ``page_bytes`` are ever copied.
How torch tensors become PageArrays: ``tiercache.transfer.kv_caches``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiercache.errors import ArgumentError


@dataclass(frozen=True)
class PageArray:
    """The pages of one tensor at fixed process addresses (validated at construction)."""

    base_address: int
    num_blocks: int
    block_stride_bytes: int
    page_bytes: int
    pages_per_block: int = 1

    def __post_init__(self) -> None:
        for name in ("base_address", "num_blocks", "block_stride_bytes", "page_bytes",
                     "pages_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ArgumentError(f"PageArray.{name} = {value!r}: must be an int")
        if self.base_address <= 0:
            raise ArgumentError(f"PageArray.base_address = {self.base_address}: must be > 0")
        if self.num_blocks < 1 or self.page_bytes < 1 or self.pages_per_block < 1:
            raise ArgumentError(
                f"PageArray(num_blocks={self.num_blocks}, page_bytes={self.page_bytes}, "
                f"pages_per_block={self.pages_per_block}): each must be >= 1")
        if self.num_blocks > 1 and self.block_stride_bytes < self.block_bytes:
            raise ArgumentError(
                f"PageArray block_stride_bytes = {self.block_stride_bytes} is smaller than a "
                f"block's pages ({self.pages_per_block} x {self.page_bytes} bytes): blocks "
                "would overlap")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's pages (what a block holds, without padding)."""
        return self.pages_per_block * self.page_bytes

    @classmethod
    def from_tensor(cls, tensor: Any, page_bytes: int, pages_per_block: int = 1) -> PageArray:
        """Describe a ``(num_blocks, ...)`` tensor whose slice ``tensor[b]`` holds block b.

        ``tensor[b]`` must be contiguous and hold at least ``pages_per_block * page_bytes``
        bytes (more is padding, never copied). Works on any torch tensor (CPU or CUDA)
        without touching the device: only ``data_ptr``, strides and sizes are read.
        """
        if tensor.dim() < 1 or tensor.shape[0] < 1:
            raise ArgumentError(
                f"tensor of shape {tuple(tensor.shape)}: need the block dimension first, "
                "(num_blocks >= 1, ...)")
        block = tensor[0]
        if not block.is_contiguous():
            raise ArgumentError(
                f"tensor of shape {tuple(tensor.shape)} and strides {tuple(tensor.stride())}: "
                "one block's slice tensor[b] must be contiguous (the block dimension must be "
                "outermost in memory)")
        item = tensor.element_size()
        slot_bytes = block.numel() * item
        if slot_bytes < pages_per_block * page_bytes:
            raise ArgumentError(
                f"tensor of shape {tuple(tensor.shape)} holds {slot_bytes} bytes per block, but "
                f"the region expects {pages_per_block} x {page_bytes} bytes")
        return cls(base_address=tensor.data_ptr(), num_blocks=int(tensor.shape[0]),
                   block_stride_bytes=tensor.stride(0) * item, page_bytes=page_bytes,
                   pages_per_block=pages_per_block)

