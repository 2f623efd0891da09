"""The tier chain: host memory's index and the tiers below it (disk, a cluster pool), and
the only thing that moves blocks between them and the index.

Tiers are one-way (``tiercache.tiers.base``): they answer, move bytes and report.
The chain alone does against the index what each tier used to, and sees the index only as
its narrow ``HostSlots`` (``tiercache.index.host_slots``: a few reads and six verbs, under
the index's locking discipline; never its table): it reserves host slots before a
promotion (``reserve_promotion``), pins blocks before a demotion or a publish
(``pin_for_tier``), completes, unpins or quarantines when a job reports, watches the host
watermark, admits what goes down, and passes what the tiers came to hold on to the key
listeners (the presence map) and the node's events. It runs as the index's owner
``TIER_OWNER`` (no session, no cap).

* **Promotion on lookup.** A lookup (or lease) that misses host memory asks the tiers,
  fastest first, about the keys after its hits: a key the first tier answers ``YES`` for
  gets a host slot reserved at once and a ``PROMOTE`` job (the run's keys in host memory
  are in the reservation too, so its evictions cannot take the rest of its own prefix);
  for keys answered ``MAYBE`` the tier gets a ``PROBE`` job, and what it finds is promoted
  when it reports. The asker hears "not yet" (pending) and asks again. A key is promoted
  once however many ask (it is WRITING from the reservation on, or being probed).
* **Demotion ahead of eviction and write-through publish**: what goes down, admitted
  reused-first and waiting unpinned until the tier has room (``tiercache.index.feeds``).
* **Reads that may still land** (``JobResult.may_land``) hold their host slots out of use
  until the job settles; while more than ``1 / QUARANTINE_SHARE`` of host memory is held
  out, no promotion starts (``promoting`` is False in the tier's stats).
* **A promotion's read that hangs** makes its keys misses after ``PROMOTION_WAIT_S``.

Threads: the chain's thread books results and refills; lookups call in under the index's
lock, as do tiers' quick ``holds`` and ``submit``. A tier never calls the index.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from tiercache.tiers.base import JobKind, JobResult, KeyChange, LowerTier, Presence, TierJob
from tiercache.results import BlockSource, TierStats
from tiercache.index.events import NodeEvents
from tiercache.index.feeds import Feeds
from tiercache.index.slots import KeyListener, SlotState
from tiercache.specs import Medium

if TYPE_CHECKING:
    from tiercache.index.host_slots import HostSlots

log = logging.getLogger(__name__)

TIER_OWNER = 0xFFFF  # the tier chain's own reservations and pins: no session, no cap
PROMOTION_WAIT_S = 1.0  # a promotion's read pending longer: lookups miss it (overdue)
QUARANTINE_SHARE = 64  # promotions stop while 1/64 of host memory's slots are held out
POLL_S = 0.02  # the watermark is looked at this often


class _Job:
    __slots__ = ("tier", "job", "run", "held_out", "reported")

    def __init__(self, tier: LowerTier, job: TierJob, run: tuple[bytes, ...] = ()):
        self.tier, self.job, self.run = tier, job, run
        self.held_out: list[int] = []  # host slots held out until the job settles
        self.reported = False  # its first result came


class TierChain:
    """See the module docstring. Built by the manager: ``host`` is what the chain may do to
    the index and read of it (under ``host.lock``); the manager tells it what becomes
    readable (``host_changed``), READY (``became_ready``) or is reset (``host_cleared``)."""

    def __init__(self, host: HostSlots):
        self._host = host
        self._lock = host.lock
        self._tiers: tuple[LowerTier, ...] = ()
        self._feeds = Feeds(host, TIER_OWNER)
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._probing: dict[bytes, LowerTier] = {}  # keys of PROBE jobs in flight
        self._sink: NodeEvents | None = None
        self._tier_keys: KeyListener | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life
    def set_tiers(self, tiers: Sequence[LowerTier]) -> None:
        """Use ``tiers`` (fastest first) from now on; ``start`` runs them."""
        with self._lock:
            self._tiers = tuple(tiers)
            self._feeds.use(self._tiers)

    def start(self, tiers: Sequence[LowerTier]) -> None:
        """Start ``tiers`` and the chain's thread."""
        self.set_tiers(tiers)
        for tier in tiers:
            tier.start(self._wake.set)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tiercache-tier-chain",
                                        daemon=True)
        self._thread.start()

    def close(self) -> list[str]:
        """Stop the chain's thread, then each tier (``LowerTier.close`` within its
        ``policy.stop_timeout_s``), and book what they reported; returns what was
        abandoned, ``"<tier> <thread>: <what>"`` each."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        abandoned: list[str] = []
        for tier in self._tiers:
            abandoned += [f"{tier.name} {what}" for what in tier.close(tier.policy.stop_timeout_s)]
            self._book(tier, tier.take_finished())
        self.set_tiers([])
        return abandoned

    # ------------------------------------------------------------------ listeners
    def set_tier_key_listener(self, listener: KeyListener | None) -> None:
        """Call ``listener(keys, removed)`` when a tier with exact holdings comes to hold
        keys or stops (first with every key held now): the presence map counts them."""
        with self._lock:
            self._tier_keys = listener
            if listener is not None:
                for tier in self._tiers:
                    if tier.policy.exact_holdings and (keys := tier.held_keys()):
                        listener(keys, False)

    def set_node_events(self, sink: NodeEvents | None) -> None:
        """Tell ``sink`` what the node holds (host memory, then each tier) and every change
        from now on."""
        with self._lock:
            self._sink = sink
            if sink is None:
                return
            if readable := self._host.readable_keys():
                sink.stored(readable, Medium.CPU)
            for tier in self._tiers:
                if tier.policy.exact_holdings and (keys := tier.held_keys()):
                    sink.stored(keys, tier.policy.medium)

    def host_changed(self, keys: Sequence[bytes], removed: bool) -> None:
        """Under the lock: ``keys`` became readable in host memory or stopped being."""
        if self._sink is not None:
            (self._sink.removed if removed else self._sink.stored)(keys, Medium.CPU)

    def host_cleared(self) -> None:
        """Host memory was reset (under the lock): what waits to go down goes too."""
        self._feeds.forget_waiting()
        if self._sink is not None:
            self._sink.cleared(Medium.CPU)

    # ------------------------------------------------------------------ lookups (locked)
    def overdue(self, key: bytes) -> bool:
        """Whether ``key``'s promotion has been read for longer than ``PROMOTION_WAIT_S``
        (a hung disk, a frozen node): a lookup then misses it instead of waiting."""
        since = self._host.promotion_since(key)
        return since is not None and time.monotonic() - since > PROMOTION_WAIT_S

    def after_miss(self, keys: Sequence[bytes], hits: int, asker: int) -> bool:
        """Under the lock: start bringing up the run of keys after the host hits that the
        tiers hold, each key by the first tier that does not answer NO; whether the key
        after the hits is on its way (then "pending"). The run goes on through keys READY
        in host memory, which the promotion's reservation protects."""
        tiers, host = self._tiers, self._host
        if not tiers or hits >= len(keys) or host.state_of(keys[hits]) is not None:
            return False
        run: list[bytes] = []
        chosen: dict[bytes, tuple[LowerTier, Presence]] = {}
        for key in keys[hits:]:
            state = host.state_of(key)
            if state is None:
                answer = self._ask(key, asker)
                if answer is None:
                    break
                chosen[key] = answer
            elif state is SlotState.WRITING:
                break
            run.append(key)
        for tier in tiers:
            mine = {k for k, (t, _) in chosen.items() if t is tier}
            if not mine:
                continue
            part = tuple(k for k in run if k in mine or k not in chosen)
            probe = [k for k in part if k in mine and chosen[k][1] is Presence.MAYBE
                     and k not in self._probing]
            if probe:
                self._submit(tier, JobKind.PROBE, probe, (), part, asker)
                self._probing.update(dict.fromkeys(probe, tier))
            sure = {k for k in mine if chosen[k][1] is Presence.YES}
            if sure:
                self._promote(tier, [k for k in part if k in sure or k not in chosen])
        if not run:
            return False
        first = keys[hits]  # on its way: reserved now, or the tier is finding out
        return chosen[first][1] is Presence.MAYBE or host.state_of(first) is SlotState.WRITING

    def _ask(self, key: bytes, asker: int) -> tuple[LowerTier, Presence] | None:
        for tier in self._tiers:
            if key in self._probing and self._probing[key] is not tier or self._paused(tier):
                continue
            answer = tier.holds(key, asker)
            if answer is not Presence.NO:
                return tier, answer
        return None

    def _promoting(self) -> bool:
        return self._host.num_held_out() < self._max_held_out()

    def _max_held_out(self) -> int:
        """Slots held out at which promotions stop."""
        return max(1, self._host.num_blocks // QUARANTINE_SHARE)

    def _paused(self, tier: LowerTier) -> bool:
        """Whether ``tier`` promotes nothing now: host memory holds out too many slots, some
        for reads of this tier that may still land."""
        return not self._promoting() and any(
            e.tier is tier and e.held_out for e in self._jobs.values())

    def _promote(self, tier: LowerTier, run: Sequence[bytes]) -> None:
        """Reserve host slots for ``run`` (what is not in host memory yet) and hand them to
        ``tier``, ``promote_blocks`` at a time: as many of its leading keys as free and
        evictable slots allow now (blocks pinned a moment, by a demotion say, are not); the
        rest wait for a later lookup."""
        if self._paused(tier) or not self._host.keys_fit(run):
            return  # (a key longer than any the index can hold: nothing to promote)
        step = tier.policy.promote_blocks
        for start in range(0, len(run), step):
            chunk = run[start:start + step]
            out = self._host.reserve_promotion(chunk)
            if out.keys_to_store:
                self._submit(tier, JobKind.PROMOTE, out.keys_to_store,
                             tuple(out.store_spec.block_ids.tolist()))
            if out.no_room_keys:
                return

    def _hand_over(self, tier: LowerTier, kind: JobKind, keys: list[bytes]) -> None:
        """Under the lock: pin ``keys`` (readable) for ``tier`` to read and give it the job."""
        spec = self._host.pin_for_tier(keys, f"a tier's read ({kind.value})")
        self._submit(tier, kind, keys, tuple(spec.block_ids.tolist()))

    def _submit(self, tier: LowerTier, kind: JobKind, keys: Sequence[bytes],
                slots: tuple[int, ...], run: tuple[bytes, ...] = (), asker: int = 0) -> None:
        job = TierJob(next(self._ids), kind, tuple(keys), slots, asker)
        self._jobs[job.job_id] = _Job(tier, job, run)
        if kind.reads_host:
            self._feeds[tier].in_flight.update(keys)
        tier.submit(job)

    # ------------------------------------------------------------------ stores (locked)
    def became_ready(self, keys: Sequence[bytes], source: BlockSource) -> None:
        """Under the lock: ``keys`` became READY in host memory; queue them for the tiers
        that publish (all but the one they came up from)."""
        if self._feeds.publish(self._tiers, keys, source):
            self._wake.set()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            self.run_once()

    def run_once(self) -> None:
        """One round of the chain's thread: book each tier's results and changes, then
        hand it what waits and demotions below the watermark."""
        for tier in self._tiers:
            try:
                self._book(tier, tier.take_finished())
                self._changed(tier.policy.medium, tier.policy.exact_holdings,
                              tier.take_changes())
                with self._lock:
                    self._feeds.refill(tier, self._hand_over)
            except Exception:  # a bug: keep the chain serving, say it loudly
                log.exception("tier chain: serving the %s tier failed", tier.name)

    def _changed(self, medium: Medium, exact: bool, changes: list[KeyChange]) -> None:
        if not changes:
            return
        with self._lock:
            for change in changes:
                if exact and self._tier_keys is not None:
                    self._tier_keys(change.keys, change.removed)
                if self._sink is not None:
                    (self._sink.removed if change.removed else self._sink.stored)(
                        change.keys, medium)

    def _book(self, tier: LowerTier, results: list[JobResult]) -> None:
        """What the tier reported, put right in the index."""
        host = self._host
        for result in results:
            with self._lock:
                entry = self._jobs.get(result.job_id)
            if entry is None:
                log.error("tier chain: the %s tier reported job %d, which it was never given "
                          "or reported before; ignored", tier.name, result.job_id)
                continue
            job = entry.job
            if job.kind is JobKind.PROBE:
                self._probed(entry, result)
            elif job.kind is JobKind.PROMOTE:
                if not entry.reported:
                    self._promoted(entry, result)
                if result.settled:  # every read of the job ended: its held-out slots return
                    host.release_quarantine(entry.held_out)
                    entry.held_out = []
                else:
                    continue
            else:
                host.complete_read(list(job.keys))
                with self._lock:
                    self._feeds[tier].in_flight.difference_update(job.keys)
            with self._lock:
                del self._jobs[job.job_id]

    def _promoted(self, entry: _Job, result: JobResult) -> None:
        """A promotion's first result: the blocks that came up and checked are READY, the
        others' slots are freed, or held out while a read into them may still land (and
        those of its reservations that expired meanwhile, held out by the index, stay out
        until the job settles: only then has every read of it ended)."""
        entry.reported = True
        host, source = self._host, entry.tier.source
        host.complete_write(list(result.done), True, source)
        with self._lock:
            entry.held_out = host.held_out(entry.job.slots)
        if not result.settled and result.may_land:
            entry.held_out += host.quarantine_slots(list(result.may_land))
            with self._lock:
                held, stop = host.num_held_out(), not self._promoting()
            log.error("tier chain: %d read(s) from the %s tier gave up with their transfer "
                      "possibly still running; their host slots are held out of use until it "
                      "ends (%d held out now; a read that never says so: until the coordinator "
                      "restarts)%s", len(result.may_land), entry.tier.name, held,
                      f"; promotions stop at {self._max_held_out()}"
                      if stop else "")
            host.complete_write(list(result.failed), False, source)
        else:
            host.complete_write(list(result.failed + result.may_land), False, source)

    def _probed(self, entry: _Job, result: JobResult) -> None:
        """A PROBE found ``result.done``: promote the leading part of its run the tier has
        (with the run's host keys) now."""
        found = set(result.done)
        with self._lock:
            for key in entry.job.keys:
                if self._probing.get(key) is entry.tier:
                    del self._probing[key]
            mine = set(entry.job.keys)
            run = []
            for key in entry.run:
                if key in mine and key not in found:
                    break
                run.append(key)
            if found and run:
                self._promote(entry.tier, run)

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, TierStats]:
        """Each tier's figures, with what waits in the chain for it."""
        with self._lock:
            tiers = [(tier, self._feeds[tier].queued, self._feeds[tier].dropped,
                      self._paused(tier)) for tier in self._tiers]
        out = {}
        for tier, queued, dropped, paused in tiers:
            snap = tier.snapshot()
            out[tier.name] = replace(snap, queued_blocks=snap.queued_blocks + queued,
                                     dropped_spills=snap.dropped_spills + dropped,
                                     promoting=snap.promoting and not paused)
        return out

