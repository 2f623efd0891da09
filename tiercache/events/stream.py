"""``NodeEventStream``: the sink and its publisher, as the coordinator runs them.

``stream.sink`` is what the index and the tiers call (the ``NodeEvents`` hook);
``describe(family, text)`` is what the control plane's DESCRIBE verb calls; ``stats()``
is what the exporter reads (``tiercache.metrics.events``)."""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.config.events import EventsConfig
from tiercache.events.namespaces import NamespaceInfo, parse_description
from tiercache.events.publisher import EventPublisher, PublisherStats
from tiercache.events.sink import NodeEventSink, SinkStats


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

    def describe(self, family: int, text: str) -> NamespaceInfo:
        """Learn a namespace from an engine's description (``ProtocolError`` if malformed,
        ``StateError`` if no room); its keys are published from the next batch on."""
        info = parse_description(family, text)
        self.sink.describe(info)
        return info

    def stats(self) -> EventStats:
        return EventStats(self.sink.stats(), self.publisher.stats())
