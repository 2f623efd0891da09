"""Event peers that never read, and a replay flood: what they cost the coordinator.

A real ``tiercache serve`` with ``[events]`` (PUB and replay ROUTER on loopback, the
default ``hwm``; ``--replay-batches`` small enough that the buffer is full before the
baseline, so that what grows after is what the peers hold). A paced storer keeps the stream busy (stores of
1024 new keys into a full cache, spread over ``--namespaces`` namespaces: each store evicts
1024, ~2048 events, and each round publishes one small batch per namespace, the batches
pyzmq copies), long enough first for the replay buffer to fill. Then, one after the other:

* **quiet** (the storer paused: the coordinator idle but for this, the buffer full): a
  client process calls 1-key ``lookup``s (a hit) every 2 ms and records each call's
  latency: p50, p99;
* **replay flood**: the same, while ``--flooders`` processes each send a replay request
  from sequence 0 as soon as the previous answer ended (they read everything); quiet and
  flood windows alternate for ``--rounds`` rounds, so both see the same machine load;
* **never-read peers**: ``--replay-peers`` DEALERs that each send ``--requests`` replay
  requests and never read, ``--subscribers`` SUBs (RCVHWM 1) that never read and
  ``--raw-peers`` TCP sockets that send the ZMTP greeting and nothing else, held for
  ``--hold-s`` while the storer goes on; the coordinator's VmRSS is sampled throughout
  (its peak over the baseline is the figure), then the peers close and RSS is read again.

A watchdog kills the coordinator if its RSS passes ``--rss-cap-mib`` (the machine is
shared), and reports it.

    PYTHONPATH=. .venv/bin/python benchmarks/events_flood_bench.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import tempfile
import threading
import time
import urllib.request

import zmq

from tiercache.config import Config, EventsConfig, ExporterConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.link.namespaces import EngineFamily
from tiercache.service.process import CoordinatorProcess

SPAWN = mp.get_context("spawn")
NUM_BLOCKS = 65536
STORE_KEYS = 1024
NAMESPACES_PER_SESSION = 16
ZMTP_GREETING = (b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
                 + b"\0" + b"\0" * 31)


def _namespace_text(i: int) -> str:
    return json.dumps({"model": f"flood-{i}", "blocks_per_chunk": 1,
                       "groups": [{"tokens_per_block": 16}]}, sort_keys=True)


def _keys(prefixes: list[bytes], first: int, n: int) -> list[bytes]:
    """``n`` keys from number ``first`` on, spread over the namespaces (round robin)."""
    return [prefixes[i % len(prefixes)] + i.to_bytes(32, "big") + b"\0\0\0\0"
            for i in range(first, first + n)]


class Storers:
    """One session per ``NAMESPACES_PER_SESSION`` namespaces (a session stores only under
    namespaces it described); ``store(n)`` stores ``STORE_KEYS`` keys numbered from
    ``n * STORE_KEYS`` through the session whose turn it is, under its namespaces."""

    def __init__(self, config: Config, num_namespaces: int):
        self.clients: list[Client] = []
        self.prefixes: list[list[bytes]] = []
        for first in range(0, num_namespaces, NAMESPACES_PER_SESSION):
            client = Client(config)
            self.clients.append(client)
            self.prefixes.append([
                client.describe(EngineFamily.VLLM, _namespace_text(i)).digest
                for i in range(first, min(num_namespaces, first + NAMESPACES_PER_SESSION))])

    def store(self, n: int) -> None:
        i = n % len(self.clients)
        out = self.clients[i].prepare_store(_keys(self.prefixes[i], n * STORE_KEYS,
                                                  STORE_KEYS))
        self.clients[i].complete_store(list(out.keys_to_store))

    def close(self) -> None:
        for client in self.clients:
            client.close()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _storer(config: Config, num_namespaces: int, stores_per_s: float, stop, paused) -> None:
    storers = Storers(config, num_namespaces)
    first = NUM_BLOCKS // STORE_KEYS
    n, t0 = 0, time.monotonic()
    while not stop.is_set():
        if paused.is_set():
            time.sleep(0.05)
            n, t0 = 0, time.monotonic()
            first += 1 << 20
            continue
        storers.store(first + n)
        n += 1
        ahead = t0 + n / stores_per_s - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    storers.close()


def _lookups(config: Config, key: bytes, seconds: float, period_s: float, out) -> None:
    times = []
    with Client(config) as client:
        end = time.monotonic() + seconds
        next_t = time.monotonic()
        while time.monotonic() < end:
            t0 = time.perf_counter()
            if client.lookup([key]) != 1:
                raise RuntimeError("the latency probe's key missed")
            times.append(time.perf_counter() - t0)
            next_t += period_s
            ahead = next_t - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    out.put(times)


def _flooder(replay: str, stop) -> None:
    """Replay requests from 0, one after the other, every answer read to its end."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 2000)
    dealer.connect(replay)
    while not stop.is_set():
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        try:
            while dealer.recv_multipart()[3] != (-1).to_bytes(8, "big", signed=True):
                pass
        except zmq.Again:
            continue
    dealer.close()
    context.term()


