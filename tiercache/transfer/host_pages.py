"""``PageMap``: how one engine page held in host memory lies on one region row.

An engine that keeps its KV pages in host memory (SGLang's host pool) describes a page as
``k`` blobs, each contiguous (``page_first``/``page_first_direct``: a K blob and a V blob
of ``layers x tokens x heads x head_dim`` elements; MLA: one blob; ``layer_first``: one
blob per layer and K/V). A region row is its tensors' pages at their offsets
(``RegionLayout.page_offsets``), possibly with alignment gaps between them. The page map
reads both as byte streams, the blobs in order and the row's segments in order, and pairs
them up: a page fits a row when the two streams have the same length. So a row keeps an
engine page byte for byte, whatever the row's tensor split: a region laid out for vLLM
(one tensor per layer, K and V of a layer together) holds an SGLang page of the same
model and the same per-rank bytes (its K blob over the first half of the layers' pages,
its V blob over the rest), and the two engines share one budget. What the bytes mean is
the engine's: the keys say which engine wrote them (``tiercache.sglang.namespace``).

``pieces`` turns ``n`` pages (an ``(n, k)`` array of blob addresses) and ``n`` row
addresses into the flat (destination, source, bytes) arrays a ``HostCopyPool`` copies, in
numpy, no Python per page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tiercache.errors import LayoutMismatchError
from tiercache.region.layout import RegionLayout
from tiercache.specs import Direction


@dataclass(frozen=True)
class PageMap:
    """``blob_bytes``: the engine page's blobs in stream order; ``segments``: the row's
    (offset, bytes) in stream order. Both streams must be equally long."""

    blob_bytes: tuple[int, ...]
    segments: tuple[tuple[int, int], ...]
    _template: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.blob_bytes or any(b <= 0 for b in self.blob_bytes):
            raise LayoutMismatchError(f"an engine page of blobs {list(self.blob_bytes)}: "
                                      "needs >= 1 blob, each > 0 bytes")
        if sum(self.blob_bytes) != sum(n for _, n in self.segments):
            raise LayoutMismatchError(
                f"an engine page of {sum(self.blob_bytes)} bytes ({_blobs(self.blob_bytes)}) "
                f"does not fill a region row of {sum(n for _, n in self.segments)} bytes")
        object.__setattr__(self, "_template", self._pair())

    @classmethod
    def onto(cls, blob_bytes: Sequence[int], layout: RegionLayout) -> PageMap:
        """The map of a page of ``blob_bytes`` onto ``layout``'s rows (one CPU block)."""
        segments = tuple(zip(layout.page_offsets, layout.cpu_page_bytes))
        return cls(tuple(int(b) for b in blob_bytes), segments)

    @property
    def page_bytes(self) -> int:
        return sum(self.blob_bytes)

    @property
    def num_blobs(self) -> int:
        return len(self.blob_bytes)

    @property
    def pieces_per_page(self) -> int:
        return int(self._template.shape[0])

    def _pair(self) -> np.ndarray:
        """(blob index, offset in blob, offset in row, bytes) per piece, stream order."""
        rows: list[tuple[int, int, int, int]] = []
        blob, blob_off = 0, 0
        for seg_off, seg_len in self.segments:
            done = 0
            while done < seg_len:
                take = min(seg_len - done, self.blob_bytes[blob] - blob_off)
                rows.append((blob, blob_off, seg_off + done, take))
                done += take
                blob_off += take
                if blob_off == self.blob_bytes[blob]:
                    blob, blob_off = blob + 1, 0
        return np.array(rows, dtype=np.uint64).reshape(-1, 4)

    def pieces(self, direction: Direction, blob_addrs: np.ndarray, row_addrs: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dst, src, bytes) for copying ``n`` pages: a store (``GPU_TO_CPU``: the engine's
        host pool stands where the GPU does) copies blobs into rows, a load the reverse.
        ``blob_addrs``: uint64 ``(n, num_blobs)``; ``row_addrs``: uint64 ``(n,)``."""
        n = row_addrs.shape[0]
        if blob_addrs.shape != (n, self.num_blobs):
            raise LayoutMismatchError(f"{blob_addrs.shape} blob addresses for {n} rows of "
                                      f"{self.num_blobs} blob(s) each")
        t = self._template
        blob_side = (blob_addrs[:, t[:, 0].astype(np.intp)] + t[:, 1]).reshape(-1)
        row_side = (row_addrs[:, None] + t[:, 2]).reshape(-1)
        lengths = np.tile(t[:, 3], n)
        if direction.stores:
            return row_side, blob_side, lengths
        return blob_side, row_side, lengths


def _blobs(blob_bytes: tuple[int, ...]) -> str:
    sizes = sorted(set(blob_bytes))
    if len(sizes) == 1:
        return f"{len(blob_bytes)} x {blob_bytes[0]} B"
    return "[" + ", ".join(map(str, blob_bytes)) + "]"
