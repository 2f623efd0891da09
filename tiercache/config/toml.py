"""The config file: TOML parsed into ``Config`` (every section and key is listed in
``_SCHEMA`` with its type; anything else is a ``ConfigError`` that names the key, the value
and what is allowed), and ``Config`` written back as TOML."""

from __future__ import annotations

import json
import os
import tomllib
from enum import Enum
from pathlib import Path
from typing import Any

from tiercache.backend_kind import BackendKind
from tiercache.config.events import EventsConfig, HashFormat
from tiercache.config.model import Config
from tiercache.config.sections import (
    DTYPE_BYTES, ExporterConfig, KVGeometry, PinningPolicy, RegionConfig,
)
from tiercache.config.tiers import ClusterConfig, DiskConfig
from tiercache.errors import ConfigError
from tiercache.sizes import parse_size, size_text


_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "instance": {"name": str, "world_size": int},
    "region": {
        "capacity": (int, str), "num_blocks": int, "prefault_threads": int,
        "pinning": str, "check_host_memory": bool, "attachments_per_rank": int,
        "numa_placement": bool,
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
                "key_file": str,
                "segment_size": (int, str), "local_buffer_size": (int, str),
                "protocol": str, "rdma_devices": str, "replicas": int,
                "publish_queue_blocks": int, "publish_threads": int,
                "promote_threads": int, "exists_ttl_s": (int, float),
                "exists_wait_s": (int, float),
                "retry_s": (int, float), "census_period_s": (int, float),
                "start_timeout_s": (int, float), "stop_timeout_s": (int, float)},
    "events": {"endpoint": str, "replay_endpoint": str, "topic": str, "hash_format": str,
               "replay_batches": int, "hwm": int, "queue_keys": int,
               "batch_interval_s": (int, float), "max_peers": int,
               "peer_timeout_s": (int, float)},
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
            kind = allowed[key]
            types = kind if isinstance(kind, tuple) else (kind,)
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


def _disk_from(raw: dict[str, Any], base_dir: str | os.PathLike[str] | None) -> DiskConfig:
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


def _cluster_from(raw: dict[str, Any], base_dir: str | os.PathLike[str] | None,
                  ) -> ClusterConfig:
    for key in ("master", "metadata_server", "local_hostname"):
        if key not in raw:
            raise ConfigError(f"cluster.{key} is missing: the cluster tier needs cluster.master "
                              "(host:port of mooncake_master), cluster.metadata_server (its "
                              "HTTP metadata URL) and cluster.local_hostname (this node's "
                              "address as the other nodes reach it)")
    given: dict[str, Any] = {}  # values taken apart from the file's own: sizes, paths
    for key, field_name in (("segment_size", "segment_bytes"),
                            ("local_buffer_size", "local_buffer_bytes")):
        if key in raw:
            given[field_name] = parse_size(raw[key], f"cluster.{key}")
    if base_dir is not None and raw.get("key_file"):
        given["key_file"] = os.path.join(base_dir, raw["key_file"])
    return ClusterConfig(**{**_present(raw, {
        "key_file": "key_file", "master": "master", "metadata_server": "metadata_server",
        "local_hostname": "local_hostname", "backend": "backend", "protocol": "protocol",
        "rdma_devices": "rdma_devices", "replicas": "replicas",
        "publish_queue_blocks": "publish_queue_blocks", "publish_threads": "publish_threads",
        "promote_threads": "promote_threads", "exists_ttl_s": "exists_ttl_s",
        "exists_wait_s": "exists_wait_s", "retry_s": "retry_s",
        "census_period_s": "census_period_s",
        "start_timeout_s": "start_timeout_s", "stop_timeout_s": "stop_timeout_s"}), **given})


