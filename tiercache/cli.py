"""``tiercache`` command line: serve, status, clean, bench, demo, config-for-vllm."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tiercache.config import Config, format_bytes, load_config
from tiercache.errors import TiercacheError
from tiercache.region.header import RegionState
from tiercache.region.hostmem import process_alive
from tiercache.service.signals import stop_on_signals
from tiercache.region.stats import Direction

EXIT_ERROR = 1
EXIT_USAGE = 2


def _say(message: str) -> None:
    print(f"tiercache: {message}", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from tiercache.service.coordinator import Coordinator

    config = load_config(args.config)
    stop = stop_on_signals(_say, "shutting down")
    coordinator = Coordinator(config, say=_say)
    try:
        coordinator.start()
        coordinator.serve_until(stop)
    finally:
        coordinator.close()
    return 0


def _region_names(args: argparse.Namespace) -> list[str] | None:
    if args.config:
        return [load_config(args.config).name]
    if args.name:
        return [args.name]
    return None


def _print_index(socket_path: str) -> None:
    from tiercache.index.client import Client
    from tiercache.errors import CoordinatorGoneError

    try:
        with Client(socket_path, timeout_s=2.0) as client:
            s = client.stats()
    except CoordinatorGoneError as e:
        print(f"  index: not reachable at {socket_path} ({e})")
        return
    print(f"  index: {s.ready_blocks} ready, {s.writing_blocks} writing, {s.loading_blocks} "
          f"loading, {s.free_blocks} free of {s.capacity_blocks} ({s.occupancy:.0%} used); "
          f"{s.lookups} lookups, {s.hit_blocks} hit / {s.miss_blocks} missed blocks, "
          f"{s.stored_blocks} stored, {s.evicted_blocks} evicted, {s.store_rejections} "
          "store rejections")


def cmd_status(args: argparse.Namespace) -> int:
    from tiercache.region.shared import SharedOffloadRegion, list_regions

    wanted = _region_names(args)
    listings = [r for r in list_regions() if wanted is None or r.name in wanted]
    if not listings:
        target = f"named {', '.join(wanted)}" if wanted else "in /dev/shm"
        print(f"no tiercache region {target}")
        return EXIT_ERROR if wanted else 0
    for listing in listings:
        info = listing.info
        owner = "live" if listing.live else "STALE (coordinator gone; `tiercache clean` removes it)"
        print(f"region {listing.name}  {listing.path}  {format_bytes(listing.size_bytes)}  {owner}")
        if info is None:
            print("  header: not initialised")
            continue
        layout = info.layout
        print(f"  state {info.state.label}, generation {info.generation}, coordinator pid "
              f"{info.owner_pid}, format {info.format_version}")
        print(f"  geometry: {layout.describe()}")
        if info.state != RegionState.READY:
            continue
        if listing.live:  # without --config the socket is assumed at its default path
            config = load_config(args.config) if args.config else Config(name=listing.name)
            _print_index(config.socket_path)
        region = SharedOffloadRegion.attach(listing.name)
        try:
            for rank in range(layout.world_size):
                try:
                    s = region.stats(rank).snapshot()
                except TimeoutError:
                    print(f"  rank {rank}: stats block left mid-update (its worker died while "
                          "writing; the next worker of this rank repairs it)")
                    continue
                up = process_alive(s.pid, s.pid_start_ns)
                worker = f"worker pid {s.pid} {'up' if up else 'DOWN'}" if s.pid else "no worker"
                moved = ", ".join(
                    f"{d.label} {format_bytes(s.directions[d].bytes_total)} in "
                    f"{s.directions[d].transfers_ok} ok/{s.directions[d].transfers_failed} failed"
                    f" ({s.backends[d].label})"
                    for d in Direction)
                print(f"  rank {rank}: {worker}, attached {s.attach_count}x, pre-faulted in "
                      f"{s.prefault_seconds:.2f} s, pin {s.pin_state.label} "
                      f"{format_bytes(s.pinned_bytes)} in {s.pin_seconds:.2f} s; {moved}")
        finally:
            region.close()
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    from tiercache.region.shared import list_regions, remove_stale

    removed = remove_stale(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for listing in removed:
        print(f"{verb} stale region {listing.path} ({format_bytes(listing.size_bytes)})")
    live = [r for r in list_regions() if r.live]
    for listing in live:
        print(f"kept live region {listing.path} (coordinator running)")
    if not removed and not live:
        print("no tiercache regions")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tiercache.tools.bench import main as bench_main

    return bench_main(args.rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from tiercache.tools.demo import main as demo_main

    return demo_main(args.rest)


def cmd_config_for_vllm(args: argparse.Namespace) -> int:
    from tiercache.vllm.config_cmd import main as config_for_vllm_main

    return config_for_vllm_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiercache", description=__doc__)
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the coordinator (region, index, exporter)")
    serve.add_argument("--config", required=True, help="TOML config file")
    serve.set_defaults(func=cmd_serve)
    status = sub.add_parser("status", help="show regions, geometry and per-rank state")
    status.add_argument("--config", help="only the region of this config")
    status.add_argument("--name", help="only the region of this instance name")
    status.set_defaults(func=cmd_status)
    clean = sub.add_parser("clean", help="remove stale regions (never a live one)")
    clean.add_argument("--dry-run", action="store_true", help="only list what would go")
    clean.set_defaults(func=cmd_clean)
    for name, func, text in (("bench", cmd_bench, "transfer benchmark (see tiercache bench -h)"),
                             ("demo", cmd_demo, "engine-shaped workload (see tiercache demo -h)"),
                             ("config-for-vllm", cmd_config_for_vllm,
                              "the coordinator config a vLLM engine fits (config-for-vllm -h)")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=func)
    return parser


PASSTHROUGH_COMMANDS = ("bench", "demo", "config-for-vllm")  # parse their own arguments


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # REMAINDER does not take arguments that start with '-' (`demo --config F`), so
    # everything after a pass-through command word is handed over as it was typed.
    args, unknown = parser.parse_known_args(argv)
    if args.command in PASSTHROUGH_COMMANDS:
        args.rest = argv[argv.index(args.command) + 1:]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except TiercacheError as e:
        print(f"tiercache: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `tiercache status | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
