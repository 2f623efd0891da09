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
"""

from __future__ import annotations

from tiercache.events.namespaces import EngineFamily, NamespaceInfo, parse_description
from tiercache.events.sink import NodeEventSink
from tiercache.events.stream import EventStats, NodeEventStream

__all__ = ["EngineFamily", "EventStats", "NamespaceInfo", "NodeEventSink", "NodeEventStream",
           "parse_description"]
