"""Admission (issue 21, item 1; numbers: docs/vllm.md): a cold request is scheduled in the
step it is first looked up, a request with hits starts its load in the next one, whatever
the step time."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import json  # noqa: E402

from bench_admission import main  # noqa: E402


def test_cold_requests_are_admitted_at_once_and_hits_load_in_the_next_step(tmp_path):
    out = tmp_path / "admission.json"
    # a generous wait: the guarantee is "the next step", bounded by the wait, and a loaded
    # CI machine must not turn a slow answer into a failed assertion
    assert main(["--model-ms", "0", "5", "--rounds", "3", "--lookup-wait-ms", "5000",
                 "--json", str(out)]) == 0
    for ms, r in json.loads(out.read_text())["results"].items():
        cold = r["cold_first_scheduled"]
        # the presence map's "maybe" for a key nobody holds (about 1 in 16 at worst) costs
        # one probe, so: exactly the definite misses are scheduled in step 0, the rest in 1
        assert r["cold_definite_misses"] >= 1, ms
        assert cold.count(0) == r["cold_definite_misses"], (ms, r)
        assert all(step <= 1 for step in cold), (ms, r)
        assert r["hit_load_started"] == [1] * len(cold), (ms, r)
        assert r["hit_loaded_tokens"] == r["hit_asked_tokens"], (ms, r)
