"""``PoolPages``: the addresses of SGLang host-pool pages, for any number of pages at once.

SGLang's zero-copy contract is ``host_pool.get_page_buffer_meta(indices)``: the pointers
and sizes of each page's blobs, computed in a Python loop per page. The backend needs them
for up to 128 pages per call on SGLang's I/O threads, so it learns the rule once instead:
at registration it asks the pool for page 0, page 1 and the last page and derives, per
blob, a base address and a per-token stride (every layout's pointer is affine in the
page's first token index). The rule is checked against the pool's own answer for the last
page (a pool whose addresses are not affine, or whose blobs differ in size across pages,
is refused at attach, naming what differed), so a later SGLang that changes its layouts
fails loudly rather than copying the wrong bytes. Then ``addresses`` is numpy: no Python
per page. Indices are checked against the pool's size before any address is used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiercache.errors import ArgumentError, LayoutMismatchError


class PoolPages:
    """Page addresses of one SGLang ``HostKVCache`` (see the module docstring)."""

    def __init__(self, pool: Any):
        self.page_size = int(pool.page_size)
        self.size = int(pool.size)  # tokens the pool holds
        if self.size < 2 * self.page_size:
            raise LayoutMismatchError(f"an SGLang host pool of {self.size} tokens holds fewer "
                                      f"than two pages of {self.page_size}")
        first, sizes = self._meta(pool, 0)
        second, sizes1 = self._meta(pool, self.page_size)
        last_start = (self.size // self.page_size - 1) * self.page_size
        last, sizes_last = self._meta(pool, last_start)
        if not sizes or sizes != sizes1 or sizes != sizes_last or len(first) != len(sizes):
            raise LayoutMismatchError(
                f"the SGLang host pool's pages differ in blobs: page 0 {sizes}, page 1 "
                f"{sizes1}, last page {sizes_last}; tiercache needs one blob list per page")
        step = second - first
        if np.any(step % self.page_size):
            raise LayoutMismatchError(f"SGLang page addresses step by {step.tolist()} bytes per "
                                      f"page of {self.page_size} tokens: not per-token affine")
        self.base = first
        self.per_token = step // self.page_size
        predicted = self.base + np.uint64(last_start) * self.per_token
        if not np.array_equal(predicted, last):
            raise LayoutMismatchError(
                "the SGLang host pool's last page is not where its first two predict "
                f"(predicted {predicted.tolist()[:4]}..., pool {last.tolist()[:4]}...): "
                "its layout is not one tiercache can address")
        self.blob_bytes = tuple(sizes)

    def _meta(self, pool: Any, start: int) -> tuple[np.ndarray, tuple[int, ...]]:
        indices = torch.arange(start, start + self.page_size, dtype=torch.int64)
        ptrs, sizes = pool.get_page_buffer_meta(indices)
        return np.array(ptrs, dtype=np.uint64), tuple(int(s) for s in sizes)

    def addresses(self, host_indices: torch.Tensor, num_pages: int) -> np.ndarray:
        """uint64 ``(num_pages, num_blobs)`` blob addresses of the first ``num_pages`` pages
        of ``host_indices`` (SGLang's token indices, ``page_size`` per page)."""
        tokens = host_indices.detach().to("cpu", torch.int64).numpy()
        if tokens.size < num_pages * self.page_size:
            raise ArgumentError(f"{tokens.size} host indices for {num_pages} pages of "
                                f"{self.page_size} tokens")
        starts = tokens[: num_pages * self.page_size: self.page_size]
        if starts.size and (int(starts.min()) < 0
                            or int(starts.max()) + self.page_size > self.size):
            raise ArgumentError(f"host indices {int(starts.min())}..{int(starts.max())} fall "
                                f"outside the host pool's {self.size} tokens")
        return self.base[None, :] + starts.astype(np.uint64)[:, None] * self.per_token[None, :]
