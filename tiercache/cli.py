"""The ``tiercache`` command line: one subcommand per job, each with its own ``-h``;
``tiercache -h`` lists them all from the parser (``build_parser``), with a line each.

Errors are one line on stderr (``tiercache: error: ...``; with ``--log-format json`` a
JSON record of level ERROR) and exit status 1; bad usage is argparse's message and exit
status 2. Logging goes to stderr in one timestamped format (``tiercache.service.logs``),
``serve``'s start-up steps included.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from tiercache.config import Config, check_name, load_config
from tiercache.errors import (
    RegionError, RegionNotFoundError, RegionTruncatedError, RegionTrustError, TiercacheError,
)
from tiercache.service.logs import LOG_FORMAT_ENV, STEP_LOGGER, LogFormat, configure
from tiercache.region.header import HeaderInfo, RegionState, Reservation
from tiercache.region.stale import (
    MapListing, RegionListing, list_maps, list_regions, remove_stale, remove_stale_maps,
)
from tiercache.region.stats import EngineKind
from tiercache.service.signals import stop_on_signals
from tiercache.specs import Direction
from tiercache.sizes import format_bytes

if TYPE_CHECKING:
    from tiercache.region.attachments import RankSummary

EXIT_ERROR = 1
EXIT_USAGE = 2


def cmd_serve(args: argparse.Namespace) -> int:
    from tiercache.service.coordinator import Coordinator

    config = load_config(args.config)
    say = logging.getLogger(STEP_LOGGER).info
    stop = stop_on_signals(say, "shutting down")
    coordinator = Coordinator(config, say=say)
    try:
        coordinator.start()
        coordinator.serve_until(stop)
    finally:
        coordinator.close()
    if coordinator.abandoned:  # Mooncake's teardown at exit would hang or abort under them
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0


def _region_names(args: argparse.Namespace) -> list[str] | None:
    """The instances ``--config`` or ``--name`` names, None for all (neither given: an
    empty ``--name ''`` is an error, never "all")."""
    if args.config is not None:
        return [load_config(args.config).name]
    if args.name is not None:
        return [check_name(args.name, "--name")]
    return None


def _socket_path(args: argparse.Namespace, name: str) -> str:
    """The control socket of instance ``name``: the path its region header records (the
    coordinator's, whatever this caller's environment), else the config's default."""
    from tiercache.link.client import resolve_socket_path

    config = load_config(args.config) if args.config is not None else Config(name=name)
    return resolve_socket_path(config)


def _print_index(socket_path: str) -> None:
    from tiercache.link.client import Client
    from tiercache.errors import CoordinatorGoneError
    from tiercache.results import BlockSource

    try:
        with Client(socket_path, timeout_s=2.0) as client:
            s = client.stats()
            tiers = client.tier_stats()
    except CoordinatorGoneError as e:
        print(f"  index: not reachable at {socket_path} ({e})")
        return
    held = (f", {s.quarantined_blocks} held out after failed reads until they end"
            if s.quarantined_blocks else "")
    print(f"  index: {s.ready_blocks} ready, {s.writing_blocks} writing, {s.loading_blocks} "
          f"loading, {s.free_blocks} free of {s.capacity_blocks} ({s.occupancy:.0%} used"
          f"{held}); "
          f"{s.lookups} lookups, {s.hit_blocks} hit / {s.miss_blocks} missed blocks, "
          f"{s.stored_blocks} stored, {s.evicted_blocks} evicted, {s.store_rejections} "
          "store rejections")
    for name, t in tiers.items():
        if name == BlockSource.CLUSTER.label:
            state = "up" if t.up else "DOWN (the pool's master is unreachable; retrying)"
            if not t.promoting:
                state += (", NOT PROMOTING (too many host slots held out; they come back as "
                          "their reads end, or at a restart)")
            print(f"  {name} tier: {state}, this node's segment holds {t.capacity_blocks} "
                  f"blocks; {t.used_blocks} published by this node and in the pool at their "
                  f"last check; {t.promotions} promoted, {t.demotions} published, "
                  f"{t.queued_blocks} queued, {t.dropped_spills} publishes dropped, "
                  f"{t.calls_in_flight} pool calls under way, "
                  f"{t.checksum_failures} checksum failures, {t.errors} errors")
            continue
        state = "up" if t.up else "DOWN (I/O errors; retrying)"
        io = "O_DIRECT" if t.direct_io else "buffered I/O"
        print(f"  {name} tier: {state}, {t.used_blocks} of {t.capacity_blocks} blocks, {io}; "
              f"{t.promotions} promoted, {t.demotions} demoted, {t.dropped_spills} spills "
              f"dropped, {t.checksum_failures} checksum failures, {t.errors} I/O errors")


