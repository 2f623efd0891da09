"""``NodeEventStream``: the sink and its publisher, as the coordinator runs them.

``stream.sink`` is what the index and the tiers call (the ``NodeEvents`` hook);
``describe(family, text, owner)`` is what the control plane's DESCRIBE verb calls,
``foreign_namespace`` what its store verbs ask and ``session_ended`` what it says when a
session ends (``tiercache.control.namespaces``); ``stats()`` is what the exporter reads
(``tiercache.metrics.events``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.config.events import EventsConfig
from tiercache.link.namespaces import NamespaceInfo, parse_description
from tiercache.events.publisher import EventPublisher, PublisherStats
from tiercache.events.sink import NodeEventSink, SinkStats
from tiercache.index.manager import LOCAL_OWNER


@dataclass(frozen=True)
class EventStats:
    sink: SinkStats
    publisher: PublisherStats


class NodeEventStream:
    def __init__(self, config: EventsConfig):
        self.config = config
        self.sink = NodeEventSink(config.queue_keys)
        self.publisher = EventPublisher(config, self.sink)

    def start(self) -> None:
        self.publisher.start()

    def close(self) -> None:
        self.publisher.close()

    def describe(self, family: int, text: str, owner: int = LOCAL_OWNER) -> NamespaceInfo:
        """Learn a namespace from session ``owner``'s description (``ProtocolError`` if
        malformed, ``StateError`` if no room); its keys are published from the next batch
        on, and ``owner`` may store under it."""
        info = parse_description(family, text)
        self.sink.describe(info, owner)
        return info

    def foreign_namespace(self, keys: Sequence[bytes], owner: int) -> NamespaceInfo | None:
        """A described namespace of ``keys`` that session ``owner`` may not store under."""
        return self.sink.foreign_namespace(keys, owner)

    def session_ended(self, owner: int) -> None:
        self.sink.session_ended(owner)

    def stats(self) -> EventStats:
        return EventStats(self.sink.stats(), self.publisher.stats())
