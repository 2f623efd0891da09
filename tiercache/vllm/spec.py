"""``TierCacheOffloadingSpec``: tiercache as vLLM 0.33's out-of-tree offloading back-end.

::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "TierCacheOffloadingSpec", "spec_module_path": "tiercache.vllm",
        "tiercache_config": "/etc/tiercache/node.toml"}}'

vLLM builds the spec in the scheduler process (``get_manager``) and in every worker
process (``get_worker``, once per rank). Extra-config keys (exactly one of the first two):

* ``tiercache_config``: the coordinator's TOML config (socket, instance name, geometry,
  transfer backend, pinning policy);
* ``tiercache_instance``: the coordinator's instance name (socket at its default path;
  geometry from the region; backend ``auto``);
* ``tiercache_namespace_salt`` (optional): extra identity for the key namespace, e.g. a
  weights revision when two deployments serve different weights under one model path;
* ``tiercache_ready_timeout_s`` (optional, default 0): how long to wait for the
  coordinator's region to be READY at start, instead of failing at once;
* ``tiercache_lookup_wait_ms`` (optional, default 50): the longest a lookup waits for the
  answer to its request's probe (sent after the step that first looked it up), so a hit
  loads in the next step however short steps are; past it the request is deferred again.

Start order: the coordinator first. At start the geometry vLLM announces is checked
against the region (scheduler: ranks, blocks per chunk, tokens per block, KV bytes per
block; each worker: every tensor's page bytes); a mismatch is one error naming both sides
and the config lines that would fit (``tiercache config-for-vllm`` prints a whole config).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingMetricMetadata, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from tiercache.config import Config, load_config
from tiercache.errors import ConfigError
from tiercache.region.layout import RegionLayout
from tiercache.region.shared import SharedOffloadRegion
from tiercache.vllm.geometry import EngineGeometry
from tiercache.vllm.engine_metrics import TierCacheInfo, metric_definitions
from tiercache.vllm.namespace import GroupShape, Namespace

if TYPE_CHECKING:  # each is imported by the process that builds it (see get_manager)
    from tiercache.link.client import Client
    from tiercache.vllm.manager import TierCacheManager
    from tiercache.vllm.worker import TierCacheWorker

log = logging.getLogger(__name__)

CONFIG_KEY = "tiercache_config"
INSTANCE_KEY = "tiercache_instance"
SALT_KEY = "tiercache_namespace_salt"
READY_TIMEOUT_KEY = "tiercache_ready_timeout_s"
LOOKUP_WAIT_KEY = "tiercache_lookup_wait_ms"
LOOKUP_WAIT_S = 0.05  # the longest a lookup waits for its request's probe to be answered


def lookup_wait_s(extra: Mapping[str, Any]) -> float:
    wait = extra.get(LOOKUP_WAIT_KEY, LOOKUP_WAIT_S * 1000)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 10_000:
        raise ConfigError(f"{LOOKUP_WAIT_KEY} = {wait!r}: expected milliseconds in 0..10000")
    return wait / 1000


@dataclass(frozen=True)
class CoordinatorTarget:
    """Which coordinator an engine uses, from ``kv_connector_extra_config``."""

    name: str
    config: Config | None  # None: named by instance only
    salt: str = ""
    ready_timeout_s: float = 0.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> CoordinatorTarget:
        path, name = extra.get(CONFIG_KEY), extra.get(INSTANCE_KEY)
        if (path is None) == (name is None):
            raise ConfigError(
                f"kv_connector_extra_config needs exactly one of {CONFIG_KEY!r} (the coordinator's "
                f"config file) and {INSTANCE_KEY!r} (its instance name); got "
                f"{CONFIG_KEY}={path!r}, {INSTANCE_KEY}={name!r}")
        salt = extra.get(SALT_KEY, "")
        if not isinstance(salt, str):
            raise ConfigError(f"{SALT_KEY} = {salt!r}: expected a string")
        timeout = extra.get(READY_TIMEOUT_KEY, 0.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ConfigError(f"{READY_TIMEOUT_KEY} = {timeout!r}: expected seconds >= 0")
        if path is not None:
            config = load_config(path)
            return cls(config.name, config, salt, float(timeout))
        if not isinstance(name, str):
            raise ConfigError(f"{INSTANCE_KEY} = {name!r}: expected the instance name")
        Config(name=name)  # validates the name
        return cls(name, None, salt, float(timeout))

    @property
    def attach_target(self) -> Config | str:
        return self.config if self.config is not None else self.name

    def client(self) -> Client:
        from tiercache.link.client import Client

        return Client(self.config if self.config is not None else Config(name=self.name))

    def region_layout(self) -> tuple[str, RegionLayout]:
        with SharedOffloadRegion.attach(self.name, timeout_s=self.ready_timeout_s) as region:
            return region.path, region.layout


def namespace_of(config: OffloadingConfig, salt: str = "") -> Namespace:
    parallel = config.parallel
    return Namespace(
        model=config.model.name, kv_dtype=config.model.dtype,
        kv_layout=config.kv_cache_layout or "", world_size=parallel.world_size,
        tp_size=parallel.tp_size, pp_size=parallel.pp_size, pcp_size=parallel.pcp_size,
        dcp_size=parallel.dcp_size, tokens_per_hash=config.cache.tokens_per_hash,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        groups=tuple(GroupShape(g.tokens_per_block, tuple(g.layer_names),
                                g.sliding_window_size_in_chunks) for g in config.groups),
        salt=salt)


class TierCacheOffloadingSpec(OffloadingSpec):
    """See the module docstring."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return TierCacheInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        if config.canonical_layout:
            raise ConfigError("canonical_layout = true is not supported by "
                              "TierCacheOffloadingSpec: tiercache stores each rank's own pages")
        tokens = {g.tokens_per_block for g in config.groups}
        if len(tokens) != 1:
            raise ConfigError(f"offloaded KV groups use {sorted(tokens)} tokens per block; "
                              "tiercache needs one block size across them")
        self.target = CoordinatorTarget.from_extra_config(self.extra_config)
        self.lookup_wait_s = lookup_wait_s(self.extra_config)
        self.namespace = namespace_of(config, self.target.salt)
        self.block_tokens = tokens.pop() // max(config.parallel.dcp_size, 1)
        self._manager: TierCacheManager | None = None
        self._worker: TierCacheWorker | None = None

    def engine_geometry(self) -> EngineGeometry:
        """What the scheduler knows: no tensors, only the total bytes per block."""
        return EngineGeometry(world_size=self.config.parallel.world_size,
                              block_size_factor=self.blocks_per_chunk,
                              block_tokens=self.block_tokens,
                              bytes_per_block=self.config.worker_kv_bytes_per_block or None)

    def get_manager(self) -> TierCacheManager:
        # vLLM asks the scheduler process for the manager and each worker process for a
        # worker: each imports its own side only (a worker never loads the lease book, its
        # flusher or the control client; a scheduler never the transfer path), as
        # tests/vllm/test_vllm_loads.py checks
        from tiercache.vllm.manager import connect

        if self._manager is None:
            self._manager = connect(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> TierCacheWorker:
        from tiercache.vllm.worker import TierCacheWorker, canonical_geometry

        if self._worker is None:
            geometry, groups = canonical_geometry(
                kv_caches, world_size=self.config.parallel.world_size,
                blocks_per_chunk=self.blocks_per_chunk, block_tokens=self.block_tokens)
            self._worker = TierCacheWorker.attach(
                self.target.attach_target, self.config.parallel.rank, kv_caches, geometry,
                groups, self.target.ready_timeout_s)
        return self._worker
