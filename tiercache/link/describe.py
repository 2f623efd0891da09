"""DESCRIBE on the wire: an engine tells the coordinator what one of its key namespaces is,
so the node's event stream can publish that namespace's blocks with the engine's own
hashes (``tiercache.link.namespaces``). Both sides speak it; what the coordinator does with
a description is ``tiercache.control.namespaces``.

::

    request   u8 engine family (``EngineFamily``), str description (at most
              ``MAX_DESCRIPTION_BYTES``: the exact text whose SHA-256 prefixes its keys)
    answer    8 bytes: the namespace digest the coordinator computed from the text,
              u8 1 if the node's event stream runs (the engine then leaves the blocks'
              CPU-tier events to it), else 0

A client sends it once per namespace and again on every reconnect (``Client.describe``),
so a restarted coordinator learns its namespaces back.
"""

from __future__ import annotations

from typing import NamedTuple

from tiercache.errors import ProtocolError
from tiercache.link.namespaces import MAX_DESCRIPTION_BYTES, NAMESPACE_BYTES
from tiercache.link.protocol import PayloadReader, PayloadWriter


class Described(NamedTuple):
    digest: bytes
    node_events: bool  # the coordinator publishes the node's events


def encode_describe_request(family: int, text: str) -> bytes:
    if len(text.encode()) > MAX_DESCRIPTION_BYTES:
        raise ProtocolError(f"namespace description of {len(text.encode())} bytes; at most "
                            f"{MAX_DESCRIPTION_BYTES}")
    return PayloadWriter().u8(family).raw(text.encode()).build()


def decode_describe_request(reader: PayloadReader) -> tuple[int, str]:
    """(family, description text); a text that is not UTF-8 is a ``ProtocolError``."""
    family = reader.u8()
    raw = reader.raw(MAX_DESCRIPTION_BYTES)
    reader.done()
    try:
        return family, raw.decode()
    except UnicodeDecodeError:
        raise ProtocolError("namespace description is not UTF-8") from None


def encode_described(described: Described) -> bytes:
    return PayloadWriter().raw(described.digest).u8(int(described.node_events)).build()


def decode_described(reader: PayloadReader) -> Described:
    digest = reader.raw(NAMESPACE_BYTES)
    flag = reader.u8()
    reader.done()
    if len(digest) != NAMESPACE_BYTES or flag not in (0, 1):
        raise ProtocolError(f"DESCRIBE answer with a {len(digest)}-byte digest and flag {flag}")
    return Described(digest, bool(flag))
