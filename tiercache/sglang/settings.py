"""The backend's own keys of SGLang's ``--hicache-storage-backend-extra-config``.

Exactly one of:

* ``tiercache_config``: the coordinator's TOML config (instance name, socket);
* ``tiercache_instance``: the coordinator's instance name (socket at its default path).

Optional:

* ``tiercache_namespace_salt`` (str): extra identity for the key namespace, e.g. a weights
  revision served under an unchanged model path;
* ``tiercache_call_timeout_s`` (default 2.0): the longest one call to the coordinator may
  hold an SGLang thread (connect, send, answer); past it the call is a miss or a failed
  backup, and the coordinator is left alone for ``tiercache_retry_s``;
* ``tiercache_retry_s`` (default 0.5): after the coordinator failed to answer, or while its
  region is missing, calls answer at once (misses, failed backups, counted) for this long
  before the backend tries again: a coordinator that is down costs SGLang nothing;
* ``tiercache_copy_threads``: native copy threads per direction besides the calling
  thread (default: the process's cores up to 8, minus one);
* ``tiercache_prefault_threads`` (default 4): threads that pre-fault the region slice
  this process copies into, at attach.

SGLang's own keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``,
``allocator``...) pass through unread. A bad value is a ``ConfigError`` naming the key,
the value and what is allowed (raised while SGLang builds the backend: a misconfigured
engine does not start).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiercache.config import Config, load_config
from tiercache.errors import ConfigError
from tiercache.transfer.host_copy import MAX_THREADS, default_threads

CONFIG_KEY = "tiercache_config"
INSTANCE_KEY = "tiercache_instance"
SALT_KEY = "tiercache_namespace_salt"
TIMEOUT_KEY = "tiercache_call_timeout_s"
RETRY_KEY = "tiercache_retry_s"
COPY_THREADS_KEY = "tiercache_copy_threads"
PREFAULT_KEY = "tiercache_prefault_threads"


def _seconds(extra: Mapping[str, Any], key: str, default: float, upper: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= upper:
        raise ConfigError(f"{key} = {value!r}: expected seconds in (0, {upper}]")
    return float(value)


def _count(extra: Mapping[str, Any], key: str, default: int, upper: int, lower: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        raise ConfigError(f"{key} = {value!r}: expected an integer in {lower}..{upper}")
    return value


@dataclass(frozen=True)
class BackendSettings:
    """Which coordinator, and how the backend treats SGLang's threads."""

    config: Config
    salt: str = ""
    call_timeout_s: float = 2.0
    retry_s: float = 0.5
    copy_threads: int = 0
    prefault_threads: int = 4

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        extra = extra or {}
        path, name = extra.get(CONFIG_KEY), extra.get(INSTANCE_KEY)
        if (path is None) == (name is None):
            raise ConfigError(
                f"--hicache-storage-backend-extra-config needs exactly one of {CONFIG_KEY!r} "
                f"(the coordinator's config file) and {INSTANCE_KEY!r} (its instance name); got "
                f"{CONFIG_KEY}={path!r}, {INSTANCE_KEY}={name!r}")
        if path is not None:
            if not isinstance(path, str):
                raise ConfigError(f"{CONFIG_KEY} = {path!r}: expected a file path")
            config = load_config(path)
        else:
            if not isinstance(name, str):
                raise ConfigError(f"{INSTANCE_KEY} = {name!r}: expected the instance name")
            config = Config(name=name)  # validates the name
        salt = extra.get(SALT_KEY, "")
        if not isinstance(salt, str):
            raise ConfigError(f"{SALT_KEY} = {salt!r}: expected a string")
        return cls(config=config, salt=salt,
                   call_timeout_s=_seconds(extra, TIMEOUT_KEY, 2.0, 60.0),
                   retry_s=_seconds(extra, RETRY_KEY, 0.5, 60.0),
                   copy_threads=_count(extra, COPY_THREADS_KEY, default_threads(),
                                       MAX_THREADS, 0),
                   prefault_threads=_count(extra, PREFAULT_KEY, 4, 256, 1))
