"""The copy-backend contract: what byte-moving code guarantees to the handlers.

A ``CopyPlan`` is flat numpy arrays of (src address, dst address, bytes), already
validated and merged by the planner; a backend only moves bytes. Addresses are
process virtual addresses: GPU memory, or host memory of the region (pinned and
UVA-mapped when the worker pinned its slice).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.region.stats import BackendCode, Direction


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """Descriptors of one transfer; ``src[i] -> dst[i]``, ``sizes[i]`` bytes each.

    Arrays are uint64, equal length, read-only; copies never overlap each other.
    """

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    direction: Direction

    @property
    def num_descriptors(self) -> int:
        return int(self.sizes.size)

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum(dtype=np.uint64))


class CopyBackend(ABC):
    """Moves the bytes of a plan, ordered on a stream.

    Guarantees: ``copy_async`` enqueues every copy of the plan on ``stream`` and
    returns without waiting for the device; copies start only after work already
    enqueued on ``stream`` (the handler makes the stream wait for the compute stream
    and for the previous transfer first) and finish before work enqueued after them.
    The returned object must be kept alive by the caller until the stream has passed
    the copies (it owns pointer arrays, staging space, etc.). On failure to submit it
    raises ``BackendError`` and leaves nothing enqueued that it cannot account for.
    """

    code: BackendCode

    @abstractmethod
    def copy_async(self, plan: CopyPlan, stream: Any) -> Any:
        """Enqueue the plan's copies on ``stream``; return a keep-alive token."""

    def close(self) -> None:
        """Release buffers; called once after every transfer has finished."""
