"""Configuration: a TOML file parsed into frozen, validated dataclasses.

Every section and key is listed in ``_SCHEMA`` with its type; anything else is a
``ConfigError`` that names the key, the value and what is allowed. See the README's
config reference (kept in step with this module by ``tests/test_config.py``).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from tiercache.backend_kind import BackendKind
from tiercache.errors import ConfigError
from tiercache.sizes import parse_size

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1, "uint8": 1}
INDEX_POLICIES = ("lru", "arc")  # kept in step with tiercache.index.policies by a test
MAX_ATTACHMENTS_PER_RANK = 16  # stats blocks per rank in the region header
MAX_TENSORS = 480  # what the region header can describe (see RegionHeader)
MAX_ZERO_COPY_BYTES = 64 << 20  # from 16 blocks of 2 MiB on the ring is as fast (or faster)


def check_name(name: object, key: str = "instance.name") -> str:
    """``name`` if it is a valid instance name, else a ``ConfigError`` naming ``key`` (the
    CLI's ``--name`` is held to the same rule: an empty name must not mean "every one")."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"{key} = {name!r}: 1-64 characters of letters, digits, '.', '_', "
                          "'-', starting with a letter or digit")
    return name


class PinningPolicy(Enum):
    """What a worker does when it cannot pin its slice."""

    REQUIRED = "required"  # raise: a quietly slower path is worse than no path
    ALLOW_UNPINNED = "allow_unpinned"  # run unpinned; state 'unpinned' is exported


@dataclass(frozen=True)
class KVGeometry:
    """One rank's KV cache as the region sees it.

    ``page_bytes[t]`` is the bytes of GPU block ``b`` in tensor ``t`` (one page); a CPU
    block holds ``block_size_factor`` consecutive GPU blocks, so its page in tensor t
    is ``block_size_factor * page_bytes[t]``.
    """

    page_bytes: tuple[int, ...]
    block_size_factor: int = 1
    block_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.page_bytes:
            raise ConfigError("kv: at least one tensor is needed (kv.num_tensors >= 1)")
        if len(self.page_bytes) > MAX_TENSORS:
            raise ConfigError(f"kv: {len(self.page_bytes)} tensors; at most {MAX_TENSORS} are allowed")
        for t, b in enumerate(self.page_bytes):
            if not isinstance(b, int) or b <= 0:
                raise ConfigError(f"kv.page_bytes[{t}] = {b!r}: must be a positive byte count")
        if self.block_size_factor < 1:
            raise ConfigError(f"kv.block_size_factor = {self.block_size_factor}: must be >= 1")
        if self.block_tokens < 1:
            raise ConfigError(f"kv.block_tokens = {self.block_tokens}: must be >= 1")

    @property
    def num_tensors(self) -> int:
        return len(self.page_bytes)

    @property
    def cpu_page_bytes(self) -> tuple[int, ...]:
        return tuple(b * self.block_size_factor for b in self.page_bytes)

    @property
    def cpu_block_bytes(self) -> int:
        """Useful bytes of one CPU block on one rank (no padding)."""
        return sum(self.cpu_page_bytes)


