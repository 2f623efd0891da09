"""Key namespaces of SGLang deployments (plain Python: runs in every venv)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tiercache.errors import ArgumentError
from tiercache.sglang.namespace import (
    NAMESPACE_BYTES, Namespace, page_key, weights_fingerprint,
)
from tiercache.vllm.namespace import Namespace as VllmNamespace

BASE = Namespace(model="/models/llama", weights="w1", kv_dtype="bfloat16",
                 layout="page_first_direct", page_size=64, blob_bytes=(1 << 20, 1 << 20),
                 tp_size=2, is_mla=False)
HASH = "ab" * 32


@pytest.mark.parametrize("change", [
    dict(model="/models/qwen"), dict(weights="w2"), dict(kv_dtype="float8_e4m3fn"),
    dict(layout="page_first"), dict(layout="layer_first"), dict(page_size=32),
    dict(blob_bytes=(1 << 19, 1 << 19)), dict(tp_size=4), dict(is_mla=True),
    dict(dcp_size=2), dict(salt="rev-2"), dict(key_format=2),
])
def test_every_field_that_shapes_the_bytes_changes_the_digest(change):
    other = dataclasses.replace(BASE, **change)
    assert other.digest != BASE.digest
    assert page_key(other.digest, 0, HASH) != page_key(BASE.digest, 0, HASH)


def test_keys_carry_the_namespace_the_shard_and_the_hash():
    key = page_key(BASE.digest, 1, HASH)
    assert key[:NAMESPACE_BYTES] == BASE.digest
    assert key != page_key(BASE.digest, 0, HASH)
    assert len(key) == NAMESPACE_BYTES + 2 + 1 + 32  # the hex hash travels as its bytes
    assert page_key(BASE.digest, 0, "not-hex") != page_key(BASE.digest, 0, HASH)
    with pytest.raises(ArgumentError, match="at most"):
        page_key(BASE.digest, 0, "x" * 1000)


def test_sglang_and_vllm_namespaces_of_one_model_never_share_a_prefix():
    vllm = VllmNamespace(model="/models/llama", kv_dtype="bfloat16", kv_layout="", world_size=2,
                         tp_size=2, pp_size=1, pcp_size=1, dcp_size=1, tokens_per_hash=16,
                         blocks_per_chunk=4, groups=())
    assert not page_key(BASE.digest, 0, HASH).startswith(vllm.digest)
    assert BASE.digest[:len(vllm.digest)] != vllm.digest


def test_the_weights_fingerprint_follows_what_is_in_the_model_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 64)
    first = weights_fingerprint(str(tmp_path))
    assert first and weights_fingerprint(f"{tmp_path}-unified-token-major") == first
    os.utime(weights, ns=(1, 1))  # other weights written under the same name
    assert weights_fingerprint(str(tmp_path)) != first
    blob = tmp_path / ("c" * 64)  # a Hugging Face cache: the link's target names the content
    blob.write_bytes(b"\1" * 64)
    weights.unlink()
    weights.symlink_to(blob)
    linked = weights_fingerprint(str(tmp_path))
    os.utime(blob, ns=(2, 2))
    assert weights_fingerprint(str(tmp_path)) == linked
    assert weights_fingerprint("not-a-directory") == ""
