"""``Config``: the whole validated configuration of one tiercache instance."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tiercache.backend_kind import BackendKind
from tiercache.config.events import EventsConfig
from tiercache.config.sections import (
    INDEX_POLICIES, MAX_ZERO_COPY_BYTES, ExporterConfig, KVGeometry, RegionConfig, check_name,
)
from tiercache.config.tiers import ClusterConfig, DiskConfig
from tiercache.errors import ConfigError


@dataclass(frozen=True)
class Config:
    name: str = "default"
    world_size: int = 1
    kv: KVGeometry = field(default_factory=lambda: KVGeometry(page_bytes=(32 << 10,) * 8))
    region: RegionConfig = field(default_factory=RegionConfig)
    backend: BackendKind = BackendKind.AUTO
    # staged moves a transfer of at most this many bytes zero-copy: one kernel between the
    # GPU pages and the pinned host rows, no DMA, no ring (only when pinned). 0 (never) by
    # default: it saves 1-10 us of GPU time per block but holds SMs for the PCIe time, and a
    # matmul beside it lost up to 15 % (docs/benchmarks.md, "Zero-copy small transfers")
    zero_copy_bytes: int = 0
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    control_socket: str = ""  # "" = derived from name, see socket_path; made absolute here
    index_policy: str = "lru"  # eviction policy of the cache index (tiercache.eviction registry)
    index_events: bool = False  # keep stored/removed events for take_events()
    index_session_grace_s: float = 5.0  # a gone client's reservations and pins live this long
    # a session that holds something and sends nothing (not even the client's heartbeat) for
    # this long is declared dead: a frozen engine loses its pins and reservations
    index_session_timeout_s: float = 30.0
    index_reservation_timeout_s: float = 600.0  # a store reserved and never completed expires
    index_max_session_share: float = 0.5  # of the cache one session may hold at once
    control_max_connections: int = 256
    control_max_connections_per_peer: int = 64  # one process's connections (SO_PEERCRED pid)
    control_hello_timeout_s: float = 5.0  # a connection without HELLO is closed after this
    control_idle_timeout_s: float = 300.0  # one holding nothing and sending nothing, after this
    control_max_detached_sessions_per_peer: int = 64  # closed sessions kept per process
    control_trusted_uid: int = -1  # a uid trusted on the control socket besides our own; -1: none
    disk: DiskConfig | None = None  # the disk tier; None: host memory only
    cluster: ClusterConfig | None = None  # the cluster tier; None: this node's tiers only
    events: EventsConfig | None = None  # the node's KV event stream; None: off

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.control_socket and not os.path.isabs(self.control_socket):
            # Resolved once, here: every process given this Config uses one path whatever
            # its working directory. A file's relative path was made absolute against the
            # file's directory before (load_config); one given in code is taken, as paths
            # in code are, against the current directory.
            object.__setattr__(self, "control_socket", os.path.abspath(self.control_socket))
        if not 1 <= self.world_size <= 64:
            raise ConfigError(f"instance.world_size = {self.world_size}: allowed 1..64")
        if not 0 <= self.zero_copy_bytes <= MAX_ZERO_COPY_BYTES:
            raise ConfigError(f"transfer.zero_copy_bytes = {self.zero_copy_bytes}: allowed 0 "
                              f"(never) .. {MAX_ZERO_COPY_BYTES >> 20} MiB")
        if self.index_policy not in INDEX_POLICIES:
            raise ConfigError(f"index.policy = {self.index_policy!r}: allowed "
                              f"{', '.join(map(repr, INDEX_POLICIES))}")
        if not 0 <= self.index_session_grace_s <= 3600:
            raise ConfigError(f"index.session_grace_s = {self.index_session_grace_s!r}: "
                              "allowed 0 .. 3600 (seconds)")
        if not 1 <= self.index_session_timeout_s <= 86400:
            raise ConfigError(f"index.session_timeout_s = {self.index_session_timeout_s!r}: "
                              "allowed 1 .. 86400 (seconds)")
        if not 1 <= self.index_reservation_timeout_s <= 86400:
            raise ConfigError(f"index.reservation_timeout_s = "
                              f"{self.index_reservation_timeout_s!r}: allowed 1 .. 86400 "
                              "(seconds)")
        if not 0 < self.index_max_session_share <= 1:
            raise ConfigError(f"index.max_session_share = {self.index_max_session_share!r}: "
                              "allowed above 0 up to 1 (a fraction of the cache's blocks)")
        if not 1 <= self.control_max_connections <= 65536:
            raise ConfigError(f"control.max_connections = {self.control_max_connections!r}: "
                              "allowed 1 .. 65536")
        for key, value, low, high in (
                ("max_connections_per_peer", self.control_max_connections_per_peer, 1, 65536),
                ("max_detached_sessions_per_peer", self.control_max_detached_sessions_per_peer,
                 0, 65536)):
            if not low <= value <= high:
                raise ConfigError(f"control.{key} = {value!r}: allowed {low} .. {high}")
        for key, value_s, high in (("hello_timeout_s", self.control_hello_timeout_s, 3600),
                                   ("idle_timeout_s", self.control_idle_timeout_s, 86400)):
            if not 0 < value_s <= high:
                raise ConfigError(f"control.{key} = {value_s!r}: allowed 0 .. {high} (seconds, "
                                  "not 0)")
        if self.control_trusted_uid < -1:
            raise ConfigError(f"control.trusted_uid = {self.control_trusted_uid!r}: a uid "
                              "(>= 0), or -1 for none")

    @property
    def shm_name(self) -> str:
        """The region's name in /dev/shm."""
        return f"tiercache-{self.name}"

    @property
    def socket_path(self) -> str:
        if self.control_socket:
            return self.control_socket
        # Without XDG_RUNTIME_DIR: a private per-user directory, never bare /tmp (where any
        # user could squat the name); the control server creates it 0700.
        runtime_dir = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/tiercache-{os.geteuid()}"
        return os.path.join(runtime_dir, f"tiercache-{self.name}.sock")