def _print_ranks(listing: RegionListing) -> None:
    """Per rank: a line of its totals over every attachment, then one line per attachment
    ever made (slot, pid, up, pin state, NUMA placement, bytes moved; a slot's counters
    include its earlier holders')."""
    from tiercache.region.attachments import AttachmentReader
    from tiercache.region.shared import SharedOffloadRegion

    region = SharedOffloadRegion.attach(listing.name)
    try:
        reader = AttachmentReader(region, region.layout)
        info = region.info()
        for rank in range(region.layout.world_size):
            summary = reader.read(rank)
            for slot in summary.unreadable_slots:
                print(f"  rank {rank}: stats block left mid-update (attachment {slot}: its worker "
                      "died while writing; the next worker in this slot repairs it)")
            if not summary.readable:
                continue
            current, live = summary.current, len(summary.live)
            state = f"{live} attachment(s) up" if live else _no_live_worker(summary)
            if summary.held_by_others:  # attach cannot take those slots: say so
                state += (f" ({len(summary.held_by_others)} slot(s) of DOWN workers still held "
                          "by other processes)")
            backends = tuple("+".join(sorted({c.backends[d].label for c in current}))
                             for d in Direction)
            print(f"  rank {rank}: {state}, attached {summary.attach_count}x, pre-faulted in "
                  f"{max(c.prefault_seconds for c in current):.2f} s, pin "
                  f"{summary.pin_state.label} {format_bytes(sum(c.pinned_bytes for c in current))}"
                  f" in {max(c.pin_seconds for c in current):.2f} s; "
                  f"{_moved(summary.directions, backends)}; {summary.numa.describe()}; reserved "
                  f"{format_bytes(info.reserved_bytes(rank))} of "
                  f"{format_bytes(region.layout.slice_bytes)}")
            for a in summary.attachments:
                s = a.snapshot
                worker = f"worker pid {s.pid} {'up' if a.up else 'DOWN'}" if s.pid else "detached"
                if a.held and not a.up:  # F_OFD_GETLK names no pid for an OFD lock
                    worker += (", but its slot is held by another process (a child it "
                               "forked, or a worker attaching now)")
                if s.pid and s.engine is EngineKind.SGLANG:
                    worker += f" (SGLang TP rank {s.engine_rank}/{s.engine_ranks}, host copies)"
                print(f"    attachment {a.slot}: {worker}, attached {s.attach_count}x, pin "
                      f"{s.pin_state.label} {format_bytes(s.pinned_bytes)}; "
                      f"{_moved(s.directions, tuple(b.label for b in s.backends))}; "
                      f"{s.numa.describe()}")
    finally:
        region.close()


def _reservation(info: HeaderInfo, live: bool) -> str:
    """How far the region's slices are reserved (``tiercache.region.reservation``)."""
    layout = info.layout
    if info.reservation == Reservation.COMPLETE:
        return f"all {layout.num_blocks} blocks ({format_bytes(layout.total_bytes)})"
    done = (f"{info.reserved_rows} of {layout.num_blocks} blocks "
            f"({format_bytes(info.reserved_bytes(0))} of {format_bytes(layout.slice_bytes)} "
            "per rank)")
    if info.reservation == Reservation.FAILED:
        return (f"{done}; FAILED: {os.strerror(info.reserve_errno)} (/dev/shm ran out); only "
                "the reserved blocks are used: free /dev/shm, then restart `tiercache serve`")
    return done + ("; reserving in the background" if live else
                   "; the next `tiercache serve` reserves the rest")


def _no_live_worker(summary: RankSummary) -> str:
    """A rank none of whose workers runs: never attached, every worker detached cleanly
    (``Worker.close`` clears its pid), or some died attached (DOWN: their pid is kept)."""
    if not summary.attachments:
        return "no worker"
    if all(a.snapshot.pid == 0 for a in summary.attachments):
        return "no worker (every worker detached cleanly)"
    return "worker DOWN"


def _moved(directions, backends: tuple[str, ...]) -> str:
    return ", ".join(f"{d.label} {format_bytes(directions[d].bytes_total)} in "
                     f"{directions[d].transfers_ok} ok/{directions[d].transfers_failed} failed"
                     f" ({backends[d]})" for d in Direction)


