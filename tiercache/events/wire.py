"""The wire format of the node's event stream: exactly vLLM 0.33's ``ZmqEventPublisher``
(``vllm/distributed/kv_events.py``), so a subscriber written for vLLM decodes it with
vLLM's own ``KVEventBatch``, unchanged. The structs below mirror vLLM's field for field
(names, order, defaults, tagging); this module never imports vLLM.

A published batch is one ZMQ multipart message on the PUB socket::

    frame  bytes  content
    0      any    topic (UTF-8): ``events.topic`` + model + "@" + namespace (16 hex
                  digits); node-wide AllBlocksCleared: ``events.topic`` alone
    1      8      sequence number, big-endian, from 0, one count for the whole stream
    2      any    msgpack KVEventBatch: the array [ts (float seconds), [events], dp_rank (0)]

Each event is a msgpack *map* tagged ``"type"``: ``"BlockStored"`` (all seven fields
without defaults always present: ``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ``lora_id``, ``medium``, ``lora_name``; then ``group_idx``),
``"BlockRemoved"`` (``block_hashes``, ``medium``, ``group_idx``) or
``"AllBlocksCleared"`` (no field). Fields left at their default are omitted, as vLLM's
``omit_defaults`` does. A hash is an int (the block hash's last 8 bytes, big-endian) or
the hash's bytes (``events.hash_format``).

Replay (ROUTER, subscribers use DEALER)::

    request   [identity, "", start_seq (8 bytes big-endian)]
    answer    [identity, "", topic, seq (8 bytes), payload]   per buffered batch >= start
              [identity, "", "", -1 (8 bytes, signed), ""]      the end marker
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)

ExternalHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base: tagged with the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def stored(hash_: ExternalHash, medium: str, group_idx: int) -> BlockStored:
    """vLLM's default CPU-tier event for one offloaded chunk (its offloading connector
    without ``self_describing_kv_events``): the chunk's key hash alone, no tokens, no
    parent, ``block_size`` 0."""
    return BlockStored(block_hashes=[hash_], parent_block_hash=None, token_ids=[],
                       block_size=0, lora_id=None, medium=medium, lora_name=None,
                       group_idx=group_idx)


class StoredEncoder:
    """``stored(hash, medium, group)`` already encoded (a ``msgspec.Raw`` a batch embeds as
    it is), byte for byte what msgspec encodes for the struct (tested), at a fraction of the
    cost: the publisher makes one per key. The constant parts are cut from msgspec's own
    encoding of a template (hash 0 and group 0 encode as one byte each, 0x00)."""

    _HASHES_KEY = msgspec.msgpack.encode("block_hashes") + b"\x91"  # the key, a 1-array

    def __init__(self, medium: str):
        template = msgspec.msgpack.encode(stored(0, medium, 0))
        cut = template.index(self._HASHES_KEY) + len(self._HASHES_KEY)
        assert template[cut:cut + 1] == b"\x00" and template[-1:] == b"\x00"
        self._head, self._middle = template[:cut], template[cut + 1:-1]
        self._encode = msgspec.msgpack.encode

    def __call__(self, hash_: ExternalHash, group_idx: int) -> msgspec.Raw:
        encode = self._encode
        return msgspec.Raw(self._head + encode(hash_) + self._middle + encode(group_idx))


def removed(hashes: list[ExternalHash], medium: str, group_idx: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx)


class BatchEncoder:
    """Encodes batches (one per thread: msgspec's encoder keeps a buffer)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, events: list[Any], ts: float | None = None) -> bytes:
        return self._encoder.encode(KVEventBatch(ts=time.time() if ts is None else ts,
                                                 events=events, data_parallel_rank=0))


def decode_batch(payload: bytes) -> KVEventBatch:
    """What a subscriber does (tests, tools): a ``msgspec.DecodeError`` if it is not one."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")
