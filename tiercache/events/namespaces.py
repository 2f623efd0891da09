"""Namespaces as the event stream knows them: which engine family's keys they are, and how
a wire key becomes the hash that engine publishes.

Every key an engine adapter sends starts with its namespace's ``NAMESPACE_BYTES``-byte
digest (``tiercache.vllm.namespace``). The coordinator cannot turn a key into an engine's
hash until an engine has *described* the namespace (the control plane's DESCRIBE verb,
``tiercache.control.namespaces``): the description is the exact text the digest is the
SHA-256 of, so the coordinator computes the digest itself, and a client can describe a
namespace only truthfully (to speak for a namespace it would need a preimage of its digest).

Engine families (``EngineFamily``) each parse their description into a ``NamespaceInfo``
with a ``KeyHasher``:

* **vLLM**: a key is digest + vLLM's ``OffloadKey`` (the chunk's block hash + its KV
  group, u32 big-endian); with ``blocks_per_chunk > 1`` vLLM keys a chunk by its *last*
  block's hash, and so do its own CPU-tier events (the default form: one hash per chunk).
  The published hash is vLLM's ``maybe_convert_block_hash`` of the block hash.
* **SGLang**: reserved (``EngineFamily.SGLANG``); its adapter's description and page hashes
  plug in here as another ``KeyHasher``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

from tiercache.config.events import HashFormat
from tiercache.errors import ProtocolError

NAMESPACE_BYTES = 8
MAX_DESCRIPTION_BYTES = 64 << 10  # a description's text (vLLM's lists every layer's name)
MAX_MODEL_CHARS = 512
_GROUP_BYTES = 4  # vLLM's OffloadKey ends with the KV group index, u32 big-endian
_INT_HASH_MASK = (1 << 64) - 1


class EngineFamily(IntEnum):
    """Whose keys a namespace holds (its wire code in DESCRIBE)."""

    VLLM = 1
    SGLANG = 2


class KeyHasher(Protocol):
    """Turns one wire key of a namespace into (the engine's published hash, KV group);
    None for a key that is not of this engine's shape (it is counted, not published)."""

    def __call__(self, key: bytes) -> tuple[int | bytes, int] | None: ...


@dataclass(frozen=True)
class NamespaceInfo:
    """A described namespace: ``digest`` (the key prefix), whose engine, its model and
    block geometry (tokens per block and blocks per chunk), the description's text."""

    digest: bytes
    family: EngineFamily
    model: str
    block_size: int
    blocks_per_chunk: int
    text: str

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def topic(self, prefix: str) -> bytes:
        """The topic of this namespace's batches: prefix, model, "@", the digest in hex."""
        return f"{prefix}{self.model}@{self.hex}".encode()

    def hasher(self, form: HashFormat) -> KeyHasher:
        return _HASHERS[self.family](self, form)


def digest_of(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:NAMESPACE_BYTES]


def _vllm_hasher(info: NamespaceInfo, form: HashFormat) -> KeyHasher:
    shortest = NAMESPACE_BYTES + 1 + _GROUP_BYTES
    as_int = form is HashFormat.INT

    def hash_of(key: bytes) -> tuple[int | bytes, int] | None:
        if len(key) < shortest:
            return None
        block_hash = key[NAMESPACE_BYTES:-_GROUP_BYTES]
        group = int.from_bytes(key[-_GROUP_BYTES:], "big")
        if as_int:
            return int.from_bytes(block_hash, "big") & _INT_HASH_MASK, group
        return block_hash, group

    return hash_of


def _sglang_hasher(info: NamespaceInfo, form: HashFormat) -> KeyHasher:
    raise ProtocolError("SGLang namespaces are not described yet (no SGLang adapter)")


_HASHERS: dict[EngineFamily, Callable[[NamespaceInfo, HashFormat], KeyHasher]] = {
    EngineFamily.VLLM: _vllm_hasher,
    EngineFamily.SGLANG: _sglang_hasher,
}


def _positive_int(doc: dict[str, Any], key: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
        raise ProtocolError(f"namespace description: {key} = {value!r}; expected an integer "
                            "1 .. 1048576")
    return value


def _parse_vllm(doc: dict[str, Any]) -> tuple[str, int, int]:
    """(model, tokens per block, blocks per chunk) of a vLLM namespace description (the
    JSON of ``tiercache.vllm.namespace.Namespace``)."""
    model = doc.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS or any(
            c in model for c in "@\0\n"):
        raise ProtocolError(f"namespace description: model = {str(model)[:64]!r}; expected "
                            f"1 .. {MAX_MODEL_CHARS} characters, none of '@', NUL, newline")
    groups = doc.get("groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict)
                                                             for g in groups):
        raise ProtocolError("namespace description: groups must be a non-empty list of "
                            "objects")
    sizes = {_positive_int(g, "tokens_per_block") for g in groups}
    if len(sizes) != 1:
        raise ProtocolError(f"namespace description: groups of {sorted(sizes)} tokens per "
                            "block; expected one block size")
    return model, sizes.pop(), _positive_int(doc, "blocks_per_chunk")


def parse_description(family: int, text: str) -> NamespaceInfo:
    """The ``NamespaceInfo`` a DESCRIBE carries; ``ProtocolError`` naming what is wrong."""
    if family not in _CODES:
        raise ProtocolError(f"namespace description of engine family {family}; allowed "
                            f"{sorted(_CODES)} ({', '.join(f.name for f in EngineFamily)})")
    if len(text.encode()) > MAX_DESCRIPTION_BYTES:
        raise ProtocolError(f"namespace description of {len(text.encode())} bytes; at most "
                            f"{MAX_DESCRIPTION_BYTES}")
    engine = EngineFamily(family)
    if engine is not EngineFamily.VLLM:
        raise ProtocolError(f"namespace descriptions of {engine.name} are not supported yet")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"namespace description is not JSON: {str(e)[:80]}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("namespace description must be a JSON object")
    model, block_size, per_chunk = _parse_vllm(doc)
    return NamespaceInfo(digest_of(text), engine, model, block_size, per_chunk, text)


_CODES = {int(f) for f in EngineFamily}
