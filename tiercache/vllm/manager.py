"""``TierCacheManager``: vLLM's scheduler-side ``OffloadingManager`` over a shared coordinator.

Contract (vLLM 0.33 ``vllm.v1.kv_offload.base.OffloadingManager``) and how it is met:

* ``lock`` is a real lock: the flusher thread files answers under it, and vLLM holds it
  for the whole scheduling step, so a HIT and the ``prepare_load`` that follows cannot be
  separated by anything this engine does; other engines cannot evict it either, because a
  HIT is a lease (a pin of this engine's session in the coordinator).
* ``lookup`` never makes an RPC: HIT (leased), HIT_PENDING (this engine is storing it, or
  the last probe said so), MISS (the last probe said so, the coordinator is down, or a new
  request's first key is in no tier: the coordinator's key presence map, read in shared
  memory, says so, and the request is admitted in this step), RETRY (unknown: probed in one
  batched RPC after the step; the next step's lookup files the answer, waiting for it up
  to ``lookup_wait_s`` if it is not in yet, so a hit loads in the next step whatever the
  step time). See ``tiercache.vllm.leases`` and ``tiercache.region.presence``.
* ``prepare_load`` is answered from the leases (no RPC: the lease answer carried the
  slots, and the load reads them under the lease's pin); ``complete_load`` drops the
  load's refs (releases are batched per step). The coordinator counts leases, not loads
  (its ``loaded_blocks`` counts ``prepare_load`` calls, which this engine never makes):
  the chunks this engine loads are ``vllm:kv_offload_tiercache_loaded_chunks``.
* ``prepare_store`` is answered from the reservations the probe flushes made for the
  chunks each request is about to compute (no RPC; a lookup takes nothing: those
  reservations evict no more blocks than the engine stored in the step, see
  ``tiercache.vllm.leases``); keys no probe covered or that found no room (a GPU prefix
  hit, decode chunks, a full cache) take one RPC per call for the rest, which may
  evict. Keys already held by any engine
  of this namespace are skipped, keys of one call are never evicted for each other, and
  ``None`` means no room (nothing changed). While the coordinator is down it answers
  "nothing to store" instead, so vLLM neither retries every step nor logs a failure per
  request.
* ``complete_store`` ignores keys this engine is not writing (vLLM repeats and goes
  stale) and is batched per step; stored blocks become visible at the next flush.
* Events (when vLLM's KV events are on): when the coordinator publishes the node's event
  stream (``[events]``, docs/events.md) this engine publishes none of its CPU tier (the
  node's stream has every engine's blocks, every eviction, the disk tier); without one
  they are this engine's view: blocks it stored, and blocks its own stores evicted from
  this namespace (evictions caused by other engines are not seen here: a router may then
  send a request that misses; never a wrong hit). Each namespace is described to the
  coordinator (``describe``: at start, after a reset, and by the client on every
  reconnect).
* ``reset_cache`` moves the engine to a fresh namespace epoch (it never loads a block
  computed before the reset, and other engines keep theirs); pins and writes in flight
  are fenced until ``on_reset_flushed``.
* ``get_load_source`` names the tier a hit came from; ``get_stats`` adds tiercache's own
  metrics (declared by the spec's ``build_metric_definitions``); ``shutdown`` stops the
  flusher and closes both sessions (the coordinator frees whatever they still held).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.errors import ConfigError, CoordinatorGoneError, StateError
from tiercache.link.namespaces import EngineFamily
from tiercache.region.presence import PresenceView
from tiercache.results import BlockSource
from tiercache.vllm.flusher import Flusher, IndexSession
from tiercache.vllm.batch import Answers, RequestLeases
from tiercache.vllm.engine_metrics import TierCacheInfo, TierCacheMetrics
from tiercache.vllm.fenced_slot import FencedSlot, fenced_slots
from tiercache.vllm.load_store_spec import TierCacheLoadStoreSpec
from tiercache.vllm.leases import LeaseBook
from tiercache.vllm.namespace import Namespace

if TYPE_CHECKING:
    from tiercache.link.client import Client
    from tiercache.vllm.spec import TierCacheOffloadingSpec

log = logging.getLogger(__name__)

_HOST = CacheHitSource.HOST
# A cluster hit came from the pool, i.e. another node's memory: vLLM's P2P (what its own
# Mooncake connector reports); DISK for the disk tier.
_LOAD_SOURCES = {BlockSource.HOST: _HOST, BlockSource.DISK: CacheHitSource.DISK,
                 BlockSource.CLUSTER: CacheHitSource.P2P}
PRESENCE_CHECK_S = 1.0  # how often the scheduler checks that its presence map is current
PRESENCE_RETRY_S = 0.05  # ... while it has none, or one its coordinator retired


class TierCacheManager(OffloadingManager):
    """See the module docstring. ``bulk`` and ``writer`` are two sessions (clients) of the
    same coordinator: leases on one, store reservations on the other."""

    def __init__(self, *, namespace: Namespace, bulk: IndexSession, writer: IndexSession,
                 info: TierCacheInfo, enable_events: bool = False,
                 describe: Callable[[Namespace], bool] | None = None,
                 reserve_on_probe: bool = True, reconnect_interval_s: float = 1.0,
                 presence: PresenceView | None = None,
                 lookup_wait_s: float):
        self._lock = threading.Lock()
        self._presence = presence
        self._presence_checked = time.monotonic()
        self._namespace = namespace
        self._writer = writer
        self._bulk = bulk
        self._info = info
        answers = Answers(LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                          LookupResult.RETRY)
        self._book = LeaseBook(
            answers, namespace.digest,
            maybe_held=presence.maybe_held if presence is not None else None,
            await_answers=lambda request: self._flusher.await_answers(
                lambda: not request.in_flight, lookup_wait_s))
        # The hot path: vLLM's lookup(key, req_context) lands in the book directly (an
        # instance attribute over the method: one Python frame per key, not two).
        self.lookup = self._book.lookup  # type: ignore[method-assign]  # the line above
        self._flush_seconds: deque[float] = deque()  # appended by the flusher thread
        self._flusher = Flusher(self._book, self._lock, bulk, writer, reserve=reserve_on_probe,
                                reconnect_interval_s=reconnect_interval_s,
                                on_flush=self._flush_seconds.append,
                                on_evicted=self._evicted)
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._describe = describe
        self._probed_keys = 0
        self._cold_misses_reported = 0
        self._loaded_chunks = 0
        self._stores_skipped = 0

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def book(self) -> LeaseBook:
        return self._book

    # ------------------------------------------------------------------ requests
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        req_context.set_state(self._book.new_request(req_context.req_id, req_context))
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        request = req_context.get_state(RequestLeases)
        if request is not None:
            self._book.request_finished(request)

    # ------------------------------------------------------------------ lookups and loads
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Replaced per instance by the book's lookup (see ``__init__``)."""
        return self._book.lookup(key, req_context)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """DISK for a block the coordinator promoted from its disk tier for this lease, P2P
        from the cluster tier, HOST otherwise (and for keys no longer held)."""
        held = self._book.held.get(key)
        return _HOST if held is None else _LOAD_SOURCES[held.source]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> TierCacheLoadStoreSpec:
        request = req_context.get_state(RequestLeases)
        slots = self._book.prepare_load(keys, request)
        self._loaded_chunks += len(slots)
        return TierCacheLoadStoreSpec(slots)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._book.complete_load(keys)

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        to_store, slots, unknown = self._book.take_reserved(
            keys, req_context.get_state(RequestLeases))
        if not unknown:
            return PrepareStoreOutput(to_store, TierCacheLoadStoreSpec(slots), [])
        if self._book.down:
            return self._skip_store(unknown, to_store, slots)
        prefix = self._book.prefix
        try:
            out = self._writer.prepare_store([prefix + key for key in unknown])
        except CoordinatorGoneError:
            self._book.down = True
            self._flusher.coordinator_lost()
            return self._skip_store(unknown, to_store, slots)
        if out is None:
            if to_store:  # what was reserved is stored; the rest has no room
                return PrepareStoreOutput(to_store, TierCacheLoadStoreSpec(slots), [])
            return None
        cut = len(prefix)
        asked = [OffloadKey(k[cut:]) for k in out.keys_to_store]
        asked_slots = fenced_slots(out.store_spec)
        self._book.stores_prepared(asked, asked_slots)
        evicted = self._evicted(out.evicted_keys)
        return PrepareStoreOutput(to_store + asked, TierCacheLoadStoreSpec(slots + asked_slots),
                                  evicted)

    def _evicted(self, wire_keys: Sequence[bytes]) -> list[OffloadKey]:
        """This namespace's keys among ``wire_keys`` (evicted by our stores), as events."""
        prefix = self._book.prefix
        cut = len(prefix)
        evicted = [OffloadKey(k[cut:]) for k in wire_keys if k.startswith(prefix)]
        if evicted and self._events is not None:
            self._events.append(OffloadingEvent(evicted, Medium.CPU, removed=True))
        return evicted

    def _skip_store(self, keys: Collection[OffloadKey], to_store: list[OffloadKey],
                    slots: list[FencedSlot]) -> PrepareStoreOutput:
        self._stores_skipped += len(keys)
        return PrepareStoreOutput(to_store, TierCacheLoadStoreSpec(slots), [])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        taken = self._book.complete_store(keys, success)
        if success and taken and self._events is not None:
            self._events.append(OffloadingEvent(taken, Medium.CPU, removed=False))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """vLLM 0.33 never calls it; recency comes from the leases (a lease is an access)."""

    # ------------------------------------------------------------------ the step
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        presence = self._presence
        if presence is not None:  # a restarted coordinator makes a new map (and clears
            now = time.monotonic()  # EXACT in the old one): map the one under the name now
            if now - self._presence_checked >= (PRESENCE_CHECK_S if presence.exact()
                                                else PRESENCE_RETRY_S):
                self._presence_checked = now
                presence.refresh()
        batch = self._book.take_batch()
        if batch:
            self._probed_keys += sum(len(keys) for _, keys in batch.probes)
            self._flusher.submit(batch)

    def has_pending_work(self) -> bool:
        return self._flusher.coordinator_up and self._book.has_pending_work

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        self._namespace = self._namespace.next_epoch()
        self._book.reset(self._namespace.digest)
        if self._describe is not None:
            try:
                self._describe(self._namespace)
            except CoordinatorGoneError:  # the client describes it when it reconnects
                pass
        if self._presence is not None:
            self._presence.set_prefix(self._namespace.digest)

    def on_reset_flushed(self) -> None:
        self._book.reset_flushed()

    # ------------------------------------------------------------------ reporting
    def get_stats(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        stats.set_gauge(TierCacheMetrics.COORDINATOR_UP, float(self._flusher.coordinator_up))
        stats.set_gauge(TierCacheMetrics.LEASED_CHUNKS, float(self._book.num_held))
        if self._probed_keys:
            stats.increase_counter(TierCacheMetrics.PROBED_KEYS, self._probed_keys)
            self._probed_keys = 0
        if self._loaded_chunks:
            stats.increase_counter(TierCacheMetrics.LOADED_CHUNKS, self._loaded_chunks)
            self._loaded_chunks = 0
        cold = self._book.cold_misses - self._cold_misses_reported
        if cold:
            stats.increase_counter(TierCacheMetrics.COLD_MISSES, cold)
            self._cold_misses_reported += cold
        if self._stores_skipped:
            stats.increase_counter(TierCacheMetrics.STORES_SKIPPED, self._stores_skipped)
            self._stores_skipped = 0
        while self._flush_seconds:
            stats.observe_histogram(TierCacheMetrics.FLUSH_SECONDS, self._flush_seconds.popleft())
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._info.as_config_info()]

    def wait_flushed(self, timeout_s: float = 30.0) -> bool:
        """Until every step handed over so far has been sent and answered (tests, tools)."""
        return self._flusher.wait_idle(timeout_s)

    def shutdown(self) -> None:
        self._flusher.wait_idle(5.0)
        self._flusher.close()
        self._bulk.close()
        self._writer.close()
        if self._presence is not None:
            self._presence.close()


