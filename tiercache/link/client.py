"""``Client``: the cache index of a running coordinator, with the manager's methods.

Each verb is one request and one answer on the client's ``Channel``
(``tiercache.link.channel``: finding and trusting the coordinator, sessions and their
resumption, the heartbeat, what a call does when the coordinator is gone). The client
checks what it sends before it sends it (keys are bytes of at most ``MAX_KEY_BYTES``, at
most ``MAX_KEYS_PER_CALL`` per call) and sends a ``lease_batch`` of more lists or keys
than one request may carry as several requests (``MAX_LISTS_PER_BATCH``), so an engine
never meets the coordinator's per-request bounds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

from tiercache.config import Config
from tiercache.errors import (
    ConfigError, CoordinatorGoneError, ProtocolError, StateError, TiercacheError,
)
from tiercache.link.channel import Channel, check_path_length, resolve_socket_path
from tiercache.link.describe import Described, decode_described, encode_describe_request
from tiercache.link.sockets import trusted_uids
from tiercache.link.payloads import (
    decode_events, decode_leases, decode_stats, decode_store_output, decode_tier_stats,
    encode_hello_request, encode_lease_batch_request, encode_store_request, lease_batch_groups,
)
from tiercache.link.protocol import MAX_KEYS_PER_CALL, PayloadReader, PayloadWriter, Verb
from tiercache.results import (
    LeaseResult, ManagerStats, OffloadingEvent, PrepareStoreOutput, TierStats,
)
from tiercache.specs import CPULoadStoreSpec

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0


class Client:
    """Talks to the coordinator serving ``config_or_socket_path`` (a ``Config`` or a path).

    ``session_token``: resume that session on connect (``tiercache.link.channel``);
    ``name``: shown in the coordinator's logs; ``trusted_uid``: a uid trusted besides our
    own (default: the config's ``control.trusted_uid``); ``heartbeat``: keep the session
    alive from a background thread while connected.
    """

    def __init__(self, config_or_socket_path: Config | str | os.PathLike[str],
                 timeout_s: float = DEFAULT_TIMEOUT_S, *, session_token: bytes | None = None,
                 name: str = "", trusted_uid: int | None = None, heartbeat: bool = True):
        config: Config | None = None
        if isinstance(config_or_socket_path, Config):
            config = config_or_socket_path
            path = resolve_socket_path(config)
            if trusted_uid is None and config.control_trusted_uid >= 0:
                trusted_uid = config.control_trusted_uid
        else:
            path = os.fspath(config_or_socket_path)
        check_path_length(path)
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s = {timeout_s!r}: must be > 0")
        encode_hello_request(session_token, name)  # refuses a malformed token or name now
        self._channel = Channel(config, path, float(timeout_s), trusted_uids(trusted_uid),
                                name, session_token, heartbeat)
        self.described: Described | None = None  # the last DESCRIBE answer (``describe``)

    @property
    def socket_path(self) -> str:
        return self._channel.path

    def connect(self) -> None:
        """Connect and open (or resume) the session now, rather than at the first call;
        a no-op while connected. Raises what a call would (``CoordinatorGoneError``...)."""
        self._channel.connect()

    @property
    def session_token(self) -> bytes | None:
        """The token of this client's session: None before the first connect (``connect()``
        or any call), unless one was given to resume."""
        hello = self._channel.hello
        return hello.token if hello else None

    @property
    def resumed(self) -> bool:
        """Whether the latest connect resumed the session (False for a new one)."""
        hello = self._channel.hello
        return hello.resumed if hello else False

    @property
    def grace_s(self) -> float:
        """How long the coordinator keeps this session after its connection closes."""
        hello = self._channel.hello
        return hello.grace_s if hello else 0.0

    # ------------------------------------------------------------------ the manager's verbs

    def lookup(self, keys: Sequence[bytes]) -> int:
        reader = self._channel.call(Verb.LOOKUP, PayloadWriter().keys(keys).build())
        hits = reader.u32()
        reader.done()
        return hits

    def prepare_load(self, keys: Sequence[bytes]) -> CPULoadStoreSpec:
        reader = self._channel.call(Verb.PREPARE_LOAD, PayloadWriter().keys(keys).build())
        spec = reader.spec()
        reader.done()
        if len(spec) != len(keys):
            raise ProtocolError(
                f"prepare_load: asked for {len(keys)} keys, got {len(spec)} slot ids")
        return spec

    def touch(self, keys: Sequence[bytes]) -> None:
        self._channel.call(Verb.TOUCH, PayloadWriter().keys(keys).build()).done()

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self._channel.call(Verb.COMPLETE_LOAD, PayloadWriter().keys(keys).build()).done()

    def prepare_store(self, keys: Sequence[bytes], *, max_evictions: int | None = None
                      ) -> PrepareStoreOutput | None:
        """With ``max_evictions``: reserve ahead of a store that may not happen, from free
        slots and at most that many evictions, never ``None`` (see the index's
        ``prepare_store``)."""
        reader = self._channel.call(Verb.PREPARE_STORE, encode_store_request(keys, max_evictions))
        out = decode_store_output(reader)
        reader.done()
        return out

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        payload = PayloadWriter().u8(1 if success else 0).keys(keys).build()
        self._channel.call(Verb.COMPLETE_STORE, payload).done()

    def lease_batch(self, key_lists: Sequence[Sequence[bytes]]) -> list[LeaseResult]:
        """One lease per list, each atomic: its leading run of readable keys is pinned for
        this session until ``release``, and its slots come back as a fenced spec
        (``LeaseResult.spec``) to load from without ``prepare_load``. Sent in one request,
        or in as many as the per-request bounds ask (``MAX_LISTS_PER_BATCH`` lists,
        ``MAX_KEYS_PER_CALL`` keys). If a later one is refused, the leases the earlier
        ones took are released before the error is raised; if the coordinator goes away
        meanwhile, they go with the session (or stay with it, if it is resumed, until
        released or the session ends)."""
        results: list[LeaseResult] = []
        for group in lease_batch_groups(key_lists):
            try:
                reader = self._channel.call(Verb.LEASE_BATCH, encode_lease_batch_request(group))
                answers = decode_leases(reader)
                if len(answers) != len(group):
                    raise ProtocolError(f"lease_batch: asked for {len(group)} leases, got "
                                        f"{len(answers)}")
            except CoordinatorGoneError:
                raise  # the connection is gone: a release now would reconnect first
            except BaseException:
                self._release_taken(key_lists, results)
                raise
            results += answers
        return results

    def _release_taken(self, key_lists: Sequence[Sequence[bytes]],
                       results: list[LeaseResult]) -> None:
        """Drop the pins of the leases already answered (the caller never sees them)."""
        answered = zip(key_lists, results, strict=False)  # results: the first lists' only
        held = [key for keys, r in answered for key in keys[:r.num_hit]]
        for start in range(0, len(held), MAX_KEYS_PER_CALL):
            try:
                self.release(held[start:start + MAX_KEYS_PER_CALL])
            except TiercacheError:
                return  # best effort: the error being raised is the one to report

    def lease(self, keys: Sequence[bytes]) -> LeaseResult:
        """``lease_batch([keys])[0]``."""
        return self.lease_batch([keys])[0]

    def release(self, keys: Sequence[bytes]) -> int:
        """Drop every pin this session holds on ``keys``; returns how many were dropped."""
        reader = self._channel.call(Verb.RELEASE, PayloadWriter().keys(keys).build())
        dropped = reader.u32()
        reader.done()
        return dropped

    def tier_stats(self) -> dict[str, TierStats]:
        """The figures of the tiers below host memory, by name (``{}``: host memory only)."""
        reader = self._channel.call(Verb.TIER_STATS, b"")
        tiers = decode_tier_stats(reader)
        reader.done()
        return tiers

    def take_events(self) -> list[OffloadingEvent]:
        """Every pending event, fetched in as many calls as the frame bound needs."""
        events: list[OffloadingEvent] = []
        while True:
            reader = self._channel.call(Verb.TAKE_EVENTS, b"")
            batch = decode_events(reader)
            reader.done()
            events.extend(batch)
            if sum(len(e.keys) for e in batch) < MAX_KEYS_PER_CALL:
                return events

    def describe(self, family: int, text: str) -> Described:
        """Tell the coordinator what this client's key namespace is (DESCRIBE,
        ``tiercache.link.describe``), now and after every reconnect (a restarted
        coordinator learns it back). The answer says whether the node's event stream runs."""
        request = encode_describe_request(family, text)

        def again(exchange: Callable[[Verb, bytes], PayloadReader]) -> None:
            try:
                self.described = decode_described(exchange(Verb.DESCRIBE, request))
            except (ConfigError, StateError) as e:  # calls go on; its blocks go unpublished
                log.warning("tiercache: the coordinator on %s did not take namespace "
                            "description: %s", self.socket_path, e)

        self._channel.after_hello = again
        self.described = decode_described(self._channel.call(Verb.DESCRIBE, request))
        return self.described

    def reset(self) -> None:
        self._channel.call(Verb.RESET, b"").done()

    def stats(self) -> ManagerStats:
        reader = self._channel.call(Verb.STATS, b"")
        stats = decode_stats(reader)
        reader.done()
        return stats

    def ping(self) -> float:
        """Round-trip time in seconds; raises ``CoordinatorGoneError`` if nobody answers."""
        start = time.perf_counter()
        self._channel.call(Verb.PING, b"").done()
        return time.perf_counter() - start

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

