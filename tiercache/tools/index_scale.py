"""The index at scale, measured from outside (issue 41, item 3): a real ``tiercache serve``
per capacity, with a tiny page so that millions of slots fit in RAM.

For each capacity ``N`` (``python -m tiercache.tools.index_bench --slots 100000,2000000``):

* **start**: from ``exec`` of ``serve`` over a fresh region to its first answer;
* **fill**: every slot stored by one client (``prepare_store`` + ``complete_store`` of
  ``FILL_BATCH`` keys a call);
* **RSS**: the coordinator's anonymous memory (``RssAnon``: the region and its ledger are
  shared memory, not counted) with every slot READY; per slot, its growth over the
  ``BASE_SLOTS`` coordinator of the same run (the interpreter's fixed cost) divided by ``N``;
  again after **churn**: ``N`` more stores, each evicting a block (a full cache's steady
  state);
* **rates**: 64-key ``lookup`` calls, and ``lease`` + ``release`` cycles, from
  ``clients`` processes in closed loop, each over random 64-key runs of the stored keys
  (the best of ``RATE_RUNS`` runs), each run beside one of a resident ``BASE_SLOTS``
  reference coordinator: the share is against the reference of the same minutes;
* **recovery**: the coordinator SIGKILLed with every slot READY (after the churn) and
  started again, to its first answer, then until every key was looked up as a hit;
* **reset**: one ``reset`` of the full index, as a client waits for it.

Each step checks what it measured (every key a hit, nothing left in ``/dev/shm``), so a
figure never comes from a run that lost a block.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from tiercache.link.client import Client
from tiercache.errors import TiercacheError

SPAWN = mp.get_context("spawn")
KEY_BYTES = 32  # a sha256 block hash
PAGE_BYTES = 256  # the smallest row the region lays out (ROW_ALIGN)
FILL_BATCH = 4096  # keys per prepare_store while filling
BATCH_KEYS = 64  # keys per timed lookup or lease: a request's blocks
BATCHES_PER_CLIENT = 256  # distinct runs each timed client cycles through
BASE_SLOTS = 4096  # the reference capacity: rates and the fixed memory cost
RATE_RUNS = 5  # rates are the best of this many runs
START_TIMEOUT_S = 600.0
_POLL_S = 0.002


def scale_keys(start: int, count: int) -> list[bytes]:
    """Keys ``start .. start + count - 1`` of the benchmark: 32 pseudo-random bytes each,
    the same in every process (a splitmix64 of the index)."""
    index = np.arange(start, start + count, dtype=np.uint64)
    words = np.empty((count, KEY_BYTES // 8), np.uint64)
    with np.errstate(over="ignore"):
        for w in range(words.shape[1]):
            x = index * np.uint64(words.shape[1]) + np.uint64(w + 1)
            x *= np.uint64(0x9E3779B97F4A7C15)
            x ^= x >> np.uint64(31)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            words[:, w] = x
    blob = words.tobytes()
    return [blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


def rss_anon_bytes(pid: int) -> int:
    """``RssAnon`` of ``pid`` (anonymous memory: not the shared region)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass(frozen=True)
class ScaleResult:
    num_slots: int
    start_s: float
    fill_s: float
    rss_full_bytes: int
    lookup_calls_per_s: float
    lease_cycles_per_s: float
    reference_lookup_calls_per_s: float  # the BASE_SLOTS coordinator's, alternated with these
    reference_lease_cycles_per_s: float
    churn_s: float  # num_slots more stores, each evicting a block
    rss_churned_bytes: int
    restart_s: float  # SIGKILL's successor: exec to its first answer
    all_hits_s: float  # ... to every key looked up as a hit
    rss_recovered_bytes: int
    reset_s: float
    load: str  # the load average when the capacity's run ended


