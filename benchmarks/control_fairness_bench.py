"""One client's heavy requests against another's small calls, on a real ``tiercache serve``
(development machine; not a test).

A coordinator (``num_blocks`` slots of one 4 KiB page, ``--fill`` of them stored) serves
``--hostile`` processes that each loop on one valid request shape as fast as the coordinator
answers (``--depth`` requests written before their answers are read: a pipelining client),
while this process, the victim, leases one stored key and releases it, again and again,
for ``--seconds``. Reported: the latency of the victim's calls (leases and releases
alike: p50, p99, max) and its calls per second, and the hostile requests answered per
second with how many were refused.

Shapes (the largest the protocol lets through, ``--lists`` to pick another size):

* ``empty_lists``: LEASE_BATCH of as many empty key lists as allowed;
* ``long_list``: LEASE_BATCH of one list of MAX_KEYS_PER_CALL stored keys (all hits,
  pinned), then RELEASE of them;
* ``lookup``: LOOKUP of MAX_KEYS_PER_CALL stored keys;
* ``small_frames``: LOOKUP of MAX_KEYS_PER_CALL copies of a stored one-byte key (16 KiB
  frames, four to a read: what a pipelining client gets served back to back by a loop
  that answers every request a read brought before it looks at anyone else);
* ``store``: PREPARE_STORE of MAX_KEYS_PER_CALL new keys (evicting), then
  COMPLETE_STORE(failed) of them.

The hostile clients speak the wire protocol directly (a client library would refuse or
split what a hostile process sends in one frame).

Usage: ``PYTHONPATH=. python benchmarks/control_fairness_bench.py [--shape empty_lists]
[--hostile 1] [--depth 1] [--seconds 10] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import tempfile
import threading
import time

import numpy as np

from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig
from tiercache.link import protocol
from tiercache.link.client import Client
from tiercache.link.payloads import encode_hello_request
from tiercache.link.protocol import (
    HEADER_BYTES, MAX_KEYS_PER_CALL, FrameHeader, PayloadWriter, Status, Verb, frame,
)
from tiercache.service.process import CoordinatorProcess

SPAWN = multiprocessing.get_context("spawn")
MAX_LISTS = getattr(protocol, "MAX_LISTS_PER_BATCH", MAX_KEYS_PER_CALL)


def stored_key(i: int) -> bytes:
    return b"stored-%08d" % i


def requests_for(shape: str, lists: int) -> list[tuple[Verb, bytes]]:
    """The request frames one hostile iteration sends (verb, payload)."""
    n = MAX_KEYS_PER_CALL
    if shape == "empty_lists":
        writer = PayloadWriter().u32(lists)
        for _ in range(lists):
            writer.keys([])
        return [(Verb.LEASE_BATCH, writer.build())]
    if shape == "long_list":
        keys = [stored_key(i) for i in range(n)]
        return [(Verb.LEASE_BATCH, PayloadWriter().u32(1).keys(keys).build()),
                (Verb.RELEASE, PayloadWriter().keys(keys).build())]
    if shape == "small_frames":
        return [(Verb.LOOKUP, PayloadWriter().keys([b"a"] * n).build())]
    if shape == "lookup":
        return [(Verb.LOOKUP, PayloadWriter().keys([stored_key(i) for i in range(n)]).build())]
    if shape == "store":
        keys = [b"hostile-%08d" % i for i in range(n)]
        return [(Verb.PREPARE_STORE, PayloadWriter().u32(0xFFFFFFFF).keys(keys).build()),
                (Verb.COMPLETE_STORE, PayloadWriter().u8(0).keys(keys).build())]
    raise ValueError(f"shape {shape!r}; allowed empty_lists, long_list, lookup, small_frames, "
                     "store")


class RawConnection:
    """A HELLO-ed connection that writes frames and reads answers, nothing checked."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buf = bytearray()
        self.sock.sendall(frame(Verb.HELLO, 1, encode_hello_request(None, "hostile")))
        self.read_answer()

    def read_answer(self) -> Status:
        while True:
            if len(self.buf) >= HEADER_BYTES:
                header = FrameHeader.unpack(self.buf)
                end = HEADER_BYTES + header.payload_bytes
                if len(self.buf) >= end:
                    del self.buf[:end]
                    return header.status
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("closed by the coordinator")
            self.buf += chunk


