"""``tiercache replay``: real vLLM 0.33 schedulers over a trace, per system, on a simulated
clock; a table on stdout and ``--json`` in the issue's shape (issue 40; the trace format is
documented in ``trace``, the generators in ``workloads``, the cost model in ``cost``, the
systems in ``systems``, the routers in ``routers``, the figures in ``report``; results in
docs/benchmarks.md).

It asks vLLM (schedulers, KV-cache manager, offloading connector), so it runs in the
engines' environment; without vLLM it is one line naming where to run it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tiercache.config.hf_model import HFModel
from tiercache.errors import ConfigError
from tiercache.sizes import parse_size
from tiercache.tools.replay.cost import (
    TIERCACHE_DISK_READ_BPS, TIERCACHE_LOAD_BPS, TIERCACHE_STORE_BPS, VLLM_NATIVE_LOAD_BPS,
    VLLM_NATIVE_STORE_BPS,
    CostModel, DecoderShape, hbm_kv_tokens,
)
from tiercache.tools.replay.trace import Trace
from tiercache.tools.replay.workloads import Workload, WorkloadParams, generate

VLLM_VERSION = "0.33.0"
DEFAULT_SYSTEMS = "none,vllm_native,tiercache"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiercache replay", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a JSONL trace (format: tiercache.tools.replay.trace)")
    src.add_argument("--generate", choices=[w.value for w in Workload],
                     help="a built-in trace shape")
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json)")
    p.add_argument("--engines", type=int, default=2, help="engines per system (default 2)")
    p.add_argument("--dram", required=True, help="host memory for KV, all engines, e.g. 64GiB")
    p.add_argument("--disk", default=None, help="tiercache's disk tier, e.g. 256GiB")
    p.add_argument("--router", default="round_robin",
                   choices=["round_robin", "least_loaded", "prefix"])
    p.add_argument("--gpu-kv-tokens", type=int, default=None,
                   help="GPU KV budget per engine in tokens (default: an 80 GB H100's)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"default {DEFAULT_SYSTEMS}")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--per-request", action="store_true",
                   help="also write each request's record (engine, TTFT, hits) into --json")
    g = p.add_argument_group("--generate's trace")
    g.add_argument("--requests", type=int, default=200)
    g.add_argument("--rate", type=float, default=None,
                   help="arrivals per second (sessions for chat; default 2 per engine)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-trace", default=None, help="also write the generated trace here")
    p.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's, per engine")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="vLLM's, per engine")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def require_vllm() -> None:
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"replay drives vLLM {VLLM_VERSION}'s schedulers, and vLLM is not installed here: "
            "run it in the engines' environment (e.g. .venv-vllm/bin/tiercache replay)") from None
    if version.split("+")[0] != VLLM_VERSION:
        raise ConfigError(f"replay drives vLLM {VLLM_VERSION}; this environment has {version}")


def _quiet() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name in ("vllm", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _trace(args: argparse.Namespace) -> Trace:
    if args.trace:
        return Trace.read(args.trace)
    rate = args.rate if args.rate is not None else 2.0 * args.engines
    trace = generate(Workload(args.generate),
                     WorkloadParams(num_requests=args.requests, rate_rps=rate, seed=args.seed))
    if args.save_trace:
        trace.write(args.save_trace)
    return trace


def _cost(model_dir: Path, load_bps: float, store_bps: float,
          disk_read_bps: float = TIERCACHE_DISK_READ_BPS) -> CostModel:
    from tiercache.vllm.model_kv import ServingOptions, model_kv

    kv = model_kv(str(model_dir), ServingOptions())
    geometry = kv.geometry
    assert geometry.page_bytes is not None
    return CostModel.for_shape(DecoderShape.of(HFModel.read(str(model_dir))),
                               sum(geometry.page_bytes) // geometry.block_tokens,
                               geometry.block_tokens, load_bps, store_bps, disk_read_bps)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    dram = parse_size(args.dram, "--dram")
    disk = parse_size(args.disk, "--disk") if args.disk else 0
    from tiercache.tools.replay.routers import RouterKind
    from tiercache.tools.replay.systems import System

    systems = System.parse_list(args.systems)
    router = RouterKind.parse(args.router)
    trace = _trace(args)
    require_vllm()
    _quiet()
    # SIGTERM unwinds like Ctrl-C: each system's engines and its coordinator are closed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    model_dir = HFModel.read(args.model).path.parent
    report = replay(trace, model_dir, systems, router, engines=args.engines, dram_bytes=dram,
                    disk_bytes=disk, gpu_kv_tokens=args.gpu_kv_tokens,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    per_request=args.per_request, say=None if args.quiet else _say)
    from tiercache.tools.replay.report import headline, table

    print(headline(args.engines, dram, disk, router.value, report["trace"]))
    print(table(report["systems"]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _arm_extra(arm: Any, records: list[Any], began: float, per_request: bool
               ) -> dict[str, Any]:
    """What a system's report adds beyond ``summarize``'s: the arm's sizes, its tiers' and
    node stream's counts, and (``per_request``) each request's record."""
    extra: dict[str, Any] = {"host_blocks": arm.host_blocks, "bytes_scale": arm.bytes_scale,
                             "wall_s": round(time.monotonic() - began, 1)}
    if arm.settler is not None:
        extra["disk_tier"] = arm.settler.stats()
    if arm.node is not None:
        extra["node_stream"] = {"batches": arm.node.num_batches,
                                "events": arm.node.num_events,
                                "replays": arm.node.num_replays}
    if per_request:
        extra["per_request"] = [
            {"req_id": r.req_id, "engine": r.engine, "arrival_s": r.arrival_s,
             "prompt_tokens": r.prompt_tokens, "ttft_s": round(r.ttft_s, 6),
             "gpu_hit_tokens": r.gpu_hit_tokens, "external_hit_tokens": r.external_hit_tokens,
             "disk_read_blocks": r.disk_read_blocks} for r in records]
    return extra


def replay(trace: Trace, model_dir: Path, systems: list[Any], router: Any, *, engines: int,
           dram_bytes: int, disk_bytes: int = 0, gpu_kv_tokens: int | None = None,
           max_num_seqs: int = 64, max_num_batched_tokens: int = 4096,
           disk_read_bps: float = TIERCACHE_DISK_READ_BPS, per_request: bool = False,
           say: Any = None) -> dict[str, Any]:
    """Replay ``trace`` under each of ``systems``; the report as ``--json`` writes it.
    ``disk_read_bps``: the disk tier's read rate on the clock (the cost model's measured
    one unless given); ``per_request``: each system's records under ``per_request``."""
    from tiercache.tools.replay import clock
    from tiercache.tools.replay.events import EventRecorder
    from tiercache.tools.replay.report import summarize
    from tiercache.tools.replay.routers import RouterKind, make_router
    from tiercache.tools.replay.systems import Arm, Fleet, System

    costs = {System.NONE: _cost(model_dir, TIERCACHE_LOAD_BPS, TIERCACHE_STORE_BPS)}
    costs[System.TIERCACHE] = _cost(model_dir, TIERCACHE_LOAD_BPS, TIERCACHE_STORE_BPS,
                                    disk_read_bps)
    costs[System.VLLM_NATIVE] = _cost(model_dir, VLLM_NATIVE_LOAD_BPS, VLLM_NATIVE_STORE_BPS)
    base = costs[System.NONE]
    tokens = gpu_kv_tokens or hbm_kv_tokens(base.params, base.kv_bytes_per_token)
    out: dict[str, Any] = {"systems": {}, "engines": engines, "dram_bytes": dram_bytes,
                           "disk_bytes": disk_bytes, "router": router.value,
                           "model": str(model_dir), "gpu_kv_tokens": tokens,
                           "trace": trace.summary(), "cost_model": {}}
    with tempfile.TemporaryDirectory(prefix="tiercache-replay-") as workdir:
        for system in systems:
            fleet = Fleet(model_dir, engines, dram_bytes, tokens // base.block_tokens,
                          Path(workdir) / system.value, disk_bytes, max_num_seqs,
                          max_num_batched_tokens, kv_events=router is RouterKind.PREFIX)
            fleet.workdir.mkdir()
            recorders = [EventRecorder() for _ in range(engines)]
            began = time.monotonic()
            arm = Arm(system, fleet, costs[system], recorders)
            try:
                def progress(done: int, total: int, sim_s: float, name: str = system.value
                             ) -> None:
                    if say is not None:
                        say(f"replay {name}: {done}/{total} requests finished, "
                            f"{sim_s:.1f} s simulated, {time.monotonic() - began:.0f} s wall")

                records = clock.run(trace, arm.engines,
                                    make_router(router, recorders, base.block_tokens, arm.node),
                                    progress)
                extra = _arm_extra(arm, records, began, per_request)
                out["systems"][system.value] = summarize(records, arm.engines, extra)
                out["cost_model"][system.value] = costs[system].describe()
            finally:
                arm.close()
    return out
