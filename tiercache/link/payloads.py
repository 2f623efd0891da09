"""Each verb's payload (see ``Verb`` in ``tiercache.link.protocol`` for the table), built
from the protocol's primitives: what the client and the control server encode and decode."""

from __future__ import annotations

import struct

import numpy as np
from collections.abc import Sequence
from dataclasses import astuple, fields
from typing import Any, NamedTuple

from tiercache import errors
from tiercache.link.protocol import (
    ERROR_CODES, MAX_KEYS_PER_CALL, MAX_LISTS_PER_BATCH, MAX_NAME_BYTES, PROTOCOL_VERSION,
    TOKEN_BYTES, VARIABLE_WIDTH, PayloadReader, PayloadWriter, Verb,
)
from tiercache.link.versions import error_code_for
from tiercache.results import (
    BlockSource, LeaseResult, ManagerStats, OffloadingEvent, PrepareStoreOutput, TierStats,
)

_U32 = struct.Struct("<I")
_CODE_OF = {cls: code for code, cls in ERROR_CODES.items()}


def encode_store_output(out: PrepareStoreOutput | None) -> bytes:
    if out is None:
        return PayloadWriter().u8(0).build()
    return (PayloadWriter().u8(1).keys(out.keys_to_store).spec(out.store_spec)
            .keys(out.evicted_keys).keys(out.no_room_keys).build())


def decode_store_output(reader: PayloadReader) -> PrepareStoreOutput | None:
    flag = reader.u8()
    if flag == 0:
        return None
    if flag != 1:
        raise errors.ProtocolError(f"prepare_store answer flag {flag}; expected 0 or 1")
    keys = tuple(reader.keys())
    spec = reader.spec()
    evicted = tuple(reader.keys())
    no_room = tuple(reader.keys())
    if len(spec) != len(keys):
        raise errors.ProtocolError(
            f"prepare_store answer: {len(keys)} keys but {len(spec)} slot ids")
    return PrepareStoreOutput(keys, spec, evicted, no_room)


NO_EVICTION_LIMIT = 0xFFFFFFFF  # a PREPARE_STORE's u32 max_evictions: a store (None)


def encode_store_request(keys: Sequence[bytes], max_evictions: int | None) -> bytes:
    if max_evictions is None:
        limit = NO_EVICTION_LIMIT
    elif 0 <= max_evictions < NO_EVICTION_LIMIT:
        limit = max_evictions
    else:
        raise errors.ProtocolError(f"prepare_store max_evictions = {max_evictions!r}; allowed "
                                   f"0 .. {NO_EVICTION_LIMIT - 1}, or None")
    return PayloadWriter().u32(limit).keys(keys).build()


def decode_store_request(reader: PayloadReader) -> tuple[list[bytes], int | None]:
    limit = reader.u32()
    keys = reader.keys()
    reader.done()
    return keys, None if limit == NO_EVICTION_LIMIT else limit


def encode_events(events: Sequence[OffloadingEvent]) -> bytes:
    writer = PayloadWriter().u32(len(events))
    for event in events:
        writer.u8(int(event.removed)).text(event.medium).keys(event.keys)
    return writer.build()


def decode_events(reader: PayloadReader) -> list[OffloadingEvent]:
    n = reader.u32()
    if n > MAX_KEYS_PER_CALL:
        raise errors.ProtocolError(f"{n} events in one answer; at most {MAX_KEYS_PER_CALL}")
    events = []
    for _ in range(n):
        removed = bool(reader.u8())
        medium = reader.text()
        events.append(OffloadingEvent(tuple(reader.keys()), removed, medium))
    return events


_NUM_STATS_FIELDS = len(fields(ManagerStats))


def encode_stats(stats: ManagerStats) -> bytes:
    return PayloadWriter().u64s(astuple(stats)).build()


def decode_stats(reader: PayloadReader) -> ManagerStats:
    return ManagerStats(*reader.u64s(_NUM_STATS_FIELDS))


_TIER_FIELDS = [f.name for f in fields(TierStats)]
_SOURCE_CODES = {int(s) for s in BlockSource}


def encode_tier_stats(tiers: dict[str, TierStats]) -> bytes:
    writer = PayloadWriter().u32(len(tiers))
    for name, stats in tiers.items():
        writer.text(name).u64s([round(v * 1e6) if isinstance(v, float) else int(v)
                                for v in (getattr(stats, f) for f in _TIER_FIELDS)])
    return writer.build()


def decode_tier_stats(reader: PayloadReader) -> dict[str, TierStats]:
    tiers = {}
    for _ in range(reader.u32()):
        name = reader.text()
        raw = reader.u64s(len(_TIER_FIELDS))
        values: dict[str, Any] = dict(zip(_TIER_FIELDS, raw, strict=True))
        for f in fields(TierStats):
            if f.type in ("float", float):
                values[f.name] /= 1e6
            elif f.type in ("bool", bool):
                values[f.name] = bool(values[f.name])
        tiers[name] = TierStats(**values)
    return tiers


