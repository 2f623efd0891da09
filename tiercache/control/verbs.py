"""What the control server does for each verb: decode the request, call the index for the
connection's session (``owner``), encode the answer. HELLO is the server's own (it opens
the session these handlers act for); see ``tiercache.control.server``."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from tiercache.errors import ProtocolError
from tiercache.index.manager import OffloadingManager
from tiercache.link.payloads import (
    decode_lease_batch_request, decode_store_request, encode_events, encode_leases, encode_stats,
    encode_store_output, encode_tier_stats,
)
from tiercache.link.protocol import MAX_KEYS_PER_CALL, PayloadReader, PayloadWriter, Verb

Handler = Callable[[OffloadingManager, PayloadReader, int], bytes]
# raises (``NamespaceError``) if session ``owner`` may not store these keys
StoreCheck = Callable[[Sequence[bytes], int], None]
_EMPTY = b""
_U32 = struct.Struct("<I")


def _keys_then(reader: PayloadReader) -> list[bytes]:
    keys = reader.keys()
    reader.done()
    return keys


def _lookup(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
    return _U32.pack(m.lookup(_keys_then(r)))


def _prepare_load(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
    return PayloadWriter().spec(m.prepare_load(_keys_then(r), owner=owner)).build()


def _touch(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
    m.touch(_keys_then(r))
    return _EMPTY


def _complete_load(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
    m.complete_load(_keys_then(r), owner=owner)
    return _EMPTY


def store_verbs(check: StoreCheck | None) -> dict[Verb, Handler]:
    """PREPARE_STORE and COMPLETE_STORE, each refusing before any change what ``check``
    refuses (a completion that reports a failure always goes: it frees the slots)."""

    def prepare_store(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
        keys, max_evictions = decode_store_request(r)
        if check is not None:
            check(keys, owner)
        return encode_store_output(m.prepare_store(keys, owner=owner,
                                                   max_evictions=max_evictions))

    def complete_store(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
        success = r.u8()
        if success not in (0, 1):
            raise ProtocolError(f"complete_store success flag {success}; expected 0 or 1")
        keys = _keys_then(r)
        if check is not None and success:
            check(keys, owner)
        m.complete_store(keys, success=bool(success), owner=owner)
        return _EMPTY

    return {Verb.PREPARE_STORE: prepare_store, Verb.COMPLETE_STORE: complete_store}


def _lease_batch(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
    """One lease per list, each atomic (the index's lock per list), in list order; each
    answers its hit run's slots (no ``prepare_load`` follows)."""
    return encode_leases([m.lease(keys, owner=owner) for keys in decode_lease_batch_request(r)])


def _release(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
    return _U32.pack(m.release(_keys_then(r), owner=owner))


def _no_args(call: Callable[[OffloadingManager], bytes]) -> Handler:
    def handler(m: OffloadingManager, r: PayloadReader, owner: int) -> bytes:
        r.done()
        return call(m)
    return handler


def _reset(m: OffloadingManager) -> bytes:
    m.reset()
    return _EMPTY


HANDLERS: dict[Verb, Handler] = {
    Verb.LOOKUP: _lookup,
    Verb.PREPARE_LOAD: _prepare_load,
    Verb.TOUCH: _touch,
    Verb.COMPLETE_LOAD: _complete_load,
    **store_verbs(None),
    Verb.TAKE_EVENTS: _no_args(lambda m: encode_events(m.take_events(max_keys=MAX_KEYS_PER_CALL))),
    Verb.RESET: _no_args(_reset),
    Verb.STATS: _no_args(lambda m: encode_stats(m.stats())),
    Verb.PING: _no_args(lambda m: _EMPTY),
    Verb.LEASE_BATCH: _lease_batch,
    Verb.RELEASE: _release,
    Verb.TIER_STATS: _no_args(lambda m: encode_tier_stats(m.tier_stats())),
}
# HELLO and DESCRIBE are the server's own (the session; the event stream's namespaces)
assert set(HANDLERS) | {Verb.HELLO, Verb.DESCRIBE} == set(Verb), "every verb needs a handler"
