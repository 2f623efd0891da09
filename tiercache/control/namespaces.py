"""DESCRIBE, the coordinator's side: a session describes one of its key namespaces
(the wire: ``tiercache.link.describe``) and the node's event stream learns it, so it can
publish that namespace's blocks with the engine's own hashes.

A description that does not parse is a ``ConfigError`` (the connection stays: the
engine's configuration is at fault, not the stream). A client sends it once per namespace
and again on every reconnect (``Client.describe``), so a restarted coordinator learns its
namespaces back. Bounded: one description is at most 64 KiB, and the stream keeps at most
``MAX_NAMESPACES`` (``tiercache.events.namespace_table``: one no session holds makes room;
if a live session holds each, the description is refused with a ``StateError`` and its
blocks are not published). The digest is computed here, never taken from the client: a
client can describe a namespace only as its keys' own prefix says.

**Stored under a namespace** means: a key whose first ``NAMESPACE_BYTES`` are the digest of
a namespace the stream publishes. The session that describes a namespace holds it (until
it ends), and only its holders may store under it: PREPARE_STORE and COMPLETE_STORE of a
key under a described namespace the session does not hold are refused before any change
(``NamespaceError``, naming the namespace), so a client cannot make the stream announce
blocks under a model it read off a topic. Keys under no described namespace (``Client``,
``tiercache demo``) are stored as ever and never published (``tiercache.events.sink``).
Without an event stream the answer is the digest and 0, nothing is kept and stores are
not checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tiercache.errors import ConfigError, NamespaceError, ProtocolError
from tiercache.link.describe import Described, decode_describe_request, encode_described
from tiercache.link.namespaces import NamespaceInfo, parse_description
from tiercache.link.protocol import PayloadReader

if TYPE_CHECKING:  # the server's verb table
    from tiercache.control.verbs import StoreCheck


class Describer(Protocol):
    """What the coordinator's event stream offers the control plane (``NodeEventStream``)."""

    def describe(self, family: int, text: str, owner: int) -> NamespaceInfo:
        """Session ``owner`` describes a namespace (``ProtocolError``, ``StateError``)."""

    def foreign_namespace(self, keys: Sequence[bytes], owner: int) -> NamespaceInfo | None:
        """A described namespace of ``keys`` that session ``owner`` does not hold."""

    def session_ended(self, owner: int) -> None:
        """Session ``owner`` is gone: it holds no namespace any more."""


def describe(stream: Describer | None, reader: PayloadReader, owner: int) -> bytes:
    """The server's side: learn the namespace for session ``owner`` (if a stream runs),
    answer its digest."""
    family, text = decode_describe_request(reader)
    try:
        info = (parse_description(family, text) if stream is None
                else stream.describe(family, text, owner))
    except ProtocolError as e:  # what it says, not how: the connection stays
        raise ConfigError(str(e)) from None
    return encode_described(Described(info.digest, stream is not None))


def describer(stream: Describer | None) -> Callable[[Any, PayloadReader, int], bytes]:
    """DESCRIBE as one of the server's verb handlers (it needs the stream, not the index)."""
    return lambda manager, reader, owner: describe(stream, reader, owner)


def store_check(stream: Describer | None) -> StoreCheck | None:
    """The store verbs' check (``tiercache.control.verbs.store_verbs``): keys only under
    namespaces the storing session holds (see the module docstring); None without a
    stream."""
    if stream is None:
        return None

    def check(keys: Sequence[bytes], owner: int) -> None:
        info = stream.foreign_namespace(keys, owner)
        if info is not None:
            raise NamespaceError(
                f"keys under namespace {info.hex} ({info.model}), which this session did not "
                "describe: a session stores only under namespaces it described (DESCRIBE) "
                "while the node's event stream publishes them")

    return check

