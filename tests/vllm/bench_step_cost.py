"""Scheduler-side cost of tiercache per engine step, through vLLM's real scheduler.

    .venv-vllm/bin/python tests/vllm/bench_step_cost.py [--requests 64] [--keys 128]
        [--batched-tokens 8192] [--json PATH]

A coordinator (``tiercache serve``) and one engine (vLLM's Scheduler and both roles of
OffloadingConnector with TierCacheOffloadingSpec, CPU KV, ``cpu`` backend). Two passes of
``--requests`` prompts of ``--keys`` chunks each: *cold* (nothing cached: every chunk is
stored) and *warm* (a fresh engine on the same coordinator: every chunk is a hit and is
loaded). Every call vLLM makes into the manager is timed (lookup, prepare_load,
prepare_store, complete_*, on_request_finished, on_schedule_end, take_events, get_stats,
has_pending_work, ...), per step; the timer's own cost per call is measured and taken
off. Printed: per pass the worst step and the mean over steps that made calls, with the
calls of the worst step; and vLLM's ``schedule()`` time for scale. A timer around every
call costs about as much as the cheapest calls themselves, so these are upper bounds.

Then *direct*: the calls one step makes for ``--requests`` requests of ``--keys`` chunks,
made straight on a TierCacheManager (real coordinator, no timer per call), in the steps
vLLM goes through: admission (every key looked up: RETRY; the probe is handed over),
hits (every key HIT, one prepare_load per request, get_load_source per key), loads done
(complete_load, on_request_finished); and cold: admission, misses with the prepare_store
of every chunk (answered from the probe's reservations), stores done (complete_store).
Each is compared with the floor: as many calls of a method that does nothing (what any
Python manager pays to be called at all).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

from vllm_harness import Engine, TinyModel

from tiercache.service.process import CoordinatorProcess
from tiercache.vllm.spec import TierCacheOffloadingSpec

TIMED = ("lookup", "get_load_source", "prepare_load", "complete_load", "prepare_store",
         "complete_store", "on_new_request", "on_request_finished", "on_schedule_end",
         "has_pending_work", "take_events", "get_stats", "touch")


class StepTimer:
    """Wraps the manager's methods; ``seconds`` / ``calls`` per step and method."""

    def __init__(self, manager):
        self.step = 0
        self.seconds: dict[int, float] = defaultdict(float)
        self.calls: dict[int, Counter] = defaultdict(Counter)
        for name in TIMED:
            setattr(manager, name, self._wrap(name, getattr(manager, name)))
        self.overhead_s = self._calibrate()

    def _wrap(self, name, fn):
        perf = time.perf_counter
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            start = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[self.step] += perf() - start
                calls[self.step][name] += 1
        return timed

    def _calibrate(self, n: int = 200_000) -> float:
        """Seconds a wrapped call costs beyond the call itself (subtracted per call)."""
        probe = StepTimer.__new__(StepTimer)
        probe.step, probe.seconds, probe.calls = -1, defaultdict(float), defaultdict(Counter)
        noop = probe._wrap("noop", lambda a, b: None)
        start = time.perf_counter()
        for _ in range(n):
            noop(1, 2)
        wrapped = time.perf_counter() - start
        plain = lambda a, b: None  # noqa: E731
        start = time.perf_counter()
        for _ in range(n):
            plain(1, 2)
        return max(wrapped - (time.perf_counter() - start), 0.0) / n

    def cost(self, step: int) -> float:
        return max(self.seconds[step] - self.overhead_s * sum(self.calls[step].values()), 0.0)


def run_pass(engine: Engine, prompts: list[list[int]], label: str) -> dict:
    timer = StepTimer(engine.manager)
    schedule_s: list[float] = []
    original = engine.scheduler.schedule

    def schedule():
        start = time.perf_counter()
        try:
            return original()
        finally:
            schedule_s.append(time.perf_counter() - start)
    engine.scheduler.schedule = schedule
    for i, tokens in enumerate(prompts):
        engine.add_request(f"{label}-{i}", tokens)
    while engine.scheduler.has_requests() or engine.scheduler.connector.has_pending_push_work():
        timer.step = engine.steps
        engine.step()
    steps = [s for s in timer.calls if s >= 0 and timer.calls[s]]
    costs = {s: timer.cost(s) for s in steps}
    worst = max(costs, key=costs.get)
    return {
        "pass": label, "steps": len(steps),
        "worst_step_ms": costs[worst] * 1e3,
        "mean_step_ms": statistics.fmean(costs.values()) * 1e3,
        "worst_step_calls": dict(timer.calls[worst]),
        "loaded_tokens": sum(engine.loaded_tokens(f"{label}-{i}") for i in range(len(prompts))),
        "timer_overhead_ns": timer.overhead_s * 1e9,
        "vllm_schedule_worst_ms": max(schedule_s) * 1e3,
    }


