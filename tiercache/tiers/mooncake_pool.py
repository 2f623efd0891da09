"""The cluster pool on Mooncake Store: the one module of tiercache that imports ``mooncake``.

Pinned to ``mooncake-transfer-engine-non-cuda`` ``MOONCAKE_VERSION`` (its 0.3.x API churns:
a new version is a change of this file alone). The cluster tier speaks only this class's
verbs, each batched over object names and each answering per name, never raising for a
pool that is down (a negative code per name, as Mooncake answers):

* ``exists(names)``  -> per name: 1 present, 0 absent, < 0 an error
* ``get_into(names, parts)`` -> per name: bytes read into the name's buffers, or < 0
* ``put_from(names, parts)`` -> per name: 0 stored, or < 0
* ``register(address, num_bytes)``: memory the calls read and write (the tier's staging
  areas, never the region: Mooncake lists every registered buffer in the metadata server,
  where any peer finds it and may read and write it); ``parts`` are
  ``[(address, num_bytes), ...]`` inside it
* ``close(timeout_s)``: unmounts this node's segment (its objects leave the pool) and
  disconnects; bounded (a master that does not answer holds it for Mooncake's RPC timeout).

What Mooncake does that the tier relies on, as measured with this version (loopback TCP):
calls to a master that is gone answer ``RPC_FAIL`` (-900) at once; the client reconnects
and re-mounts its segment by itself when a master is back (about 1.5 s); the Python
binding releases the GIL during transfers. ``setup`` against an absent master retries for
about 90 s, and against an absent metadata server logs hundreds of lines before it fails,
so ``open`` first waits (``start_timeout_s``) for the master's port and the metadata
server's to accept; a ``local_hostname`` that does not resolve and ``protocol = "rdma"``
on a host without RDMA devices (``/sys/class/infiniband``) are refused before it too, as
Mooncake itself would start on them and fail every transfer.
A master that accepts and never answers (SIGSTOP, a black-holed network) holds every call,
``close`` included, for Mooncake's RPC timeout (``MC_RPC_TIMEOUT_MS``, 30 s by default),
then the call answers -901 (per name). A process whose Mooncake client is still in a call
at exit hangs or aborts in Mooncake's teardown (observed): ``tiercache serve`` then ends
with ``os._exit`` (``Coordinator.abandoned``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence

from tiercache.config import ClusterConfig, host_port
from tiercache.errors import ConfigError, TierError

MOONCAKE_VERSION = "0.3.13.post1"
RPC_FAIL = -900  # Mooncake's error code for a master it cannot reach
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706  # asked about (exists, get) within the master's default_kv_lease_ttl
REPLICA_IS_NOT_READY = -703
# A get's per-name answers given before any transfer was started (the master said the
# object or its replica is not there): nothing can land later. Every other error may
# come from a transfer Mooncake stopped waiting for (TRANSFER_FAIL after its timeout)
# while it still runs: it lands in the caller's staging area, which is then held out of
# use (``cluster_transfer``), never in a host slot.
STAGING_HELD = -10001  # tiercache's own: the caller's staging area is held, nothing moved
NOTHING_MOVED = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, STAGING_HELD})
RDMA_DEVICES_DIR = "/sys/class/infiniband"
Parts = Sequence[tuple[int, int]]  # (address, num_bytes) of one object's buffers, in order


def master_reachable(address: str, timeout_s: float, key: str = "cluster.master") -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s``."""
    host, port = host_port(key, address, need_port=True)
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return True
    except OSError:
        return False


def metadata_address(config: ClusterConfig) -> str:
    """``host:port`` of ``cluster.metadata_server`` (its scheme's port when none is given)."""
    scheme, rest = config.metadata_server.split("://", 1)
    hostport = rest.split("/", 1)[0]
    has_port = "]:" in hostport if hostport.startswith("[") else ":" in hostport
    return hostport if has_port else f"{hostport}:{443 if scheme == 'https' else 80}"


def check_host(config: ClusterConfig) -> None:
    """Refuse, in one line, what Mooncake would start on and never transfer with: a
    ``local_hostname`` that does not resolve, RDMA without devices."""
    host, _ = host_port("cluster.local_hostname", config.local_hostname, need_port=False)
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"cluster.local_hostname = {config.local_hostname!r}: does not "
                          f"resolve to an address ({e}); give this node's address as the "
                          "other nodes reach it") from None
    if config.protocol != "rdma":
        return
    try:
        present = sorted(os.listdir(RDMA_DEVICES_DIR))
    except OSError:
        present = []
    wanted = [d.strip() for d in config.rdma_devices.split(",") if d.strip()]
    missing = [d for d in wanted if d not in present]
    if not present or missing:
        raise ConfigError("cluster.protocol = 'rdma', but this host has "
                          + (f"no RDMA device {', '.join(missing)} (it has "
                             f"{', '.join(present) or 'none'})" if missing else
                             f"no RDMA device ({RDMA_DEVICES_DIR} is empty or missing)")
                          + "; use protocol = \"tcp\" or name devices this host has in "
                          "cluster.rdma_devices")


