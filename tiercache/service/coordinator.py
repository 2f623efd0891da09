"""The coordinator: owns the region, the cache index behind the control socket, and the
Prometheus exporter. One per instance name per node; ``tiercache serve`` runs it.

Start order: region (create or re-adopt, READY written last) → index (rebuilt from the
region's ledger) → control socket (its path recorded in the region header) → exporter.
Shutdown runs the reverse and unlinks the region and the socket; it is idempotent, so a
signal during start-up still leaves nothing behind. Each part is kept only once it
started, so shutdown removes (and reports) exactly what this coordinator made: a start
refused over a live coordinator's region removes nothing of it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from tiercache.config import Config
from tiercache.sizes import format_bytes
from tiercache.region.shared import SharedOffloadRegion

log = logging.getLogger(__name__)


def control_options(config: Config):
    """The control server's options from the config (``tiercache.index.control``)."""
    from tiercache.index.control import ControlOptions

    trusted = config.control_trusted_uid
    return ControlOptions(session_grace_s=config.index_session_grace_s,
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
        self.manager = None
        self.control = None
        self.exporter = None
        self._closed = False

    def start(self) -> None:
        from tiercache.index.control import ControlServer
        from tiercache.metrics.collector import TiercacheCollector, start_exporter

        cfg = self.config
        t0 = time.perf_counter()
        try:
            self.region = SharedOffloadRegion.create(cfg, log_step=self.say)
            layout = self.region.layout
            self.manager = self._build_index()
            socket_path = os.path.abspath(cfg.socket_path)
            control = ControlServer(self.manager, socket_path, control_options(cfg))
            control.start()  # cleans up after itself when it fails
            self.control = control
            self.region.header.set_socket_path(socket_path)  # found whatever a client's env
            if cfg.exporter.enabled:
                collector = TiercacheCollector(self.region, manager_stats=self.control.stats)
                self.exporter = start_exporter(cfg.exporter, collector)
        except BaseException:
            self.close()
            raise
        self.say(f"region {self.region.path}: {layout.describe()}")
        self.say(f"index: {layout.num_blocks} blocks, policy {cfg.index_policy}; "
                 f"control socket {cfg.socket_path}")
        if self.exporter is not None:
            self.say(f"metrics: http://{cfg.exporter.address}:{self.exporter.port}/metrics")
        self.say(f"ready in {time.perf_counter() - t0:.2f} s "
                 f"({format_bytes(layout.total_bytes)}); SIGTERM or Ctrl-C stops")

    def _build_index(self):
        """The index over the region, rebuilt from the region's ledger (READY blocks of a
        re-adopted region come back; a new region's ledger is empty)."""
        from tiercache.index.manager import OffloadingManager
        from tiercache.region.ledger import IndexLedger

        cfg = self.config
        manager = OffloadingManager(self.region.layout.num_blocks, policy=cfg.index_policy,
                                    enable_events=cfg.index_events,
                                    ledger=IndexLedger(self.region.ledger_array()))
        recovered = manager.stats().recovered_blocks
        if self.region.setup_times.adopted:
            self.say(f"index: {recovered} ready block(s) recovered from the region's ledger "
                     "(blocks being written and pins of the previous coordinator dropped)")
        return manager

    def serve_until(self, stop: threading.Event) -> None:
        stop.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors: dict[str, BaseException] = {}
        for name, close in (("exporter", self.exporter and self.exporter.close),
                            ("control", self.control and self.control.close),
                            # a scrape the exporter could not drain may still read the
                            # mapping: then unlink the region but keep it mapped
                            ("region", self.region and (
                                lambda: self.region.close(unmap="exporter" not in errors)))):
            if not close:
                continue
            try:
                close()
            except Exception as e:  # keep tearing down the rest; re-raised below
                log.exception("closing the %s failed", name)
                errors[name] = e
        if errors:
            raise next(iter(errors.values()))
        removed = ([f"region {self.region.path}"] if self.region else []) + (
            [f"socket {self.control.socket_path}"] if self.control else [])
        self.say(f"stopped; removed {' and '.join(removed)}" if removed else
                 "stopped; nothing to remove (this start created no region or socket)")
