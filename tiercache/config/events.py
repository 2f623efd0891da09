"""The ``[events]`` section: the node's KV event stream for routers (``tiercache.events``).

Off unless the section is present. The coordinator *binds* ``endpoint`` (a ZMQ PUB socket:
subscribers connect) and, if given, ``replay_endpoint`` (a ZMQ ROUTER answering vLLM's
replay requests). Both are TCP: ``tcp://ADDRESS:PORT`` with an IPv4 address, ``[IPv6]``
or ``*`` (all interfaces), port 0 picking a free one (the bound endpoint is logged).
Anyone who reaches the port reads the node's block hashes and model names: bind loopback
or a network only routers reach (docs/events.md, "Trust").

What peers may cost the coordinator is bounded by three keys: at most ``max_peers``
connections a port (one past it is closed at once), at most ``hwm`` batches queued for
one peer (a subscriber, or a replay requester's answer in flight), each batch at most
``MAX_BATCH_BYTES``; a peer that acknowledges nothing for ``peer_timeout_s`` while it has
bytes waiting is dropped. ``EventsConfig.peer_memory_bytes`` is the resulting bound on
what all peers together hold (docs/events.md, "Bounds").
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import Enum

from tiercache.errors import ConfigError

MAX_TOPIC_BYTES = 256
# A batch carries at most 1024 block hashes (tiercache.events.publisher cuts them so): a
# BlockStored encodes to at most ~165 bytes (a 32-byte hash, a u32 group, the longest
# medium name), so a batch stays below this (tests/events/test_wire.py checks it).
MAX_BATCH_BYTES = 192 << 10
# What one connection costs beside its queue: libzmq's engine buffers (8 KiB each way),
# pipe chunks, the publisher's handle on it, and malloc's slack; a margin: 16 stalled peers
# and thousands refused cost ~4 MiB in all (docs/benchmarks.md, "Event peers that never read").
PEER_OVERHEAD_BYTES = 256 << 10
NUM_PORTS = 2  # the PUB and the replay ROUTER: each takes max_peers


class HashFormat(Enum):
    """How block hashes go on the wire (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``):
    ``int``, the hash's last 8 bytes big-endian (vLLM's default), or the hash ``bytes``."""

    INT = "int"
    BYTES = "bytes"


def check_tcp_endpoint(endpoint: str, key: str) -> str:
    """``endpoint`` if it is ``tcp://ADDRESS:PORT`` (address an IP literal or ``*``, port
    0..65535), else a ``ConfigError`` naming ``key``."""
    allowed = ("allowed tcp://ADDRESS:PORT with ADDRESS an IPv4 address, [IPv6] or * (all "
               "interfaces) and PORT 0..65535 in ASCII digits (0: any free port)")
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ConfigError(f"{key} = {endpoint!r}: {allowed}")
    host, _, port = endpoint[6:].rpartition(":")
    # ASCII digits only: str.isdigit and int() take '٥٥٥٥' for 5555, ZMQ does not
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key} = {endpoint!r}: port {port!r}; {allowed}")
    if host != "*":
        literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            address = ipaddress.ip_address(literal)
        except ValueError:
            raise ConfigError(f"{key} = {endpoint!r}: address {host!r}; {allowed}") from None
        if address.version == 6 and literal == host:
            raise ConfigError(f"{key} = {endpoint!r}: write an IPv6 address in brackets; "
                              f"{allowed}")
    return endpoint


def tcp_address(endpoint: str) -> tuple[str, int]:
    """The (address, port) a checked ``endpoint`` binds: ``*`` is every IPv4 interface
    (ZMQ's meaning), an ``[IPv6]`` address loses its brackets."""
    host, _, port = endpoint[6:].rpartition(":")
    if host == "*":
        host = "0.0.0.0"
    return host.removeprefix("[").removesuffix("]"), int(port)


@dataclass(frozen=True)
class EventsConfig:
    """``[events]`` (see the module docstring and the README's config reference)."""

    endpoint: str
    replay_endpoint: str = ""  # "": no replay socket
    topic: str = ""  # prefix of every batch's topic (docs/events.md, "Topics")
    hash_format: HashFormat = HashFormat.INT
    replay_batches: int = 10_000  # batches kept for replay (and at most REPLAY_BUFFER_BYTES)
    hwm: int = 16  # batches queued per peer (subscriber or replay): past it ZMQ drops for it
    queue_keys: int = 1 << 20  # keys waiting to be published; past it: drop, count, resync
    batch_interval_s: float = 0.1  # how long changes wait to be batched (at most 1 s)
    max_peers: int = 8  # connections each port accepts; past it a new one is closed, counted
    peer_timeout_s: float = 10.0  # handshake, and acknowledging bytes sent: else dropped

    def __post_init__(self) -> None:
        check_tcp_endpoint(self.endpoint, "events.endpoint")
        if self.replay_endpoint:
            check_tcp_endpoint(self.replay_endpoint, "events.replay_endpoint")
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":0"):
                raise ConfigError(f"events.replay_endpoint = {self.replay_endpoint!r}: the "
                                  "same as events.endpoint; give each its own port")
        if len(self.topic.encode()) > MAX_TOPIC_BYTES:
            raise ConfigError(f"events.topic = {self.topic[:32]!r}...: "
                              f"{len(self.topic.encode())} bytes; at most {MAX_TOPIC_BYTES}")
        for key, value, low, high in (("replay_batches", self.replay_batches, 1, 1_000_000),
                                      ("hwm", self.hwm, 1, 4096),
                                      ("queue_keys", self.queue_keys, 1024, 1 << 26),
                                      ("max_peers", self.max_peers, 1, 1024)):
            if isinstance(value, bool) or not low <= value <= high:
                raise ConfigError(f"events.{key} = {value!r}: allowed {low} .. {high}")
        if not 0 < self.batch_interval_s <= 1:
            raise ConfigError(f"events.batch_interval_s = {self.batch_interval_s!r}: allowed "
                              "above 0 up to 1 (seconds: events leave within a second)")
        if not 0.1 <= self.peer_timeout_s <= 600:
            raise ConfigError(f"events.peer_timeout_s = {self.peer_timeout_s!r}: allowed "
                              "0.1 .. 600 (seconds)")

    @property
    def peer_memory_bytes(self) -> int:
        """The most that event peers together hold of the coordinator's memory: every
        connection of both ports with a full queue of the largest batches."""
        return NUM_PORTS * self.max_peers * (self.hwm * MAX_BATCH_BYTES + PEER_OVERHEAD_BYTES)

    @property
    def endpoints(self) -> dict[str, str]:
        """The endpoints the coordinator binds, by config key."""
        return {"events.endpoint": self.endpoint,
                **({"events.replay_endpoint": self.replay_endpoint}
                   if self.replay_endpoint else {})}
