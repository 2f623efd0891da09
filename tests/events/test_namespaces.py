"""Namespace descriptions: the digest is the coordinator's own, the key -> vLLM hash is
vLLM's, and a malformed description is refused naming what is wrong."""

from __future__ import annotations

import json

import pytest

from tiercache.config.events import HashFormat
from tiercache.errors import ProtocolError
from tiercache.events.namespaces import (
    MAX_DESCRIPTION_BYTES, EngineFamily, digest_of, parse_description,
)

from event_support import namespace, vllm_int_hash, vllm_key


def test_a_vllm_description_gives_the_adapters_digest_model_and_geometry():
    ns = namespace("org/llama", blocks_per_chunk=4, tokens=16, salt="rev2")
    info = parse_description(EngineFamily.VLLM, ns.description)
    assert info.digest == ns.digest == digest_of(ns.description)
    assert (info.model, info.block_size, info.blocks_per_chunk) == ("org/llama", 16, 4)
    assert info.topic("node-7/") == f"node-7/org/llama@{ns.digest.hex()}".encode()


@pytest.mark.parametrize("form", list(HashFormat))
def test_a_key_becomes_vllms_hash_and_group(form):
    ns = namespace()
    hasher = parse_description(EngineFamily.VLLM, ns.description).hasher(form)
    block_hash = bytes(range(100, 132))
    expected = vllm_int_hash(block_hash) if form is HashFormat.INT else block_hash
    assert hasher(vllm_key(ns, block_hash, group=3)) == (expected, 3)
    assert hasher(ns.digest + b"\x01\x02") is None  # too short for digest + hash + group


@pytest.mark.parametrize("family, text, message", [
    (EngineFamily.VLLM, "not json", "not JSON"),
    (EngineFamily.VLLM, "[" * 100_000 + "]" * 100_000, "bytes"),  # past the size bound
    (EngineFamily.VLLM, "[" * 20_000 + "]" * 20_000, "not JSON"),  # nesting bomb
    (EngineFamily.VLLM, "[]", "JSON object"),
    (EngineFamily.VLLM, json.dumps({"model": "a@b", "blocks_per_chunk": 1,
                                    "groups": [{"tokens_per_block": 16}]}), "'@'"),
    (EngineFamily.VLLM, json.dumps({"model": "m", "blocks_per_chunk": 0,
                                    "groups": [{"tokens_per_block": 16}]}), "blocks_per_chunk"),
    (EngineFamily.VLLM, json.dumps({"model": "m", "blocks_per_chunk": 1, "groups": []}),
     "groups"),
    (EngineFamily.VLLM, json.dumps({"model": "m", "blocks_per_chunk": 1,
                                    "groups": [{"tokens_per_block": 16},
                                               {"tokens_per_block": 32}]}), "one block size"),
    (EngineFamily.SGLANG, "{}", "SGLANG"),
    (99, "{}", "engine family 99"),
])
def test_malformed_descriptions_are_refused_naming_why(family, text, message):
    with pytest.raises(ProtocolError, match=message):
        parse_description(family, text)
    assert len("[" * 100_000) > MAX_DESCRIPTION_BYTES  # the second case is past the bound
