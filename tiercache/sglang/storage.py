"""``TierCacheHiCacheStorage``: tiercache as SGLang 0.5.23's HiCache storage backend (L3).

::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "tiercache",
        "module_path": "tiercache.sglang", "class_name": "TierCacheHiCacheStorage",
        "interface_v1": 1, "tiercache_config": "/etc/tiercache/node.toml"}'

SGLang's dynamic factory builds it with ``cls(storage_config, {})`` on each TP rank's
scheduler process, then hands it the rank's host pool (``register_mem_pool_host``). The
rank is one tiercache attachment (``tiercache.sglang.region_link``) and three control
sessions, one per SGLang I/O thread (``tiercache.sglang.coordinator_link``). Pages are
copied between SGLang's host pool and the region's rows by native threads, fenced like
every other copy (``tiercache.transfer.host_transfer``).

The data path (up to 128 pages a call, from three threads at once):

* ``batch_exists(keys)`` (prefetch thread): ``lookup`` of the keys, the leading run of
  pages READY in host memory. Pages a lower tier holds are being promoted by that very
  lookup and count as misses this round: SGLang asks again (its prefetch retries) and finds
  them READY. Nothing is pinned: SGLang may drop a prefetch without ever loading it, and
  a pin taken here would leak until the session ended.
* ``batch_get_v1(keys, host_indices)`` (I/O thread): a lease on the keys (the leading run
  still READY, pinned), one fenced copy of that run into the pool's pages, release. A page
  evicted since ``batch_exists`` is a miss from there on (SGLang keeps the leading run).
* ``batch_set_v1(keys, host_indices)`` (backup thread): ``prepare_store`` (pages already
  stored or being written by another engine are skipped and reported done), one fenced
  copy into the reserved rows, ``complete_store`` (success or not). A key that comes twice
  in one call is stored once, from its first page, and each of its places answers as that
  page does (SGLang's own file backend answers a key it holds already True).
  Its session describes the namespace (``CoordinatorLink``): the node's event stream
  publishes the pages with the hashes SGLang's own KV events use.

Failure model: nothing raises into SGLang's threads. A coordinator that is down at attach
is not an error (hits start once it is up); down mid-run, calls answer at once with misses
and failed backups (counted) for ``tiercache_retry_s`` and then try again; sessions
reconnect by themselves. A geometry mismatch at attach raises (the engine does not start
on a misconfiguration), and so does an unsupported parallel layout at construction.

``clear()`` (``POST /hicache/storage-backend/clear``) does not wipe the node's cache: other
engines share it. It logs that and counts nothing away; to drop everything, restart the
coordinator without its region (``tiercache clean``). ``get_stats()`` returns SGLang's
``StorageMetrics``. The legacy ``get``/``set``/``batch_get``/``batch_set``/``exists`` exist
because SGLang's base class requires them; with ``interface_v1`` SGLang never calls them,
and they answer misses and failures.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, PoolName,
)
from sglang.srt.observability.metrics_collector import StorageMetrics
from sglang.srt.runtime_context import get_server_args

from tiercache.errors import ConfigError
from tiercache.results import LeaseResult, PrepareStoreOutput
from tiercache.loglimit import LogLimiter
from tiercache.sglang.coordinator_link import CallFailed, CoordinatorLink, Role
from tiercache.sglang.counters import BackendCounters, StorageSamples
from tiercache.sglang.geometry import PoolGeometry
from tiercache.sglang.namespace import Namespace, page_key, weights_fingerprint
from tiercache.sglang.pool_pages import PoolPages
from tiercache.sglang.region_link import RegionLink
from tiercache.sglang.settings import BackendSettings
from tiercache.specs import Direction
from tiercache.transfer.host_transfer import HostOutcome, HostTransfer

log = logging.getLogger(__name__)


def _check_supported(config: HiCacheStorageConfig) -> None:
    unsupported = []
    if config.pp_size > 1:
        unsupported.append(f"pipeline parallelism (pp_size {config.pp_size})")
    if config.attn_cp_size > 1:
        unsupported.append(f"attention context parallelism (attn_cp_size {config.attn_cp_size})")
    if config.should_split_heads:
        unsupported.append(f"heterogeneous TP (page_head with tp_lcm_size {config.tp_lcm_size})")
    if unsupported:
        raise ConfigError("tiercache's SGLang backend does not support " + ", ".join(unsupported)
                          + " yet (docs/sglang.md, 'Limits')")


def _weights(model_name: str | None) -> str:
    """The weights fingerprint: of SGLang's ``--model-path`` where the scheduler published
    its server args (``model_name`` is the served name, which may be any string), else of
    ``model_name`` itself where that is a directory."""
    try:
        path = get_server_args().model_path
    except Exception:  # not published (a controller built outside a scheduler): the name
        path = None
    return weights_fingerprint(path) or weights_fingerprint(model_name)


class TierCacheHiCacheStorage(HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        _check_supported(storage_config)
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.counters = BackendCounters()
        self._logs = LogLimiter(log, 10.0)
        self.link = CoordinatorLink(
            self.settings.config, name=(f"sglang tp{storage_config.tp_rank}/"
                                        f"{storage_config.tp_size} pid {os.getpid()}"),
            call_timeout_s=self.settings.call_timeout_s, retry_s=self.settings.retry_s)
        self.region: RegionLink | None = None
        self.pages: PoolPages | None = None
        self.namespace: Namespace | None = None
        self._digest = b""
        self._shard = 0
        self._samples: StorageSamples | None = None
        self._metrics = storage_config.enable_storage_metrics

    # ------------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the pool's pages and namespace; map the region if it is up (a geometry
        that does not fit raises); a coordinator that is down is not an error."""
        super().register_mem_pool_host(mem_pool_host)
        config = self.storage_config
        self.pages = PoolPages(mem_pool_host)
        kv_dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        geometry = PoolGeometry(layout=mem_pool_host.layout, kv_dtype=kv_dtype,
                                page_size=self.pages.page_size, blob_bytes=self.pages.blob_bytes,
                                tp_size=config.tp_size, tp_rank=config.tp_rank,
                                is_mla=config.is_mla_model)
        self.namespace = Namespace(
            model=config.model_name or "", weights=_weights(config.model_name),
            kv_dtype=kv_dtype, layout=geometry.layout, page_size=geometry.page_size,
            blob_bytes=geometry.blob_bytes, tp_size=1 if config.is_mla_model else config.tp_size,
            is_mla=config.is_mla_model, dcp_size=config.dcp_size, salt=self.settings.salt)
        self._digest = self.namespace.digest
        self.link.describe(self.namespace.description)  # the STORE session's, when it connects
        self._shard = config.dcp_rank if config.is_mla_model else config.tp_rank
        self._samples = StorageSamples(geometry.page_bytes)
        self.region = RegionLink(self.settings.config, geometry, retry_s=self.settings.retry_s,
                                 copy_threads=self.settings.copy_threads,
                                 prefault_threads=self.settings.prefault_threads)
        self.region.open()
        log.info("tiercache: SGLang TP rank %d/%d on coordinator %s, namespace %s%s",
                 config.tp_rank, config.tp_size, self.settings.config.name,
                 self.namespace.describe(),
                 "" if self.region.transfer() is not None else
                 " (its region is not there yet: lookups miss until it is)")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) != PoolName.KV.value:
            raise ConfigError(
                f"tiercache's SGLang backend stores KV pages only (interface_v1); this model "
                f"also has the host pool {str(host_pool_name)!r}, which needs SGLang's v2 "
                "interface (docs/sglang.md, 'Limits')")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        """Nothing to finalise: the region and sessions come up lazily."""

    # ------------------------------------------------------------------ data path
    def _keys(self, keys: list[str]) -> list[bytes]:
        return [page_key(self._digest, self._shard, k) for k in keys]

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            return self._exists(keys)
        except Exception as e:  # the contract: never raise into SGLang (counted, logged)
            return self._error("exists", e, 0)

    def _exists(self, keys: list[str]) -> int:
        if not keys or self.region is None or self.region.transfer() is None:
            self.counters.add(lookups=1, miss_pages=len(keys))
            return 0
        hits = self.link.call(Role.QUERY, lambda c: c.lookup(self._keys(keys)))
        if isinstance(hits, CallFailed):
            self._count_failed(hits, lookups=1, miss_pages=len(keys))
            return 0
        self.counters.add(lookups=1, hit_pages=hits, miss_pages=len(keys) - hits)
        return hits

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        try:
            return self._get(keys, host_indices)
        except Exception as e:
            return self._error("get", e, [False] * len(keys))

    def _get(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys or self.region is None or self.region.transfer() is None \
                or self.pages is None:
            self.counters.add(load_failed_pages=len(keys))
            return [False] * len(keys)
        tkeys = self._keys(keys)
        lease = self.link.call(Role.LOAD, lambda c: c.lease(tkeys))
        if isinstance(lease, CallFailed):
            self._count_failed(lease, load_failed_pages=len(keys))
            self.region.record_failure(Direction.CPU_TO_GPU)
            return [False] * len(keys)
        assert isinstance(lease, LeaseResult)
        loaded = 0
        start = time.perf_counter()
        try:
            spec = lease.spec
            if lease.num_hit and spec is not None:
                addrs = self.pages.addresses(host_indices, lease.num_hit)
                outcome = self._copy(spec.region_id, lambda t: t.load(spec, addrs))
                if outcome is not None and outcome.ok:
                    loaded = lease.num_hit
                elif outcome is not None:
                    self._logs.warn("load", "tiercache: load of %d page(s) refused: %s",
                                    lease.num_hit, outcome.reason)
        finally:
            if lease.num_hit:
                released = self.link.call(Role.LOAD, lambda c: c.release(tkeys[:lease.num_hit]))
                if isinstance(released, CallFailed):
                    self._logs.warn("release", "tiercache: release of %d pin(s) failed (%r); "
                                    "they are dropped when the session ends",
                                    lease.num_hit, released)
        self.counters.add(loaded_pages=loaded, load_failed_pages=len(keys) - loaded)
        if loaded and self._metrics and self._samples is not None:
            self._samples.prefetch(loaded, time.perf_counter() - start)
        return [True] * loaded + [False] * (len(keys) - loaded)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        try:
            return self._set(keys, host_indices)
        except Exception as e:
            return self._error("set", e, [False] * len(keys))

    def _set(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys or self.region is None or self.region.transfer() is None \
                or self.pages is None:
            self.counters.add(store_failed_pages=len(keys))
            return [False] * len(keys)
        tkeys = self._keys(keys)
        first: dict[bytes, int] = {}  # each key's first place (a key may come twice)
        for i, key in enumerate(tkeys):
            first.setdefault(key, i)
        unique = list(first)
        start = time.perf_counter()
        out = self.link.call(Role.STORE, lambda c: c.prepare_store(unique))
        if isinstance(out, CallFailed) or out is None:
            if isinstance(out, CallFailed):
                self._count_failed(out, store_failed_pages=len(keys))
            else:
                self.counters.add(store_failed_pages=len(keys))  # no room: counted by the index
            self.region.record_failure(Direction.GPU_TO_CPU)
            return [False] * len(keys)
        assert isinstance(out, PrepareStoreOutput)
        new = out.keys_to_store
        if not new:
            self.counters.add(already_stored_pages=len(keys))
            return [True] * len(keys)
        rows = np.array([first[k] for k in new], dtype=np.int64)
        ok = False
        try:
            addrs = self.pages.addresses(host_indices, len(keys))[rows]
            spec = out.store_spec
            outcome = self._copy(spec.region_id, lambda t: t.store(spec, addrs))
            ok = outcome is not None and outcome.ok
            if outcome is not None and not ok:
                self._logs.warn("store", "tiercache: backup of %d page(s) refused: %s",
                                len(new), outcome.reason)
        finally:
            done = self.link.call(Role.STORE, lambda c: c.complete_store(list(new), success=ok))
            if isinstance(done, CallFailed):
                ok = False
        failed = set() if ok else set(new)
        results = [k not in failed for k in tkeys]
        stored, refused = (len(new) if ok else 0), results.count(False)
        self.counters.add(stored_pages=stored, store_failed_pages=refused,
                          already_stored_pages=len(keys) - stored - refused)
        if stored and self._metrics and self._samples is not None:
            self._samples.backup(stored, time.perf_counter() - start)
        return results

    def _copy(self, region_id: int, move: Callable[[HostTransfer], HostOutcome]
              ) -> HostOutcome | None:
        """``move`` on the mapping of the spec's region (re-attached if the coordinator
        replaced the region), held for the copy; None (a miss) when none has its identity."""
        region = self.region
        transfer = region.acquire(region_id) if region is not None else None
        if region is None or transfer is None:
            self._logs.warn("region", "tiercache: a spec of region %#018x, which this process "
                            "does not map: a miss", region_id)
            return None
        try:
            return move(transfer)
        finally:
            region.release(transfer)

    def _count_failed(self, failed: CallFailed, **pages: int) -> None:
        self.counters.add(coordinator_down_calls=1 if failed.gone else 0,
                          errors=0 if failed.gone else 1, **pages)

    def _error(self, verb: str, error: Exception, answer: Any) -> Any:
        self.counters.add(errors=1)
        self._logs.warn(f"error-{verb}", "tiercache: %s failed, answered as a miss: %s: %s",
                        verb, type(error).__name__, error)
        return answer

    # ------------------------------------------------------------------ the rest of SGLang's API
    def clear(self) -> None:
        log.warning("tiercache: clear() leaves the node's shared cache as it is (other engines "
                    "use it); `tiercache clean` after stopping the coordinator drops it all")

    def get_stats(self) -> StorageMetrics | None:
        if self._samples is None:
            return None
        prefetch_pgs, backup_pgs, prefetch_bw, backup_bw = self._samples.take()
        return StorageMetrics(prefetch_pgs=prefetch_pgs, backup_pgs=backup_pgs,
                              prefetch_bandwidth=prefetch_bw, backup_bandwidth=backup_bw)

    def close(self) -> None:
        log.info("tiercache: SGLang TP rank %d detaches: %s", self.storage_config.tp_rank,
                 self.counters.snapshot())
        try:
            if self.region is not None:
                self.region.close()
        finally:
            self.link.close()

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[None]:
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return False

    def exists(self, key: str) -> bool:
        return False

