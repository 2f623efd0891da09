"""The cluster tier: blocks stored on one node are found by the engines of every node.

A pool shared by the nodes of a cluster (Mooncake Store, behind ``MooncakePool``), below
host memory and the disk tier. Owned by the coordinator, which maps the region: blocks
move zero-copy between the pool and the host slots (the region is registered with the
pool's client), on the tier's own threads (``cluster_transfer.BlockTransfers`` moves the
bytes; this module keeps the bookkeeping). Workers and the engine's step never wait on
the pool, and nothing here does network I/O under the index's lock.

* **Publish: write-through, asynchronous, bounded.** A block that becomes READY in host
  memory, stored by an engine or promoted from the disk tier, is queued
  (``LowerTier.stored``; the tier's own promotions are not: they came from the pool),
  unless the tier knows the pool has it (this node published it and the last census found
  it, or an exists answer of the last ``exists_ttl_s`` said so). The publisher pins a batch
  (as the tier's own owner), writes one object per rank (header + row, see
  ``cluster_object``) and unpins. The queue holds ``publish_queue_blocks``; past it a
  block is dropped and counted, never waited for.
* **What it holds: this node's published blocks, checked.** The keys this node published
  whole are kept; the health thread asks the pool about those whose last check (or
  publish) is ``census_period_s`` old, up to ``CENSUS_NAMES`` objects every ``retry_s``,
  and forgets those it no longer has (evicted by the master, the segment gone with a
  master restart). Each block is asked about at most once per ``census_period_s``
  because the master *leases* every object it is asked about (for its
  ``default_kv_lease_ttl``, 10 s in the pinned version), and a leased object can be
  neither evicted nor removed: a census any faster would keep this node's objects in the
  pool for good and fill it. ``used_blocks`` is their number: blocks this node published
  that the pool held at their last check. It is not this node's segment's occupancy
  (other nodes' objects can live there, and this node's in others' once its segment is
  full) nor the pool's size (``mooncake_master``'s metrics say those), and an eviction
  shows at the block's next check, up to ``census_period_s`` later.
* **Promote: what a lookup finds in the pool comes up like a disk hit.** A lookup that
  misses host memory and the disk asks ``holds``, which answers from what the tier knows
  (no I/O): "the pool has it" or "has not" (an answer of the last ``exists_ttl_s``), or,
  for a key it knows nothing of, "maybe" — the lookup answers "not yet" (pending) and the
  promoter asks the pool (one batched exists for the run), reserves host slots for the
  leading run the pool has, reads each object into its slot, checks its header and CRC,
  and completes the store (READY) or frees the slot. A key is promoted once however many
  ask (it is WRITING in the host index from the reservation on).
* **What a cold miss costs: bounded.** While the pool is being asked about a key,
  ``holds`` answers "maybe" to each new asker (session), and to those who asked already
  for ``exists_wait_s`` (a pool that answers within it is waited for); after that "no";
  for ``exists_ttl_s`` after the pool answered "no", "no" to everyone. So a block the
  pool does not have costs an asker one extra lookup, or at most ``exists_wait_s`` of
  them when the pool is slow. The price: a block published by another node within
  ``exists_ttl_s`` of a "no" here, or whose "yes" comes later than ``exists_wait_s``, is
  missed that once.
* **Stop: bounded.** ``close(timeout_s)`` waits that long for threads in a pool call; a
  master that does not answer (frozen, black-holed) holds Mooncake's calls for its own RPC
  timeout (30 s by default), so the threads still in one are abandoned: they are daemon
  threads, and what they hold (pins and reservations of this index, header buffers) dies
  with the index and the process; their names and calls are returned for the log.
* **Fail: the pool is a cache.** A master that cannot be reached (Mooncake's ``RPC_FAIL``,
  or the health probe every ``retry_s`` failing) marks the tier down: ``holds`` answers
  "no", publishing drops, one log line per interval; the probe brings it back. A get that
  fails for one object (a dead node's segment, a key stuck mid-put by a writer that died)
  or an object that does not check is a miss for that block (counted), never a load.
* **A read given up on may still land.** Mooncake answers a get ``TRANSFER_FAIL`` after
  waiting 60 s on a peer's segment (a frozen node) without stopping the transfer, which
  lands when the peer answers. Every failed read but those the master refused before any
  transfer (``NOTHING_MOVED``) has its host slot quarantined (``OffloadingManager
  .quarantine``): the key is a miss, the slot is never reused while this coordinator
  runs. Past ``1 / QUARANTINE_SHARE`` of host memory held out, promotions stop
  (``promoting``; lookups answer from this node's tiers). While a read waits, lookups
  of its block are pending for at most ``PROMOTION_WAIT_S`` (the index), then misses.

Thread-safety: ``holds``, ``promote`` and ``stored`` run under the index's lock and only
take the tier's lock briefly; the tier never calls the index holding its own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from tiercache.errors import ManagerError
from tiercache.loglimit import LogLimiter
from tiercache.index.manager import TIER_OWNER, OffloadingManager
from tiercache.index.results import BlockSource, TierStats
from tiercache.tiers.cluster_object import BlockFormat
from tiercache.tiers.cluster_transfer import BlockTransfers, Rows
from tiercache.tiers.mooncake_pool import NOTHING_MOVED, RPC_FAIL

log = logging.getLogger(__name__)

PUBLISH_BATCH = 16  # blocks per publish (pinned, put and unpinned together)
PROMOTE_BATCH = 32  # blocks per promotion read (their host slots reserved together)
MAX_PROMOTIONS_QUEUED = 64  # promotion jobs waiting; past it a lookup's run is a miss
MAX_KNOWN = 1 << 16  # exists answers remembered (oldest forgotten first)
QUARANTINE_SHARE = 64  # promotions stop once 1/64 of host memory's slots are held out
PROBE_NAME = "tiercache/health-probe"  # the health probe asks whether this exists
CENSUS_NAMES = 8192  # at most this many objects checked per retry_s (one batched exists)


class ClusterTier:
    """See the module docstring. ``pool``: a ``MooncakePool`` (open, the region
    registered); ``rows(slot)``: the host slot's rows, rank by rank."""

    def __init__(self, pool, manager: OffloadingManager, block_format: BlockFormat,
                 rows: Rows, *, capacity_blocks: int, publish_queue_blocks: int = 256,
                 exists_ttl_s: float = 1.0, exists_wait_s: float = 0.05,
                 retry_s: float = 5.0, census_period_s: float = 120.0,
                 publish_threads: int = 4, promote_threads: int = 2,
                 log_interval_s: float = 10.0):
        self._pool = pool
        self._manager = manager
        self._format = block_format
        self._queue_max = publish_queue_blocks
        self._ttl_s = exists_ttl_s
        self._wait_s = exists_wait_s
        self._retry_s = retry_s
        self._census_period_s = census_period_s
        self._warn = LogLimiter(log, log_interval_s)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._publish: deque[bytes] = deque()
        self._jobs: deque[tuple[tuple[bytes, ...], frozenset[bytes]]] = deque()
        # keys a queued or running job asks the pool about -> (since, the askers told "maybe")
        self._probing: dict[bytes, tuple[float, set[int]]] = {}
        self._known: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()  # (has, until)
        self._calls: dict[str, tuple[str, float]] = {}  # thread -> (pool call, since)
        self._publishing = 0  # blocks taken off the publish queue, not booked yet
        # keys this node published whole -> when the pool last said it has them (publish
        # or census), least recently checked first (at most 2x what its segment holds)
        self._published: OrderedDict[bytes, float] = OrderedDict()
        self._published_max = max(2 * capacity_blocks, PUBLISH_BATCH)
        self._up = True
        self._stop = False
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._publish_threads, self._promote_threads = publish_threads, promote_threads
        self._moves = BlockTransfers(pool, block_format, rows,
                                     num_areas=publish_threads + promote_threads,
                                     max_blocks=max(PUBLISH_BATCH, PROMOTE_BATCH))
        self.source = BlockSource.CLUSTER
        self.name = self.source.label
        self._block_bytes = block_format.world_size * block_format.object_bytes
        self.stats = TierStats(capacity_blocks=capacity_blocks)
        self._promoting = True  # False once too many host slots are held out (_hold_out)
        self._quarantine_max = max(1, manager.stats().capacity_blocks // QUARANTINE_SHARE)

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """``publish_threads`` publishers, ``promote_threads`` promoters, and the health
        probe. Publishing wants more calls in flight than promoting: Mooncake's client
        copies into its own segment on one thread and each put also waits on the master,
        so while one publisher checksums its batch or waits for an answer another's copy
        must be queued (docs/benchmarks.md: 2 publishers kept that thread busy about half
        the time on the development VM)."""
        work = [(self._publisher, f"publish-{i}", (i,)) for i in range(self._publish_threads)]
        work += [(self._promoter, f"promote-{i}", (self._publish_threads + i,))
                 for i in range(self._promote_threads)]  # each thread its header buffers
        for target, name, args in [*work, (self._health, "health", ())]:
            thread = threading.Thread(target=target, args=args, daemon=True,
                                      name=f"tiercache-cluster-{name}")
            thread.start()
            self._threads.append(thread)

    def close(self, timeout_s: float | None = None) -> list[str]:
        """Stop the threads, waiting up to ``timeout_s`` in all (None: as long as it takes)
        for those in a pool call; the pool stays open (its owner closes it). Returns the
        calls abandoned, ``"<thread>: <call> for <s> s"`` each (empty: every thread ended).
        An abandoned thread is a daemon blocked in Mooncake: the process may end under it;
        in-process, its call may still write into the region's mapping when it returns,
        so the region's owner must keep the mapping (see ``Coordinator.close``)."""
        with self._lock:
            self._stop = True
            self._work.notify_all()
        self._stopped.set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        now = time.monotonic()
        with self._lock:
            return [f"{t.name.removeprefix('tiercache-cluster-')}: "
                    + (f"{call[0]} for {now - call[1]:.1f} s" if call else "not in a call")
                    for t in self._threads for call in [self._calls.get(t.name)]]

    # ------------------------------------------------------------------ the index's side
    def holds(self, key: bytes, owner: int) -> bool:
        """From what the tier knows, never the pool: its fresh answer, else "maybe" while
        the pool is asked — to a new asker, or for ``exists_wait_s`` (see the module
        docstring)."""
        with self._lock:
            if not self._up or not self._promoting:
                return False
            now = time.monotonic()
            known = self._known.get(key)
            if known is not None and known[1] > now:
                return known[0]
            probing = self._probing.get(key)
            if probing is None:
                return True
            since, askers = probing
            return owner not in askers or now - since < self._wait_s

    def promote(self, run: Sequence[bytes], mine: Collection[bytes], owner: int) -> None:
        with self._lock:
            if not self._up or not self._promoting:
                return
            for key in mine:
                if key in self._probing:  # asked already: this asker heard "maybe" too
                    self._probing[key][1].add(owner)
            todo = frozenset(k for k in mine if k not in self._probing)
            if not todo:
                return
            if len(self._jobs) >= MAX_PROMOTIONS_QUEUED:  # busy: these are misses a while
                self._remember(todo, False)
                return
            now = time.monotonic()
            for key in todo:
                self._probing[key] = (now, {owner})
            self._jobs.append((tuple(run), todo))
            self._work.notify_all()

    def stored(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            if not self._up:
                self.stats.dropped_spills += len(keys)
                return
            now = time.monotonic()
            keys = [k for k in keys if k not in self._published
                    and not ((known := self._known.get(k)) and known[0] and known[1] > now)]
            room = self._queue_max - len(self._publish)
            self._publish.extend(keys[:max(room, 0)])
            if len(keys) > room:
                self.stats.dropped_spills += len(keys) - max(room, 0)
            self._work.notify_all()

    def snapshot(self) -> TierStats:
        with self._lock:
            return replace(self.stats, up=self._up, promoting=self._promoting,
                           used_blocks=len(self._published),
                           queued_blocks=len(self._publish) + self._publishing,
                           calls_in_flight=len(self._calls))

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
    def _next(self, queue: deque, count: int) -> list | None:
        """Up to ``count`` items of ``queue`` once it has any; None when stopping. Blocks
        taken to publish count as queued until they are booked."""
        with self._lock:
            while not queue and not self._stop:
                self._work.wait()
            if self._stop:
                return None
            items = [queue.popleft() for _ in range(min(count, len(queue)))]
            if queue is self._publish:
                self._publishing += len(items)
            return items

    def _publisher(self, area: int) -> None:
        while (keys := self._next(self._publish, PUBLISH_BATCH)) is not None:
            try:
                self._publish_batch(keys, area)
            except Exception:  # a bug: keep the tier serving, say it loudly
                log.exception("cluster tier: publishing failed")
            finally:
                with self._lock:
                    self._publishing -= len(keys)

    def _promoter(self, area: int) -> None:
        while (jobs := self._next(self._jobs, 1)) is not None:
            (run, mine), = jobs
            try:
                self._promote(run, mine, area)
            except Exception:
                log.exception("cluster tier: a promotion failed")
            finally:
                with self._lock:
                    for key in mine:
                        del self._probing[key]

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
            keys = []
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

    # ------------------------------------------------------------------ publishing
    def _publish_batch(self, keys: list[bytes], area: int) -> None:
        held = self._pin(keys)
        if not held:
            return
        try:
            with self._calling("put"):
                out = self._moves.put(area, held)
        finally:
            self._manager.complete_load([key for key, _ in held], owner=TIER_OWNER)
        failed = len(held) - len(out.done)
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

    def _pin(self, keys: list[bytes]) -> list[tuple[bytes, int]]:
        """(key, host slot) of the keys still readable in host memory, each pinned for the
        tier (one index call for the batch where it can); an evicted one is a dropped
        publish."""
        try:
            spec = self._manager.prepare_load(keys, owner=TIER_OWNER)
            return list(zip(keys, spec.block_ids.tolist()))
        except ManagerError:  # one was evicted (or is being rewritten) since: one by one
            held = []
            for key in keys:
                try:
                    spec = self._manager.prepare_load([key], owner=TIER_OWNER)
                    held.append((key, int(spec.block_ids[0])))
                except ManagerError:
                    with self._lock:
                        self.stats.dropped_spills += 1
            return held

    # ------------------------------------------------------------------ promoting
    def _promote(self, run: tuple[bytes, ...], mine: frozenset[bytes], area: int) -> None:
        """Ask the pool about ``mine`` (what the tier does not know yet), then bring up the
        leading part of ``run`` the pool has, ``PROMOTE_BATCH`` blocks at a time."""
        has = self._ask(mine)
        if has is None:
            return
        wanted = []
        for key in run:
            if key in mine and not has.get(key, False):
                break
            wanted.append(key)
        for start in range(0, len(wanted), PROMOTE_BATCH):
            chunk = wanted[start:start + PROMOTE_BATCH]
            if not self._read_into_host(chunk, {k for k in chunk if has.get(k, False)}, area):
                return

    def _ask(self, keys: frozenset[bytes]) -> dict[bytes, bool] | None:
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

    def _read_into_host(self, chunk: list[bytes], present: set[bytes], area: int) -> bool:
        """Reserve host slots for ``chunk`` and read the pool's objects of ``present`` into
        them; whether to go on (False: no room in host memory, or the pool failed)."""
        try:
            out = self._manager.prepare_store(chunk, owner=TIER_OWNER)
        except ManagerError:
            log.exception("cluster tier: reserving host slots for a promotion failed")
            return False
        if out is None:  # no room in host memory: the lookups simply miss
            return False
        keys = list(out.keys_to_store)
        wanted = [(key, slot) for key, slot in zip(keys, out.store_spec.block_ids.tolist())
                  if key in present]
        try:
            with self._calling("get"):
                got = self._moves.get(area, wanted)
        except BaseException:  # the read may be under way still: hold its slots out
            self._hold_out([k for k, _ in wanted])
            self._manager.complete_store(keys, False, owner=TIER_OWNER, source=self.source)
            raise
        good = set(got.done)
        errors = [c for c in got.codes if c < 0]
        world = self._format.world_size
        landing = [key for i, (key, _) in enumerate(wanted) if key not in good and any(
            c < 0 and c not in NOTHING_MOVED for c in got.codes[i * world:(i + 1) * world])]
        with self._lock:  # booked before the blocks are READY: a hit is already counted
            self.stats.promotions += len(got.done)
            self.stats.read_bytes += len(got.done) * self._block_bytes
            self.stats.read_seconds += got.seconds
            self.stats.checksum_failures += got.mismatched
            self.stats.errors += len(wanted) - len(got.done) - got.mismatched
            self._remember([k for k, _ in wanted if k not in good], False)
        self._hold_out(landing)
        self._manager.complete_store(got.done, True, owner=TIER_OWNER, source=self.source)
        self._manager.complete_store([k for k in keys if k not in good], False,
                                     owner=TIER_OWNER, source=self.source)
        if got.mismatched:
            self._warn.warn("checksum", "cluster tier: %d object(s) read from the pool did not "
                            "check (header or CRC); dropped, not served", got.mismatched)
        if errors:
            self._failed("get", errors)
        return RPC_FAIL not in errors

    def _hold_out(self, keys: list[bytes]) -> None:
        """Reads of ``keys`` that failed in a way that may leave their transfer running
        (Mooncake gives up waiting on a transfer without stopping it): their host slots
        are quarantined, never reused while this coordinator runs, so a late write lands
        in no block. Once the index holds ``max(1, capacity / QUARANTINE_SHARE)`` slots out
        (these, and lower tiers' reservations it expired), promotions stop (``promoting``)."""
        held = self._manager.quarantine(keys, owner=TIER_OWNER) if keys else 0
        if not held:  # none left to hold (an expired reservation is held out already)
            return
        total = self._manager.stats().quarantined_blocks
        with self._lock:
            stop = self._promoting and total >= self._quarantine_max
            if stop:  # queued jobs dropped: their keys are misses from now on
                self._promoting = False
                for _, todo in self._jobs:
                    for key in todo:
                        del self._probing[key]
                self._jobs.clear()
        log.error("cluster tier: %d read(s) from the pool failed with their transfer possibly "
                  "still running; their host slots are held out of use until the coordinator "
                  "restarts (%d so far)%s", held, total,
                  f"; promotions from the pool stop at {self._quarantine_max}" if stop else "")

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
            dropped = len(self._publish)
            self._publish.clear()
            self.stats.dropped_spills += dropped
        self._warn.warn("down", "cluster tier: %s; the tier is down (lookups use this node's "
                        "own tiers, nothing is published) and retries every %.0f s%s", why,
                        self._retry_s, "" if was_up else " (still down)")