def fill(coordinator, num_keys: int, salt: int) -> None:
    """Store ``num_keys`` keys of another namespace: a full cache of READY blocks."""
    from tiercache.link.client import Client
    from tiercache.link.protocol import MAX_KEYS_PER_CALL

    keys = [b"filler-%d-%d" % (salt, i) for i in range(num_keys)]
    batch = min(MAX_KEYS_PER_CALL, 64)  # a disk tier pins a few blocks while it demotes them
    with Client(coordinator.config) as client:
        for start in range(0, num_keys, batch):
            out = client.prepare_store(keys[start:start + batch])
            client.complete_store(list(out.keys_to_store))


def direct_steps(coordinator, num_requests: int, num_keys: int, full_cache: bool = False,
                 salt: int = 1) -> dict[str, float]:
    """Milliseconds per step of the calls vLLM makes, straight on the manager; with
    ``full_cache``, the cache is filled with other READY blocks before the cold steps, so
    every store must evict."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key

    from vllm_harness import offloading_config

    spec = TierCacheOffloadingSpec(offloading_config(coordinator, TinyModel()))
    manager = spec.get_manager()
    end = ScheduleEndContext((), ())
    perf = time.perf_counter
    results: dict[str, float] = {}

    def keys_of(r: int, salt: int) -> list:
        return [make_offload_key((salt * 1_000_003 + r * 1009 + i).to_bytes(32, "big"), 0)
                for i in range(num_keys)]

    def timed(name, fn):
        with manager.lock:
            start = perf()
            fn()
            results[name] = (perf() - start) * 1e3
        assert manager.wait_flushed(120)

    try:
        if full_cache:
            fill(coordinator, num_requests * num_keys, salt)
        for label in ("cold", "warm"):
            contexts = [ReqContext(f"{label}-{r}") for r in range(num_requests)]
            keys = [keys_of(r, salt) for r in range(num_requests)]
            with manager.lock:
                for ctx in contexts:
                    manager.on_new_request(ctx)

            def admit():
                for ctx, ks in zip(contexts, keys):
                    for k in ks:
                        manager.lookup(k, ctx)
                manager.on_schedule_end(end)
            timed(f"{label}: admission (RETRY x {num_requests * num_keys})", admit)
            if label == "cold":
                def miss_and_store():
                    for ctx, ks in zip(contexts, keys):
                        manager.lookup(ks[0], ctx)  # vLLM stops at the first MISS
                        manager.prepare_store(ks, ctx)
                    manager.on_schedule_end(end)
                timed(f"cold: misses + prepare_store x {num_requests}", miss_and_store)

                def stored():
                    for ctx, ks in zip(contexts, keys):
                        manager.complete_store(ks, ctx)
                        manager.on_request_finished(ctx)
                    manager.on_schedule_end(end)
                timed(f"cold: complete_store + finished x {num_requests}", stored)
            else:
                def hits():
                    for ctx, ks in zip(contexts, keys):
                        for k in ks:
                            manager.lookup(k, ctx)
                        manager.prepare_load(ks, ctx)
                        for k in ks:
                            manager.get_load_source(k, ctx)
                    manager.on_schedule_end(end)
                timed(f"warm: HIT x {num_requests * num_keys} + prepare_load x {num_requests}",
                      hits)

                def loaded():
                    for ctx, ks in zip(contexts, keys):
                        manager.complete_load(ks, ctx)
                        manager.on_request_finished(ctx)
                    manager.on_schedule_end(end)
                timed(f"warm: complete_load + finished x {num_requests}", loaded)
    finally:
        manager.shutdown()

    class Null:
        def call(self, key, ctx):
            return None
    null, ctx = Null(), object()
    start = perf()
    for _ in range(num_requests):
        for i in range(2 * num_keys):
            null.call(i, ctx)
    floor = f"floor: {2 * num_requests * num_keys} calls of a no-op method"
    results[floor] = (perf() - start) * 1e3
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--keys", type=int, default=128, help="chunks (16-token blocks) per prompt")
    parser.add_argument("--batched-tokens", type=int, default=8192,
                        help="vLLM max_num_batched_tokens (prefill tokens per step)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--repeats", type=int, default=5, help="direct measurements (best kept)")
    parser.add_argument("--full-cache", action="store_true",
                        help="a cache of exactly one pass, full of other blocks before the "
                             "cold steps: every store evicts")
    parser.add_argument("--disk", action="store_true",
                        help="a disk tier below host memory (busy: it demotes ahead of the "
                             "cold pass's evictions and promotes on the warm pass's lookups)")
    parser.add_argument("--cluster", action="store_true",
                        help="a cluster tier on a mooncake_master started here (busy: it "
                             "publishes every block the cold pass stores)")
    args = parser.parse_args(argv)
    model = TinyModel()
    tokens_per_prompt = args.keys * 16
    chunks = (args.requests * args.keys if args.full_cache
              else 2 * args.requests * args.keys + 64)
    gpu_blocks = args.requests * (args.keys + 2) + 16
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-") as tmp:
        tmp_path = Path(tmp)
        disk = None
        if args.disk:
            from tiercache.config import DiskConfig

            (tmp_path / "disk").mkdir()
            disk = DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=4 << 30,
                              low_watermark=0.5)
        master = cluster = None
        if args.cluster:
            from mooncake_master import MooncakeMaster

            from tiercache.config import ClusterConfig

            master = MooncakeMaster(tmp_path / "master")
            cluster = ClusterConfig(master=master.address, metadata_server=master.metadata_url,
                                    local_hostname="127.0.0.1", key_file=master.key_file,
                                    segment_bytes=1 << 30,
                                    publish_queue_blocks=4096)
        config = model.coordinator_config(f"bench-{uuid.uuid4().hex[:8]}",
                                          str(tmp_path / "c.sock"), chunks, disk=disk,
                                          cluster=cluster)
        try:
            return _run(args, model, config, tmp_path, chunks, gpu_blocks, tokens_per_prompt)
        finally:
            if master is not None:
                master.stop()


def _run(args, model, config, tmp_path, chunks, gpu_blocks, tokens_per_prompt) -> int:
    with CoordinatorProcess(config, workdir=tmp_path / "coord") as coordinator:
        model_dir = model.write(tmp_path / "model")
        prompts = [[(r * 7919 + i) % 250 for i in range(tokens_per_prompt)]
                   for r in range(args.requests)]
        direct: dict[str, float] = {}
        for repeat in range(args.repeats):
            salt = 1 + repeat if args.full_cache else 1  # a full cache: fresh keys each time
            for name, ms in direct_steps(coordinator, args.requests, args.keys,
                                         args.full_cache, salt).items():
                direct[name] = min(ms, direct.get(name, ms))
        results = []
        if args.full_cache:
            fill(coordinator, chunks, salt=0)
        for label in ("cold", "warm"):
            engine = Engine.build(model, model_dir, coordinator.config_path,
                                  num_gpu_blocks=gpu_blocks, max_num_seqs=args.requests,
                                  max_num_batched_tokens=args.batched_tokens,
                                  check_content=False)
            try:
                results.append(run_pass(engine, prompts, label))
            finally:
                engine.shutdown()
    for r in results:
        print(f"{r['pass']}: {r['steps']} steps with calls; worst {r['worst_step_ms']:.3f} ms, "
              f"mean {r['mean_step_ms']:.3f} ms of tiercache per step; worst step's calls "
              f"{r['worst_step_calls']}; loaded {r['loaded_tokens']} tokens; vLLM schedule() "
              f"worst {r['vllm_schedule_worst_ms']:.1f} ms; "
              f"timer {r['timer_overhead_ns']:.0f} ns/call")
    for name, ms in direct.items():
        print(f"direct {name}: {ms:.3f} ms (best of {args.repeats})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results,
                                               "direct_ms": direct}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
