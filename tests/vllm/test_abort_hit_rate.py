"""The abort-heavy workload (issue 21, item 2; numbers: docs/vllm.md): aborted lookups
take nothing from the cache."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import json  # noqa: E402

from bench_abort_hit_rate import main  # noqa: E402


def test_aborted_lookups_evict_nothing_and_every_popular_chunk_is_loaded(tmp_path):
    out = tmp_path / "aborts.json"
    assert main(["--rounds", "8", "--aborts", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["evicted_blocks"] == 0
    assert report["loaded_tokens"] == report["asked_tokens"] == 8 * 8 * 16
