"""How the control server behaves toward its clients: ``ControlOptions`` (its bounds and
timings, validated at construction) and the constants they are checked against. What each
bound does is in ``tiercache.control.server``'s docstring; the README lists them."""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.errors import ConfigError
from tiercache.link.protocol import HEADER_BYTES, MAX_REQUEST_BYTES

RECV_BYTES = 64 << 10  # below malloc's mmap threshold: no mmap per call
# After serving, keep polling this long before sleeping in epoll_wait: a sleeping core
# takes ~50 µs to wake on the 2-core VM we measured (a 16-byte echo between two processes:
# 108 µs p50 blocking, 13 µs with this poll). It costs CPU only while calls keep coming.
POLL_BEFORE_SLEEP_S = 50e-6
# The smallest partial-request budget: one whole request and one read past it, so that a
# connection sending one request always fits once the hogs are closed.
MIN_BUFFERED_BYTES = HEADER_BYTES + MAX_REQUEST_BYTES + RECV_BYTES


@dataclass(frozen=True)
class ControlOptions:
    """How the control server behaves toward its clients (see the module docstring)."""

    session_grace_s: float = 5.0
    session_timeout_s: float = 30.0  # a session silent this long while holding something ends
    reservation_timeout_s: float = 600.0  # a reservation not completed this long is freed
    tick_s: float = 1.0  # how often liveness, restored sessions and reservations are checked
    max_connections: int = 256
    max_buffered_bytes: int = 64 << 20
    listen_backlog: int = 4096  # the kernel caps it at net.core.somaxconn
    accept_backoff_s: float = 0.1
    log_interval_s: float = 10.0
    trusted_uid: int | None = None  # trusted besides our own uid
    poll_before_sleep_s: float = POLL_BEFORE_SLEEP_S
    hello_timeout_s: float = 5.0
    # Long enough that an idle engine's connection rarely goes (it would reconnect on its
    # next call anyway); short enough that abandoned ones do not keep slots for long.
    idle_timeout_s: float = 300.0
    max_connections_per_peer: int = 64
    max_detached_sessions_per_peer: int = 64

    def __post_init__(self) -> None:
        checks = (
            ("session_grace_s", 0 <= self.session_grace_s <= 3600, "0 .. 3600 s"),
            ("session_timeout_s", 0 <= self.session_timeout_s <= 86400, "0 (off) .. 86400 s"),
            ("reservation_timeout_s", 0 <= self.reservation_timeout_s <= 86400,
             "0 (off) .. 86400 s"),
            ("tick_s", 0 < self.tick_s <= 60, "0 .. 60 s (not 0)"),
            ("max_connections", 1 <= self.max_connections <= 65536, "1 .. 65536"),
            ("max_buffered_bytes", self.max_buffered_bytes >= MIN_BUFFERED_BYTES,
             f">= {MIN_BUFFERED_BYTES} (one whole request and one read)"),
            ("listen_backlog", 1 <= self.listen_backlog <= 65535, "1 .. 65535"),
            ("accept_backoff_s", 0 < self.accept_backoff_s <= 10, "0 .. 10 s (not 0)"),
            ("log_interval_s", 0 <= self.log_interval_s <= 3600, "0 .. 3600 s"),
            ("trusted_uid", self.trusted_uid is None or self.trusted_uid >= 0, "None or >= 0"),
            ("poll_before_sleep_s", 0 <= self.poll_before_sleep_s <= 0.01, "0 .. 0.01 s"),
            ("hello_timeout_s", 0 < self.hello_timeout_s <= 3600, "0 .. 3600 s (not 0)"),
            ("idle_timeout_s", 0 < self.idle_timeout_s <= 86400, "0 .. 86400 s (not 0)"),
            ("max_connections_per_peer", 1 <= self.max_connections_per_peer <= 65536,
             "1 .. 65536"),
            ("max_detached_sessions_per_peer",
             0 <= self.max_detached_sessions_per_peer <= 65536, "0 .. 65536"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r}: allowed {allowed}")


__all__ = ["ControlOptions", "MIN_BUFFERED_BYTES", "POLL_BEFORE_SLEEP_S", "RECV_BYTES"]