def latency(config: Config, key: bytes, seconds: float) -> tuple[float, float, int]:
    out = SPAWN.Queue()
    p = SPAWN.Process(target=_lookups, args=(config, key, seconds, 0.002, out))
    p.start()
    times = out.get(timeout=seconds + 120)
    p.join(30)
    times.sort()
    return (statistics.median(times) * 1e3, times[int(0.99 * (len(times) - 1))] * 1e3,
            len(times))


class Watchdog(threading.Thread):
    """Samples the coordinator's RSS; kills it past the cap (the machine is shared)."""

    def __init__(self, coordinator: CoordinatorProcess, cap_mib: float):
        super().__init__(daemon=True)
        self.coordinator, self.cap_mib = coordinator, cap_mib
        self.peak = 0.0
        self.killed = False
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            try:
                now = rss_mib(self.coordinator.pid)
            except (OSError, RuntimeError):
                return
            self.peak = max(self.peak, now)
            if now > self.cap_mib:
                self.killed = True
                self.coordinator.kill()
                return

    def reset(self) -> None:
        self.peak = 0.0


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tiercache_events_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def never_readers(context: zmq.Context, endpoint: str, replay: str, args) -> list:
    held: list = []
    for _ in range(args.replay_peers):
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.connect(replay)
        for _ in range(args.requests):
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        held.append(dealer)
    for _ in range(args.subscribers):
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        held.append(sub)
    for i in range(args.raw_peers):
        host, port = (endpoint if i % 2 else replay)[len("tcp://"):].rsplit(":", 1)
        raw = socket.create_connection((host, int(port)))
        raw.sendall(ZMTP_GREETING)
        held.append(raw)
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fill-s", type=float, default=20.0)
    parser.add_argument("--replay-batches", type=int, default=2000,
                        help="events.replay_batches: full before the baseline is taken")
    parser.add_argument("--namespaces", type=int, default=16,
                        help="batches per round: one per namespace, so small ones")
    parser.add_argument("--stores-per-s", type=float, default=14.0)
    parser.add_argument("--seconds", type=float, default=8.0, help="each latency window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flooders", type=int, default=2)
    parser.add_argument("--replay-peers", type=int, default=10)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--subscribers", type=int, default=20)
    parser.add_argument("--raw-peers", type=int, default=20)
    parser.add_argument("--hold-s", type=float, default=15.0, help="0: no never-read peers")
    parser.add_argument("--rss-cap-mib", type=float, default=3072)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    workdir = tempfile.mkdtemp(prefix="tiercache-flood-bench-")
    config = Config(name=f"flood-bench-{os.getpid()}", world_size=1,
                    kv=KVGeometry(page_bytes=(256,)),
                    region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS,
                                        prefault_threads=1),
                    exporter=ExporterConfig(port=0), control_socket=f"{workdir}/c.sock",
                    index_max_session_share=1.0,
                    events=EventsConfig(endpoint="tcp://127.0.0.1:0",
                                        replay_endpoint="tcp://127.0.0.1:0",
                                        replay_batches=args.replay_batches))
    with CoordinatorProcess(config, workdir) as coordinator:
        output = coordinator.output()
        url = "http://127.0.0.1:{}/metrics".format(
            re.search(r"metrics: http://\S+:(\d+)/metrics", output).group(1))
        endpoint, replay = re.search(r"events: publishing on (\S+?), replay on (\S+?);",
                                     output).groups()
        watchdog = Watchdog(coordinator, args.rss_cap_mib)
        watchdog.start()
        with Client(config) as client:
            fill = Storers(config, args.namespaces)
            for n in range(NUM_BLOCKS // STORE_KEYS):  # full: every store evicts
                fill.store(n)
            fill.close()
            probe_key = _keys(fill.prefixes[0], 0, 1)[0]
            if client.lease([probe_key]).num_hit != 1:  # pinned: the storer never evicts it
                raise RuntimeError("the probe key missed")
            stop, paused = SPAWN.Event(), SPAWN.Event()
            storer = SPAWN.Process(target=_storer, args=(config, args.namespaces,
                                                         args.stores_per_s, stop, paused))
            storer.start()
            time.sleep(args.fill_s)
            stats = scrape(url)
            print(f"after {args.fill_s} s of stores: {stats['tiercache_events_batches_total']:.0f} "
                  f"batches published; RSS {rss_mib(coordinator.pid):.0f} MiB", flush=True)
            paused.set()
            quiet, flood = [], []
            for r in range(args.rounds):
                cpu0 = cpu_s(coordinator.pid)
                quiet.append(latency(config, probe_key, args.seconds))
                print(f"round {r} quiet: lookup p50 {quiet[-1][0]:.2f} ms, p99 "
                      f"{quiet[-1][1]:.2f} ms ({quiet[-1][2]} calls); coordinator CPU "
                      f"{(cpu_s(coordinator.pid) - cpu0) / args.seconds:.0%}; load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
                flood_stop = SPAWN.Event()
                flooders = [SPAWN.Process(target=_flooder, args=(replay, flood_stop))
                            for _ in range(args.flooders)]
                for p in flooders:
                    p.start()
                time.sleep(1.0)
                replayed0 = scrape(url)["tiercache_events_replayed_batches_total"]
                cpu0 = cpu_s(coordinator.pid)
                flood.append(latency(config, probe_key, args.seconds))
                cpu = (cpu_s(coordinator.pid) - cpu0) / args.seconds
                replayed = scrape(url)["tiercache_events_replayed_batches_total"] - replayed0
                flood_stop.set()
                for p in flooders:
                    p.join(30)
                print(f"round {r} replay flood ({args.flooders} readers): lookup p50 "
                      f"{flood[-1][0]:.2f} ms, p99 {flood[-1][1]:.2f} ms ({flood[-1][2]} "
                      f"calls); {replayed / args.seconds:,.0f} batches/s replayed; coordinator "
                      f"CPU {cpu:.0%}; load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
            for name, runs in (("quiet", quiet), ("replay flood", flood)):
                print(f"{name}: median of {args.rounds} rounds: lookup p50 "
                      f"{statistics.median(x[0] for x in runs):.2f} ms, p99 "
                      f"{statistics.median(x[1] for x in runs):.2f} ms", flush=True)
            paused.clear()
            if args.hold_s <= 0:  # latency only
                stop.set()
                storer.join(30)
                return 0
            time.sleep(1.0)
            base = rss_mib(coordinator.pid)
            watchdog.reset()
            context = zmq.Context()
            t0 = time.monotonic()
            held = never_readers(context, endpoint, replay, args)
            while time.monotonic() - t0 < args.hold_s and not watchdog.killed:
                time.sleep(0.5)
            peak = watchdog.peak
            for sock in held:
                sock.close(**({"linger": 0} if isinstance(sock, zmq.Socket) else {}))
            context.term()
            if watchdog.killed:
                print(f"never-read peers: RSS passed the cap {args.rss_cap_mib:.0f} MiB "
                      f"(baseline {base:.0f} MiB): coordinator killed", flush=True)
                stop.set()
                storer.join(30)
                return 1
            time.sleep(2.0)
            after = rss_mib(coordinator.pid)
            stats = scrape(url)
            print(f"never-read peers ({args.replay_peers} replay x {args.requests} requests, "
                  f"{args.subscribers} SUB, {args.raw_peers} raw, {args.hold_s:.0f} s): RSS "
                  f"baseline {base:.0f} MiB, peak {peak:.0f} MiB (+{peak - base:.0f}), "
                  f"2 s after they closed {after:.0f} MiB; load {os.getloadavg()[0]:.1f}",
                  flush=True)
            print("  " + ", ".join(f"{k.removeprefix('tiercache_events_')} {v:.0f}"
                                   for k, v in stats.items()
                                   if "peer" in k or "replay" in k or "dropped" in k))
            stop.set()
            storer.join(30)
        watchdog.halt.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
