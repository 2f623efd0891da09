"""The replay's cost model against the GPU run it is calibrated on: every prefill and decode
point of ``cost.CALIBRATION`` (``benchmarks/model_cost_gpu.py`` on one H100), read from the
file, within ``TOLERANCE``; the model built from the Llama fixture's config.json, as
``tiercache replay --model`` builds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.config.hf_model import HFModel
from tiercache.tools.replay.cost import CALIBRATION, Chunk, CostModel, DecoderShape

ROOT = Path(__file__).parents[2]
RUN = json.loads((ROOT / CALIBRATION).read_text())
TOLERANCE = 0.06  # relative, every point the run does not contradict (the fit's worst: 4.0 %)
CONTRADICTED_TOLERANCE = 0.25  # a point the run itself contradicts (see contradicted())


def model() -> CostModel:
    shape = DecoderShape.of(HFModel.read(str(ROOT / "tests/fixtures/models" / RUN["model"])))
    kv_bytes_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2  # bf16 K, V
    return CostModel.for_shape(shape, kv_bytes_per_token, 16, load_bps=1.0, store_bps=1.0)


def contradicted(point: dict) -> bool:
    """A decode step measured slower than another of at least its batch and its context:
    no model that grows with the work meets both (benchmarks/fit_model_cost.py)."""
    return any(e["batch"] >= point["batch"] and e["context"] >= point["context"]
               and e["s"] < point["s"] for e in RUN["decode"] if e is not point)


def test_the_fixture_has_the_measured_shape():
    s = DecoderShape.of(HFModel.read(str(ROOT / "tests/fixtures/models" / RUN["model"])))
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab) == \
        tuple(RUN["shape"][k] for k in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                         "mlp", "vocab"))


@pytest.mark.parametrize("point", RUN["prefill"], ids=lambda p: f"prefill-{p['tokens']}")
def test_prefill_within_tolerance(point):
    modelled = model().step_s([Chunk(point["tokens"], 0)])
    assert abs(modelled / point["s"] - 1) <= TOLERANCE, (modelled, point)


@pytest.mark.parametrize("point", RUN["decode"],
                         ids=lambda p: f"decode-b{p['batch']}-c{p['context']}")
def test_decode_within_tolerance(point):
    modelled = model().step_s([Chunk(1, point["context"])] * point["batch"])
    tolerance = CONTRADICTED_TOLERANCE if contradicted(point) else TOLERANCE
    assert abs(modelled / point["s"] - 1) <= tolerance, (modelled, point)


def test_at_most_one_point_is_excused():
    assert sum(contradicted(p) for p in RUN["decode"]) <= 1


def test_the_report_names_its_calibration():
    described = model().describe()
    assert described["calibration"] == CALIBRATION and (ROOT / CALIBRATION).is_file()
    assert described["provenance"]["measured_on_gpu"] is True


def test_a_step_that_computes_nothing_is_idle():
    m = model()
    assert m.step_s([]) == m.step_s([Chunk(0, 512)]) == m.idle_step_s
