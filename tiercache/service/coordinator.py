"""The coordinator: owns the region, the cache index behind the control socket, and the
Prometheus exporter. One per instance name per node; ``tiercache serve`` runs it.

Start order: preflight (``tiercache.service.preflight``: every cheap precondition, the
exporter's port bound and kept, nothing allocated; a refusal here is the start's only
line) → region (create or re-adopt, its header reserved, READY written last) → sessions
and index (rebuilt from the region's session table and ledger) → the slices' reservation
in the background (``tiercache.region.reservation``: the index hands out a slot only once
its memory is reserved, so ``serve`` answers within about a second at any capacity) →
lower tiers, event stream, key presence map → control socket (its path recorded in the
region header) → exporter (on the port preflight holds). Shutdown runs the reverse (the
reservation stops first, between two chunks); it is idempotent, so a signal during
start-up still leaves nothing behind. Each part is kept only once it started, so
shutdown removes (and reports) exactly what this coordinator made: a start refused over
a live coordinator's region removes nothing of it.

**A stop keeps the cache warm when engines are attached.** Unlinking a region that
workers still map frees no memory, and a new region would leave them mapping the old one.
So at a stop (SIGTERM, SIGINT, SIGHUP) with any worker attached, the region stays — READY,
with its index ledger and its session table (sessions are not ended: what they hold stays
fenced) — and the next ``serve`` of the same geometry re-adopts it: the cache, the
engines' mappings and pins, and their sessions carry over (``systemctl restart`` is
invisible to engines). With no worker attached, the stop removes the region as before;
``tiercache clean`` removes a kept region once its coordinator is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiercache.config import Config
from tiercache.sizes import format_bytes
from tiercache.region.shared import SharedOffloadRegion
from tiercache.service.notify import notify
from tiercache.service.preflight import Preflight

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from tiercache.config import EventsConfig
    from tiercache.control.options import ControlOptions
    from tiercache.control.server import ControlServer
    from tiercache.events import NodeEventStream
    from tiercache.tiers.base import LowerTier
    from tiercache.index.manager import OffloadingManager
    from tiercache.metrics.exporter import Exporter
    from tiercache.region.presence import PresenceMap
    from tiercache.region.reservation import SliceReserver
    from tiercache.region.sessions import SessionLedger, SessionRecord

log = logging.getLogger(__name__)


def control_options(config: Config) -> ControlOptions:
    """The control server's options from the config (``tiercache.control.server``)."""
    from tiercache.control.server import ControlOptions

    trusted = config.control_trusted_uid
    return ControlOptions(session_grace_s=config.index_session_grace_s,
                          session_timeout_s=config.index_session_timeout_s,
                          reservation_timeout_s=config.index_reservation_timeout_s,
                          max_connections=config.control_max_connections,
                          max_connections_per_peer=config.control_max_connections_per_peer,
                          hello_timeout_s=config.control_hello_timeout_s,
                          idle_timeout_s=config.control_idle_timeout_s,
                          max_detached_sessions_per_peer=(
                              config.control_max_detached_sessions_per_peer),
                          trusted_uid=trusted if trusted >= 0 else None)


