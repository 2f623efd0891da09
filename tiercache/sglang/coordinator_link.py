"""``CoordinatorLink``: the backend's sessions with the coordinator, one per SGLang thread.

SGLang calls a storage backend from three threads at once: the prefetch thread
(``batch_exists``), the prefetch I/O thread (``batch_get_v1``) and the backup thread
(``batch_set_v1``). ``tiercache.link.client.Client`` is thread-safe by serialising
calls on one connection, so one shared client would let a slow backup hold up a
prefetch query. So each thread role has its own ``Client`` (its own connection and
session: a lease is pinned and released by the I/O thread's session, a reservation made
and completed by the backup thread's), built lazily: nothing connects at attach, so a
coordinator that is down when SGLang starts costs nothing and raises nothing.

The STORE session describes the backend's key namespace (``describe``: DESCRIBE when it
first connects and again on every reconnect, as the vLLM adapter's writer does), so the
node's event stream publishes the pages it stores with SGLang's own hashes and lets that
session, and no other, store under the namespace (``tiercache.control.namespaces``). A
coordinator that does not take the description (no room, a refused description) leaves
the backups working and their pages unpublished; that is logged.

Bounded waits: every client has ``call_timeout_s`` as its socket timeout (connect, send,
answer). A call that fails with the coordinator gone (``CoordinatorGoneError``: no socket,
refused, timed out, closed mid-call) opens the breaker: for ``retry_s`` every role's calls
answer ``None`` at once (the caller turns that into misses or failed backups, counted),
then the next call tries again, and the client connects by itself (resuming its session
within the coordinator's grace period, or a new one after a restart). Any other tiercache
error (a session declared lost, a refused request) is returned to the caller as the
error, for it to count and log; nothing is raised into SGLang's threads from here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import TypeVar

from tiercache.config import Config
from tiercache.link.client import Client
from tiercache.errors import ConfigError, CoordinatorGoneError, StateError, TiercacheError
from tiercache.link.namespaces import EngineFamily
from tiercache.loglimit import LogLimiter

log = logging.getLogger(__name__)
T = TypeVar("T")


class Role(Enum):
    """The SGLang thread a session serves."""

    QUERY = "query"  # the prefetch thread: batch_exists
    LOAD = "load"  # the prefetch I/O thread: batch_get_v1
    STORE = "store"  # the backup thread: batch_set_v1


class CallFailed:
    """What a call that did not happen returns: why (``gone``: the coordinator is down)."""

    def __init__(self, error: TiercacheError | None, gone: bool):
        self.error, self.gone = error, gone

    def __repr__(self) -> str:
        return f"CallFailed({'gone' if self.gone else self.error!r})"


class CoordinatorLink:
    """Sessions per ``Role`` with the coordinator of ``config`` (see module docstring)."""

    def __init__(self, config: Config, *, name: str, call_timeout_s: float, retry_s: float):
        self.config, self.name = config, name
        self.call_timeout_s, self.retry_s = call_timeout_s, retry_s
        self._clients: dict[Role, Client] = {}
        self._description: str | None = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._up = False
        self._closed = False
        self._logs = LogLimiter(log, 10.0)

    @property
    def up(self) -> bool:
        """Whether the latest call reached the coordinator."""
        return self._up

    def describe(self, description: str) -> None:
        """The namespace the STORE session describes (before its first call)."""
        self._description = description

    def call(self, role: Role, fn: Callable[[Client], T]) -> T | CallFailed:
        """``fn(client)`` on ``role``'s session, or a ``CallFailed`` (never raises a
        tiercache error)."""
        if self._closed or time.monotonic() < self._down_until:
            return CallFailed(None, gone=True)
        try:
            client = self._client(role)
            result = fn(client)
        except CoordinatorGoneError as e:
            self._went_down(e)
            return CallFailed(e, gone=True)
        except TiercacheError as e:
            self._logs.warn(f"{role.value}-error", "tiercache: %s call failed: %s",
                               role.value, e)
            return CallFailed(e, gone=False)
        if not self._up:
            log.info("tiercache: coordinator %s answers (%s)", self.config.name, self.name)
        self._up = True
        return result

    def _client(self, role: Role) -> Client:
        with self._lock:
            client = self._clients.get(role)
            if client is not None:
                return client
            client = Client(self.config, timeout_s=self.call_timeout_s,
                            name=f"{self.name} {role.value}")
            self._clients[role] = client
        if role is Role.STORE and self._description is not None:
            self._describe(client, self._description)
        return client

    def _describe(self, client: Client, description: str) -> None:
        """DESCRIBE now and on every reconnect (a ``CoordinatorGoneError`` propagates: the
        call fails as gone, and the reconnect describes)."""
        try:
            answer = client.describe(EngineFamily.SGLANG, description)
        except (ConfigError, StateError) as e:
            log.warning("tiercache: coordinator %s did not take this SGLang namespace (its "
                        "pages are stored, not published on the node's event stream): %s",
                        self.config.name, e)
            return
        if answer.node_events:
            log.info("tiercache: coordinator %s publishes the pages this engine stores on the "
                     "node's KV event stream, with SGLang's page hashes (docs/events.md)",
                     self.config.name)

    def _went_down(self, error: CoordinatorGoneError) -> None:
        self._down_until = time.monotonic() + self.retry_s
        if self._up:
            log.warning("tiercache: coordinator %s is gone (%s); SGLang's lookups miss and "
                        "backups fail until it is back (retried every %.1f s)",
                        self.config.name, error, self.retry_s)
        self._up = False

    def close(self) -> None:
        self._closed = True
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
