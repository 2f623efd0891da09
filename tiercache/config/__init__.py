"""Configuration: a TOML file parsed into frozen, validated dataclasses.

Every section and key is listed in ``tiercache.config.toml._SCHEMA`` with its type;
anything else is a ``ConfigError`` that names the key, the value and what is allowed. See
the README's config reference (kept in step with this package by ``tests/test_config.py``).

* ``sections``: the instance name, ``KVGeometry``, ``RegionConfig``, ``ExporterConfig``;
* ``tiers``: ``DiskConfig``, ``ClusterConfig``;
* ``events``: ``EventsConfig`` (the node's KV event stream);
* ``model``: ``Config``, the whole;
* ``toml``: ``load_config`` / ``config_from_dict`` / ``config_to_toml`` / ``config_keys``.
"""

from __future__ import annotations

from tiercache.backend_kind import BackendKind
from tiercache.config.events import EventsConfig, HashFormat
from tiercache.config.model import Config
from tiercache.config.sections import (
    DTYPE_BYTES, INDEX_POLICIES, MAX_ATTACHMENTS_PER_RANK, MAX_TENSORS, MAX_ZERO_COPY_BYTES,
    ExporterConfig, KVGeometry, PinningPolicy, RegionConfig, check_name, host_port,
)
from tiercache.config.tiers import CLUSTER_BACKENDS, CLUSTER_PROTOCOLS, ClusterConfig, DiskConfig
from tiercache.config.toml import config_from_dict, config_keys, config_to_toml, load_config

__all__ = [
    "CLUSTER_BACKENDS", "CLUSTER_PROTOCOLS", "DTYPE_BYTES", "INDEX_POLICIES",
    "MAX_ATTACHMENTS_PER_RANK", "MAX_TENSORS", "MAX_ZERO_COPY_BYTES", "BackendKind",
    "ClusterConfig", "Config", "DiskConfig", "EventsConfig", "ExporterConfig", "HashFormat",
    "KVGeometry", "PinningPolicy",
    "RegionConfig", "check_name", "config_from_dict", "config_keys", "config_to_toml",
    "host_port", "load_config",
]
