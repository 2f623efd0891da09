"""Steps from ``add_request`` to the first scheduled token, through vLLM's real scheduler
(issue 21, item 1): a cold request, and one whose prefix tiercache holds.

    .venv-vllm/bin/python tests/vllm/bench_admission.py [--model-ms 0 2 20] [--rounds 4]
        [--lookup-wait-ms 50] [--json PATH]

A coordinator (``tiercache serve``) and two engines (vLLM's Scheduler and both roles of
OffloadingConnector with TierCacheOffloadingSpec, CPU KV, ``cpu`` backend, every loaded
block checked). The first engine stores ``--rounds`` prompts of 6 chunks. For each step
time (``--model-ms``: the forward pass, slept while the flusher talks to the
coordinator), the second engine (an empty GPU prefix cache) gets, per round, a new prompt
(cold) and one of the stored prompts (hit) in the same step, and is stepped the way an
engine steps: without waiting for the coordinator between steps.

Printed per step time: for the cold requests, the step (0 = the first step after
``add_request``) in which tokens were first scheduled, and how many the presence map
answered as definite misses (the others were false "maybe"s, probed: one step); for the
hit requests, the step in which their load was started.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path

from vllm_harness import BLOCK_TOKENS, Engine, TinyModel

from tiercache.service.process import CoordinatorProcess

CHUNKS = 6


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * (seed % 13 + 1)) % 250 for i in range(CHUNKS * BLOCK_TOKENS + 4)]


def admissions(engine: Engine, requests: dict[str, list[int]], model_s: float,
               max_steps: int = 2000) -> tuple[dict[str, int], dict[str, int]]:
    """Add ``requests`` at once and step: (first step each was scheduled tokens, first
    step a load of it was started)."""
    for req_id, tokens in requests.items():
        engine.add_request(req_id, tokens)
    scheduled: dict[str, int] = {}
    loads: dict[str, int] = {}
    for step in range(max_steps):
        out = engine.step(flush=False, model_s=model_s)
        for req_id in out.num_scheduled_tokens:
            scheduled.setdefault(req_id, step)
        for job in out.kv_connector_metadata.load_jobs.values():
            loads.setdefault(job.req_id, step)
        if all(r in engine.finished for r in requests):
            break
    engine.run()  # whatever is left, and the flusher drained
    return scheduled, loads


def run(coordinator, model: TinyModel, model_dir: Path, *, model_ms: list[float],
        rounds: int, lookup_wait_ms: float) -> dict:
    stored = [prompt(1 + r) for r in range(rounds)]
    first = Engine.build(model, model_dir, coordinator.config_path, num_gpu_blocks=16)
    try:
        for r, tokens in enumerate(stored):
            first.add_request(f"store-{r}", tokens)
            first.run()
    finally:
        first.shutdown()
    results = {}
    for ms in model_ms:
        cold_steps, hit_steps, loaded, definite = [], [], 0, 0
        for r in range(rounds):
            engine = Engine.build(model, model_dir, coordinator.config_path, num_gpu_blocks=64,
                                  extra={"tiercache_lookup_wait_ms": lookup_wait_ms})
            try:
                cold, hit = f"cold-{ms}-{r}", f"hit-{ms}-{r}"
                seed = 10_000 + int(ms * 1000) * 100 + r
                scheduled, loads = admissions(
                    engine, {cold: prompt(seed), hit: stored[r] + [1, 2]}, ms / 1000)
                definite += getattr(engine.manager.book, "cold_misses", 0)  # 0 before the map
                cold_steps.append(scheduled[cold])
                hit_steps.append(loads.get(hit, -1))
                loaded += engine.loaded_tokens(hit)
            finally:
                engine.shutdown()
        results[str(ms)] = {"cold_first_scheduled": cold_steps, "hit_load_started": hit_steps,
                            "cold_definite_misses": definite,
                            "hit_loaded_tokens": loaded,
                            "hit_asked_tokens": rounds * CHUNKS * BLOCK_TOKENS}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-ms", type=float, nargs="+", default=[0.0, 2.0, 20.0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--lookup-wait-ms", type=float, default=50.0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    model = TinyModel()
    with tempfile.TemporaryDirectory(prefix="tiercache-admission-") as tmp:
        tmp_path = Path(tmp)
        config = model.coordinator_config(f"admission-{uuid.uuid4().hex[:8]}",
                                          str(tmp_path / "c.sock"), 64)
        with CoordinatorProcess(config, workdir=tmp_path / "coord") as coordinator:
            results = run(coordinator, model, model.write(tmp_path / "model"),
                          model_ms=args.model_ms, rounds=args.rounds,
                          lookup_wait_ms=args.lookup_wait_ms)
    print("| step time (forward) | cold: first scheduled at step | cold: definite misses "
          "| hit: load started at step | hit tokens loaded |")
    print("|---|---|---|---|---|")
    for ms, r in results.items():
        print(f"| {float(ms):g} ms | {r['cold_first_scheduled']} | {r['cold_definite_misses']} "
              f"of {len(r['cold_first_scheduled'])} | {r['hit_load_started']} | "
              f"{r['hit_loaded_tokens']} of {r['hit_asked_tokens']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
