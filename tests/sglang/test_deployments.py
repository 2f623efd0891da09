"""Deployments that differ in model, weights, KV dtype, host layout or page size share one
coordinator (same bytes per page, one region) and never see each other's pages."""

from __future__ import annotations

from sglang_env import require_sglang

require_sglang()

import pytest  # noqa: E402

from sglang_harness import ModelSpec, tokens_of  # noqa: E402

SAME_BYTES = {  # each deployment's page is as large as the base one: 2 x 8192 bytes
    "model": dict(model_name="other-model"),
    "dtype": dict(model=ModelSpec(dtype="float16")),
    "layout": dict(layout="page_first"),
    "page size": dict(model=ModelSpec(page_size=32, heads=1)),
}


@pytest.mark.parametrize("difference", SAME_BYTES)
def test_deployments_that_differ_never_share_a_page(coordinator, make_rank, difference):
    base = make_rank(coordinator)
    other = make_rank(coordinator, **SAME_BYTES[difference])
    tokens = tokens_of(21, 4)  # both back up the same tokens
    assert base.backup(tokens) == len(tokens)
    assert other.query(tokens) == 0  # the other deployment's pages are not its own
    assert other.backup(tokens) == len(tokens)  # stored again, under its own keys
    assert base.prefetch(tokens) == (len(tokens), [])
    assert other.prefetch(tokens) == (len(tokens), [])
    assert other.counters()["already_stored_pages"] == 0


def test_new_weights_under_the_same_path_are_another_namespace(coordinator, make_rank, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"num_hidden_layers": 2}')
    (model_dir / "model.safetensors").write_bytes(b"old")
    before = make_rank(coordinator, model_name=str(model_dir))
    tokens = tokens_of(22, 2)
    before.backup(tokens)
    (model_dir / "model.safetensors").write_bytes(b"new weights")
    after = make_rank(coordinator, model_name=str(model_dir))
    assert after.query(tokens) == 0