@dataclass(frozen=True)
class RegionConfig:
    capacity_bytes: int | None = 256 << 20  # all ranks together; or num_blocks
    num_blocks: int | None = None
    prefault_threads: int = 4
    pinning: PinningPolicy = PinningPolicy.ALLOW_UNPINNED
    check_host_memory: bool = True
    attachments_per_rank: int = 4  # worker processes that may attach one rank at once

    def __post_init__(self) -> None:
        if (self.capacity_bytes is None) == (self.num_blocks is None):
            raise ConfigError("region: set exactly one of region.capacity and region.num_blocks")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"region.num_blocks = {self.num_blocks}: must be >= 1")
        if not 1 <= self.prefault_threads <= 256:
            raise ConfigError(f"region.prefault_threads = {self.prefault_threads}: allowed 1..256")
        if not 1 <= self.attachments_per_rank <= MAX_ATTACHMENTS_PER_RANK:
            raise ConfigError(f"region.attachments_per_rank = {self.attachments_per_rank}: "
                              f"allowed 1..{MAX_ATTACHMENTS_PER_RANK}")


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
        path = os.path.abspath(self.path)
        object.__setattr__(self, "path", path)
        if not os.path.isdir(path):
            raise ConfigError(f"disk.path = {path!r}: not an existing directory")
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
    served at ``local_hostname`` (``host`` or ``host:port``; a host alone: a free port)."""

    master: str
    metadata_server: str
    local_hostname: str
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
        host_port("cluster.local_hostname", self.local_hostname, need_port=False)
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
        for key, value, top in (("exists_ttl_s", self.exists_ttl_s, 60),
                                ("exists_wait_s", self.exists_wait_s, 60),
                                ("retry_s", self.retry_s, 3600),
                                ("census_period_s", self.census_period_s, 86400),
                                ("start_timeout_s", self.start_timeout_s, 3600),
                                ("stop_timeout_s", self.stop_timeout_s, 3600)):
            if not 0 < value <= top:
                raise ConfigError(f"cluster.{key} = {value}: allowed above 0 up to {top} "
                                  "(seconds)")


def host_port(key: str, value: str, need_port: bool) -> tuple[str, int | None]:
    """``host:port`` (or a bare host when not ``need_port``) -> (host, port); a one-line
    error naming ``key`` otherwise."""
    host, sep, port = value.rpartition(":") if ":" in value else (value, "", "")
    want = "host:port" if need_port else "a host or host:port"
    if not host or any(c.isspace() or c == "/" for c in value) or (sep and not port):
        raise ConfigError(f"{key} = {value!r}: expected {want}")
    if not sep:
        if need_port:
            raise ConfigError(f"{key} = {value!r}: expected {want} (no port given)")
        return host, None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key} = {value!r}: the port must be 1..65535")
    return host, int(port)


@dataclass(frozen=True)
class ExporterConfig:
    address: str = "127.0.0.1"
    port: int = 9477  # 0 = any free port (tests)
    enabled: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"exporter.port = {self.port}: allowed 0..65535")


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
    index_policy: str = "lru"  # eviction policy of the cache index (tiercache.index.policies registry)
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
        for key, value, high in (("hello_timeout_s", self.control_hello_timeout_s, 3600),
                                 ("idle_timeout_s", self.control_idle_timeout_s, 86400)):
            if not 0 < value <= high:
                raise ConfigError(f"control.{key} = {value!r}: allowed 0 .. {high} (seconds, "
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


# ---------------------------------------------------------------- file parsing

_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "instance": {"name": str, "world_size": int},
    "region": {
        "capacity": (int, str), "num_blocks": int, "prefault_threads": int,
        "pinning": str, "check_host_memory": bool, "attachments_per_rank": int,
    },
    "kv": {
        "num_tensors": int, "page_bytes": (int, str, list),
        "num_layers": int, "kv_tensors_per_layer": int, "num_kv_heads": int, "head_dim": int,
        "dtype": str, "block_tokens": int, "block_size_factor": int,
    },
    "transfer": {"backend": str, "zero_copy_bytes": (int, str)},
    "exporter": {"address": str, "port": int, "enabled": bool},
    "control": {"socket": str, "max_connections": int, "max_connections_per_peer": int,
                "hello_timeout_s": (int, float), "idle_timeout_s": (int, float),
                "max_detached_sessions_per_peer": int, "trusted_uid": int},
    "disk": {"path": str, "capacity": (int, str), "io_threads": int,
             "low_watermark": (int, float), "direct_io": (bool, str),
             "retry_s": (int, float)},
    "cluster": {"backend": str, "master": str, "metadata_server": str, "local_hostname": str,
                "segment_size": (int, str), "local_buffer_size": (int, str),
                "protocol": str, "rdma_devices": str, "replicas": int,
                "publish_queue_blocks": int, "publish_threads": int,
                "promote_threads": int, "exists_ttl_s": (int, float),
                "exists_wait_s": (int, float),
                "retry_s": (int, float), "census_period_s": (int, float),
                "start_timeout_s": (int, float), "stop_timeout_s": (int, float)},
    "index": {"policy": str, "events": bool, "session_grace_s": (int, float),
              "session_timeout_s": (int, float), "reservation_timeout_s": (int, float),
              "max_session_share": (int, float)},
}
_TYPE_NAMES = {int: "an integer", str: "a string", bool: "true/false", list: "a list",
               float: "a number"}


def _check_types(raw: dict[str, Any]) -> None:
    for section, body in raw.items():
        if section not in _SCHEMA:
            raise ConfigError(f"unknown section [{section}]; allowed: {', '.join(_SCHEMA)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{section} must be a table ([{section}]), got {body!r}")
        allowed = _SCHEMA[section]
        for key, value in body.items():
            if key not in allowed:
                raise ConfigError(
                    f"unknown key {section}.{key}; allowed in [{section}]: {', '.join(allowed)}"
                )
            types = allowed[key] if isinstance(allowed[key], tuple) else (allowed[key],)
            bad_bool = isinstance(value, bool) and bool not in types
            if bad_bool or not isinstance(value, types):
                want = " or ".join(_TYPE_NAMES[t] for t in types)
                raise ConfigError(f"{section}.{key} = {value!r}: expected {want}")


def _enum(enum_type: type[Enum], value: str, key: str) -> Any:
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_type)
        raise ConfigError(f"{key} = {value!r}: allowed {allowed}") from None


def _disk_from(raw: dict[str, Any], base_dir) -> DiskConfig:
    for key in ("path", "capacity"):
        if key not in raw:
            raise ConfigError(f"disk.{key} is missing: the disk tier needs disk.path (a "
                              "directory) and disk.capacity (a size, e.g. \"64GiB\")")
    direct = raw.get("direct_io", "auto")
    if direct not in (True, False, "auto"):
        raise ConfigError(f"disk.direct_io = {direct!r}: allowed true, false, \"auto\"")
    path = raw["path"]
    if base_dir is not None and path:
        path = os.path.join(base_dir, path)
    return DiskConfig(path=path, capacity_bytes=parse_size(raw["capacity"], "disk.capacity"),
                      direct_io=None if direct == "auto" else direct,
                      **_present(raw, {"io_threads": "io_threads",
                                       "low_watermark": "low_watermark",
                                       "retry_s": "retry_s"}))


def _cluster_from(raw: dict[str, Any]) -> ClusterConfig:
    for key in ("master", "metadata_server", "local_hostname"):
        if key not in raw:
            raise ConfigError(f"cluster.{key} is missing: the cluster tier needs cluster.master "
                              "(host:port of mooncake_master), cluster.metadata_server (its "
                              "HTTP metadata URL) and cluster.local_hostname (this node's "
                              "address as the other nodes reach it)")
    sizes = {}
    for key, field_name in (("segment_size", "segment_bytes"),
                            ("local_buffer_size", "local_buffer_bytes")):
        if key in raw:
            sizes[field_name] = parse_size(raw[key], f"cluster.{key}")
    return ClusterConfig(**sizes, **_present(raw, {
        "master": "master", "metadata_server": "metadata_server",
        "local_hostname": "local_hostname", "backend": "backend", "protocol": "protocol",
        "rdma_devices": "rdma_devices", "replicas": "replicas",
        "publish_queue_blocks": "publish_queue_blocks", "publish_threads": "publish_threads",
        "promote_threads": "promote_threads", "exists_ttl_s": "exists_ttl_s",
        "exists_wait_s": "exists_wait_s", "retry_s": "retry_s",
        "census_period_s": "census_period_s",
        "start_timeout_s": "start_timeout_s", "stop_timeout_s": "stop_timeout_s"}))


def _kv_from(raw: dict[str, Any]) -> KVGeometry:
    explicit = "page_bytes" in raw
    shaped = any(k in raw for k in ("num_layers", "num_kv_heads", "head_dim", "dtype"))
    if explicit and shaped:
        raise ConfigError("kv: give either page_bytes (+ num_tensors) or the model shape "
                          "(num_layers, num_kv_heads, head_dim, dtype), not both")
    if "num_tensors" in raw and raw["num_tensors"] < 1:
        raise ConfigError(f"kv.num_tensors = {raw['num_tensors']}: must be >= 1")
    if explicit and "kv_tensors_per_layer" in raw:
        raise ConfigError(f"kv.kv_tensors_per_layer = {raw['kv_tensors_per_layer']} belongs to the "
                          "model shape; with kv.page_bytes give kv.num_tensors instead")
    if not explicit and "num_tensors" in raw:
        raise ConfigError(f"kv.num_tensors = {raw['num_tensors']} goes with kv.page_bytes; with the "
                          "model shape there are num_layers x kv_tensors_per_layer tensors")
    block_tokens = raw.get("block_tokens", KVGeometry.block_tokens)
    factor = raw.get("block_size_factor", KVGeometry.block_size_factor)
    if explicit:
        value = raw["page_bytes"]
        if isinstance(value, list):
            if "num_tensors" in raw and raw["num_tensors"] != len(value):
                raise ConfigError(f"kv.num_tensors = {raw['num_tensors']} but kv.page_bytes lists "
                                  f"{len(value)} sizes")
            pages = tuple(parse_size(v, f"kv.page_bytes[{i}]") for i, v in enumerate(value))
        else:
            pages = (parse_size(value, "kv.page_bytes"),) * raw.get("num_tensors", 1)
    else:
        missing = [k for k in ("num_layers", "num_kv_heads", "head_dim", "dtype") if k not in raw]
        if missing:
            raise ConfigError(f"kv: missing {', '.join('kv.' + k for k in missing)} "
                              "(or give kv.page_bytes instead)")
        dtype = raw["dtype"]
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"kv.dtype = {dtype!r}: allowed {', '.join(DTYPE_BYTES)}")
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            if raw[key] < 1:
                raise ConfigError(f"kv.{key} = {raw[key]}: must be >= 1")
        per_layer = raw.get("kv_tensors_per_layer", 2)
        if per_layer not in (1, 2):
            raise ConfigError(f"kv.kv_tensors_per_layer = {per_layer}: allowed 1 (fused K/V or MLA) "
                              "or 2 (K and V apart)")
        page = block_tokens * raw["num_kv_heads"] * raw["head_dim"] * DTYPE_BYTES[dtype]
        pages = (page,) * (raw["num_layers"] * per_layer)
    return KVGeometry(page_bytes=pages, block_size_factor=factor, block_tokens=block_tokens)


def _present(body: dict[str, Any], keys: dict[str, str]) -> dict[str, Any]:
    """``{field: body[key]}`` for the keys the file sets: the dataclasses hold the defaults."""
    return {field: body[key] for key, field in keys.items() if key in body}


def config_from_dict(raw: dict[str, Any], base_dir: str | os.PathLike[str] | None = None,
                     ) -> Config:
    """Build a Config from the TOML document's tables (validated). A relative
    ``control.socket`` is taken against ``base_dir`` (the config file's directory), or,
    without one, against the current directory."""
    _check_types(raw)
    inst, reg = raw.get("instance", {}), raw.get("region", {})
    if "capacity" in reg and "num_blocks" in reg:
        raise ConfigError("region: set either region.capacity or region.num_blocks, not both")
    region = _present(reg, {"num_blocks": "num_blocks", "prefault_threads": "prefault_threads",
                            "check_host_memory": "check_host_memory",
                            "attachments_per_rank": "attachments_per_rank"})
    if "capacity" in reg:
        region["capacity_bytes"] = parse_size(reg["capacity"], "region.capacity")
    elif "num_blocks" in reg:
        region["capacity_bytes"] = None
    if "pinning" in reg:
        region["pinning"] = _enum(PinningPolicy, reg["pinning"], "region.pinning")
    kwargs: dict[str, Any] = {
        "region": RegionConfig(**region),
        "exporter": ExporterConfig(**_present(raw.get("exporter", {}), {
            "address": "address", "port": "port", "enabled": "enabled"})),
        **_present(inst, {"name": "name", "world_size": "world_size"}),
        **_present(raw.get("control", {}), {
            "socket": "control_socket", "max_connections": "control_max_connections",
            "max_connections_per_peer": "control_max_connections_per_peer",
            "hello_timeout_s": "control_hello_timeout_s",
            "idle_timeout_s": "control_idle_timeout_s",
            "max_detached_sessions_per_peer": "control_max_detached_sessions_per_peer",
            "trusted_uid": "control_trusted_uid"}),
        **_present(raw.get("index", {}), {
            "policy": "index_policy", "events": "index_events",
            "session_grace_s": "index_session_grace_s",
            "session_timeout_s": "index_session_timeout_s",
            "reservation_timeout_s": "index_reservation_timeout_s",
            "max_session_share": "index_max_session_share"}),
    }
    if base_dir is not None and kwargs.get("control_socket"):
        kwargs["control_socket"] = os.path.abspath(os.path.join(base_dir,
                                                                kwargs["control_socket"]))
    if "disk" in raw:
        kwargs["disk"] = _disk_from(raw["disk"], base_dir)
    if "cluster" in raw:
        kwargs["cluster"] = _cluster_from(raw["cluster"])
    if "backend" in raw.get("transfer", {}):
        kwargs["backend"] = BackendKind.parse(raw["transfer"]["backend"], "transfer.backend")
    if "zero_copy_bytes" in raw.get("transfer", {}):
        kwargs["zero_copy_bytes"] = parse_size(raw["transfer"]["zero_copy_bytes"],
                                               "transfer.zero_copy_bytes")
    if "kv" in raw:
        kwargs["kv"] = _kv_from(raw["kv"])
    return Config(**kwargs)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML config file. Paths in it (``control.socket``) are relative
    to the file's directory, so every process that loads it agrees, wherever it runs."""
    if not os.fspath(path):  # Path("") is ".", which would read as "a directory"
        raise ConfigError("config file '': an empty path; give a TOML file")
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(p)!r} is a directory; give a TOML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}: "
                          f"{e.reason}); give a TOML file") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from e
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    return config_from_dict(raw, base_dir=p.parent)


