"""Key namespaces: which engines may share blocks on one coordinator.

A block's bytes are interchangeable between two engines only when everything that shapes
them is equal: the model, the KV dtype, the KV layout, the parallel layout (TP/PP/PCP/DCP
and world size: each rank holds its own shard), the tokens per block and per chunk, the
hash granularity, the offloaded groups and tiercache's formats. ``Namespace`` digests all
of that into ``NAMESPACE_BYTES`` bytes that prefix every key the adapter sends, so engines
of one namespace share and engines of different namespaces never see each other's keys,
even on one coordinator (mixing would load another model's KV: a silently wrong answer,
the failure LMCache#4492 showed after a restart).

``epoch`` counts this engine's cache resets: a reset (vLLM's ``reset_prefix_cache``,
typically after new weights) moves the engine to a fresh namespace, so it never loads a
block computed before it, without wiping what other engines on the node still use.
``salt`` is the operator's extra identity (e.g. a model revision when two deployments use
one model path for different weights).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

from tiercache.region.layout import FORMAT_VERSION

NAMESPACE_BYTES = 8
KEY_FORMAT_VERSION = 1  # how the adapter builds wire keys: digest + vLLM's OffloadKey


@dataclass(frozen=True)
class GroupShape:
    """One offloaded KV-cache group as vLLM announces it."""

    tokens_per_block: int
    layer_names: tuple[str, ...]
    sliding_window_chunks: int | None


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two engines' blocks interchangeable (see the module docstring)."""

    model: str
    kv_dtype: str
    kv_layout: str
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    tokens_per_hash: int
    blocks_per_chunk: int
    groups: tuple[GroupShape, ...]
    salt: str = ""
    epoch: int = 0
    region_format: int = FORMAT_VERSION
    key_format: int = KEY_FORMAT_VERSION

    @property
    def description(self) -> str:
        """The canonical text the digest is the SHA-256 of: what the engine tells the
        coordinator (DESCRIBE) so its event stream can publish this namespace's blocks
        with vLLM's hashes (``tiercache.link.namespaces``)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> bytes:
        """``NAMESPACE_BYTES`` bytes prefixed to every key of this namespace."""
        return hashlib.sha256(self.description.encode()).digest()[:NAMESPACE_BYTES]

    def next_epoch(self) -> Namespace:
        return replace(self, epoch=self.epoch + 1)

    def describe(self) -> str:
        tokens = sorted({g.tokens_per_block for g in self.groups})
        return (f"{self.model} {self.kv_dtype} {self.kv_layout}, TP{self.tp_size} PP{self.pp_size} "
                f"PCP{self.pcp_size} DCP{self.dcp_size} (world {self.world_size}), "
                f"{'/'.join(map(str, tokens))} tokens per block x {self.blocks_per_chunk} "
                f"per chunk, "
                f"{len(self.groups)} group(s)" + (f", salt {self.salt!r}" if self.salt else "")
                + (f", epoch {self.epoch}" if self.epoch else "") + f" -> {self.digest.hex()}")
