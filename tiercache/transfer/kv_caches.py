"""The forms ``gpu_caches`` may take, turned into one ``PageArray`` per region tensor.

Accepted forms (``attach(..., gpu_caches)``):

* a list of tensors, one per region tensor, each with the block dimension first,
  ``(num_blocks, ...)``, whose per-block slice ``t[b]`` is contiguous. ``t.stride(0)`` may
  exceed the block (padding), and ``t[b]`` may hold more than the region's
  ``page_bytes[t]`` (trailing padding): only the real ``page_bytes[t]`` are copied;
* K and V in one allocation, ``(2, num_blocks, ...)``: pass ``split_kv(tensors)``, which
  gives ``t[0], t[1]`` for each tensor (two page sources with different base addresses);
* a cross-layer layout ``(num_blocks, num_layers, ...)``: one tensor (alone or in a
  list), whole block per page;
* ``PageArray`` values for anything else (explicit addresses), mixed freely with tensors.

Tensors may be CUDA tensors (GPU backends) or CPU tensors (the ``cpu`` backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tiercache.errors import ArgumentError
from tiercache.pages import PageArray

if TYPE_CHECKING:
    from tiercache.region.shared import SharedOffloadRegion

GpuCaches = torch.Tensor | Sequence[torch.Tensor | PageArray]


def split_kv(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``(2, num_blocks, ...)`` tensors (K and V in one allocation) -> ``[K0, V0, K1, V1, ...]``."""
    halves: list[torch.Tensor] = []
    for i, t in enumerate(tensors):
        if t.dim() < 2 or t.shape[0] != 2:
            raise ArgumentError(
                f"tensor {i} has shape {tuple(t.shape)}: split_kv expects (2, num_blocks, ...)")
        halves.extend((t[0], t[1]))
    return halves


def slice_tensors(region: SharedOffloadRegion, rank: int) -> list[torch.Tensor]:
    """``rank``'s slice of the region as one int8 torch view per region tensor,
    ``(num_blocks, cpu_page_bytes[t])`` with stride ``(row_stride, 1)``. Here, in the
    worker wing, not on the region: the coordinator maps the region without torch."""
    layout = region.layout
    base = torch.from_numpy(region.rank_array(rank).reshape(-1)).view(torch.int8)
    return [torch.as_strided(base, (layout.num_blocks, size), (layout.row_stride, 1), offset)
            for size, offset in zip(layout.cpu_page_bytes, layout.page_offsets)]


def page_arrays_of(caches: GpuCaches, page_bytes: Sequence[int], pages_per_block: int = 1
                   ) -> tuple[PageArray, ...]:
    """One PageArray per region tensor, checked against the region's ``page_bytes``."""
    items = [caches] if isinstance(caches, torch.Tensor) else list(caches)
    if len(items) != len(page_bytes):
        raise ArgumentError(
            f"{len(items)} KV tensors given, but the region holds {len(page_bytes)} per block "
            "(for (2, num_blocks, ...) K/V tensors pass split_kv(tensors))")
    arrays = []
    for t, (item, size) in enumerate(zip(items, page_bytes)):
        if isinstance(item, PageArray):
            if item.page_bytes != size or item.pages_per_block != pages_per_block:
                raise ArgumentError(
                    f"gpu_caches[{t}] = {item}: the region expects page_bytes={size}, "
                    f"pages_per_block={pages_per_block}")
            arrays.append(item)
        elif isinstance(item, torch.Tensor):
            try:
                arrays.append(PageArray.from_tensor(item, size, pages_per_block))
            except ArgumentError as e:
                raise ArgumentError(f"gpu_caches[{t}]: {e}") from None
        else:
            raise ArgumentError(f"gpu_caches[{t}] is a {type(item).__name__}: expected a "
                                "torch.Tensor or a PageArray")
    return tuple(arrays)


def device_of(caches: GpuCaches) -> torch.device | None:
    """The device of the tensors in ``caches`` (None when only PageArrays are given);
    mixing devices is refused."""
    items = [caches] if isinstance(caches, torch.Tensor) else list(caches)
    devices = {t.device for t in items if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ArgumentError(f"gpu_caches span several devices: {sorted(map(str, devices))}")
    return devices.pop() if devices else None
