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
