"""The step-cost benchmark runs end to end at a toy size (its numbers: docs/benchmarks.md)."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import json  # noqa: E402

from bench_step_cost import main  # noqa: E402


def test_bench_step_cost_runs_at_a_toy_size(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--requests", "2", "--keys", "4", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    cold, warm = report["results"]
    assert cold["loaded_tokens"] == 0 and warm["loaded_tokens"] == 2 * 4 * 16
    assert any(name.startswith("warm: HIT") for name in report["direct_ms"])