def cmd_status(args: argparse.Namespace) -> int:
    wanted = _region_names(args)
    listings = list_regions(wanted)
    maps = [m for m in list_maps(wanted) if _map_note(m, listings)]
    if not listings and not maps:
        if wanted:
            raise RegionNotFoundError(f"no tiercache region named {', '.join(wanted)}")
        print("no tiercache region in /dev/shm")
        return 0
    for listing in listings:
        if listing.problem:
            if wanted:  # the one region asked for cannot be shown: an error
                raise RegionTrustError(listing.problem)
            print(f"region {listing.name}  NOT USABLE: {listing.problem}")
            continue
        if listing.unrecognised:
            why = f"{listing.path} is {listing.found}: {listing.unrecognised}"
            if wanted:
                raise RegionError(why)
            print(f"region {listing.name}  NOT A REGION TO CLEAN: {why}; `tiercache clean` "
                  "leaves it alone")
            continue
        owner = "live" if listing.live else "STALE (coordinator gone; tiercache clean removes it)"
        if listing.truncated:  # mapping it would fault: one line, and on to the next
            if wanted:
                raise RegionTruncatedError(f"{listing.path} is {listing.truncated}; {owner}")
            print(f"region {listing.name}  {listing.path}  NOT USABLE: {listing.truncated}; "
                  f"{owner}")
            continue
        print(f"region {listing.name}  {listing.path}  {format_bytes(listing.size_bytes)}  {owner}")
        info = listing.info
        if info is None:
            print("  header: not initialised")
            continue
        print(f"  state {info.state.label}, generation {info.generation}, coordinator pid "
              f"{info.owner_pid}, format {info.format_version}")
        print(f"  geometry: {info.layout.describe()}")
        print(f"  reserved: {_reservation(info, listing.live)}")
        if not listing.live:
            fate = ("with the same geometry re-adopts it warm (its cache, the engines' "
                    "mappings and pins kept)" if info.state == RegionState.READY else
                    f"replaces it (a region in state {info.state.label} is not re-adopted)")
            print(f"  stale: `tiercache serve` {fate}; `tiercache clean` removes it")
        if info.state != RegionState.READY:
            continue
        if listing.live:  # at the path its header records, unless --config names one
            _print_index(_socket_path(args, listing.name))
        try:
            _print_ranks(listing)
        except RegionNotFoundError:
            if wanted:
                raise
            print("  removed while it was listed")  # its coordinator stopped, or clean ran
        except (TiercacheError, ValueError) as e:  # e.g. a stats block of a newer tiercache
            if wanted:
                raise
            print(f"  ranks: unreadable ({e}); the listing goes on")
    for m in maps:
        print(f"key presence map {m.name}  {m.path}  {_map_note(m, listings)}")
    return 0


def _map_note(listing: MapListing, regions: list[RegionListing]) -> str | None:
    """What ``status`` says of a key presence map; None for a live map of a listed region
    (the normal case: nothing to say)."""
    if listing.problem:
        return f"NOT USABLE: {listing.problem}"
    if not listing.recognised:
        return (f"NOT A MAP TO CLEAN: {listing.found} without a map header; `tiercache clean` "
                "leaves it alone")
    if not listing.live:
        return "STALE (coordinator gone; tiercache clean removes it)"
    if not any(r.name == listing.name for r in regions):
        return "live (its coordinator's region is gone)"
    return None


def cmd_clean(args: argparse.Namespace) -> int:
    from tiercache.service.cleanup import remove_stale_socket

    wanted = _region_names(args)
    verb = "would remove" if args.dry_run else "removed"
    sockets: list[str] = []

    def remove_socket(listing: RegionListing) -> None:  # runs under the region's lock
        path = _socket_path(args, listing.name)
        if remove_stale_socket(path, dry_run=args.dry_run):
            sockets.append(path)

    removed = remove_stale(dry_run=args.dry_run, names=wanted, before_unlink=remove_socket)
    for listing in removed:
        print(f"{verb} stale region {listing.path} ({format_bytes(listing.size_bytes)})")
    if wanted and not removed:  # the region is gone already: its socket may not be
        paths = [_socket_path(args, name) for name in wanted]
        sockets += [p for p in paths if remove_stale_socket(p, dry_run=args.dry_run)]
    for path in sockets:
        print(f"{verb} stale socket {path}")
    gone = {listing.name for listing in removed} if args.dry_run else set()
    maps = [m for m in remove_stale_maps(dry_run=args.dry_run, names=wanted)
            if m.name not in gone]  # a dry run lists a removed region's map only once
    for m in maps:
        print(f"{verb} stale key presence map {m.path} (its coordinator is gone)")
    kept = list_regions(wanted)
    for listing in kept:
        if listing.live:
            print(f"kept live region {listing.path} (coordinator running)")
        elif listing.problem:
            print(f"left {listing.path} alone: {listing.found} (not a region tiercache may "
                  "remove)")
        elif listing.unrecognised:
            print(f"left {listing.path} alone: {listing.found}; {listing.unrecognised}")
    kept_maps = [m for m in list_maps(wanted) if m.problem or not m.recognised]
    for m in kept_maps:
        why = ("not a key presence map tiercache may remove" if m.problem
               else "no map header: not provably a key presence map")
        print(f"left {m.path} alone: {m.found} ({why})")
    if not removed and not sockets and not kept and not maps and not kept_maps:
        print(f"no tiercache region{' named ' + ', '.join(wanted) if wanted else 's'}")
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


