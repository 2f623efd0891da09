"""Fusing descriptors that continue each other on both sides into one.

The general rule (neighbours whose source and destination both continue) is one pass
over every descriptor; the planner's ``merge_at_row_ends`` gets the same result
cheaper: it takes the joins inside each tensor's row from the block ids
(``GroupWork.within_joins``) and checks addresses only where rows meet. The tests hold
it to the general rule (``tests/support/plan_reference.py``).
"""

from __future__ import annotations

import numpy as np


def merge_at_row_ends(gpu_addr: np.ndarray, cpu_addr: np.ndarray, sizes: np.ndarray,
                      shapes: tuple[tuple[int, int], ...], within: list[np.ndarray | None],
                      ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The general merge for descriptors laid out as rows (one per tensor, ``shapes[g]`` =
    (tensors, pages) per group): ``within[g]`` flags, (k, n-1), the joins inside group g's
    rows (None: none); ``ends`` indexes each row's last descriptor but the very last, the
    only places checked on addresses. Compacts the arrays in place."""
    end_joins = ((gpu_addr[ends] + sizes[ends] == gpu_addr[ends + 1])
                 & (cpu_addr[ends] + sizes[ends] == cpu_addr[ends + 1]))
    if all(j is None for j in within) and not end_joins.any():
        return gpu_addr, cpu_addr, sizes
    joins = np.zeros(sizes.size, dtype=bool)  # joins[p]: descriptor p continues into p + 1
    at = 0
    for (rows, cols), flags in zip(shapes, within):
        if flags is not None:
            joins[at:at + rows * cols].reshape(rows, cols)[:, :-1] = flags
        at += rows * cols
    joins[ends] = end_joins
    starts = np.flatnonzero(np.concatenate(([True], ~joins[:-1])))
    count = starts.size  # compact in place: starts[i] >= i, and take/reduceat buffer overlaps
    np.add.reduceat(sizes, starts, out=sizes[:count])
    np.take(gpu_addr, starts, out=gpu_addr[:count])
    np.take(cpu_addr, starts, out=cpu_addr[:count])
    return gpu_addr[:count], cpu_addr[:count], sizes[:count]