def _events_from(raw: dict[str, Any]) -> EventsConfig:
    if "endpoint" not in raw:
        raise ConfigError("events.endpoint is missing: the event stream needs the ZMQ PUB "
                          "address it binds, e.g. \"tcp://127.0.0.1:5557\"")
    fields = _present(raw, {"endpoint": "endpoint", "replay_endpoint": "replay_endpoint",
                            "topic": "topic", "replay_batches": "replay_batches", "hwm": "hwm",
                            "queue_keys": "queue_keys", "batch_interval_s": "batch_interval_s",
                            "max_peers": "max_peers", "peer_timeout_s": "peer_timeout_s"})
    if "hash_format" in raw:
        fields["hash_format"] = _enum(HashFormat, raw["hash_format"], "events.hash_format")
    return EventsConfig(**fields)


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
        raise ConfigError(f"kv.num_tensors = {raw['num_tensors']} goes with kv.page_bytes; "
                          "with the "
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
            raise ConfigError(f"kv.kv_tensors_per_layer = {per_layer}: allowed 1 (fused K/V or "
                              "MLA) "
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
                            "attachments_per_rank": "attachments_per_rank",
                            "numa_placement": "numa_placement"})
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
        kwargs["cluster"] = _cluster_from(raw["cluster"], base_dir)
    if "events" in raw:
        kwargs["events"] = _events_from(raw["events"])
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
        # a JSON string is a TOML basic string (the same escapes: quotes, backslashes, \uXXXX)
        return str(v) if isinstance(v, (int, float)) else json.dumps(str(v))

    reg, kv, exp = config.region, config.kv, config.exporter
    size = {"num_blocks": reg.num_blocks} if reg.num_blocks is not None else {
        "capacity": size_text(reg.capacity_bytes) if reg.capacity_bytes else reg.capacity_bytes}
    tables: dict[str, dict[str, Any]] = {
        "instance": {"name": config.name, "world_size": config.world_size},
        "region": {**size, "prefault_threads": reg.prefault_threads, "pinning": reg.pinning.value,
                   "check_host_memory": reg.check_host_memory,
                   "attachments_per_rank": reg.attachments_per_rank,
                   "numa_placement": reg.numa_placement},
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
        tables["disk"] = {"path": d.path, "capacity": size_text(d.capacity_bytes),
                          "io_threads": d.io_threads, "low_watermark": d.low_watermark,
                          "retry_s": d.retry_s,
                          "direct_io": "auto" if d.direct_io is None else d.direct_io}
    if config.cluster is not None:
        c = config.cluster
        tables["cluster"] = {
            "backend": c.backend, "master": c.master, "metadata_server": c.metadata_server,
            "local_hostname": c.local_hostname, "key_file": c.key_file,
            "segment_size": size_text(c.segment_bytes),
            "local_buffer_size": size_text(c.local_buffer_bytes), "protocol": c.protocol,
            "rdma_devices": c.rdma_devices, "replicas": c.replicas,
            "publish_queue_blocks": c.publish_queue_blocks,
            "publish_threads": c.publish_threads, "promote_threads": c.promote_threads,
            "exists_ttl_s": c.exists_ttl_s,
            "exists_wait_s": c.exists_wait_s, "retry_s": c.retry_s,
            "census_period_s": c.census_period_s, "start_timeout_s": c.start_timeout_s,
            "stop_timeout_s": c.stop_timeout_s}
    if config.events is not None:
        e = config.events
        tables["events"] = {
            "endpoint": e.endpoint, "replay_endpoint": e.replay_endpoint, "topic": e.topic,
            "hash_format": e.hash_format.value, "replay_batches": e.replay_batches,
            "hwm": e.hwm, "queue_keys": e.queue_keys, "batch_interval_s": e.batch_interval_s,
            "max_peers": e.max_peers, "peer_timeout_s": e.peer_timeout_s}
    return "\n".join(
        f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in body.items())
        for name, body in tables.items()
    )


def config_keys() -> dict[str, tuple[str, ...]]:
    """Every allowed ``section -> keys`` (the README's reference is checked against it)."""
    return {section: tuple(keys) for section, keys in _SCHEMA.items()}