def config_to_toml(config: Config) -> str:
    """The TOML text that ``load_config`` reads back as an equal Config."""

    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v) if isinstance(v, (int, float)) else '"' + str(v).replace('"', '\\"') + '"'

    reg, kv, exp = config.region, config.kv, config.exporter
    size = {"num_blocks": reg.num_blocks} if reg.num_blocks is not None else {
        "capacity": reg.capacity_bytes}
    tables = {
        "instance": {"name": config.name, "world_size": config.world_size},
        "region": {**size, "prefault_threads": reg.prefault_threads, "pinning": reg.pinning.value,
                   "check_host_memory": reg.check_host_memory,
                   "attachments_per_rank": reg.attachments_per_rank},
        "kv": {"page_bytes": list(kv.page_bytes), "block_size_factor": kv.block_size_factor,
               "block_tokens": kv.block_tokens},
        "transfer": {"backend": config.backend.label,
                     "zero_copy_bytes": config.zero_copy_bytes},
        "exporter": {"address": exp.address, "port": exp.port, "enabled": exp.enabled},
        "control": {"socket": config.control_socket,
                    "max_connections": config.control_max_connections,
                    "max_connections_per_peer": config.control_max_connections_per_peer,
                    "hello_timeout_s": config.control_hello_timeout_s,
                    "idle_timeout_s": config.control_idle_timeout_s,
                    "max_detached_sessions_per_peer":
                        config.control_max_detached_sessions_per_peer,
                    "trusted_uid": config.control_trusted_uid},
        "index": {"policy": config.index_policy, "events": config.index_events,
                  "session_grace_s": config.index_session_grace_s,
                  "session_timeout_s": config.index_session_timeout_s,
                  "reservation_timeout_s": config.index_reservation_timeout_s,
                  "max_session_share": config.index_max_session_share},
    }
    if config.disk is not None:
        d = config.disk
        tables["disk"] = {"path": d.path, "capacity": d.capacity_bytes,
                          "io_threads": d.io_threads, "low_watermark": d.low_watermark,
                          "retry_s": d.retry_s,
                          "direct_io": "auto" if d.direct_io is None else d.direct_io}
    if config.cluster is not None:
        c = config.cluster
        tables["cluster"] = {
            "backend": c.backend, "master": c.master, "metadata_server": c.metadata_server,
            "local_hostname": c.local_hostname, "segment_size": c.segment_bytes,
            "local_buffer_size": c.local_buffer_bytes, "protocol": c.protocol,
            "rdma_devices": c.rdma_devices, "replicas": c.replicas,
            "publish_queue_blocks": c.publish_queue_blocks,
            "publish_threads": c.publish_threads, "promote_threads": c.promote_threads,
            "exists_ttl_s": c.exists_ttl_s,
            "exists_wait_s": c.exists_wait_s, "retry_s": c.retry_s,
            "census_period_s": c.census_period_s, "start_timeout_s": c.start_timeout_s, "stop_timeout_s": c.stop_timeout_s}
    return "\n".join(
        f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in body.items())
        for name, body in tables.items()
    )


def config_keys() -> dict[str, tuple[str, ...]]:
    """Every allowed ``section -> keys`` (the README's reference is checked against it)."""
    return {section: tuple(keys) for section, keys in _SCHEMA.items()}


__all__ = [
    "BackendKind", "ClusterConfig", "Config", "ExporterConfig", "KVGeometry", "PinningPolicy", "RegionConfig",
    "check_name", "config_from_dict", "config_keys", "config_to_toml", "load_config",
]
