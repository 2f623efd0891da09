"""The general merge rule the planner's ``merge_at_row_ends`` is held to."""

from __future__ import annotations

import numpy as np


def merge_runs(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fuse neighbouring descriptors that continue each other on both sides."""
    if sizes.size < 2:
        return src, dst, sizes
    joins = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    if not joins.any():
        return src, dst, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)
