"""``tiercache demo``: the engine-shaped workload from the command line.

Joins the coordinator of ``--config`` when its region is live, else spawns one
(``tiercache serve``) and stops it at the end; spawns one worker per rank (``cuda:r``
when CUDA is present, host tensors and the ``cpu`` backend otherwise); replays the
prefix-reuse workload with a live progress line; recovers from faults the way an
engine supervisor would (a dead worker is restarted by rank, a lost coordinator is
waited for, or restarted when the demo spawned it); prints a summary. Exit status 1
when any loaded block held the wrong bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import threading
import time
from typing import Any

from tiercache.backend_kind import BackendKind
from tiercache.config import Config, load_config
from tiercache.errors import (
    ConfigError, CoordinatorGoneError, LayoutMismatchError, RanksDownError, ServiceError,
    WorkerError,
)
from tiercache.region.layout import RegionLayout
from tiercache.region.stale import list_regions
from tiercache.service.signals import stop_on_signals
from tiercache.service.process import CoordinatorProcess
from tiercache.tools.demo.engine import ATTACH_TIMEOUT_S, DemoEngine
from tiercache.tools.demo.rank import RankOptions
from tiercache.tools.demo.report import Progress, format_summary, summary
from tiercache.tools.demo.workload import PrefixWorkload, WorkloadSpec

EXIT_MISMATCH = 1
REQUEST_TIMEOUT_S = 120.0


def _say(message: str) -> None:
    print(f"tiercache demo: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiercache demo", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="TOML config of the coordinator to use")
    p.add_argument("--requests", type=int, default=500,
                   help="requests to replay (0: until SIGINT/SIGTERM); default 500")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--ranks", type=int, default=None,
                   help="worker processes (= instance.world_size; default: the config's)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: one GPU per rank when CUDA is present, else host tensors")
    p.add_argument("--backend", choices=[k.label for k in BackendKind if k.configurable],
                   default=None,
                   help="copy backend (default: the config's transfer.backend)")
    p.add_argument("--prefixes", type=int, default=32, help="shared prefixes in the workload")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of prefix reuse")
    p.add_argument("--bench", action="store_true",
                   help="after the workload: aggregate GB/s per direction, all ranks vs one")
    p.add_argument("--bench-blocks", type=int, default=None,
                   help="blocks per bench transfer (default: half the region, at most 2048)")
    p.add_argument("--bench-reps", type=int, default=5, help="transfers per bench phase")
    p.add_argument("--respawn", type=int, default=3, help="worker restarts allowed")
    p.add_argument("--coordinator-wait", type=float, default=30.0,
                   help="seconds to wait for a lost coordinator that the demo did not start")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON ('-': stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def _resolve_device(requested: str, ranks: int) -> str:
    if requested == "cpu":
        return "cpu"
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        requested = "cuda" if count else "cpu"
    if requested == "cuda" and ranks > count:
        raise ConfigError(f"--ranks {ranks} with --device cuda: one GPU per rank, and this host "
                          f"has {count}")
    return requested


class CoordinatorLink:
    """The coordinator the demo uses: joined (someone else's) or spawned (the demo's own)."""

    def __init__(self, config: Config):
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="tiercache-demo-")
        self.process: CoordinatorProcess | None = None
        live = {r.name: r for r in list_regions() if r.live}.get(config.name)
        if live is not None:
            want = RegionLayout.from_config(config)
            if live.info is None or live.info.layout.digest != want.digest:
                have = live.info.layout.describe() if live.info else "no header"
                raise LayoutMismatchError(
                    f"a live coordinator serves {config.name!r} with geometry [{have}]; this "
                    f"demo needs [{want.describe()}] (--ranks, kv.*, region.*)")
            self.spawned = False
            self.pid = live.info.owner_pid
            _say(f"joined the live coordinator of {config.name!r} (pid {self.pid})")
        else:
            self.spawned = True
            try:
                self.start()
            except BaseException:
                self._tmp.cleanup()
                raise

    def start(self) -> None:
        try:
            self.process = CoordinatorProcess(self.config, self._tmp.name)
        except ServiceError as e:  # serve exited: its log names the reason
            raise CoordinatorGoneError(f"the coordinator the demo started did not come up: "
                                       f"{e}") from e
        self.pid = self.process.pid
        url = re.search(r"metrics: (http://\S+)", self.process.output())
        _say(f"started a coordinator (pid {self.pid}){', metrics at ' + url[1] if url else ''}")

    def recover(self, client_ping, wait_s: float) -> None:
        """After CoordinatorGoneError: restart our own, or wait for someone else's."""
        if self.spawned:
            assert self.process is not None
            self.process.kill()  # reap it (it is gone already, or wedged)
            _say("the coordinator is gone; starting a new one (it re-adopts the region)")
            self.start()
            return
        _say(f"the coordinator is gone; waiting up to {wait_s:.0f} s for it to come back")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                client_ping()
                return
            except CoordinatorGoneError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        try:
            if self.process is not None:
                code = self.process.stop()
                if code != 0:
                    raise CoordinatorGoneError(f"the demo's coordinator exited with {code}:\n"
                                               f"{self.process.output()}")
        finally:
            self._tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = load_config(args.config)
    if args.ranks is not None:
        config = dataclasses.replace(config, world_size=args.ranks)
    device = _resolve_device(args.device, config.world_size)
    spec = WorkloadSpec(num_prefixes=args.prefixes, zipf_s=args.zipf, seed=args.seed)
    layout = RegionLayout.from_config(config)
    args.bench_blocks = args.bench_blocks or min(2048, layout.num_blocks // 2)
    gpu_blocks = max(spec.max_request_blocks, args.bench_blocks if args.bench else 0)
    options = RankOptions(device, gpu_blocks * config.kv.block_size_factor, args.backend)
    stop = stop_on_signals(_say, "finishing the current request, then stopping")
    link = CoordinatorLink(config)
    try:
        doc = _run(config, options, spec, args, link, stop)
    finally:
        link.close()
    text = json.dumps(doc, indent=2)
    if args.json == "-":
        print(text)
    else:
        print(format_summary(doc))
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if doc["mismatched_blocks"]:
        print(f"tiercache demo: error: {doc['mismatched_blocks']} loaded blocks held the wrong "
              "bytes", file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def _run(config: Config, options: RankOptions, spec: WorkloadSpec, args, link: CoordinatorLink,
         stop: threading.Event) -> dict[str, Any]:
    engine = DemoEngine(config, options)
    try:
        engine.start(ATTACH_TIMEOUT_S)
        for rank in range(config.world_size):
            a = engine.pool.channel(rank).attachment
            _say(f"rank {rank}: worker pid {a.pid} on {options.device}, backends store "
                 f"{a.backends[0].label} / load {a.backends[1].label}, pin {a.pin_state.label}")
        progress = Progress(engine.totals, target=args.requests or None)
        respawns = args.respawn
        workload = PrefixWorkload(spec)
        for request in workload.requests(args.requests or None):
            if stop.is_set():
                break
            while True:  # a worker may die between any check and the submit: retry then
                for rank in engine.tracker.down_ranks():
                    if respawns == 0:
                        raise WorkerError(f"rank {rank}'s worker died and --respawn is used up")
                    respawns -= 1
                    _say(f"rank {rank}'s worker is gone; restarting it")
                    engine.restart_rank(rank)
                try:
                    engine.run(request, REQUEST_TIMEOUT_S)
                except RanksDownError:
                    continue
                except CoordinatorGoneError:
                    engine.wait_idle(REQUEST_TIMEOUT_S)
                    link.recover(engine.client.ping, args.coordinator_wait)
                break
            if not args.quiet:
                progress.tick()
        engine.wait_idle(REQUEST_TIMEOUT_S)
        if not args.quiet:
            progress.done()
        bench = None
        if args.bench and not stop.is_set():
            from tiercache.tools.demo.bench import run_bench

            _say(f"bench: {args.bench_blocks} blocks per transfer, {args.bench_reps} "
                 "repetitions, rank 0 alone then every rank at once")
            bench = run_bench(engine, args.bench_blocks, args.bench_reps)
        extra = {
            "device": options.device, "interrupted": stop.is_set(),
            "coordinator": "spawned" if link.spawned else "joined",
            "coordinator_pid": link.pid, "worker_pids": engine.worker_pids(),
            "stale_acks": engine.tracker.stale_acks, "stats_agree": engine.stats_agree(),
            "backends": [[b.label for b in engine.pool.channel(r).attachment.backends]
                         for r in range(config.world_size)],
            "numa": engine.numa(), "bench": bench,
        }
        doc = summary(engine.totals, progress.elapsed_s, extra)
    finally:
        engine.close()
    return doc