def _describer(client: Client) -> Callable[[Namespace], bool]:
    """Tells the coordinator what a namespace is (DESCRIBE; again on every reconnect), so
    its event stream publishes the namespace's blocks with vLLM's hashes; answers whether
    that stream runs (False too when the coordinator did not take the description: the
    engine then publishes its own view, as without a stream)."""

    def describe(namespace: Namespace) -> bool:
        try:
            return client.describe(EngineFamily.VLLM, namespace.description).node_events
        except (ConfigError, StateError) as e:
            log.warning("tiercache: the coordinator did not take namespace %s: %s",
                        namespace.digest.hex(), e)
            return False

    return describe


def connect(spec: TierCacheOffloadingSpec) -> TierCacheManager:
    """The scheduler's manager for ``spec``: the region's geometry checked, two sessions
    (bulk lookups, the writer's completions), the namespace described, the presence map."""
    path, layout = spec.target.region_layout()
    spec.engine_geometry().check(layout, path, spec.target.config)
    bulk, writer = spec.target.client(), spec.target.client()
    try:
        bulk.ping()
        writer.ping()
    except BaseException:
        bulk.close()
        writer.close()
        raise
    info = TierCacheInfo(spec.target.name, spec.namespace.digest.hex(), layout.num_blocks)
    describe = _describer(writer)
    node_events = describe(spec.namespace)
    own_events = spec.kv_events_config.enable_kv_cache_events and not node_events
    if spec.kv_events_config.enable_kv_cache_events and node_events:
        log.info("tiercache: coordinator %s publishes the node's KV events (every "
                 "engine's blocks, evictions and the disk tier): this engine's own "
                 "CPU-tier events are off (docs/events.md)", spec.target.name)
    # Reserving on probe assumes a probe is a prefix the request will store: true
    # of full attention; sliding-window groups probe from the end.
    full_attention = all(g.sliding_window_size_in_chunks is None
                         for g in spec.config.groups)
    presence = PresenceView(spec.target.name, spec.namespace.digest)
    if presence.problem is not None:
        log.warning("tiercache: %s; every new request is looked up in the coordinator "
                    "(one step) until it is there", presence.problem)
    manager = TierCacheManager(
        namespace=spec.namespace, bulk=bulk, writer=writer, info=info,
        enable_events=own_events, describe=describe,
        reserve_on_probe=full_attention, presence=presence,
        lookup_wait_s=spec.lookup_wait_s)
    log.info("tiercache: engine %s uses coordinator %s, namespace %s",
             spec.config.engine_id, spec.target.name, spec.namespace.describe())
    return manager