class MooncakePool:
    """One Mooncake Store client: this node's segment of ``config.segment_bytes`` mounted in
    the pool of the master at ``config.master``. Thread-safe (Mooncake's client is)."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self._store = None
        self._registered: list[int] = []
        self._replicate = None

    def open(self) -> None:
        """Connect and mount this node's segment. Raises ``ConfigError`` (one line) when the
        master does not answer within ``start_timeout_s`` or Mooncake refuses the setup."""
        cfg = self.config
        check_host(cfg)
        deadline = time.monotonic() + cfg.start_timeout_s
        for key, address, what in (("cluster.master", cfg.master, "no mooncake_master"),
                                   ("cluster.metadata_server", metadata_address(cfg),
                                    "no metadata server")):
            while not master_reachable(address, min(1.0, cfg.start_timeout_s), key):
                if time.monotonic() >= deadline:
                    shown = cfg.master if key == "cluster.master" else cfg.metadata_server
                    raise ConfigError(f"{key} = {shown!r}: {what} answers there (waited "
                                      f"{cfg.start_timeout_s:g} s, cluster.start_timeout_s)")
                time.sleep(0.1)
        # Mooncake logs through glog; INFO and WARNING lines of every call would flood the
        # coordinator's log (the operator's own GLOG_minloglevel wins).
        os.environ.setdefault("GLOG_minloglevel", "2")
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise ConfigError(f"cluster.backend = 'mooncake': the mooncake package is not "
                              f"installed ({e}); pip install "
                              f"mooncake-transfer-engine-non-cuda=={MOONCAKE_VERSION}") from e
        store = MooncakeDistributedStore()
        code = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.segment_bytes,
                           cfg.local_buffer_bytes, cfg.protocol, cfg.rdma_devices, cfg.master)
        if code != 0:
            store.close()
            raise ConfigError(
                f"cluster: Mooncake refused the setup (code {code}) with master {cfg.master}, "
                f"metadata server {cfg.metadata_server}, local_hostname "
                f"{cfg.local_hostname}, segment_size {cfg.segment_bytes}")
        replicate = ReplicateConfig()
        replicate.replica_num = cfg.replicas
        # A node's objects live in the segment it contributes (and die with it): its own
        # blocks never cost another node's memory, and a dead node takes only its own.
        replicate.preferred_segment = store.get_hostname()
        self._store, self._replicate = store, replicate

    @property
    def hostname(self) -> str:
        """Where this node's segment is served (``host:port``, the port Mooncake picked)."""
        return self._require().get_hostname()

    def register(self, address: int, num_bytes: int) -> None:
        code = self._require().register_buffer(address, num_bytes)
        if code != 0:
            raise TierError(f"cluster: Mooncake could not register {num_bytes} bytes at "
                            f"{address:#x} for zero-copy transfers (code {code})")
        self._registered.append(address)

    def exists(self, names: Sequence[str]) -> list[int]:
        if not names:
            return []
        return self._call(lambda s: s.batch_is_exist(list(names)), len(names))

    def get_into(self, names: Sequence[str], parts: Sequence[Parts]) -> list[int]:
        if not names:
            return []
        ptrs = [[a for a, _ in p] for p in parts]
        sizes = [[n for _, n in p] for p in parts]
        return self._call(lambda s: s.batch_get_into_multi_buffers(list(names), ptrs, sizes),
                          len(names))

    def put_from(self, names: Sequence[str], parts: Sequence[Parts]) -> list[int]:
        if not names:
            return []
        ptrs = [[a for a, _ in p] for p in parts]
        sizes = [[n for _, n in p] for p in parts]
        return self._call(lambda s: s.batch_put_from_multi_buffers(
            list(names), ptrs, sizes, self._replicate), len(names))

    def remove(self, names: Sequence[str]) -> list[int]:
        if not names:
            return []
        return self._call(lambda s: s.batch_remove(list(names)), len(names))

    def close(self, timeout_s: float | None = None) -> bool:
        """Unregister the buffers, unmount the segment and disconnect; whether that ended.
        With ``timeout_s`` it runs on a daemon thread waited for that long: a master that
        does not answer leaves it there (abandoned, False; the client must not be used
        again, and the process should end without Mooncake's teardown)."""
        store, self._store = self._store, None
        if store is None:
            return True
        registered, self._registered = self._registered, []

        def close() -> None:
            for address in registered:
                store.unregister_buffer(address)
            store.close()
        if timeout_s is None:
            close()
            return True
        closing = threading.Thread(target=close, daemon=True, name="tiercache-mooncake-close")
        closing.start()
        closing.join(timeout_s)
        return not closing.is_alive()

    def _call(self, call, count: int) -> list[int]:
        """A batched call's per-name codes; a call the binding fails with ``RuntimeError``
        answers ``RPC_FAIL`` for every name (the tier counts it, logs it and marks itself
        down, as for a master that is gone)."""
        try:
            codes = call(self._require())
        except RuntimeError:
            return [RPC_FAIL] * count
        if len(codes) != count:
            raise TierError(f"cluster: Mooncake answered {len(codes)} codes for {count} names")
        return [int(c) for c in codes]

    def _require(self):
        if self._store is None:
            raise TierError("cluster: the Mooncake client is not open (open() it first)")
        return self._store
