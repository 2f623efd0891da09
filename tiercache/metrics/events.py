"""The event stream's metrics (``tiercache_events_*``), read from the stream at scrape time.

``EventsCollector(stats)`` serves ``NodeEventStream.stats``; ``collectors(a, b)`` serves
several collectors as one (the exporter takes one). Labels are bounded: ``type`` is one
of vLLM's three event types, ``medium`` one of the engines' names for the node's media
(vLLM's ``CPU``, ``STORAGE``; SGLang's ``CPU_PINNED``, ``DISK``) or ``""`` (a clear).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tiercache.events.peers import DropReason
from tiercache.events.stream import EventStats

EVENT_METRIC_NAMES = (
    "tiercache_events_published_total", "tiercache_events_batches_total",
    "tiercache_events_replay_requests_total", "tiercache_events_bad_replay_requests_total",
    "tiercache_events_replayed_batches_total", "tiercache_events_dropped_total",
    "tiercache_events_resyncs_total", "tiercache_events_unpublished_keys_total",
    "tiercache_events_queued_keys", "tiercache_events_namespaces", "tiercache_events_peers",
    "tiercache_events_peers_dropped_total",
)


class EventsCollector(Collector):
    def __init__(self, stats: Callable[[], EventStats]):
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._stats()))

    @staticmethod
    def _families(stats: EventStats | None) -> list[Metric]:
        published = CounterMetricFamily(
            "tiercache_events_published", "KV events the node's stream published, by vLLM "
            "event type and medium (\"\" for AllBlocksCleared)", labels=("type", "medium"))
        unpublished = CounterMetricFamily(
            "tiercache_events_unpublished_keys", "Changed keys not published: stored while no "
            "session had described their namespace, as Client and tiercache demo store "
            "(reason=no_namespace), held from before the stream began or of a namespace "
            "given up, and not described (again) (reason=undescribed), or not of their "
            "engine's shape (reason=unreadable)", labels=("reason",))
        counters = {
            "batches": ("Batches published (one sequence number each)", "batches"),
            "replay_requests": ("Replay requests answered", "replay_requests"),
            "bad_replay_requests": ("Messages on the replay socket that were not replay "
                                    "requests (ignored)", "bad_replay_requests"),
            "replayed_batches": ("Batches sent again in answer to replay requests",
                                 "replayed_batches"),
            "resyncs": ("Times the stream started over: AllBlocksCleared, then every block "
                        "held (a start, a reset, an overflow of the queue)", "resyncs"),
        }
        counted = [CounterMetricFamily(f"tiercache_events_{name}", doc)
                   for name, (doc, _) in counters.items()]
        dropped = CounterMetricFamily(
            "tiercache_events_dropped", "Changed keys dropped by the stream's bounded queue "
            "(events.queue_keys) before they were published; each overflow resyncs")
        queued = GaugeMetricFamily("tiercache_events_queued_keys",
                                   "Changed keys waiting to be published")
        namespaces = GaugeMetricFamily("tiercache_events_namespaces",
                                       "Namespaces engines described (published)")
        peers = GaugeMetricFamily(
            "tiercache_events_peers", "Connections to the stream's ports now, by socket (pub: "
            "subscribers, replay: replay requesters); at most events.max_peers each",
            labels=("socket",))
        peers_dropped = CounterMetricFamily(
            "tiercache_events_peers_dropped", "Connections the stream ended, by socket and "
            "reason: over_cap (accepted while events.max_peers were connected), stalled "
            "(acknowledged nothing for events.peer_timeout_s while bytes waited for it), "
            "inbound (a subscriber that sent more than subscriptions need)",
            labels=("socket", "reason"))
        families: list[Metric] = [published, *counted, dropped, unpublished, queued, namespaces,
                                  peers, peers_dropped]
        if stats is None:
            return families
        pub = stats.publisher
        for (kind, medium), count in sorted(pub.events.items()):
            published.add_metric([kind, medium], count)
        for family, (_, field) in zip(counted, counters.values(), strict=True):
            family.add_metric([], getattr(pub, field))
        dropped.add_metric([], stats.sink.dropped_keys)
        unpublished.add_metric(["no_namespace"], stats.sink.no_namespace_keys)
        unpublished.add_metric(["undescribed"],
                               pub.undescribed_keys + stats.sink.undescribed_keys)
        unpublished.add_metric(["unreadable"], pub.unreadable_keys)
        queued.add_metric([], stats.sink.queued_keys)
        namespaces.add_metric([], stats.sink.namespaces)
        for name, connected in sorted(pub.peers.items()):
            peers.add_metric([name], connected)
            for reason in DropReason:
                peers_dropped.add_metric([name, reason.value],
                                         pub.peers_dropped[name, reason.value])
        return families


class Part(Protocol):
    """A collector that also describes its families (ours all do)."""

    def describe(self) -> Iterator[Metric]: ...
    def collect(self) -> Iterator[Metric]: ...


class _Collectors(Collector):
    def __init__(self, parts: tuple[Part, ...]):
        self._parts = parts

    def describe(self) -> Iterator[Metric]:
        for part in self._parts:
            yield from part.describe()

    def collect(self) -> Iterator[Metric]:
        for part in self._parts:
            yield from part.collect()


def collectors(*parts: Part) -> Collector:
    return _Collectors(parts)