def encode_error(exc: errors.TiercacheError | Exception,
                 version: int = PROTOCOL_VERSION) -> bytes:
    """An ERROR payload for a connection of ``version`` (a code it knows)."""
    code = next((_CODE_OF[c] for c in type(exc).__mro__ if c in _CODE_OF), 1)
    code = error_code_for(code, version)
    message = str(exc) if isinstance(exc, errors.TiercacheError) else f"{type(exc).__name__}: {exc}"
    return PayloadWriter().u32(code).text(message).build()


def decode_error(reader: PayloadReader) -> errors.TiercacheError:
    code = reader.u32()
    message = reader.text()
    cls = ERROR_CODES.get(code)
    if cls is None:
        return errors.ProtocolError(f"coordinator sent unknown error code {code}: {message}")
    return cls(message)


# ---------------------------------------------------------------- sessions and leases

class Hello(NamedTuple):
    """A HELLO answer: the session's token, whether it was resumed, its grace period, and
    its liveness deadline (a session silent that long while it holds something is ended;
    0: none), which the client heartbeats well within."""

    token: bytes
    resumed: bool
    grace_s: float
    timeout_s: float = 0.0


def encode_hello_request(token: bytes | None, name: str) -> bytes:
    token = token or b""
    if len(token) not in (0, TOKEN_BYTES):
        raise errors.ProtocolError(
            f"session token of {len(token)} bytes; a token is {TOKEN_BYTES} bytes (or none)")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise errors.ProtocolError(f"client name {name[:32]!r}... is {len(name.encode())} bytes; "
                                   f"at most {MAX_NAME_BYTES}")
    return PayloadWriter().raw(token).text(name).build()


def decode_hello_request(reader: PayloadReader) -> tuple[bytes, str]:
    token = reader.raw(TOKEN_BYTES)
    if len(token) not in (0, TOKEN_BYTES):
        raise errors.ProtocolError(f"session token of {len(token)} bytes; expected 0 or "
                                   f"{TOKEN_BYTES}")
    name = reader.text()
    if len(name.encode()) > MAX_NAME_BYTES:
        raise errors.ProtocolError(f"client name of {len(name.encode())} bytes; at most "
                                   f"{MAX_NAME_BYTES}")
    reader.done()
    return token, name


def encode_hello(hello: Hello) -> bytes:
    return (PayloadWriter().raw(hello.token).u8(int(hello.resumed))
            .u32(round(hello.grace_s * 1000)).u32(round(hello.timeout_s * 1000)).build())


def decode_hello(reader: PayloadReader) -> Hello:
    token = reader.raw(TOKEN_BYTES)
    resumed = reader.u8()
    grace_ms = reader.u32()
    timeout_ms = reader.u32()
    reader.done()
    if len(token) != TOKEN_BYTES or resumed not in (0, 1):
        raise errors.ProtocolError(f"HELLO answer with a {len(token)}-byte token and resumed "
                                   f"flag {resumed}")
    return Hello(token, bool(resumed), grace_ms / 1000, timeout_ms / 1000)


def encode_lease_batch_request(key_lists: Sequence[Sequence[bytes]]) -> bytes:
    """One LEASE_BATCH request: at most ``MAX_LISTS_PER_BATCH`` lists and
    ``MAX_KEYS_PER_CALL`` keys in all (``lease_batch_groups`` cuts a batch to fit)."""
    total = sum(map(len, key_lists))
    if total > MAX_KEYS_PER_CALL or len(key_lists) > MAX_LISTS_PER_BATCH:
        raise errors.ProtocolError(f"{len(key_lists)} lists of {total} keys in one lease_batch; "
                                   f"at most {MAX_KEYS_PER_CALL} keys and "
                                   f"{MAX_LISTS_PER_BATCH} lists in all")
    writer = PayloadWriter().u32(len(key_lists))
    for keys in key_lists:
        writer.keys(keys)
    return writer.build()


def lease_batch_groups(key_lists: Sequence[Sequence[bytes]]
                       ) -> list[Sequence[Sequence[bytes]]]:
    """Consecutive groups of ``key_lists`` that each fit one LEASE_BATCH request (each list
    is leased on its own, so a batch may be sent as several requests); a single list of
    more than ``MAX_KEYS_PER_CALL`` keys cannot be split and is refused."""
    groups: list[Sequence[Sequence[bytes]]] = []
    start = total = 0
    for i, keys in enumerate(key_lists):
        if len(keys) > MAX_KEYS_PER_CALL:
            raise errors.ProtocolError(f"a lease of {len(keys)} keys; at most "
                                       f"{MAX_KEYS_PER_CALL} keys per list")
        if i > start and (i - start == MAX_LISTS_PER_BATCH
                          or total + len(keys) > MAX_KEYS_PER_CALL):
            groups.append(key_lists[start:i])
            start, total = i, 0
        total += len(keys)
    if start < len(key_lists) or not groups:
        groups.append(key_lists[start:])
    return groups


