"""The node's KV event stream for routers (``[events]``; docs/events.md).

Every change to what the node holds, whoever caused it, published in vLLM 0.33's own wire
format with the engines' own block hashes, so a router that reads vLLM's KV events reads
the node. Coordinator wing, no engine imported: pyzmq and msgspec only.

* ``wire``: the frames and msgpack structs (vLLM's ``KVEventBatch``, field for field);
* ``sink``: ``NodeEventSink``, the index's ``NodeEvents`` hook (a mirror of what each
  medium holds and a bounded queue of changes: never blocks, drops and resyncs);
* ``replay``: the bounded buffer of past batches;
* ``publisher``: ``EventPublisher``, the thread with the PUB and ROUTER sockets;
* ``stream``: ``NodeEventStream``, the three together as the coordinator runs them.

The engine families, namespace descriptions and key -> engine hash it publishes by are
``tiercache.link.namespaces``: engines describe their namespaces with them and load nothing
of this package. Names resolve lazily (``_EXPORTS``): importing the package loads neither
pyzmq, the publisher nor the sink.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "NodeEventSink": "tiercache.events.sink",
    "EventStats": "tiercache.events.stream",
    "NodeEventStream": "tiercache.events.stream",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tiercache.events' has no attribute {name!r}")
