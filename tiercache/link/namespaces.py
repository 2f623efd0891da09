"""Namespaces as the event stream knows them: which engine family's keys they are, and how
a wire key becomes the hash that engine publishes.

Every key an engine adapter sends starts with its namespace's ``NAMESPACE_BYTES``-byte
digest (``tiercache.vllm.namespace``). The coordinator cannot turn a key into an engine's
hash until an engine has *described* the namespace (the control plane's DESCRIBE verb,
``tiercache.link.describe``): the description is the exact text the digest is the
SHA-256 of, so the coordinator computes the digest itself, and a client can describe a
namespace only truthfully (to speak for a namespace it would need a preimage of its digest).

Engine families (``EngineFamily``) each parse their description into a ``NamespaceInfo``
with a ``KeyHasher``:

* **vLLM**: a key is digest + vLLM's ``OffloadKey`` (the chunk's block hash + its KV
  group, u32 big-endian); with ``blocks_per_chunk > 1`` vLLM keys a chunk by its *last*
  block's hash, and so do its own CPU-tier events (the default form: one hash per chunk).
  The published hash is vLLM's ``maybe_convert_block_hash`` of the block hash.
* **SGLang**: a key is the adapter's 16-byte digest (whose first ``NAMESPACE_BYTES`` are the
  namespace's prefix here) + the TP shard (u16 little-endian) + a kind byte (0: SGLang's
  64-hex page hash, as its 32 bytes) + the hash (``tiercache.sglang.namespace.page_key``).
  The published hash is what SGLang 0.5.23's own radix-cache events publish for the page
  (``sglang/srt/mem_cache/events.py``: ``hash_str_to_int64`` of the page's hash, a signed
  int64 of its first 8 bytes, whatever ``events.hash_format`` says). Only shard 0's key is
  an event: SGLang publishes from its attention-TP rank 0 alone, one event per page; the
  other ranks' shards of the page are not events of their own (``ANOTHER_SHARD``). A page
  hash that is not 64 hex digits has no int form SGLang would publish: unreadable.

Model names go into every topic: a description's model is 1 .. ``MAX_MODEL_CHARS``
printable characters (``str.isprintable``: no control or format characters such as ESC,
CR or U+202E) without "@", the topic's separator.

Media: each family publishes under its engine's names for the node's media
(``NamespaceInfo.medium_name``): vLLM's ``CPU`` and ``STORAGE``; SGLang's ``StorageMedium``
values, ``CPU_PINNED`` (host memory: SGLang's name for its host tier) and ``DISK``.
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
from tiercache.specs import Medium

NAMESPACE_BYTES = 8
MAX_DESCRIPTION_BYTES = 64 << 10  # a description's text (vLLM's lists every layer's name)
MAX_MODEL_CHARS = 512
_GROUP_BYTES = 4  # vLLM's OffloadKey ends with the KV group index, u32 big-endian
_INT_HASH_MASK = (1 << 64) - 1
SGLANG_KEY_FORMAT = 1  # the SGLang adapter's key layout this module reads (module docstring)
_SGLANG_DIGEST_BYTES = 16
_SGLANG_HEX_KIND = 0  # the kind byte of a 64-hex page hash
_SGLANG_HASH_OFFSET = _SGLANG_DIGEST_BYTES + 2 + 1  # after digest, shard u16, kind u8
_SGLANG_KEY_BYTES = _SGLANG_HASH_OFFSET + 32


class EngineFamily(IntEnum):
    """Whose keys a namespace holds (its wire code in DESCRIBE)."""

    VLLM = 1
    SGLANG = 2


Hashed = tuple[int | bytes, int] | tuple[()]
ANOTHER_SHARD: tuple[()] = ()
"""What a ``KeyHasher`` answers for a key that is not an event of its own: another TP
rank's shard of a page its engine publishes once (under shard 0's key)."""


class KeyHasher(Protocol):
    """Turns one wire key of a namespace into (the engine's published hash, KV group);
    ``ANOTHER_SHARD`` for a key whose page another key publishes; None for a key that is not
    of this engine's shape (it is counted, not published)."""

    def __call__(self, key: bytes) -> Hashed | None: ...


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

    def medium_name(self, medium: Medium) -> str:
        """``medium`` as this namespace's engine names it in its own events."""
        return _MEDIA[self.family][medium]


def digest_of(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:NAMESPACE_BYTES]


def _vllm_hasher(info: NamespaceInfo, form: HashFormat) -> KeyHasher:
    shortest = NAMESPACE_BYTES + 1 + _GROUP_BYTES
    as_int = form is HashFormat.INT

    def hash_of(key: bytes) -> Hashed | None:
        if len(key) < shortest:
            return None
        block_hash = key[NAMESPACE_BYTES:-_GROUP_BYTES]
        group = int.from_bytes(key[-_GROUP_BYTES:], "big")
        if as_int:
            return int.from_bytes(block_hash, "big") & _INT_HASH_MASK, group
        return block_hash, group

    return hash_of


def _sglang_hasher(info: NamespaceInfo, form: HashFormat) -> KeyHasher:
    """SGLang publishes ints whatever ``form`` says (its ``BlockStored.block_hashes`` is
    ``list[int]``)."""
    digest = hashlib.sha256(info.text.encode()).digest()[:_SGLANG_DIGEST_BYTES]
    first_shard = bytes(2)

    def hash_of(key: bytes) -> Hashed | None:
        if (len(key) != _SGLANG_KEY_BYTES or key[_SGLANG_HASH_OFFSET - 1] != _SGLANG_HEX_KIND
                or not key.startswith(digest)):
            return None
        if key[_SGLANG_DIGEST_BYTES:_SGLANG_HASH_OFFSET - 1] != first_shard:
            return ANOTHER_SHARD
        page = key[_SGLANG_HASH_OFFSET:_SGLANG_HASH_OFFSET + 8]
        return int.from_bytes(page, "big", signed=True), 0

    return hash_of


_HASHERS: dict[EngineFamily, Callable[[NamespaceInfo, HashFormat], KeyHasher]] = {
    EngineFamily.VLLM: _vllm_hasher,
    EngineFamily.SGLANG: _sglang_hasher,
}

_MEDIA: dict[EngineFamily, dict[Medium, str]] = {
    EngineFamily.VLLM: {m: m.value for m in Medium},
    # SGLang 0.5.23's StorageMedium values (sglang/srt/disaggregation/kv_events.py)
    EngineFamily.SGLANG: {Medium.GPU: "GPU", Medium.CPU: "CPU_PINNED", Medium.STORAGE: "DISK"},
}


def _positive_int(doc: dict[str, Any], key: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
        raise ProtocolError(f"namespace description: {key} = {value!r}; expected an integer "
                            "1 .. 1048576")
    return value


def _model(doc: dict[str, Any]) -> str:
    """The description's model: it goes verbatim into every topic of the namespace."""
    model = doc.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS \
            or not model.isprintable() or "@" in model:
        raise ProtocolError(f"namespace description: model = {str(model)[:64]!a}; expected "
                            f"1 .. {MAX_MODEL_CHARS} printable characters (no control or "
                            "format characters such as ESC, CR or U+202E), without '@'")
    return model


def _parse_vllm(doc: dict[str, Any]) -> tuple[str, int, int]:
    """(model, tokens per block, blocks per chunk) of a vLLM namespace description (the
    JSON of ``tiercache.vllm.namespace.Namespace``)."""
    model = _model(doc)
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


def _parse_sglang(doc: dict[str, Any]) -> tuple[str, int, int]:
    """(model, tokens per page, 1) of an SGLang namespace description (the JSON of
    ``tiercache.sglang.namespace.Namespace``)."""
    model = _model(doc)
    engine, key_format = doc.get("engine"), doc.get("key_format")
    if engine != "sglang" or key_format != SGLANG_KEY_FORMAT:
        raise ProtocolError(f"namespace description: engine {str(engine)[:32]!a}, key_format "
                            f"{str(key_format)[:32]!a}; expected 'sglang' and "
                            f"{SGLANG_KEY_FORMAT}")
    return model, _positive_int(doc, "page_size"), 1


def parse_description(family: int, text: str) -> NamespaceInfo:
    """The ``NamespaceInfo`` a DESCRIBE carries; ``ProtocolError`` naming what is wrong."""
    if family not in _CODES:
        raise ProtocolError(f"namespace description of engine family {family}; allowed "
                            f"{sorted(_CODES)} ({', '.join(f.name for f in EngineFamily)})")
    if len(text.encode()) > MAX_DESCRIPTION_BYTES:
        raise ProtocolError(f"namespace description of {len(text.encode())} bytes; at most "
                            f"{MAX_DESCRIPTION_BYTES}")
    engine = EngineFamily(family)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"namespace description is not JSON: {str(e)[:80]}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("namespace description must be a JSON object")
    model, block_size, per_chunk = _PARSERS[engine](doc)
    return NamespaceInfo(digest_of(text), engine, model, block_size, per_chunk, text)


_PARSERS: dict[EngineFamily, Callable[[dict[str, Any]], tuple[str, int, int]]] = {
    EngineFamily.VLLM: _parse_vllm,
    EngineFamily.SGLANG: _parse_sglang,
}
_CODES = {int(f) for f in EngineFamily}