class Coordinator:
    def __init__(self, config: Config, say: Callable[[str], None] = log.info):
        self.config = config
        self.say = say
        self.region: SharedOffloadRegion | None = None
        self.manager: OffloadingManager | None = None
        self.control: ControlServer | None = None
        self.exporter: Exporter | None = None
        self.tiers: list[LowerTier] = []  # below host memory, fastest first (tiercache.tiers)
        self.presence: PresenceMap | None = None
        self.reserver: SliceReserver | None = None  # while the region's slices are reserved
        self.events: NodeEventStream | None = None  # the node's KV event stream, with [events]
        # what stop left blocked in a tier (a disk read, the cluster tier's pool calls,
        # Mooncake's close): daemon threads; the region stays mapped under them, and `serve`
        # ends the process without Mooncake's teardown (which would hang or abort under them)
        self.abandoned: list[str] = []
        self._preflight: Preflight | None = None  # once every precondition passed
        self._closed = False

    def start(self) -> None:
        from tiercache.control.server import ControlServer
        from tiercache.metrics.collector import TiercacheCollector, start_exporter

        cfg = self.config
        t0 = time.perf_counter()
        self._preflight = preflight = Preflight.run(cfg)  # raises holding nothing
        try:
            self.region = region = SharedOffloadRegion.create(cfg, log_step=self.say,
                                                              reserve_now=False)
            layout = region.layout
            store, restored, (total, damaged) = self._restore_sessions(region)
            self.manager = manager = self._build_index(region, {r.owner for r in restored})
            self._report_sessions(manager, restored, total, damaged)
            self.reserver = region.reserver(manager.set_usable_blocks, self.say)
            if self.reserver is not None:
                self.reserver.start()
            self._start_tiers(region, manager)
            if cfg.events is not None:
                self._start_events(cfg.events, manager)
            self.presence = self._start_presence(region, manager)
            socket_path = os.path.abspath(cfg.socket_path)
            control = ControlServer(manager, socket_path, control_options(cfg),
                                    session_store=store, restored=restored, events=self.events)
            control.start()  # cleans up after itself when it fails
            self.control = control
            region.header.set_socket_path(socket_path)  # found whatever a client's env
            if cfg.exporter.enabled:
                node = TiercacheCollector(region, manager_stats=control.stats,
                                          tier_stats=manager.tier_stats if self.tiers else None)
                collector: Collector = node
                if self.events is not None:
                    from tiercache.metrics.events import EventsCollector, collectors

                    collector = collectors(node, EventsCollector(self.events.stats))
                self.exporter = start_exporter(cfg.exporter, collector,
                                               listener=preflight.take_exporter_listener())
        except BaseException:
            self.close()
            raise
        self.say(f"region {region.path}: {layout.describe()}")
        self.say(f"index: {layout.num_blocks} blocks, policy {cfg.index_policy}; "
                 f"control socket {cfg.socket_path}")
        if self.exporter is not None:
            self.say(f"metrics: http://{cfg.exporter.address}:{self.exporter.port}/metrics")
        reserving = "" if self.reserver is None or self.reserver.wait(0) else (
            f"; the slices are being reserved in the background ({manager.stats().capacity_blocks}"
            f" of {layout.num_blocks} blocks so far)")
        self.say(f"ready in {time.perf_counter() - t0:.2f} s "
                 f"({format_bytes(layout.total_bytes)}){reserving}; SIGTERM or Ctrl-C stops")
        notify("READY=1", f"STATUS=serving {region.path}")

    @staticmethod
    def _restore_sessions(region: SharedOffloadRegion,
                          ) -> tuple[SessionLedger, list[SessionRecord], tuple[int, int]]:
        """The region's session table, and the sessions of a previous coordinator whose
        processes still run (their records are kept; the others' are freed)."""
        from tiercache.region.hostmem import process_alive
        from tiercache.region.sessions import SessionLedger

        store = SessionLedger(region.sessions_array())
        records, damaged = store.recover()
        alive = [r for r in records if process_alive(r.pid, r.pid_start_ns)]
        for record in records:
            if record not in alive:
                store.close(record.owner)
        return store, alive, (len(records), damaged)

    def _report_sessions(self, manager: OffloadingManager, alive: list[SessionRecord],
                         total: int, damaged: int) -> None:
        """The live previous sessions are restored (until they resume, their process ends,
        or they stay away for ``index.session_timeout_s``): those holding something keep
        it fenced, the others keep their tokens, so a restart is invisible to clients."""
        holding = sum(manager.holds(r.owner) for r in alive)
        if total or damaged:
            self.say(f"sessions: {len(alive)} of the previous coordinator's {total} session(s) "
                     f"have live processes and are kept ({holding} holding reservations or "
                     "pins) until they resume, their process ends, or "
                     f"{self.config.index_session_timeout_s:g} s pass"
                     + (f"; {damaged} damaged session record(s) dropped" if damaged else ""))

    def _build_index(self, region: SharedOffloadRegion, surviving_owners: set[int],
                     ) -> OffloadingManager:
        """The index over the region, rebuilt from the region's ledger (READY blocks of a
        re-adopted region come back, with the reservations and pins of surviving
        sessions; a new region's ledger is empty)."""
        from tiercache.index.manager import OffloadingManager
        from tiercache.region.ledger import IndexLedger

        cfg = self.config
        num_blocks = region.layout.num_blocks
        manager = OffloadingManager(
            num_blocks, policy=cfg.index_policy, enable_events=cfg.index_events,
            ledger=IndexLedger(region.ledger_array()), region_id=region.region_id,
            surviving_owners=surviving_owners,
            max_session_blocks=max(1, int(num_blocks * cfg.index_max_session_share)),
            usable_blocks=region.info().reserved_rows)
        stats = manager.stats()
        if region.setup_times.adopted:
            self.say(f"index: {stats.recovered_blocks} ready block(s) recovered from the "
                     f"region's ledger, {stats.recovered_pins} pin(s) and "
                     f"{stats.recovered_writing_blocks} reservation(s) of live sessions kept"
                     + (f"; {stats.damaged_records} damaged record(s) dropped"
                        if stats.damaged_records else ""))
        return manager

    def _start_tiers(self, region: SharedOffloadRegion, manager: OffloadingManager) -> None:
        """The configured lower tiers (``tiercache.tiers.TIER_FACTORIES``), fastest first,
        driven by the index's tier chain."""
        from tiercache.tiers import build_tier, configured_tiers

        try:
            for name in configured_tiers(self.config):
                self.tiers.append(build_tier(name, self.config, region, self.say))
        except BaseException:
            for tier in self.tiers:
                tier.close(tier.policy.stop_timeout_s)
            self.tiers = []
            raise
        if self.tiers:
            manager.chain.start(self.tiers)

    def _start_presence(self, region: SharedOffloadRegion, manager: OffloadingManager,
                        ) -> PresenceMap:
        """The key presence map engines read to answer definite misses without asking
        (``tiercache.region.presence``), filled with what the tiers hold now."""
        from tiercache.region.presence import PresenceMap

        exact = [t for t in self.tiers if t.policy.exact_holdings]
        num_keys = manager.num_blocks + sum(t.snapshot().capacity_blocks for t in exact)
        presence = PresenceMap(self.config.name, num_keys, region.region_id)
        if len(exact) < len(self.tiers):  # a pool's keys are not counted: no zero is sure
            presence.set_exact(False)  # for good: nothing reads the counts, none are kept
            self.say("key presence map: not exact (a cluster tier's keys are not counted on "
                     "this node): every new request is looked up in the coordinator, one step")
            return presence
        try:
            manager.set_key_listener(presence.update)
            manager.chain.set_tier_key_listener(presence.update)
        except BaseException:
            presence.close()
            raise
        return presence

    def _stop_presence(self) -> None:
        assert self.manager is not None and self.presence is not None, "started after the index"
        self.manager.set_key_listener(None)
        self.manager.chain.set_tier_key_listener(None)
        self.presence.close()

    def _stop_tiers(self) -> None:
        """Each tier within its own stop bound (``cluster.stop_timeout_s``, the disk's
        ``DISK_STOP_S``); what is still blocked then is abandoned (one line says what)."""
        assert self.manager is not None, "the tiers start after the index"
        self.abandoned = self.manager.chain.close()
        if self.abandoned:
            self.say("tiers: stop waited each tier's bound (cluster.stop_timeout_s; the disk's "
                     "5 s) and abandoned what the pool's master or the disk still holds: "
                     f"{'; '.join(self.abandoned)}. Daemon threads holding nothing the next "
                     "start needs; this process ends without their teardown")

    def _start_events(self, config: EventsConfig, manager: OffloadingManager) -> None:
        """The node's KV event stream (``[events]``, ``tiercache.events``): bound and
        publishing, then hung on the index's ``NodeEvents`` hook (which first tells it
        everything the node holds), before any engine can change anything."""
        from tiercache.events import NodeEventStream

        stream = NodeEventStream(config)
        stream.start()  # a ServiceError naming the endpoint if it cannot bind
        self.events = stream
        manager.set_node_events(stream.sink)
        stream.sink.adopted()  # what was held is in: new keys publish once a session describes
        publisher = stream.publisher
        self.say(f"events: publishing on {publisher.endpoint}"
                 + (f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint
                    else "") + "; what the node holds is announced as engines describe "
                 "their namespaces")

    def _stop_events(self) -> None:
        assert self.manager is not None and self.events is not None, "started after the index"
        self.manager.set_node_events(None)
        self.events.close()

    def serve_until(self, stop: threading.Event) -> None:
        stop.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._preflight is None:  # refused before it made anything: the error says all
            return
        self._preflight.close()
        notify("STOPPING=1")
        errors: dict[str, BaseException] = {}
        attached = self.region.live_attachments() if self.region and self.control else 0
        keep = attached > 0
        for name, close in (("reservation", self.reserver and self.reserver.close),
                            ("exporter", self.exporter and self.exporter.close),
                            ("events", self.events and self._stop_events),
                            ("presence", self.presence and self._stop_presence),
                            ("tiers", self.tiers and self._stop_tiers),
                            ("control", self.control and (
                                lambda: self.control.close(end_sessions=not keep))),
                            # a scrape the exporter could not drain may still read the
                            # mapping: then unlink the region but keep it mapped
                            # (and a Mooncake call abandoned under it may still write it)
                            ("region", self.region and (
                                lambda: self.region.close(
                                    unlink=not keep,
                                    unmap="exporter" not in errors and not self.abandoned)))):
            if not close:
                continue
            try:
                close()
            except Exception as e:  # keep tearing down the rest; re-raised below
                log.exception("closing the %s failed", name)
                errors[name] = e
        if errors:
            raise next(iter(errors.values()))
        removed = ([f"region {self.region.path}"] if self.region and not keep else []) + (
            [f"socket {self.control.socket_path}"] if self.control else [])
        kept = (f"; kept region {self.region.path} with its cache for the next `serve` "
                f"({attached} worker attachment(s) still map it; `tiercache clean` removes it "
                "once they are gone)" if keep and self.region else "")
        self.say((f"stopped; removed {' and '.join(removed)}" if removed else
                  "stopped; nothing to remove (this start created no region or socket)") + kept)