def hostile(path: str, shape: str, lists: int, depth: int, stop, counts) -> None:
    """Keeps ``depth`` iterations' frames in flight: a writer thread sends while this
    thread reads (the coordinator reads nothing more from a connection whose answers
    wait, so a client that only wrote would stall itself)."""
    conn = RawConnection(path)
    frames = [frame(verb, 2 + i, payload)
              for i, (verb, payload) in enumerate(requests_for(shape, lists))]
    window = threading.Semaphore(depth * len(frames))

    def write() -> None:
        try:
            while not stop.is_set():
                for f in frames:
                    window.acquire()
                    conn.sock.sendall(f)
        except OSError:
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    answered = refused = 0
    try:
        while not stop.is_set():
            if conn.read_answer() is not Status.OK:
                refused += 1
            answered += 1
            window.release()
    except (OSError, EOFError):
        pass
    with counts.get_lock():
        counts[0] += answered
        counts[1] += refused


def run(args: argparse.Namespace) -> dict:
    tmp = tempfile.TemporaryDirectory(prefix="tiercache-fairness-")
    config = Config(name=f"fairness-{os.getpid()}", world_size=1,
                    kv=KVGeometry(page_bytes=(4096,)),
                    region=RegionConfig(capacity_bytes=None, num_blocks=args.blocks,
                                        prefault_threads=1),
                    exporter=ExporterConfig(enabled=False),
                    control_socket=os.path.join(tmp.name, "ctl.sock"),
                    index_max_session_share=1.0)
    with CoordinatorProcess(config, tmp.name) as coordinator:
        with Client(config) as setup:
            setup.complete_store(list(setup.prepare_store([b"a"]).keys_to_store))
            for start in range(0, args.fill, MAX_KEYS_PER_CALL):
                end = min(args.fill, start + MAX_KEYS_PER_CALL)
                keys = [stored_key(i) for i in range(start, end)]
                setup.complete_store(list(setup.prepare_store(keys).keys_to_store))
        stop, counts = SPAWN.Event(), SPAWN.Array("q", 2)
        procs = [SPAWN.Process(target=hostile, args=(config.socket_path, args.shape,
                                                    args.lists, args.depth, stop, counts))
                 for _ in range(args.hostile)]
        for p in procs:
            p.start()
        time.sleep(1.0 if procs else 0.0)  # the hostile loops are running
        latencies = []
        with Client(config, name="victim") as victim:
            victim.ping()
            key = [stored_key(args.fill - 1)]
            t_end = time.perf_counter() + args.seconds
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                victim.lease(key)
                t1 = time.perf_counter()
                victim.release(key)
                latencies += [t1 - t0, time.perf_counter() - t1]
            elapsed = args.seconds
        stop.set()
        for p in procs:
            p.join(60)
        assert coordinator.stop() == 0
    ms = np.array(latencies) * 1e3
    return {"shape": args.shape, "hostile": args.hostile, "depth": args.depth,
            "lists": args.lists if args.shape == "empty_lists" else None,
            "victim_calls": len(ms), "victim_calls_per_s": round(len(ms) / elapsed, 1),
            "call_p50_ms": round(float(np.percentile(ms, 50)), 3),
            "call_p99_ms": round(float(np.percentile(ms, 99)), 3),
            "call_max_ms": round(float(ms.max()), 3),
            "hostile_answers_per_s": round(counts[0] / elapsed, 1),
            "hostile_refused": int(counts[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="empty_lists",
                        choices=["empty_lists", "long_list", "lookup", "small_frames", "store"])
    parser.add_argument("--hostile", type=int, default=1)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--lists", type=int, default=MAX_LISTS)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--blocks", type=int, default=65536)
    parser.add_argument("--fill", type=int, default=MAX_KEYS_PER_CALL + 1)
    parser.add_argument("--json", help="append the result as one JSON line to this file")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
