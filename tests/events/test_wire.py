"""The wire structs and the fast encoder of stored events: byte for byte what msgspec
encodes for vLLM's struct (the vLLM subscriber tests decode both with vLLM's classes)."""

from __future__ import annotations

import random

import msgspec
import pytest

from tiercache.events import wire


@pytest.mark.parametrize("medium", ["CPU", "STORAGE"])
def test_the_stored_encoder_is_msgspecs_encoding_byte_for_byte(medium):
    encode = wire.StoredEncoder(medium)
    rng = random.Random(7)
    hashes = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1,
              *(rng.getrandbits(64) for _ in range(200)), b"", rng.randbytes(32),
              rng.randbytes(8)]
    for h in hashes:
        for group in (0, 1, 127, 128, 70000, (1 << 32) - 1):
            assert encode(h, group) == msgspec.Raw(msgspec.msgpack.encode(
                wire.stored(h, medium, group)))


def test_a_batch_of_encoded_events_decodes_as_the_structs():
    encode = wire.StoredEncoder("CPU")
    events = [encode(5, 0), wire.removed([5, 6], "CPU", 1), wire.AllBlocksCleared()]
    batch = wire.decode_batch(wire.BatchEncoder().encode(events, ts=1.5))
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    assert batch.events == [wire.stored(5, "CPU", 0), wire.removed([5, 6], "CPU", 1),
                            wire.AllBlocksCleared()]


def test_the_largest_batch_the_publisher_cuts_stays_under_max_batch_bytes():
    """What bounds the memory of peers' queues (``EventsConfig.peer_memory_bytes``): a batch
    of ``MAX_HASHES_PER_BATCH`` of the largest events (a 32-byte hash, a u32 group, a
    medium name longer than any engine's: SGLang's CPU_PINNED is 10) encodes under
    ``MAX_BATCH_BYTES``, and the publisher cuts a mix of events at that many hashes."""
    from tiercache.config.events import MAX_BATCH_BYTES
    from tiercache.events.publisher import MAX_EVENTS_PER_BATCH, MAX_HASHES_PER_BATCH, _batches

    medium, group, hash_ = "M" * 16, (1 << 32) - 1, b"\xff" * 32
    stored = wire.StoredEncoder(medium)(hash_, group)
    removed = wire.removed([hash_] * MAX_EVENTS_PER_BATCH, medium, group)
    encoder = wire.BatchEncoder()
    for events in ([stored] * MAX_HASHES_PER_BATCH, [removed]):
        assert len(encoder.encode(events)) <= MAX_BATCH_BYTES
    mix = [stored] * 700 + [removed] + [stored] * 2000 + [wire.removed([hash_] * 5, medium, 0)]
    cut = list(_batches(mix))
    assert [e for batch in cut for e in batch] == mix
    for batch in cut:
        hashes = sum(len(e.block_hashes) if isinstance(e, wire.BlockRemoved) else 1
                     for e in batch)
        assert hashes <= MAX_HASHES_PER_BATCH
        assert len(encoder.encode(batch)) <= MAX_BATCH_BYTES
