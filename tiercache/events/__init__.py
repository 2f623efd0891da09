"""The node's KV event stream for routers (``[events]``; docs/events.md).

Every change to what the node holds, whoever caused it, published in vLLM 0.33's own wire
format with the engines' own block hashes, so a router that reads vLLM's KV events reads
the node. Coordinator wing, no engine imported: pyzmq and msgspec only.

* ``wire``: the frames and msgpack structs (vLLM's ``KVEventBatch``, field for field);
* ``namespaces``: engine families, namespace descriptions, key -> engine hash;
* ``sink``: ``NodeEventSink``, the index's ``NodeEvents`` hook (a mirror of what each
  medium holds and a bounded queue of changes: never blocks, drops and resyncs);
* ``replay``: the bounded buffer of past batches;
* ``publisher``: ``EventPublisher``, the thread with the PUB and ROUTER sockets;
* ``stream``: ``NodeEventStream``, the three together as the coordinator runs them.

Names resolve lazily (``_EXPORTS``): an engine that describes its namespace
(``tiercache.control.client``, ``namespaces``: plain Python) loads neither pyzmq, the
publisher nor the sink.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineFamily": "tiercache.events.namespaces",
    "NamespaceInfo": "tiercache.events.namespaces",
    "parse_description": "tiercache.events.namespaces",
    "NodeEventSink": "tiercache.events.sink",
    "EventStats": "tiercache.events.stream",
    "NodeEventStream": "tiercache.events.stream",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tiercache.events' has no attribute {name!r}")
