"""What the bench moves: one rank's pages, shaped like a real model's KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.region.layout import RegionLayout

KIB, MIB = 1 << 10, 1 << 20
TRANSFER_BYTES = 512 * MIB
DEFAULT_TENSORS = 64  # 32 layers x K, V
DEFAULT_PAGE_KIB = (16, 32, 64, 2048)
BLOCKS_PER_TENSOR = 256  # at most this many tensors' worth of blocks decides the tensor count
HOST_TRANSFERS = 4  # host rows for four transfers: store and load sets never overlap
GPU_TRANSFERS = 2


@dataclass(frozen=True)
class Workload:
    """``blocks_per_transfer`` blocks of ``num_tensors`` pages of ``page_bytes`` each."""

    page_bytes: int
    num_tensors: int
    blocks_per_transfer: int

    @classmethod
    def for_page(cls, page_bytes: int, transfer_bytes: int = TRANSFER_BYTES,
                 max_tensors: int = DEFAULT_TENSORS) -> Workload:
        """``transfer_bytes`` per transfer: as many tensors as keep >= 256 blocks, at most
        ``max_tensors`` (a 2 MiB page is one cross-layer tensor)."""
        tensors = max(1, min(max_tensors, transfer_bytes // (page_bytes * BLOCKS_PER_TENSOR)))
        return cls(page_bytes, tensors, max(1, transfer_bytes // (page_bytes * tensors)))

    @property
    def pages(self) -> int:
        return self.num_tensors * self.blocks_per_transfer

    @property
    def transfer_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def is_default(self) -> bool:
        """The Llama-3-8B-like shape the latency and submit figures are taken on."""
        return self.page_bytes == 32 * KIB and self.num_tensors == DEFAULT_TENSORS

    def host_layout(self) -> RegionLayout:
        """Region rows for ``HOST_TRANSFERS`` transfers of this workload (one rank)."""
        return RegionLayout(1, HOST_TRANSFERS * self.blocks_per_transfer,
                            (self.page_bytes,) * self.num_tensors)

    def label(self) -> str:
        size = f"{self.page_bytes // MIB} MiB" if self.page_bytes >= MIB \
            else f"{self.page_bytes // KIB} KiB"
        return f"{size} x {self.num_tensors}t x {self.blocks_per_transfer}b"
