"""``tiercache bench`` on a GPU machine: the engine's pattern end to end (real handlers,
the default backend), every figure in the JSON and the table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_engine_pattern_reports_distributions_and_the_control(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "tiercache", "bench", "--page-kib", "32",
                          "--backend", "auto", "--reps", "1", "--pattern-steps", "3",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "engine pattern" in run.stdout
    row = json.loads(out.read_text())["rows"][0]
    for order in ("store_first", "load_first", "control"):  # of the summed ceilings
        assert 0 < row[f"pattern_{order}_min_ratio"] and row[f"pattern_{order}_ratio"] < 1.2
    for what in ("store_call", "load_call", "one_call", "one_block", "one_block_spin",
                 "one_block_torch"):
        assert row[f"pattern_{what}_p50_us"] > 0
    for what in ("one_block", "one_block_spin", "one_block_torch"):  # none beats the wire
        assert row[f"pattern_{what}_p50_us"] > row["pattern_one_block_wire_us"] > 0
    assert row["pattern_busy_rounds"] > 0  # the other Python thread ran meanwhile
