"""Hit rate of an abort-heavy workload, through vLLM's real scheduler (issue 21, item 2).

    .venv-vllm/bin/python tests/vllm/bench_abort_hit_rate.py [--cache-chunks 48]
        [--popular 4] [--chunks 8] [--rounds 16] [--aborts 3] [--computed 0] [--json PATH]

A coordinator (``tiercache serve``) of ``--cache-chunks`` chunks and one engine (vLLM's
Scheduler and both roles of OffloadingConnector with TierCacheOffloadingSpec, CPU KV,
``cpu`` backend, every loaded block checked). Deterministic, no clock involved:

* warm-up: ``--popular`` prompts of ``--chunks`` chunks each run once and are stored;
* each of ``--rounds`` rounds: ``--aborts`` new prompts of the same length arrive with one
  of the popular prompts (in turn) and ``--computed`` other new prompts; the engine takes
  one step (every request is looked up), the ``--aborts`` ones are aborted (a client that
  went away), and the others run to the end (the computed ones store their chunks: real
  stores, which must evict in a full cache). The aborted prompts share their first chunk
  with the round's popular prompt, so they are probed in the coordinator (and deferred a
  step) and aborted before computing anything; a wholly new prompt is a cold miss that
  the presence map admits at once, and it computes (and stores) in its first step.

Printed: the hit rate (tokens of the popular requests loaded from tiercache over their
full-chunk prompt tokens, rounds only) and the blocks the coordinator evicted during the
rounds. The engine's GPU holds 16 blocks, so a popular prompt's previous run is gone from
its prefix cache by its next turn: its hits can only come from tiercache.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path

from vllm_harness import BLOCK_TOKENS, Engine, TinyModel

from tiercache.link.client import Client
from tiercache.service.process import CoordinatorProcess


def prompt(seed: int, num_chunks: int) -> list[int]:
    """``num_chunks`` full blocks and a partial one, different for every seed."""
    return [(seed * 7919 + i * (seed % 13 + 1)) % 250 for i in range(num_chunks * BLOCK_TOKENS + 4)]


def run(engine: Engine, coordinator, *, popular: int, chunks: int, rounds: int,
        aborts: int, computed: int = 0) -> dict:
    prompts = [prompt(1 + p, chunks) for p in range(popular)]
    for p, tokens in enumerate(prompts):
        engine.add_request(f"warm-{p}", tokens)
        engine.run()
    with Client(coordinator.config) as client:
        evicted_before = client.stats().evicted_blocks
    loaded = asked = 0
    for r in range(rounds):
        # an empty GPU prefix cache (not tiercache's): the shared first chunk below is then
        # found in tiercache only, so the aborted prompts are probed there
        assert engine.scheduler.reset_prefix_cache(reset_connector=False)
        novel = [f"new-{r}-{j}" for j in range(aborts)]
        shared = prompts[r % popular][:BLOCK_TOKENS]  # a cached first chunk: probed, not cold
        for j, req_id in enumerate(novel):
            engine.add_request(req_id, shared + prompt(1000 + r * aborts + j, chunks)[BLOCK_TOKENS:])
        req_id = f"popular-{r}"
        engine.add_request(req_id, prompts[r % popular])
        for j in range(computed):
            engine.add_request(f"computed-{r}-{j}", prompt(100_000 + r * computed + j, chunks))
        engine.step()  # every request is looked up (and probed)
        for novel_id in novel:
            engine.abort(novel_id)
        engine.run()
        loaded += engine.loaded_tokens(req_id)
        asked += chunks * BLOCK_TOKENS
    with Client(coordinator.config) as client:
        evicted = client.stats().evicted_blocks - evicted_before
    return {"hit_rate": loaded / asked, "loaded_tokens": loaded, "asked_tokens": asked,
            "evicted_blocks": evicted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-chunks", type=int, default=48)
    parser.add_argument("--popular", type=int, default=4, help="prompts asked again and again")
    parser.add_argument("--chunks", type=int, default=8, help="chunks (16-token blocks) per prompt")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--aborts", type=int, default=3, help="aborted new requests per round")
    parser.add_argument("--computed", type=int, default=0,
                        help="new requests per round that run to the end (and store)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    model = TinyModel()
    with tempfile.TemporaryDirectory(prefix="tiercache-aborts-") as tmp:
        tmp_path = Path(tmp)
        config = model.coordinator_config(f"aborts-{uuid.uuid4().hex[:8]}",
                                          str(tmp_path / "c.sock"), args.cache_chunks)
        with CoordinatorProcess(config, workdir=tmp_path / "coord") as coordinator:
            engine = Engine.build(model, model.write(tmp_path / "model"), coordinator.config_path,
                                  num_gpu_blocks=16 * (1 + args.computed),
                                  max_num_seqs=args.aborts + args.computed + 1)
            try:
                result = run(engine, coordinator, popular=args.popular, chunks=args.chunks,
                             rounds=args.rounds, aborts=args.aborts, computed=args.computed)
            finally:
                engine.shutdown()
    print(f"abort-heavy workload: {args.rounds} rounds of {args.aborts} aborted new prompts + "
          f"{args.computed} computed new prompts + 1 of {args.popular} popular prompts "
          f"({args.chunks} chunks each), cache of "
          f"{args.cache_chunks} chunks: hit rate {result['hit_rate']:.1%} "
          f"({result['loaded_tokens']} of {result['asked_tokens']} tokens), "
          f"{result['evicted_blocks']} blocks evicted")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
