"""The config sections of the tiers below host memory: ``[disk]`` and ``[cluster]``."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from tiercache.config.sections import host_port
from tiercache.errors import ConfigError


@dataclass(frozen=True)
class DiskConfig:
    """The optional disk tier (``[disk]``): its file lives in ``path`` (an existing
    directory on a local filesystem), ``capacity_bytes`` preallocated at start."""

    path: str
    capacity_bytes: int
    io_threads: int = 8
    low_watermark: float = 0.1  # demote while fewer host slots than this fraction are free
    direct_io: bool | None = None  # None: O_DIRECT where the filesystem and rows allow it
    retry_s: float = 10.0  # after I/O errors in a row, the tier stays down this long

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("disk.path = '': give a directory for the disk tier's file")
        # made absolute here; that it is a directory of ours is a start-up check of
        # `serve` (a config is written before the node's directory exists: config-for-vllm)
        object.__setattr__(self, "path", os.path.abspath(self.path))
        if self.capacity_bytes < 1:
            raise ConfigError(f"disk.capacity = {self.capacity_bytes}: must be > 0")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"disk.io_threads = {self.io_threads}: allowed 1..64")
        if not 0 < self.retry_s <= 3600:
            raise ConfigError(f"disk.retry_s = {self.retry_s}: allowed above 0 up to 3600 "
                              "(seconds)")
        if not 0 < self.low_watermark < 1:
            raise ConfigError(f"disk.low_watermark = {self.low_watermark}: allowed between 0 "
                              "and 1 (a fraction of the host slots)")

    def file_path(self, name: str) -> str:
        return os.path.join(self.path, f"tiercache-{name}.disk")


CLUSTER_BACKENDS = ("mooncake",)
CLUSTER_PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class ClusterConfig:
    """The optional cluster tier (``[cluster]``): a pool shared by the nodes of a cluster,
    on Mooncake Store (``mooncake_master`` at ``master``, its HTTP metadata server at
    ``metadata_server``). This node contributes ``segment_bytes`` of memory to the pool,
    served at ``local_hostname`` (``host`` or ``host:port``; a host alone: a free port).
    ``key_file`` is required: a pool is reachable by anyone on its network, and only the
    key tells the cluster's objects from anyone else's."""

    master: str
    metadata_server: str
    local_hostname: str
    # the cluster's shared key (a file of at least 32 random bytes, 0600, the service
    # user's): every pool object is signed and checked with it (tiers.cluster_key)
    key_file: str = ""
    backend: str = "mooncake"
    segment_bytes: int = 4 << 30
    # Mooncake's own transfer buffer: tiercache's blocks move zero-copy from the registered
    # region, not through it
    local_buffer_bytes: int = 16 << 20
    protocol: str = "tcp"
    rdma_devices: str = ""  # with protocol "rdma": the NICs, e.g. "mlx5_0,mlx5_1"
    replicas: int = 1  # copies of each object in the pool (on as many nodes' segments)
    publish_queue_blocks: int = 256  # blocks waiting to be published; past it: dropped
    publish_threads: int = 4  # batched puts in flight (Mooncake copies on one thread)
    promote_threads: int = 2  # batched gets in flight
    exists_ttl_s: float = 1.0  # how long a "the pool has / has not this block" answer is used
    exists_wait_s: float = 0.05  # a lookup answers "not yet" this long while the pool is asked
    retry_s: float = 5.0  # while the tier is down: probe the master this often (and log)
    # ask the pool whether it still holds each published block this often, no more: the
    # master leases (keeps from eviction) each object it is asked about for its
    # default_kv_lease_ttl (10 s in the pinned version); keep this well above that
    census_period_s: float = 120.0
    start_timeout_s: float = 10.0  # at start, wait this long for the master, then an error
    # at stop, wait this long for the tier's pool calls, and as long for Mooncake's close
    stop_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.backend not in CLUSTER_BACKENDS:
            raise ConfigError(f"cluster.backend = {self.backend!r}: allowed "
                              + ", ".join(repr(b) for b in CLUSTER_BACKENDS))
        host_port("cluster.master", self.master, need_port=True)
        url = self.metadata_server
        if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1]:
            raise ConfigError(f"cluster.metadata_server = {url!r}: give the master's HTTP "
                              "metadata URL, e.g. \"http://10.0.0.1:8080/metadata\"")
        if not self.key_file:
            raise ConfigError("cluster.key_file is missing: the nodes of a cluster sign and "
                              "check every pool object with a key they share; make one with "
                              "`head -c 32 /dev/urandom > KEY && chmod 600 KEY`, copy it to "
                              "every node and set cluster.key_file = \"KEY\"")
        object.__setattr__(self, "key_file", os.path.abspath(self.key_file))
        host, _ = host_port("cluster.local_hostname", self.local_hostname, need_port=False)
        if all(part.isdigit() for part in host.split(".")):  # digits and dots: an IPv4 address
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ConfigError(f"cluster.local_hostname = {self.local_hostname!r}: not an "
                                  "IPv4 address (four numbers 0..255); give this node's "
                                  "address as the other nodes reach it") from None
        if self.protocol not in CLUSTER_PROTOCOLS:
            raise ConfigError(f"cluster.protocol = {self.protocol!r}: allowed "
                              + ", ".join(repr(p) for p in CLUSTER_PROTOCOLS))
        if self.segment_bytes < 1 << 20:
            raise ConfigError(f"cluster.segment_size = {self.segment_bytes}: give at least "
                              "1 MiB (what this node contributes to the pool)")
        if self.local_buffer_bytes < 1 << 20:
            raise ConfigError(f"cluster.local_buffer_size = {self.local_buffer_bytes}: give "
                              "at least 1 MiB")
        if not 1 <= self.replicas <= 8:
            raise ConfigError(f"cluster.replicas = {self.replicas}: allowed 1..8")
        if not 1 <= self.publish_queue_blocks <= 1 << 20:
            raise ConfigError(f"cluster.publish_queue_blocks = {self.publish_queue_blocks}: "
                              "allowed 1..1048576")
        for key, value in (("publish_threads", self.publish_threads),
                           ("promote_threads", self.promote_threads)):
            if not 1 <= value <= 64:
                raise ConfigError(f"cluster.{key} = {value}: allowed 1..64")
        for key, value_s, top in (("exists_ttl_s", self.exists_ttl_s, 60),
                                  ("exists_wait_s", self.exists_wait_s, 60),
                                  ("retry_s", self.retry_s, 3600),
                                  ("census_period_s", self.census_period_s, 86400),
                                  ("start_timeout_s", self.start_timeout_s, 3600),
                                  ("stop_timeout_s", self.stop_timeout_s, 3600)):
            if not 0 < value_s <= top:
                raise ConfigError(f"cluster.{key} = {value_s}: allowed above 0 up to {top} "
                                  "(seconds)")
