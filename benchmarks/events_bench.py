"""What the node's event stream costs the index, and how many events it publishes.

A real ``tiercache serve`` per round, with and without ``[events]`` (rounds alternate, so
both see the same machine load): ``--lookup-clients`` processes call 64-key ``lookup``s
that all hit, in a closed loop (the index's heaviest lookup load); one more process stores
64 new keys per call into a full cache (each store evicts 64: 128 events per call) as fast
as it can; with the stream on, a subscriber (pyzmq + msgspec, the wire vLLM's subscribers
read) counts what arrives. Reported per mode: lookups/s, stores/s, events/s published (the
coordinator's ``tiercache_events_published_total``) and received.

    PYTHONPATH=. python3 benchmarks/events_bench.py --rounds 3 --seconds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass

import numpy as np
import zmq

from tiercache.config import Config, EventsConfig, ExporterConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.link.namespaces import EngineFamily
from tiercache.events.wire import decode_batch
from tiercache.service.process import CoordinatorProcess

SPAWN = mp.get_context("spawn")
NUM_BLOCKS = 65536
BATCH = 64
DIGEST_BYTES = 8


def _namespace_text() -> str:
    import json

    return json.dumps({"model": "bench", "blocks_per_chunk": 1,
                       "groups": [{"tokens_per_block": 16}]}, sort_keys=True)


def _keys(prefix: bytes, first: int, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(first, first + n)]


def _lookups(config: Config, prefix: bytes, seed: int, leased, stop, counts) -> None:
    keys = _keys(prefix, seed * BATCH, BATCH)
    calls = 0
    with Client(config) as client:
        if client.lease(keys).num_hit != BATCH:  # pinned: the stores evict other blocks
            raise RuntimeError("a benchmark lease missed")
        leased.wait(60)
        while not stop.is_set():
            if client.lookup(keys) != BATCH:
                raise RuntimeError("a benchmark lookup missed")
            calls += 1
    counts.put(("lookups", calls))


def _stores(config: Config, prefix: bytes, first: int, stop, counts) -> None:
    calls = 0
    with Client(config) as client:
        client.describe(EngineFamily.VLLM, _namespace_text())
        while not stop.is_set():
            out = client.prepare_store(_keys(prefix, first + calls * BATCH, BATCH))
            client.complete_store(list(out.keys_to_store))
            calls += 1
    counts.put(("stores", calls))


def _published(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^tiercache_events_published_total\{[^}]*\} (\S+)",
                                            text, re.M))


class Subscriber(threading.Thread):
    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(endpoint)
        self.events = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                _, _, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            self.events += len(decode_batch(payload).events)
        self.sock.close(linger=0)
        self.context.term()


@dataclass
class Round:
    events_on: bool
    lookups_per_s: float
    stores_per_s: float
    published_per_s: float
    received_per_s: float


def one_round(name: str, events_on: bool, seconds: float, lookup_clients: int) -> Round:
    workdir = tempfile.mkdtemp(prefix="tiercache-events-bench-")
    config = Config(name=name, world_size=1, kv=KVGeometry(page_bytes=(256,)),
                    region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS,
                                        prefault_threads=1),
                    exporter=ExporterConfig(port=0), control_socket=f"{workdir}/c.sock",
                    index_max_session_share=1.0,
                    events=EventsConfig(endpoint="tcp://127.0.0.1:0") if events_on else None)
    with CoordinatorProcess(config, workdir) as coordinator:
        port = re.search(r"metrics: http://\S+:(\d+)/metrics", coordinator.output()).group(1)
        url = f"http://127.0.0.1:{port}/metrics"
        with Client(config) as client:
            prefix = client.describe(EngineFamily.VLLM, _namespace_text()).digest
            for i in range(0, NUM_BLOCKS, 1024):  # full: every store evicts
                out = client.prepare_store(_keys(prefix, i, 1024))
                client.complete_store(list(out.keys_to_store))
        subscriber = None
        if events_on:
            endpoint = re.search(r"events: publishing on (\S+?);", coordinator.output()).group(1)
            subscriber = Subscriber(endpoint)
            subscriber.start()
        stop, counts = SPAWN.Event(), SPAWN.Queue()
        leased = SPAWN.Barrier(lookup_clients + 1)
        procs = [SPAWN.Process(target=_lookups, args=(config, prefix, c, leased, stop, counts))
                 for c in range(lookup_clients)]
        for p in procs:
            p.start()
        leased.wait(120)  # the lookups' keys are pinned before any store evicts
        procs.append(SPAWN.Process(target=_stores, args=(config, prefix, NUM_BLOCKS, stop,
                                                         counts)))
        procs[-1].start()
        time.sleep(1.0)  # warm up, then measure a window
        published0 = _published(url) if events_on else 0.0
        received0 = subscriber.events if subscriber else 0
        t0 = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        elapsed = time.perf_counter() - t0
        published = (_published(url) - published0) if events_on else 0.0
        received = (subscriber.events - received0) if subscriber else 0
        totals: dict[str, int] = {}
        for _ in procs:
            kind, calls = counts.get(timeout=60)
            totals[kind] = totals.get(kind, 0) + calls
        for p in procs:
            p.join(60)
        if subscriber:
            subscriber.halt.set()
            subscriber.join()
        # calls are counted over warm-up + window; rates over the same span
        span = elapsed + 1.0
        return Round(events_on, totals["lookups"] / span, totals["stores"] / span,
                     published / elapsed, received / elapsed)


def ceiling(num_keys: int = 500_000) -> tuple[float, float]:
    """The publisher alone, in this process: ``num_keys`` distinct keys of one described
    namespace handed to the sink in 1024-key calls (within its bound), then the time until
    the publisher has sent them all as BlockStored (translated, encoded, on the PUB socket,
    read by a subscriber). Returns (keys/s handed to the sink, events/s published)."""
    from tiercache.events import NodeEventStream
    from tiercache.specs import Medium

    stream = NodeEventStream(EventsConfig(endpoint="tcp://127.0.0.1:0"))
    stream.start()
    prefix = stream.describe(EngineFamily.VLLM, _namespace_text()).digest
    subscriber = Subscriber(stream.publisher.endpoint)
    subscriber.start()
    while not stream.stats().publisher.batches:  # the first batch (the clear) is out
        time.sleep(0.01)
    keys = _keys(prefix, 0, num_keys)
    t0 = time.perf_counter()
    for i in range(0, num_keys, 1024):
        stream.sink.stored(keys[i:i + 1024], Medium.CPU)
    handed_s = time.perf_counter() - t0
    while stream.stats().publisher.events["BlockStored", "CPU"] < num_keys:
        time.sleep(0.001)
    published_s = time.perf_counter() - t0
    assert stream.stats().sink.dropped_keys == 0
    stream.close()
    subscriber.halt.set()
    subscriber.join()
    return num_keys / handed_s, num_keys / published_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--lookup-clients", type=int, default=2)
    args = parser.parse_args()
    handed, published = ceiling()
    print(f"publisher alone: {handed:,.0f} keys/s handed to the sink, {published:,.0f} "
          "events/s published", flush=True)
    rounds = []
    for r in range(args.rounds):
        for on in (False, True):
            result = one_round(f"events-bench-{r}-{int(on)}", on, args.seconds,
                               args.lookup_clients)
            rounds.append(result)
            print(f"round {r} events {'on ' if on else 'off'}: {result.lookups_per_s:,.0f} "
                  f"lookups/s ({result.lookups_per_s * BATCH:,.0f} keys/s), "
                  f"{result.stores_per_s:,.0f} stores/s, {result.published_per_s:,.0f} "
                  f"events/s published, {result.received_per_s:,.0f} received", flush=True)
    for on in (False, True):
        mine = [x for x in rounds if x.events_on == on]
        print(f"events {'on ' if on else 'off'}: lookups/s median "
              f"{np.median([x.lookups_per_s for x in mine]):,.0f}, stores/s median "
              f"{np.median([x.stores_per_s for x in mine]):,.0f}"
              + (f", events/s published median "
                 f"{np.median([x.published_per_s for x in mine]):,.0f}" if on else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