# Where each verb's one key list starts in its request (after its fixed fields; ``Verb``).
_KEYS_AT = {Verb.LOOKUP: 0, Verb.PREPARE_LOAD: 0, Verb.TOUCH: 0, Verb.COMPLETE_LOAD: 0,
            Verb.RELEASE: 0, Verb.PREPARE_STORE: 4, Verb.COMPLETE_STORE: 1}
_LIST_HEAD = struct.Struct("<IH")  # a key list's count and width (``PayloadWriter.keys``)


def request_size(verb: Verb, payload: bytes | memoryview) -> tuple[int, int]:
    """(keys, key lists) a request carries, read from its list heads without decoding a
    key: what fair turns charge it before it is served (``tiercache.control.turns``).
    Counts stop just past the bounds (a request past them is refused when decoded), and a
    malformed payload counts what could be read."""
    if verb is Verb.LEASE_BATCH:
        return _batch_size(payload)
    at = _KEYS_AT.get(verb)
    if at is None or len(payload) < at + _LIST_HEAD.size:
        return 0, 0
    return min(_LIST_HEAD.unpack_from(payload, at)[0], MAX_KEYS_PER_CALL + 1), 1


def _batch_size(payload: bytes | memoryview) -> tuple[int, int]:
    if len(payload) < 4:
        return 0, 0
    num_lists = min(struct.unpack_from("<I", payload)[0], MAX_LISTS_PER_BATCH + 1)
    pos, keys, lists = 4, 0, 0
    while lists < num_lists and keys <= MAX_KEYS_PER_CALL and pos + 6 <= len(payload):
        n, width = _LIST_HEAD.unpack_from(payload, pos)
        pos += _LIST_HEAD.size
        lists += 1
        keys += n
        if width != VARIABLE_WIDTH:
            pos += n * width
        elif n <= MAX_KEYS_PER_CALL and pos + 2 * n <= len(payload):
            pos += 2 * n + sum(struct.unpack_from(f"<{n}H", payload, pos))
        else:
            break
    return min(keys, MAX_KEYS_PER_CALL + 1), num_lists


def decode_lease_batch_request(reader: PayloadReader) -> list[list[bytes]]:
    n = reader.u32()
    if n > MAX_LISTS_PER_BATCH:
        raise errors.ProtocolError(f"{n} key lists in one lease_batch; at most "
                                   f"{MAX_LISTS_PER_BATCH} (MAX_LISTS_PER_BATCH: send more as "
                                   "several requests)")
    lists, total = [], 0
    for _ in range(n):
        keys = reader.keys()
        total += len(keys)
        if total > MAX_KEYS_PER_CALL:
            raise errors.ProtocolError(f"more than {MAX_KEYS_PER_CALL} keys in one lease_batch")
        lists.append(keys)
    reader.done()
    return lists


def encode_leases(results: Sequence[LeaseResult]) -> bytes:
    """Per lease: u8 pending, the hit run's spec (its length is ``num_hit``), then the
    positions of the run's promoted blocks (``ids``) and their sources (``ids``, the
    ``BlockSource`` codes, co-indexed)."""
    writer = PayloadWriter().u32(len(results))
    for r in results:
        if r.spec is None:
            raise errors.ProtocolError(f"a lease of {r.num_hit} hits without its slots")
        writer.u8(int(r.pending)).spec(r.spec).ids(np.asarray(r.promoted, np.int64))
        writer.ids(np.asarray([int(s) for s in r.sources], np.int64))
    return writer.build()


def decode_leases(reader: PayloadReader) -> list[LeaseResult]:
    n = reader.u32()
    if n > MAX_KEYS_PER_CALL:
        raise errors.ProtocolError(f"{n} lease results; at most {MAX_KEYS_PER_CALL}")
    results = []
    for _ in range(n):
        pending = reader.u8()
        if pending not in (0, 1):
            raise errors.ProtocolError(f"lease pending flag {pending}; expected 0 or 1")
        spec = reader.spec()
        promoted = tuple(reader.ids().tolist())
        if any(not 0 <= i < len(spec) for i in promoted):
            raise errors.ProtocolError(f"promoted positions {promoted[:4]} outside a run of "
                                       f"{len(spec)}")
        codes = reader.ids().tolist()
        if len(codes) != len(promoted) or any(c not in _SOURCE_CODES for c in codes):
            raise errors.ProtocolError(f"lease sources {codes[:4]} for {len(promoted)} promoted "
                                       f"positions; allowed codes {sorted(_SOURCE_CODES)}")
        results.append(LeaseResult(len(spec), bool(pending), spec, promoted,
                                   tuple(BlockSource(c) for c in codes)))
    reader.done()
    return results
