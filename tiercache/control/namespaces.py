"""DESCRIBE: an engine tells the coordinator what one of its key namespaces is, so the
node's event stream can publish that namespace's blocks with the engine's own hashes
(``tiercache.events.namespaces``).

::

    request   u8 engine family (``EngineFamily``), str description (at most
              ``MAX_DESCRIPTION_BYTES``: the exact text whose SHA-256 prefixes its keys)
    answer    8 bytes: the namespace digest the coordinator computed from the text,
              u8 1 if the node's event stream runs (the engine then leaves the blocks'
              CPU-tier events to it), else 0

A description that does not parse is a ``ConfigError`` (the connection stays: the
engine's configuration is at fault, not the stream). A client sends it once per namespace
and again on every reconnect (``Client.describe``), so a restarted coordinator learns its
namespaces back. Bounded: one description is at
most 64 KiB, and the stream keeps at most ``MAX_NAMESPACES`` (a new one replaces one that
holds no block, else it is refused with an error and its blocks are not published). The
digest is computed here, never taken from the client: a client can describe a namespace
only as its keys' own prefix says. Without an event stream the answer is the digest and
0, and nothing is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from tiercache.control.protocol import PayloadReader, PayloadWriter
from tiercache.errors import ConfigError, ProtocolError
from tiercache.events.namespaces import (
    MAX_DESCRIPTION_BYTES, NAMESPACE_BYTES, NamespaceInfo, parse_description,
)


class Describer(Protocol):
    """What the coordinator's event stream offers DESCRIBE (``NodeEventStream``)."""

    def describe(self, family: int, text: str) -> NamespaceInfo: ...


class Described(NamedTuple):
    digest: bytes
    node_events: bool  # the coordinator publishes the node's events


def encode_describe_request(family: int, text: str) -> bytes:
    if len(text.encode()) > MAX_DESCRIPTION_BYTES:
        raise ProtocolError(f"namespace description of {len(text.encode())} bytes; at most "
                            f"{MAX_DESCRIPTION_BYTES}")
    return PayloadWriter().u8(family).raw(text.encode()).build()


def describe(stream: Describer | None, reader: PayloadReader) -> bytes:
    """The server's side: learn the namespace (if a stream runs), answer its digest."""
    family = reader.u8()
    raw = reader.raw(MAX_DESCRIPTION_BYTES)
    reader.done()
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ProtocolError("namespace description is not UTF-8") from None
    try:
        info = (parse_description(family, text) if stream is None
                else stream.describe(family, text))
    except ProtocolError as e:  # what it says, not how: the connection stays
        raise ConfigError(str(e)) from None
    return PayloadWriter().raw(info.digest).u8(int(stream is not None)).build()


def describer(stream: Describer | None) -> Callable[[Any, PayloadReader, int], bytes]:
    """DESCRIBE as one of the server's verb handlers (it needs the stream, not the index)."""
    return lambda manager, reader, owner: describe(stream, reader)


def decode_described(reader: PayloadReader) -> Described:
    digest = reader.raw(NAMESPACE_BYTES)
    flag = reader.u8()
    reader.done()
    if len(digest) != NAMESPACE_BYTES or flag not in (0, 1):
        raise ProtocolError(f"DESCRIBE answer with a {len(digest)}-byte digest and flag {flag}")
    return Described(digest, bool(flag))
