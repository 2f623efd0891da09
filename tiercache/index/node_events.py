"""What the node holds, as it changes: the hook the node's KV events hang on.

The index and its tier chain call one ``NodeEvents`` for every change to what the node
holds, whoever caused it: a block readable in host memory (stored by any engine, promoted
from a lower tier) or gone from it (evicted, reset), and a block a lower tier came to hold
or stopped holding (``medium`` is the tier's, e.g. ``STORAGE`` for the disk). The
publisher (``tiercache.events``) turns them into vLLM-format KV events for routers.

Calls are made under the index's lock, from the control server's thread and the tier
chain's: an implementation must be thread-safe, O(len(keys)), and never block or do I/O
(buffer, bounded, and let a thread of its own send).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tiercache.specs import Medium


class NodeEvents(Protocol):
    def stored(self, keys: Sequence[bytes], medium: Medium) -> None:
        """``keys`` are now readable in ``medium``."""

    def removed(self, keys: Sequence[bytes], medium: Medium) -> None:
        """``keys`` are no longer held in ``medium``."""

    def cleared(self, medium: Medium) -> None:
        """Everything ``medium`` held is gone (host memory's reset)."""
