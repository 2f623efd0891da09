"""``tiercache_events_*`` from a real ``tiercache serve`` with ``[events]``: the exposition
passes ``promtool check metrics``, and the counters say what a subscriber received."""

from __future__ import annotations

import time
import urllib.request

import zmq

from tiercache.config import EventsConfig, ExporterConfig
from tiercache.link.client import Client
from tiercache.link.namespaces import EngineFamily
from tiercache.events.wire import decode_batch
from tiercache.metrics.events import EVENT_METRIC_NAMES
from tiercache.service.process import CoordinatorProcess

from e2e_support import metrics_url, sample, scrape
from event_support import namespace, stream_endpoints, vllm_key
from metrics_support import promtool_check

WAIT_S = 120.0


def test_the_stream_metrics_lint_and_count_what_subscribers_receive(make_config, tmp_path):
    config = make_config(world_size=1, exporter=ExporterConfig(port=0),
                         events=EventsConfig(endpoint="tcp://127.0.0.1:0",
                                             batch_interval_s=0.02))
    ns = namespace()
    with CoordinatorProcess(config, tmp_path) as coordinator, zmq.Context() as context:
        url = metrics_url(coordinator)
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(stream_endpoints(coordinator)[0])
        received: dict[tuple[str, str], int] = {}
        with Client(config) as client:
            client.describe(EngineFamily.VLLM, ns.description)
            keys = [vllm_key(ns, i.to_bytes(32, "big")) for i in range(40)]  # 16 slots
            deadline = time.monotonic() + WAIT_S
            stored = 0
            while not received.get(("BlockRemoved", "CPU")):  # the subscription is live
                assert time.monotonic() < deadline, received
                out = client.prepare_store(keys[stored % 40:stored % 40 + 8])
                client.complete_store(list(out.keys_to_store))
                stored += 8
                while sub.poll(100):
                    for event in decode_batch(sub.recv_multipart()[2]).events:
                        kind = (type(event).__name__, getattr(event, "medium", "") or "")
                        received[kind] = received.get(kind, 0) + 1
        text = urllib.request.urlopen(url, timeout=10).read()
        promtool_check(text)
        assert set(EVENT_METRIC_NAMES) <= {line.split()[2] for line in text.decode().splitlines()
                                           if line.startswith("# TYPE")}
        samples = scrape(url)
        assert sample(samples, "tiercache_events_namespaces") == 1
        assert sample(samples, "tiercache_events_dropped_total") == 0
        published = sample(samples, "tiercache_events_published_total", type="BlockRemoved",
                           medium="CPU")
        assert published >= received[("BlockRemoved", "CPU")] > 0  # a late joiner sees less
        sub.close()
