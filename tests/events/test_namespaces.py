"""Namespace descriptions: the digest is the coordinator's own, the key -> hash is the
engine's (vLLM's; SGLang's page hash as SGLang's events publish it), each family names the
media as its engine does, and a malformed description is refused naming what is wrong."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tiercache.config.events import HashFormat
from tiercache.errors import ProtocolError
from tiercache.link.namespaces import (
    ANOTHER_SHARD, MAX_DESCRIPTION_BYTES, EngineFamily, digest_of, parse_description,
)
from tiercache.sglang.namespace import KEY_FORMAT_VERSION, Namespace as SGLangNamespace, page_key
from tiercache.specs import Medium

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
    (EngineFamily.SGLANG, "{}", "model"),
    (EngineFamily.SGLANG, json.dumps({"model": "m", "engine": "vllm", "key_format": 1,
                                      "page_size": 16}), "'sglang'"),
    (EngineFamily.SGLANG, json.dumps({"model": "m", "engine": "sglang", "key_format": 2,
                                      "page_size": 16}), "key_format"),
    (EngineFamily.SGLANG, json.dumps({"model": "m", "engine": "sglang", "key_format": 1,
                                      "page_size": 0}), "page_size"),
    (99, "{}", "engine family 99"),
])
def test_malformed_descriptions_are_refused_naming_why(family, text, message):
    with pytest.raises(ProtocolError, match=message):
        parse_description(family, text)
    assert len("[" * 100_000) > MAX_DESCRIPTION_BYTES  # the second case is past the bound


@pytest.mark.parametrize("model", ["evil\x1b[2Jmodel", "a\rb", "left\u202eright", "tab\there",
                                   "nul\0", "line\nbreak", "zero\u200bwidth", "at@sign"])
def test_model_names_are_printable_characters_only(model):
    text = json.dumps({"model": model, "blocks_per_chunk": 1,
                       "groups": [{"tokens_per_block": 16}]})
    with pytest.raises(ProtocolError) as refused:
        parse_description(EngineFamily.VLLM, text)
    message = str(refused.value)
    assert "printable characters" in message and message.isprintable()  # no raw escape
    sglang = dataclasses.replace(SGLANG, model=model)
    with pytest.raises(ProtocolError, match="printable characters"):
        parse_description(EngineFamily.SGLANG, sglang.description)


def test_printable_names_of_any_script_are_models():
    for model in ("org/Llama-3.1-8B Instruct", "/models/通义千问", "Ünïcödé-ß"):
        text = json.dumps({"model": model, "blocks_per_chunk": 1,
                           "groups": [{"tokens_per_block": 16}]})
        assert parse_description(EngineFamily.VLLM, text).model == model


SGLANG = SGLangNamespace(model="/models/llama", weights="w", kv_dtype="bfloat16",
                         layout="page_first_direct", page_size=64, blob_bytes=(4096, 4096),
                         tp_size=2, is_mla=False)


def test_an_sglang_description_gives_the_adapters_digest_and_page_size():
    info = parse_description(EngineFamily.SGLANG, SGLANG.description)
    assert info.digest == SGLANG.digest[:8] == digest_of(SGLANG.description)
    assert (info.model, info.block_size, info.blocks_per_chunk) == ("/models/llama", 64, 1)
    assert KEY_FORMAT_VERSION == 1  # the key layout the hasher reads (namespaces.py)


@pytest.mark.parametrize("form", list(HashFormat))
def test_an_sglang_key_becomes_the_int64_sglangs_events_publish_once_per_page(form):
    """SGLang's ``hash_str_to_int64`` of the page's hash (its first 16 hex digits, signed),
    whatever the hash format; rank 0's shard is the page's event, the others are not
    events of their own; a key of another namespace or a non-hex hash is unreadable."""
    hasher = parse_description(EngineFamily.SGLANG, SGLANG.description).hasher(form)
    low, high = "0123456789abcdef" + "0" * 48, "f" * 16 + "1" * 48
    assert hasher(page_key(SGLANG.digest, 0, low)) == (0x0123456789ABCDEF, 0)
    assert hasher(page_key(SGLANG.digest, 0, high)) == (-1, 0)  # signed, as SGLang's
    assert hasher(page_key(SGLANG.digest, 1, low)) == ANOTHER_SHARD
    other = dataclasses.replace(SGLANG, salt="x")
    assert hasher(SGLANG.digest[:8] + page_key(other.digest, 0, low)[8:]) is None
    assert hasher(page_key(SGLANG.digest, 0, "not-a-hex-hash")) is None


def test_each_family_names_the_media_as_its_engine_does():
    vllm = parse_description(EngineFamily.VLLM, namespace().description)
    sglang = parse_description(EngineFamily.SGLANG, SGLANG.description)
    assert [vllm.medium_name(m) for m in (Medium.CPU, Medium.STORAGE)] == ["CPU", "STORAGE"]
    assert [sglang.medium_name(m) for m in (Medium.CPU, Medium.STORAGE)] == [
        "CPU_PINNED", "DISK"]