class Coordinator:
    """One ``tiercache serve`` over a config written into ``workdir``."""

    def __init__(self, workdir: str, num_slots: int, policy: str, tag: str = ""):
        self.num_slots = num_slots
        label = f"{tag}{num_slots}"
        self.name = f"bench-scale-{os.getpid()}-{label}"
        self.socket_path = os.path.join(workdir, f"{label}.sock")
        self.config_path = os.path.join(workdir, f"{label}.toml")
        self.log_path = os.path.join(workdir, f"{label}.log")
        with open(self.config_path, "w") as f:
            f.write(f'[instance]\nname = "{self.name}"\nworld_size = 1\n'
                    f'[region]\nnum_blocks = {num_slots}\nprefault_threads = 1\n'
                    f'pinning = "allow_unpinned"\n'
                    f'[kv]\npage_bytes = {PAGE_BYTES}\nnum_tensors = 1\n'
                    f'[transfer]\nbackend = "cpu"\n'
                    f'[exporter]\nenabled = false\n'
                    f'[control]\nsocket = "{self.socket_path}"\n'
                    f'[index]\npolicy = "{policy}"\nmax_session_share = 1.0\n')
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start ``serve``; seconds until it answered a client."""
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tiercache", "serve", "--config", self.config_path],
                stdout=log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with Client(self.socket_path, timeout_s=START_TIMEOUT_S, heartbeat=False) as c:
                    c.lookup([])
                return time.perf_counter() - t0
            except (TiercacheError, OSError):
                if time.perf_counter() - t0 > START_TIMEOUT_S:
                    raise TimeoutError(f"serve did not answer in {START_TIMEOUT_S} s") from None
                time.sleep(_POLL_S)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "started"
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None, "started"
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then ``tiercache clean`` for what a killed one left."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        subprocess.run([sys.executable, "-m", "tiercache", "clean", "--name", self.name],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-20:])


def _wait_reserved(socket_path: str, num_slots: int) -> float:
    """Seconds until the index may hand out every slot: ``serve`` answers before the
    region is reserved (issue 41, item 1) and gives out only reserved slots."""
    t0 = time.perf_counter()
    with Client(socket_path, timeout_s=START_TIMEOUT_S) as client:
        while (capacity := client.stats().capacity_blocks) < num_slots:
            if time.perf_counter() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"{capacity} of {num_slots} slots reserved after "
                                   f"{START_TIMEOUT_S:.0f} s")
            time.sleep(_POLL_S)
    return time.perf_counter() - t0


def _fill(socket_path: str, num_slots: int, first: int = 0) -> None:
    """Store keys ``first ..`` into every slot (from ``first = num_slots``: each stored
    block evicts one)."""
    with Client(socket_path, timeout_s=START_TIMEOUT_S) as client:
        for start in range(first, first + num_slots, FILL_BATCH):
            keys = scale_keys(start, min(FILL_BATCH, first + num_slots - start))
            out = client.prepare_store(keys)
            if out is None or len(out.keys_to_store) != len(keys):
                raise RuntimeError(f"fill: slots {start}.. were refused")
            client.complete_store(keys)


def _check_all_hit(socket_path: str, num_slots: int, first: int) -> None:
    with Client(socket_path, timeout_s=START_TIMEOUT_S) as client:
        for start in range(first, first + num_slots, FILL_BATCH):
            keys = scale_keys(start, min(FILL_BATCH, first + num_slots - start))
            if (hits := client.lookup(keys)) != len(keys):
                raise RuntimeError(f"keys {start + hits}.. are not hits")


def _client_main(socket_path: str, num_slots: int, verb: str, num_calls: int, seed: int,
                 barrier, results) -> None:
    """Child: ``num_calls`` timed calls of ``verb`` over random runs of stored keys."""
    rng = np.random.default_rng(seed)
    runs = num_slots // BATCH_KEYS
    batches = [scale_keys(int(r) * BATCH_KEYS, BATCH_KEYS)
               for r in rng.integers(0, runs, min(BATCHES_PER_CLIENT, runs))]
    with Client(socket_path, timeout_s=START_TIMEOUT_S) as client:
        call = _verbs(client)[verb]
        for batch in batches[:50]:
            call(batch)
        barrier.wait(START_TIMEOUT_S)
        t0 = time.perf_counter()
        for i in range(num_calls):
            call(batches[i % len(batches)])
        results.put(time.perf_counter() - t0)


def _verbs(client: Client) -> dict[str, Callable[[list[bytes]], None]]:
    def lookup(keys: list[bytes]) -> None:
        if client.lookup(keys) != len(keys):
            raise RuntimeError("a timed lookup missed")

    def lease(keys: list[bytes]) -> None:
        if client.lease(keys).num_hit != len(keys):
            raise RuntimeError("a timed lease missed")
        client.release(keys)

    return {"lookup": lookup, "lease": lease}


def _paired_rates(coordinator: Coordinator, reference: Coordinator | None, verb: str,
                  num_clients: int, num_calls: int) -> tuple[float, float]:
    """The best of ``RATE_RUNS`` runs of ``_rate`` on ``coordinator`` and on the resident
    ``reference`` (``BASE_SLOTS``), alternated: on a shared machine a run is only ever
    slowed by others, so the best is the one they disturbed least, and each capacity is
    compared with the reference as it ran minutes, not a quarter of an hour, apart."""
    mine, theirs = [], []
    for _ in range(RATE_RUNS):
        if reference is not None:
            theirs.append(_rate(reference.socket_path, BASE_SLOTS, verb, num_clients,
                                num_calls))
        mine.append(_rate(coordinator.socket_path, coordinator.num_slots, verb, num_clients,
                          num_calls))
    return max(mine), max(theirs or mine)


def _rate(socket_path: str, num_slots: int, verb: str, num_clients: int, num_calls: int
          ) -> float:
    """Calls (or lease + release cycles) per second of ``num_clients`` closed loops."""
    barrier = SPAWN.Barrier(num_clients)
    results = SPAWN.Queue()
    clients = [SPAWN.Process(target=_client_main, daemon=True,
                             args=(socket_path, num_slots, verb, num_calls, c, barrier, results))
               for c in range(num_clients)]
    try:
        for client in clients:
            client.start()
        walls: list[float] = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(walls) < num_clients:
            try:
                walls.append(results.get(timeout=1.0))
            except queue.Empty:
                failed = [c.exitcode for c in clients if c.exitcode]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark clients failed ({failed}) or hung") from None
        for client in clients:
            client.join(START_TIMEOUT_S)
            if client.exitcode != 0:
                raise RuntimeError(f"benchmark client exited with {client.exitcode}")
    finally:
        for client in clients:
            if client.is_alive():
                client.terminate()
            client.join(START_TIMEOUT_S)
    return num_clients * num_calls / max(walls)


@contextmanager
def _workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tiercache-scale-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def bench_scale(num_slots: int, num_clients: int = 8, num_calls: int = 2000,
                policy: str = "lru", say: Callable[[str], None] = print,
                reference: Coordinator | None = None) -> ScaleResult:
    """One capacity, end to end (see the module docstring); rates beside ``reference``'s
    (a filled ``BASE_SLOTS`` coordinator), when given."""
    with _workdir() as workdir:
        coordinator = Coordinator(workdir, num_slots, policy)
        try:
            start_s = coordinator.start()
            reserved_s = start_s + _wait_reserved(coordinator.socket_path, num_slots)
            say(f"  {num_slots}: serve answered in {start_s:.2f} s, every slot reserved "
                f"at {reserved_s:.2f} s")
            t0 = time.perf_counter()
            _fill(coordinator.socket_path, num_slots)
            fill_s = time.perf_counter() - t0
            rss_full = rss_anon_bytes(coordinator.pid)
            say(f"  {num_slots}: filled in {fill_s:.2f} s, RssAnon {rss_full / 2**20:.0f} MiB")
            lookup_rate, ref_lookup = _paired_rates(coordinator, reference, "lookup",
                                                    num_clients, num_calls)
            lease_rate, ref_lease = _paired_rates(coordinator, reference, "lease",
                                                  num_clients, num_calls)
            say(f"  {num_slots}: lookup {lookup_rate:,.0f}/s (reference {ref_lookup:,.0f}), "
                f"lease {lease_rate:,.0f}/s (reference {ref_lease:,.0f})")
            t0 = time.perf_counter()
            _fill(coordinator.socket_path, num_slots, num_slots)
            churn_s = time.perf_counter() - t0
            rss_churned = rss_anon_bytes(coordinator.pid)
            say(f"  {num_slots}: every block evicted once by {num_slots} more stores in "
                f"{churn_s:.2f} s, RssAnon {rss_churned / 2**20:.0f} MiB")
            coordinator.kill()
            restart_s = coordinator.start()
            t0 = time.perf_counter()
            _check_all_hit(coordinator.socket_path, num_slots, num_slots)
            all_hits_s = restart_s + time.perf_counter() - t0
            rss_recovered = rss_anon_bytes(coordinator.pid)
            say(f"  {num_slots}: restarted in {restart_s:.2f} s, every key a hit at "
                f"{all_hits_s:.2f} s, RssAnon {rss_recovered / 2**20:.0f} MiB")
            with Client(coordinator.socket_path, timeout_s=START_TIMEOUT_S) as client:
                t0 = time.perf_counter()
                client.reset()
                reset_s = time.perf_counter() - t0
                if client.stats().ready_blocks:
                    raise RuntimeError("reset left READY blocks")
            say(f"  {num_slots}: reset in {reset_s:.3f} s")
        except BaseException:
            say(coordinator.log_tail())
            raise
        finally:
            coordinator.stop()
    return ScaleResult(num_slots, start_s, fill_s, rss_full, lookup_rate, lease_rate,
                       ref_lookup, ref_lease, churn_s, rss_churned, restart_s, all_hits_s,
                       rss_recovered, reset_s, load_average())


def scale_main(capacities: list[int], num_clients: int, num_calls: int, policy: str) -> int:
    """Run ``BASE_SLOTS`` then each capacity; print a Markdown table (per-slot memory is
    the growth over the ``BASE_SLOTS`` run; rates also as a share of those of a resident
    ``BASE_SLOTS`` reference, measured alternately with them)."""
    print(f"machine: {os.cpu_count()} CPUs; policy {policy}; {num_clients} clients x "
          f"{num_calls} calls; page {PAGE_BYTES} B; load at start {load_average()}")
    results = []
    with _workdir() as workdir:
        reference = Coordinator(workdir, BASE_SLOTS, policy, tag="reference")
        try:
            reference.start()
            _wait_reserved(reference.socket_path, BASE_SLOTS)
            _fill(reference.socket_path, BASE_SLOTS)
            for num_slots in [BASE_SLOTS, *capacities]:
                results.append(bench_scale(num_slots, num_clients, num_calls, policy,
                                           lambda line: print(line, flush=True), reference))
        finally:
            reference.stop()
    base = results[0]
    print("\n| slots | start | fill | RssAnon | B/slot | lookup/s | lease/s | churn | "
          "B/slot churned | restart | all hits | B/slot recovered | reset | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        grown = max(1, r.num_slots - base.num_slots)
        per_slot = (r.rss_full_bytes - base.rss_full_bytes) / grown
        per_slot_recovered = (r.rss_recovered_bytes - base.rss_recovered_bytes) / grown
        per_slot_churned = (r.rss_churned_bytes - base.rss_churned_bytes) / grown
        lookups, leases = r.lookup_calls_per_s, r.lease_cycles_per_s
        print(f"| {r.num_slots:,} | {r.start_s:.2f} s | {r.fill_s:.1f} s "
              f"| {r.rss_full_bytes / 2**20:.0f} MiB | {per_slot:.0f} "
              f"| {lookups:,.0f} ({lookups / r.reference_lookup_calls_per_s:.0%}) "
              f"| {leases:,.0f} ({leases / r.reference_lease_cycles_per_s:.0%}) "
              f"| {r.churn_s:.1f} s | {per_slot_churned:.0f} "
              f"| {r.restart_s:.2f} s | {r.all_hits_s:.2f} s | {per_slot_recovered:.0f} "
              f"| {r.reset_s:.3f} s | {r.load} |")
    return 0
