"""Fit `tiercache replay`'s step model to a run of `model_cost_gpu.py` (issue 40).

Reads the run's JSON, turns each measured prefill and decode point into the model's work
(``cost.Chunk``s: a prefill of n tokens is one chunk of n new tokens; a decode step of batch
b at context c is b chunks of 1 new token after c), and searches MFU, HBM efficiency, the
step overhead and the roofline's p for the least worst-case relative error plus the root mean
square one (the worst case alone leaves the decode constants loose: HBM efficiency and the
overhead trade against each other at the same worst case); a grid, refined twice around its
best. Prints the constants and the model against every point:

    python benchmarks/fit_model_cost.py docs/results/model_cost_h100_llama8b.json

A point the run contradicts is left out of the fit and printed with its error: a decode
step measured slower than another of at least its batch and its context (more work in
less time: a model that grows with the work cannot meet both; the slower one is taken as
the outlier, as a warm-up or clock ramp slows a step and nothing speeds one up).
The constants go into ``tiercache/tools/replay/cost.py`` by hand, rounded;
``tests/tools/test_replay_cost.py`` holds them to the points.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tiercache.tools.replay.cost import (
    H100_HBM_BPS, H100_PEAK_FLOPS, Chunk, CostModel, DecoderShape,
)


def model_for(shape: dict) -> CostModel:
    s = DecoderShape(layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
                     kv_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                     intermediate=shape["mlp"], vocab=shape["vocab"], tied_embeddings=False)
    kv_bytes_per_token = 2 * s.layers * s.kv_heads * s.head_dim * 2  # K and V, bf16
    return CostModel.for_shape(s, kv_bytes_per_token, block_tokens=16, load_bps=1.0,
                               store_bps=1.0)


def points(run: dict) -> list[tuple[str, list[Chunk], float, bool]]:
    """(label, chunks, measured seconds, contradicted) for every measured point."""
    decode = run["decode"]

    def contradicted(d: dict) -> bool:
        return any(e is not d and e["batch"] >= d["batch"] and e["context"] >= d["context"]
                   and e["s"] < d["s"] for e in decode)

    out = [(f"prefill {p['tokens']}", [Chunk(p["tokens"], 0)], p["s"], False)
           for p in run["prefill"]]
    out += [(f"decode b{d['batch']} c{d['context']}", [Chunk(1, d["context"])] * d["batch"],
             d["s"], contradicted(d)) for d in decode]
    return out


def fit(flops: np.ndarray, hbm: np.ndarray, measured: np.ndarray) -> tuple[float, ...]:
    """(mfu, hbm_efficiency, step_overhead_s, p) of the least worst + RMS relative error."""
    best: tuple[float, ...] = ()
    best_err = np.inf
    spans = [(0.3, 1.0), (0.5, 1.0), (0.0, 0.008)]
    for p in (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 6.0, 8.0, 16.0):
        lo_hi = spans
        for _ in range(3):
            axes = [np.linspace(lo, hi, 41) for lo, hi in lo_hi]
            mfu, eff, over = np.meshgrid(*axes, indexing="ij")
            compute = flops[:, None, None, None] / (H100_PEAK_FLOPS * mfu)
            memory = hbm[:, None, None, None] / (H100_HBM_BPS * eff) + over
            model = (compute ** p + memory ** p) ** (1 / p)
            err = np.abs(model / measured[:, None, None, None] - 1)
            worst = err.max(axis=0) + np.sqrt((err ** 2).mean(axis=0))
            i = np.unravel_index(worst.argmin(), worst.shape)
            x = [a[j] for a, j in zip(axes, i)]
            if worst[i] < best_err:
                best_err, best = float(worst[i]), (*x, p)
            steps = [(hi - lo) / 40 for lo, hi in lo_hi]
            lo_hi = [(max(v - 4 * d, 1e-6), v + 4 * d) for v, d in zip(x, steps)]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="model_cost_gpu.py's JSON")
    run = json.loads(parser.parse_args().results.read_text())
    model = model_for(run["shape"])
    pts = points(run)
    flops = np.array([model.flops(c) for _, c, _, _ in pts])
    hbm = np.array([model.hbm_bytes(c) for _, c, _, _ in pts])
    measured = np.array([s for _, _, s, _ in pts])
    keep = np.array([not bad for *_, bad in pts])
    mfu, eff, over, p = fit(flops[keep], hbm[keep], measured[keep])
    print(f"{run['device']}, {run['date']}: MFU {mfu:.4f}, HBM efficiency {eff:.4f}, "
          f"step overhead {over * 1e3:.3f} ms, p {p}")
    fitted = CostModel(**{**model.__dict__, "mfu": mfu, "hbm_efficiency": eff,
                          "step_overhead_s": over, "roofline_p": p})
    for label, chunks, s, bad in pts:
        m = fitted.step_s(chunks)
        note = "  (contradicted by the run: left out of the fit)" if bad else ""
        print(f"{label:18s} measured {s * 1e3:8.2f} ms  model {m * 1e3:8.2f} ms  "
              f"{m / s - 1:+7.1%}{note}")


if __name__ == "__main__":
    main()