def cmd_replay(args: argparse.Namespace) -> int:
    from tiercache.tools.replay import main as replay_main

    return replay_main(args.rest)


def cmd_config_for_sglang(args: argparse.Namespace) -> int:
    from tiercache.sglang.config_cmd import main as config_for_sglang_main

    return config_for_sglang_main(args.rest)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = tuple(f.value for f in LogFormat)


def version() -> str:
    from tiercache import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiercache",
        description="tiercache: a node-local host-memory KV-cache tier. Each command has "
                    "its own -h.")
    parser.add_argument("--version", action="version", version=f"tiercache {version()}")
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS,
                        help="log threshold (also accepted after the command; serve's "
                             "start-up steps are always logged)")
    parser.add_argument("--log-format", default=None, choices=LOG_FORMATS,
                        help=f"text (timestamp, level, logger, message) or json (one object "
                             f"per line) on stderr; default ${LOG_FORMAT_ENV}, else text "
                             "(also accepted after the command)")
    sub = parser.add_subparsers(dest="command", required=True, title="commands",
                                metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the coordinator (region, index, exporter)")
    serve.add_argument("--config", required=True, help="TOML config file")
    serve.set_defaults(func=cmd_serve)
    status = sub.add_parser("status", help="show regions, geometry and per-rank state")
    status.add_argument("--config", help="only the region of this config (and its socket)")
    status.add_argument("--name", help="only the region of this instance name")
    status.set_defaults(func=cmd_status)
    clean = sub.add_parser("clean", help="remove stale regions and their stale control "
                                         "sockets (never a live one)")
    clean.add_argument("--config", help="only the region and socket of this config")
    clean.add_argument("--name", help="only the region of this instance name (its socket "
                                      "at the default path)")
    clean.add_argument("--dry-run", action="store_true", help="only list what would go")
    clean.set_defaults(func=cmd_clean)
    for command in (serve, status, clean):
        command.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                             help="log threshold")
        command.add_argument("--log-format", default=argparse.SUPPRESS, choices=LOG_FORMATS,
                             help=f"text or json on stderr (default ${LOG_FORMAT_ENV}, else "
                                  "text)")
    for name, func, text in (("bench", cmd_bench, "transfer benchmark (see tiercache bench -h)"),
                             ("demo", cmd_demo, "engine-shaped workload (see tiercache demo -h)"),
                             ("config-for-vllm", cmd_config_for_vllm,
                              "the coordinator config a vLLM engine fits (config-for-vllm -h)"),
                             ("config-for-sglang", cmd_config_for_sglang,
                              "the coordinator config SGLang engines fit "
                              "(config-for-sglang -h)"),
                             ("replay", cmd_replay,
                              "real vLLM schedulers over a trace: hits and TTFT per system "
                              "(replay -h)")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=func)
    return parser


# these parse their own arguments
PASSTHROUGH_COMMANDS = ("bench", "demo", "config-for-vllm", "config-for-sglang", "replay")


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
    try:
        log_format = (LogFormat(args.log_format) if args.log_format is not None
                      else LogFormat.from_env())
    except TiercacheError as e:
        parser.error(str(e))
    configure(args.log_level, log_format)
    try:
        return args.func(args)
    except TiercacheError as e:
        if log_format is LogFormat.JSON:  # every line on stderr is one JSON object
            logging.getLogger("tiercache").error("error: %s", e)
        else:
            print(f"tiercache: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `tiercache status | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
