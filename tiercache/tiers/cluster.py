"""The cluster tier: blocks stored on one node are found by the engines of every node.

A pool shared by the nodes of a cluster (Mooncake Store, behind ``MooncakePool``), below
host memory and the disk tier. A one-way tier (``tiercache.tiers.base``): the
index's tier chain hands it jobs over host slots it reserved or pinned; this module keeps
the tier's own knowledge (what the pool has, what this node published) and
``cluster_transfer.BlockTransfers`` moves the bytes, on the tier's own threads. Workers
and the engine's step never wait on the pool, and nothing here does network I/O under
the index's lock.

* **Publish: write-through, asynchronous, bounded** (``PUBLISH`` jobs; the chain queues
  every block that becomes READY in host memory but this tier's own promotions, skips
  those ``holds`` says the pool has, and drops past ``publish_queue_blocks``). A job's
  blocks are pinned by the chain while the publisher writes one object per rank (header +
  row, see ``cluster_object``).
* **What it holds: this node's published blocks, checked.** The keys this node published
  whole are kept; the health thread asks the pool about those whose last check (or
  publish) is ``census_period_s`` old, up to ``CENSUS_NAMES`` objects every ``retry_s``,
  and forgets those it no longer has. Each block is asked about at most once per
  ``census_period_s`` because the master *leases* every object it is asked about (for its
  ``default_kv_lease_ttl``, 10 s in the pinned version), and a leased object can be
  neither evicted nor removed: a census any faster would keep this node's objects in the
  pool for good. ``used_blocks`` is their number (not the segment's occupancy nor the
  pool's size: ``mooncake_master``'s metrics say those).
* **Promote: what a lookup finds in the pool comes up like a disk hit.** ``holds``
  answers from what the tier knows (no I/O): "the pool has it" (``YES``: an answer of the
  last ``exists_ttl_s``, or a block this node published that its census still finds),
  "has not" (``NO``, an answer of the last ``exists_ttl_s``), or ``MAYBE`` for a key it
  knows nothing of: the chain sends a ``PROBE`` (one batched exists for the run) and promotes
  the leading run the pool has; a ``PROMOTE`` reads each object into its reserved host
  slot and checks its header and CRC before reporting it done.
* **What a cold miss costs: bounded.** While the pool is being asked about a key,
  ``holds`` answers ``MAYBE`` to each new asker (session), and to those who asked already
  for ``exists_wait_s``; after that ``NO``; for ``exists_ttl_s`` after the pool answered
  "no", ``NO`` to everyone. So a block the pool does not have costs an asker one extra
  lookup, or at most ``exists_wait_s`` of them when the pool is slow.
* **Stop: bounded.** ``close(timeout_s)`` waits that long for threads in a pool call; a
  master that does not answer holds Mooncake's calls for its own RPC timeout (30 s by
  default), so the threads still in one are abandoned (daemons; named in the result).
* **Fail: the pool is a cache.** A master that cannot be reached (Mooncake's ``RPC_FAIL``,
  or the health probe every ``retry_s`` failing) marks the tier down: ``holds`` answers
  ``NO``, jobs fail at once, one log line per interval; the probe brings it back. A get
  that fails for one object or an object that does not check is a miss for that block
  (counted), never a load.
* **A read given up on may still land — in staging, never a host slot.** Only the tier's
  staging areas are registered with the pool (peers could reach the region otherwise):
  a get lands in staging and is checked (header, CRC, the cluster's MAC) as it is copied
  into the reserved host slot. Mooncake answers a get ``TRANSFER_FAIL`` after waiting 60 s
  on a peer's segment (a frozen node) without stopping the transfer; the staging area it
  may still land in is held out of use (``BlockTransfers.held_areas``), and the read is
  reported failed: its host slot is freed at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import replace

from tiercache.tiers.base import JobKind, JobResult, LowerTier, Presence, TierJob, TierPolicy
from tiercache.results import BlockSource, TierStats
from tiercache.loglimit import LogLimiter
from tiercache.specs import Medium
from tiercache.tiers.cluster_object import BlockFormat
from tiercache.tiers.cluster_transfer import BlockTransfers, Rows
from tiercache.tiers.mooncake_pool import RPC_FAIL
from tiercache.tiers.pump import JobPump, Lane

log = logging.getLogger(__name__)

PUBLISH_BATCH = 16  # blocks per publish (pinned, put and unpinned together)
PROMOTE_BATCH = 32  # blocks per promotion read (their host slots reserved together)
MAX_PROMOTIONS_QUEUED = 64  # promotion and probe jobs waiting; past it a run is a miss
MAX_KNOWN = 1 << 16  # exists answers remembered (oldest forgotten first)
PROBE_NAME = "tiercache/health-probe"  # the health probe asks whether this exists
CENSUS_NAMES = 8192  # at most this many objects checked per retry_s (one batched exists)


class ClusterTier(LowerTier):
    """See the module docstring. ``pool``: a ``MooncakePool`` (open, its buffers
    registered); ``rows(slot)``: the host slot's rows, rank by rank."""

    source = BlockSource.CLUSTER

    def __init__(self, pool, block_format: BlockFormat, rows: Rows, *, capacity_blocks: int,
                 publish_queue_blocks: int = 256, exists_ttl_s: float = 1.0,
                 exists_wait_s: float = 0.05, retry_s: float = 5.0,
                 census_period_s: float = 120.0, publish_threads: int = 4,
                 promote_threads: int = 2, stop_timeout_s: float = 2.0,
                 log_interval_s: float = 10.0):
        self._pool = pool
        self._format = block_format
        self.policy = TierPolicy(Medium.CPU, publish=True, max_queued_blocks=publish_queue_blocks,
                                 job_blocks=PUBLISH_BATCH, promote_blocks=PROMOTE_BATCH,
                                 exact_holdings=False, stop_timeout_s=stop_timeout_s,
                                 max_in_flight_blocks=publish_threads * PUBLISH_BATCH)
        self._ttl_s = exists_ttl_s
        self._wait_s = exists_wait_s
        self._retry_s = retry_s
        self._census_period_s = census_period_s
        self._warn = LogLimiter(log, log_interval_s)
        self._lock = threading.Lock()
        # publishers, and promoters that probe too (in order); each thread its staging area
        self._pump = JobPump("cluster", self._lock, [
            Lane("publish", publish_threads, self._publish_job),
            Lane("promote", promote_threads, self._promote_job)], self._finish)
        # keys a queued or running probe asks the pool about -> (since, askers told "maybe")
        self._probing: dict[bytes, tuple[float, set[int]]] = {}
        self._known: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()  # (has, until)
        self._calls: dict[str, tuple[str, float]] = {}  # thread -> (pool call, since)
        # keys this node published whole -> when the pool last said it has them (publish
        # or census), least recently checked first (at most 2x what its segment holds)
        self._published: OrderedDict[bytes, float] = OrderedDict()
        self._published_max = max(2 * capacity_blocks, PUBLISH_BATCH)
        self._finished: list[JobResult] = []
        self._wake: Callable[[], None] = lambda: None
        self._up = True
        self._stopped = threading.Event()
        self._moves = BlockTransfers(pool, block_format, rows,
                                     num_areas=publish_threads + promote_threads,
                                     max_blocks=max(PUBLISH_BATCH, PROMOTE_BATCH))
        self._block_bytes = block_format.world_size * block_format.object_bytes
        self.stats = TierStats(capacity_blocks=capacity_blocks)

    # ------------------------------------------------------------------ life
    def start(self, wake: Callable[[], None]) -> None:
        """``publish_threads`` publishers, ``promote_threads`` promoters, and the health
        probe. Publishing wants more calls in flight than promoting: Mooncake's client
        copies into its own segment on one thread and each put also waits on the master,
        so while one publisher checksums its batch or waits for an answer another's copy
        must be queued (measured in docs/benchmarks.md, "Cluster tier (Mooncake Store over
        loopback TCP)", its 4-publishers run: where a publish's time goes)."""
        self._wake = wake
        self._pump.start([("health", self._health)])

    def close(self, timeout_s: float | None = None) -> list[str]:
        """Stop the threads, then Mooncake's client, each waited for at most ``timeout_s``
        (None: as long as it takes): a master that does not answer (frozen, black-holed)
        holds Mooncake's calls for its own RPC timeout, and a stop must not. Jobs never
        started are reported failed. Returns what was abandoned, ``"<thread>: <call> for
        <s> s"`` each, and Mooncake's close when it did not end (a client with a call still
        in it is not closed under that call). An abandoned thread is a daemon blocked in
        Mooncake: its call may still write into the region's mapping when it returns, so
        the region's owner must keep the mapping (see ``Coordinator.close``)."""
        with self._lock:
            self._finished += [JobResult(j.job_id, failed=j.keys) for j in self._pump.stop()]
        self._stopped.set()
        left = self._pump.join(timeout_s)
        now = time.monotonic()
        with self._lock:
            calls = [f"{name.removeprefix('tiercache-cluster-')}: "
                     + (f"{call[0]} for {now - call[1]:.1f} s" if call else "not in a call")
                     for name in left for call in [self._calls.get(name)]]
        if calls:
            return calls + ["Mooncake's close (not started: calls in it)"]
        return [] if self._pool.close(timeout_s) else ["Mooncake's close"]

    # ------------------------------------------------------------------ the chain's side
    def holds(self, key: bytes, asker: int) -> Presence:
        """From what the tier knows, never the pool: its fresh answer, else ``MAYBE`` while
        the pool is asked — to a new asker, or for ``exists_wait_s``."""
        with self._lock:
            if not self._up:
                return Presence.NO
            now = time.monotonic()
            known = self._known.get(key)
            if known is not None and known[1] > now:
                return Presence.YES if known[0] else Presence.NO
            if key in self._published:  # this node's, and the pool had it at its last check
                return Presence.YES
            probing = self._probing.get(key)
            if probing is None:
                return Presence.MAYBE
            since, askers = probing
            if asker not in askers:
                askers.add(asker)
                return Presence.MAYBE
            return Presence.MAYBE if now - since < self._wait_s else Presence.NO

    def submit(self, job: TierJob) -> None:
        with self._lock:
            if self._pump.stopping or not self._up:
                if job.kind is JobKind.PUBLISH:
                    self.stats.dropped_spills += len(job.keys)
                self._report(JobResult(job.job_id, failed=job.keys))
                return
            if job.kind is JobKind.PUBLISH:
                self._pump.put("publish", job)
            elif self._pump.queued("promote") >= MAX_PROMOTIONS_QUEUED:  # busy: misses a while
                if job.kind is JobKind.PROBE:
                    self._remember(job.keys, False)
                self._report(JobResult(job.job_id, failed=job.keys))
                return
            else:
                if job.kind is JobKind.PROBE:
                    now = time.monotonic()
                    for key in job.keys:
                        self._probing.setdefault(key, (now, set()))[1].add(job.asker)
                self._pump.put("promote", job)

    def take_finished(self) -> list[JobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
            return finished

    def _report(self, result: JobResult) -> None:
        """Under the lock."""
        self._finished.append(result)
        self._wake()

    def snapshot(self) -> TierStats:
        with self._lock:
            return replace(self.stats, up=self._up, used_blocks=len(self._published),
                           calls_in_flight=len(self._calls),
                           held_buffers=self._moves.held_areas)

    @contextmanager
    def _calling(self, what: str) -> Iterator[None]:
        """Around each pool call: what this thread waits on (``calls_in_flight``, and
        what ``close`` abandons)."""
        me = threading.current_thread().name
        with self._lock:
            self._calls[me] = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                del self._calls[me]

    # ------------------------------------------------------------------ threads
    def _finish(self, job: TierJob, result: JobResult) -> None:
        """Under the lock: a job the pump ran."""
        if job.kind is JobKind.PROBE:
            for key in job.keys:
                self._probing.pop(key, None)
        self._report(result)

    def _health(self) -> None:
        """Ask the master every ``retry_s`` (any answer but an error is "up"); while up,
        check the next of this node's published blocks."""
        while not self._stopped.wait(self._retry_s):
            with self._calling("exists (health probe)"):
                (code,) = self._pool.exists([PROBE_NAME])
            if code < 0:
                self._down(f"the health probe failed (code {code})")
                continue
            with self._lock:
                was_up, self._up = self._up, True
            if not was_up:
                log.warning("cluster tier: the pool's master answers again; the tier is up")
            self._census()

    def _census(self) -> None:
        """Ask the pool about the published blocks last checked ``census_period_s`` ago
        or more (up to ``CENSUS_NAMES`` objects, the least recently checked first); forget
        those it no longer has whole."""
        due = time.monotonic() - self._census_period_s
        with self._lock:
            count = max(1, CENSUS_NAMES // self._format.world_size)
            keys: list[bytes] = []
            for key, checked in self._published.items():
                if checked > due or len(keys) == count:
                    break
                keys.append(key)
        if not keys:
            return
        with self._calling("exists (census)"):
            codes = self._moves.exists(keys)
        if any(c < 0 for c in codes):
            self._failed("census", [c for c in codes if c < 0])
            return
        now = time.monotonic()
        with self._lock:
            for key, code in zip(keys, codes):
                if key not in self._published:  # forgotten meanwhile
                    continue
                if code == 1:
                    self._published[key] = now
                    self._published.move_to_end(key)
                else:
                    del self._published[key]

    # ------------------------------------------------------------------ moving blocks
    def _publish_job(self, job: TierJob, area: int) -> JobResult:
        with self._calling("put"):
            out = self._moves.put(area, job.blocks())
        failed = len(job.keys) - len(out.done)
        now = time.monotonic()
        with self._lock:
            for key in out.done:
                self._published[key] = now
                self._published.move_to_end(key)
            while len(self._published) > self._published_max:
                self._published.popitem(last=False)
            self.stats.demotions += len(out.done)
            self.stats.write_bytes += len(out.done) * self._block_bytes
            self.stats.write_seconds += out.seconds
            self.stats.dropped_spills += failed
            self.stats.errors += failed
            self._remember(out.done, True)
        if failed:
            self._failed("publish", [c for c in out.codes if c != 0])
        done = set(out.done)
        return JobResult(job.job_id, done=tuple(out.done),
                         failed=tuple(k for k in job.keys if k not in done))

    def _promote_job(self, job: TierJob, area: int) -> JobResult:
        if job.kind is JobKind.PROBE:
            has = self._ask(job.keys)
            run = []
            for key in job.keys:
                if not (has or {}).get(key, False):
                    break
                run.append(key)
            return JobResult(job.job_id, done=tuple(run), failed=job.keys[len(run):])
        return self._read_into_host(job, area)

    def _ask(self, keys: Collection[bytes]) -> dict[bytes, bool] | None:
        """Whether the pool has each key (every rank's object): fresh answers the tier
        remembers, the rest in one batched exists. None when the pool could not answer."""
        now = time.monotonic()
        has: dict[bytes, bool] = {}
        with self._lock:
            for key in keys:
                known = self._known.get(key)
                if known is not None and known[1] > now:
                    has[key] = known[0]
        unknown = [k for k in keys if k not in has]
        if not unknown:
            return has
        with self._calling("exists"):
            codes = self._moves.exists(unknown)
        if any(c < 0 for c in codes):
            self._failed("exists", [c for c in codes if c < 0])
            return None
        answers = {k: c == 1 for k, c in zip(unknown, codes)}
        with self._lock:
            for present in (True, False):
                self._remember([k for k, v in answers.items() if v is present], present)
        has.update(answers)
        return has

    def _read_into_host(self, job: TierJob, area: int) -> JobResult:
        """Read the pool's objects of ``job`` into its reserved host slots; a read that
        failed in a way that may leave its transfer running is ``may_land``."""
        wanted = job.blocks()
        with self._calling("get"):
            got = self._moves.get(area, wanted)
        good = set(got.done)
        errors = [c for c in got.codes if c < 0]
        with self._lock:
            self.stats.promotions += len(got.done)
            self.stats.read_bytes += len(got.done) * self._block_bytes
            self.stats.read_seconds += got.seconds
            self.stats.checksum_failures += got.mismatched
            self.stats.errors += len(wanted) - len(got.done) - got.mismatched
            missed = [k for k, _ in wanted if k not in good]
            self._remember(missed, False)
            for key in missed:  # not in the pool after all (or not whole): asked again
                self._published.pop(key, None)
        if got.mismatched:
            self._warn.warn("checksum", "cluster tier: %d object(s) read from the pool did not "
                            "check (header or CRC); dropped, not served", got.mismatched)
        if errors:
            self._failed("get", errors)
        # a read that may still land lands in its staging area (held out by the transfers),
        # never in the host slot: every key not done is simply failed
        return JobResult(job.job_id, done=tuple(got.done),
                         failed=tuple(k for k in job.keys if k not in good))

    # ------------------------------------------------------------------ state
    def _remember(self, keys: Collection[bytes], present: bool) -> None:
        """Note the pool's answer for ``keys`` (under the lock)."""
        until = time.monotonic() + self._ttl_s
        known = self._known
        for key in keys:
            known[key] = (present, until)
            known.move_to_end(key)
        while len(known) > MAX_KNOWN:
            known.popitem(last=False)

    def _failed(self, what: str, codes: list[int]) -> None:
        """Pool calls that answered errors: the master gone marks the tier down."""
        if RPC_FAIL in codes:
            self._down(f"a {what} found the master unreachable (code {RPC_FAIL})")
        else:
            self._warn.warn(what, "cluster tier: %d object(s) failed in a %s (codes %s); "
                            "missed, not served", len(codes), what, sorted(set(codes))[:4])

    def _down(self, why: str) -> None:
        with self._lock:
            self.stats.errors += 1
            was_up, self._up = self._up, False
            for job in self._pump.drain("publish"):
                self.stats.dropped_spills += len(job.keys)
                self._report(JobResult(job.job_id, failed=job.keys))
        self._warn.warn("down", "cluster tier: %s; the tier is down (lookups use this node's "
                        "own tiers, nothing is published) and retries every %.0f s%s", why,
                        self._retry_s, "" if was_up else " (still down)")


