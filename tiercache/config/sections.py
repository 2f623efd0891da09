"""The config's small sections and the vocabulary they share: the instance name, the KV
geometry, the region, the exporter; a ``host:port`` parser for the sections that name
addresses."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from tiercache.errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1, "uint8": 1}
INDEX_POLICIES = ("lru", "arc")  # kept in step with tiercache.eviction by a test
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
            raise ConfigError(f"kv: {len(self.page_bytes)} tensors; at most {MAX_TENSORS} are "
                              "allowed")
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
    # each rank's slice in the NUMA node of its worker's GPU: bound by the coordinator before
    # fallocate, checked and completed by the worker (tiercache.region.placement)
    numa_placement: bool = True

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
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key} = {value!r}: the port must be 1..65535 (ASCII digits)")
    return host, int(port)


@dataclass(frozen=True)
class ExporterConfig:
    address: str = "127.0.0.1"
    port: int = 9477  # 0 = any free port (tests)
    enabled: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"exporter.port = {self.port}: allowed 0..65535")
