"""Generates ``dashboards/tiercache.json`` (Grafana classic JSON model) from Python.

    python dashboards/generate.py          # rewrite tiercache.json
    python dashboards/generate.py --check  # exit 1 if tiercache.json differs

Edit the panels here, not in the JSON. Every query filters on ``$instance`` (and
per-rank queries on ``$rank``), uses ``$__rate_interval`` in every ``rate`` and
``$__range`` only in whole-range ``increase`` tiles, and names only metrics that
the collectors export (``tiercache.metrics.collector``, ``tiercache.metrics.events``);
``tests/metrics/test_dashboards.py`` checks all of it, and
``tests/metrics/test_prometheus_e2e.py`` runs every query against a real Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).with_name("tiercache.json")
UID = "tiercache-overview"
DS = {"type": "prometheus", "uid": "${datasource}"}
GRID_COLUMNS = 24
# pinned host<->H100 copies, one direction (docs/benchmarks.md, "Transfer engine (issue 3)")
DEFAULT_LINK_CEILING_BPS = 55_000_000_000

INST = 'instance=~"$instance"'
RANKS = f'{INST}, rank=~"$rank"'


def rate(metric: str, selector: str = RANKS) -> str:
    return f"rate({metric}{{{selector}}}[$__rate_interval])"


def sum_rate(metric: str, by: str = "", selector: str = RANKS) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({rate(metric, selector)})"


@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False

    def model(self, ref_id: str) -> dict:
        out = {"datasource": DS, "expr": self.expr, "legendFormat": self.legend or "__auto",
               "refId": ref_id, "range": not self.instant, "instant": self.instant}
        if self.instant:
            out["format"] = "table"
        return out


@dataclass
class Panel:
    title: str
    description: str
    targets: list[Target]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    options: dict = field(default_factory=dict)
    defaults: dict = field(default_factory=dict)
    transformations: list[dict] = field(default_factory=list)


# Tables of state-set and info series: the labels are the data, the value is always 1.
HIDE_SAMPLE_COLUMNS = {"id": "organize", "options": {
    "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True}}}


def up_down_mappings(zero: str, one: str) -> list[dict]:
    return [{"type": "value", "options": {
        "0": {"text": zero, "color": "red", "index": 0},
        "1": {"text": one, "color": "green", "index": 1}}}]


def overview() -> list[Panel]:
    hits = sum_rate("tiercache_index_hit_blocks_total", selector=INST)
    misses = sum_rate("tiercache_index_miss_blocks_total", selector=INST)
    return [
        Panel("Workers up", "Ranks whose attached worker process is alive, of all ranks.",
              [Target(f"sum(tiercache_worker_up{{{RANKS}}})", "up"),
               Target(f"count(tiercache_worker_up{{{RANKS}}})", "ranks")],
              kind="stat", width=4, height=4),
        Panel("Block hit rate", "Blocks found by lookups / blocks asked for.",
              [Target(f"{hits} / ({hits} + {misses} > 0)", "hit rate")],
              kind="stat", unit="percentunit", width=4, height=4),
        Panel("Occupancy", "Fraction of the region's slots holding or receiving a block.",
              [Target(f"tiercache_index_occupancy_ratio{{{INST}}}", "occupancy")],
              kind="gauge", unit="percentunit", width=4, height=4,
              defaults={"min": 0, "max": 1}),
        Panel("Cached / capacity", "Bytes of READY blocks (all ranks) and of the whole region.",
              [Target(f'sum without (state) (tiercache_index_blocks{{{INST}, '
                      f'state=~"ready|loading"}}) * tiercache_region_block_bytes{{{INST}}}',
                      "cached"),
               Target(f"tiercache_region_bytes{{{INST}}}", "region")],
              kind="stat", unit="bytes", width=6, height=4),
        Panel("Throughput now", "Bytes per second moved, all selected ranks, per direction.",
              [Target(sum_rate("tiercache_transfer_bytes_total", "direction"), "{{direction}}")],
              kind="stat", unit="Bps", width=6, height=4),
    ]


def transfers() -> list[Panel]:
    by = "rank, direction"
    bytes_rate = sum_rate("tiercache_transfer_bytes_total", by)
    busy_rate = sum_rate("tiercache_transfer_seconds_total", by)

    def quantile(q: float, metric: str) -> Target:
        inner = sum_rate(f"{metric}_bucket", "le, direction")
        return Target(f"histogram_quantile({q}, {inner})", f"p{round(q * 100)} {{{{direction}}}}")

    return [
        Panel("Throughput per rank and direction",
              "Bytes per second moved by successful transfers (gpu_to_cpu = store, "
              "cpu_to_gpu = load).",
              [Target(bytes_rate, "rank {{rank}} {{direction}}")], unit="Bps"),
        Panel("Throughput as a fraction of the link ceiling",
              "Throughput divided by the dashboard's link ceiling variable (bytes/s per "
              "direction per GPU; 55 GB/s is a measured pinned H100 copy).",
              [Target(f"{bytes_rate} / $link_ceiling", "rank {{rank}} {{direction}}")],
              unit="percentunit", defaults={"min": 0}),
        Panel("Copy bandwidth while busy",
              "Bytes per second of transfer time: how fast copies run when they run "
              "(throughput also counts idle time).",
              [Target(f"{bytes_rate} / ({busy_rate} > 0)", "rank {{rank}} {{direction}}")],
              unit="Bps"),
        Panel("Transfer latency quantiles",
              "Duration of successful transfers, from the per-rank histograms summed over "
              "the selected ranks.",
              [quantile(q, "tiercache_transfer_duration_seconds") for q in (0.5, 0.9, 0.99)],
              unit="s"),
        Panel("Transfer size",
              "Bytes per transfer: mean and 90th percentile. Many small transfers cost "
              "more per byte.",
              [Target(f'{sum_rate("tiercache_transfer_size_bytes_sum", "direction")} / '
                      f'({sum_rate("tiercache_transfer_size_bytes_count", "direction")} > 0)',
                      "mean {{direction}}"),
               quantile(0.9, "tiercache_transfer_size_bytes")],
              unit="bytes"),
        Panel("Transfers per second by outcome",
              "Finished transfers; any 'failed' series means a copy reported failure.",
              [Target(sum_rate("tiercache_transfers_total", "direction, outcome"),
                      "{{direction}} {{outcome}}")], unit="ops"),
        Panel("Handler busy time",
              "Seconds of transfer per second, per rank and direction (1 = always copying).",
              [Target(busy_rate, "rank {{rank}} {{direction}}")],
              unit="percentunit", defaults={"min": 0}),
        Panel("Bytes moved in the time range",
              "Bytes moved per rank and direction over the whole dashboard time range.",
              [Target(f"sum by ({by}) (increase(tiercache_transfer_bytes_total{{{RANKS}}}"
                      "[$__range]))", "rank {{rank}} {{direction}}", instant=True)],
              kind="bargauge", unit="bytes",
              options={"displayMode": "gradient", "orientation": "horizontal",
                       "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
    ]


def workers() -> list[Panel]:
    return [
        Panel("Worker up/down",
              "The coordinator's view: the recorded worker pid runs, is not a zombie and "
              "started when it attached.",
              [Target(f"tiercache_worker_up{{{RANKS}}}", "rank {{rank}}")],
              kind="state-timeline", defaults={"mappings": up_down_mappings("down", "up")}),
        Panel("Pinned per rank",
              "Whether each rank's slice is registered (pinned) with its GPU.",
              [Target(f"tiercache_region_pinned{{{RANKS}}}", "rank {{rank}}")],
              kind="state-timeline",
              defaults={"mappings": up_down_mappings("not pinned", "pinned")}),
        Panel("Pin state per rank",
              "none: no worker pinned yet; unpinned: pinning failed and the config allowed "
              "running without it; failed: pinning failed and the worker refused to run; "
              "not_needed: only host-to-host attachments (SGLang ranks) on the rank.",
              [Target(f"tiercache_pin_state{{{RANKS}}} == 1", instant=True)],
              kind="table", width=8, transformations=[HIDE_SAMPLE_COLUMNS]),
        Panel("Pinned bytes, pin and pre-fault time",
              "Bytes registered with the GPU driver per rank; how long registering and "
              "pre-faulting the slice took at attach.",
              [Target(f"tiercache_pinned_bytes{{{RANKS}}}", "rank {{rank}}", instant=True),
               Target(f"tiercache_pin_duration_seconds{{{RANKS}}}", "rank {{rank}} pin s",
                      instant=True),
               Target(f"tiercache_prefault_duration_seconds{{{RANKS}}}",
                      "rank {{rank}} pre-fault s", instant=True)],
              kind="table", width=8, transformations=[{"id": "merge", "options": {}}]),
        Panel("Region reserved per rank",
              "Bytes of each rank's slice reserved (fallocated) in /dev/shm, against the "
              "region's bytes per rank: serve answers at once and reserves in the background; "
              "the index hands out only reserved slots. A reservation that stopped short "
              "because /dev/shm ran out is tiercache_region_reservation{state=\"failed\"}.",
              [Target(f"tiercache_region_reserved_bytes{{{RANKS}}}", "rank {{rank}}"),
               Target(f"tiercache_region_bytes{{{INST}}} / tiercache_region_ranks{{{INST}}}",
                      "region / ranks")],
              unit="bytes", width=8),
        Panel("Copy backend per rank and direction",
              "The backend each handler uses (auto picks per direction at attach).",
              [Target(f"tiercache_transfer_backend_info{{{RANKS}}}", instant=True)],
              kind="table", width=8, transformations=[HIDE_SAMPLE_COLUMNS]),
        Panel("NUMA placement per rank",
              "Each rank's slice: the NUMA node of its worker's GPU (-1: not known), the "
              "fraction of the slice's pages on that node (1: all local; below 1 the copies "
              "cross the socket link), and the state: placed; off (region.numa_placement = "
              "false); unknown_node (the GPU's node is not known); failed (a NUMA call "
              "failed: the worker's log names it).",
              [Target(f"tiercache_numa_node{{{RANKS}}}", "rank {{rank}} node", instant=True),
               Target(f"tiercache_numa_local_ratio{{{RANKS}}}", "rank {{rank}} local",
                      instant=True),
               Target(f"tiercache_numa_placement{{{RANKS}}} == 1", instant=True)],
              kind="table", width=8, transformations=[{"id": "merge", "options": {}}]),
        Panel("Attaches and unreadable stats in the time range",
              "Worker (re)attaches per rank; stats reads that found a block mid-update "
              "(a worker killed while writing its stats).",
              [Target(f"sum by (rank) (increase(tiercache_worker_attaches_total{{{RANKS}}}"
                      "[$__range]))", "attaches rank {{rank}}", instant=True),
               Target(f"sum by (rank) (increase(tiercache_stats_read_failures_total{{{RANKS}}}"
                      "[$__range]))", "read failures rank {{rank}}", instant=True)],
              kind="bargauge", width=24, height=6,
              options={"displayMode": "basic", "orientation": "horizontal",
                       "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
    ]


def index() -> list[Panel]:
    hits = sum_rate("tiercache_index_hit_blocks_total", selector=INST)
    misses = sum_rate("tiercache_index_miss_blocks_total", selector=INST)
    per_s = lambda metric, legend: Target(sum_rate(metric, selector=INST), legend)  # noqa: E731
    return [
        Panel("Capacity and occupancy",
              "Slots by state (stacked; they sum to the capacity line).",
              [Target(f"tiercache_index_blocks{{{INST}}}", "{{state}}"),
               Target(f"tiercache_index_capacity_blocks{{{INST}}}", "capacity")],
              defaults={"custom": {"stacking": {"mode": "normal", "group": "A"}}}),
        Panel("Occupancy", "Fraction of slots not free.",
              [Target(f"tiercache_index_occupancy_ratio{{{INST}}}", "occupancy")],
              unit="percentunit", defaults={"min": 0, "max": 1}),
        Panel("Block hit rate", "Blocks found by lookups / blocks asked for.",
              [Target(f"{hits} / ({hits} + {misses} > 0)", "hit rate")],
              unit="percentunit", defaults={"min": 0, "max": 1}),
        Panel("Lookups, stores and loads",
              "Lookup calls, and blocks stored and handed out for loading, per second.",
              [per_s("tiercache_index_lookups_total", "lookups"),
               per_s("tiercache_index_stored_blocks_total", "stored blocks"),
               per_s("tiercache_index_loaded_blocks_total", "loaded blocks")], unit="ops"),
        Panel("Evictions and rejections",
              "Blocks evicted to make room; stores refused for lack of room; stores that "
              "completed with failure.",
              [per_s("tiercache_index_evicted_blocks_total", "evicted blocks"),
               per_s("tiercache_index_store_rejections_total", "store rejections"),
               per_s("tiercache_index_failed_store_blocks_total", "failed store blocks")],
              unit="ops", width=24),
    ]


def tiers() -> list[Panel]:
    """The tiers below host memory (a coordinator with a ``[disk]`` or ``[cluster]``
    section)."""
    per_tier = lambda metric, legend: Target(  # noqa: E731
        sum_rate(metric, "tier", selector=INST), f"{{{{tier}}}} {legend}")
    return [
        Panel("Tier blocks", "Blocks each tier holds, its capacity (cluster: this node's "
              "segment; what the pool holds is the master's to say), and whether it is up "
              "(0: marked down after I/O errors or with the pool's master unreachable; "
              "lookups use the faster tiers until it is back).",
              [Target(f"tiercache_tier_blocks{{{INST}}}", "{{tier}} held"),
               Target(f"tiercache_tier_capacity_blocks{{{INST}}}", "{{tier}} capacity"),
               Target(f"tiercache_tier_up{{{INST}}}", "{{tier}} up")]),
        Panel("Tier throughput", "Bytes per second read from (promotions) and written to "
              "(demotions) each tier.",
              [per_tier("tiercache_tier_read_bytes_total", "read"),
               per_tier("tiercache_tier_write_bytes_total", "written")], unit="Bps"),
        Panel("Promotions and demotions", "Blocks per second promoted into host memory, "
              "written to the tier (disk: ahead of eviction; cluster: published), and writes "
              "dropped (not admitted, queue full, tier down).",
              [per_tier("tiercache_tier_promotions_total", "promoted"),
               per_tier("tiercache_tier_demotions_total", "written"),
               per_tier("tiercache_tier_dropped_spills_total", "dropped")], unit="ops"),
        Panel("Tier write queues", "Blocks waiting to be written to each tier (disk: "
              "demotions in flight; cluster: the publish queue, which drops past "
              "cluster.publish_queue_blocks).",
              [Target(f"tiercache_tier_queued_blocks{{{INST}}}", "{{tier}} queued")]),
        Panel("Tier failures", "Blocks whose checksum failed (dropped, never served) and I/O "
              "errors, per second.",
              [per_tier("tiercache_tier_checksum_failures_total", "checksum failures"),
               per_tier("tiercache_tier_errors_total", "I/O errors")], unit="ops"),
    ]


def engines() -> list[Panel]:
    engine = f"(tiercache_attachment_engine{{{INST}}} == 1)"
    return [
        Panel("Attachments up by engine", "Live attachments of the region by the kind of "
              "process holding them: worker (a GPU worker: vLLM ranks, the demo) or sglang "
              "(an SGLang TP rank copying host to host).",
              [Target(f"sum by (engine) ({engine} * on(instance, rank, attachment) group_left "
                      f"tiercache_attachment_up{{{INST}}})", "{{engine}}")]),
        Panel("Throughput by engine", "Bytes per second each kind of engine moved through its "
              "attachments (gpu_to_cpu: stores, for SGLang its backups; cpu_to_gpu: loads, "
              "for SGLang its prefetches).",
              [Target(f"sum by (engine, direction) (rate(tiercache_attachment_transfer_bytes_total"
                      f"{{{INST}}}[$__rate_interval]) * on(instance, rank, attachment) "
                      f"group_left(engine) {engine})", "{{engine}} {{direction}}")], unit="Bps"),
    ]


def events() -> list[Panel]:
    """The node's KV event stream (a coordinator with an ``[events]`` section)."""
    per_s = lambda metric, legend: Target(sum_rate(metric, selector=INST), legend)  # noqa: E731
    return [
        Panel("Events published", "KV events per second the node's stream published, by "
              "vLLM event type and medium (CPU: host memory; STORAGE: the disk tier; none for "
              "AllBlocksCleared), and batches per second (one sequence number each).",
              [Target(sum_rate("tiercache_events_published_total", "type, medium", INST),
                      "{{type}} {{medium}}"),
               per_s("tiercache_events_batches_total", "batches")], unit="ops"),
        Panel("Stream queue and namespaces", "Changed keys waiting to be published (past "
              "events.queue_keys they are dropped and the stream resyncs), and the namespaces "
              "engines described (a key of a namespace no engine described is not published).",
              [Target(f"tiercache_events_queued_keys{{{INST}}}", "queued keys"),
               Target(f"tiercache_events_namespaces{{{INST}}}", "namespaces")]),
        Panel("Replay", "Replay requests answered per second, the batches sent again for "
              "them, and messages on the replay socket that were not a request (ignored). "
              "Steady replays: subscribers lose batches (slower than events.hwm allows).",
              [per_s("tiercache_events_replay_requests_total", "replay requests"),
               per_s("tiercache_events_replayed_batches_total", "replayed batches"),
               per_s("tiercache_events_bad_replay_requests_total", "bad requests")],
              unit="ops"),
        Panel("Dropped, unpublished and resyncs", "Changed keys per second the stream's "
              "bounded queue dropped (each overflow resyncs); keys not published, by reason "
              "(undescribed: no engine described their namespace; unreadable: not of their "
              "engine's key shape); resyncs (AllBlocksCleared, then every block held: a start, "
              "a reset, an overflow). Routers see every change only while the first two are 0.",
              [per_s("tiercache_events_dropped_total", "dropped keys"),
               Target(sum_rate("tiercache_events_unpublished_keys_total", "reason", INST),
                      "unpublished {{reason}}"),
               per_s("tiercache_events_resyncs_total", "resyncs")], unit="ops"),
        Panel("Stream peers", "Connections to the stream's ports by socket (pub: "
              "subscribers; replay: replay requesters; at most events.max_peers each), and "
              "connections the stream ended per second, by reason (over_cap: past "
              "events.max_peers; stalled: acknowledged nothing for events.peer_timeout_s "
              "while batches waited; inbound: a subscriber sending more than subscriptions "
              "need). A router dropped reconnects and replays what it missed.",
              [Target(f"tiercache_events_peers{{{INST}}}", "{{socket}} peers"),
               Target(sum_rate("tiercache_events_peers_dropped_total", "socket, reason", INST),
                      "dropped {{socket}} {{reason}}")]),
    ]


ROWS = (("Overview", overview), ("Transfers", transfers), ("Workers and pinning", workers),
        ("Engines", engines), ("Cache index", index), ("Tiers below host memory", tiers),
        ("Node events", events))


def variables() -> list[dict]:
    def query(name: str, label: str, expr: str) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": expr, "refId": f"{name}-values"}, "definition": expr,
                "refresh": 2, "multi": True, "includeAll": True, "allValue": ".+",
                "current": {}, "options": [], "sort": 3, "hide": 0}

    return [
        {"name": "datasource", "label": "Data source", "type": "datasource",
         "query": "prometheus", "current": {}, "options": [], "refresh": 1, "hide": 0},
        query("instance", "Instance", "label_values(tiercache_build_info, instance)"),
        query("rank", "Rank", 'label_values(tiercache_worker_up{instance=~"$instance"}, rank)'),
        {"name": "link_ceiling", "label": "Link ceiling (bytes/s per direction)",
         "type": "textbox", "query": str(DEFAULT_LINK_CEILING_BPS),
         "current": {"text": str(DEFAULT_LINK_CEILING_BPS),
                     "value": str(DEFAULT_LINK_CEILING_BPS)},
         "options": [], "hide": 0,
         "description": "Host<->GPU copy bandwidth one direction can reach; throughput "
                        "panels divide by it."},
    ]


def panel_model(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    defaults = {"unit": panel.unit, **panel.defaults}
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title,
        "description": panel.description, "datasource": DS,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": panel.options,
        "targets": [t.model(chr(ord("A") + i)) for i, t in enumerate(panel.targets)],
        "transformations": panel.transformations,
    }


def dashboard() -> dict:
    panels, y, next_id = [], 0, 1
    for title, make in ROWS:
        panels.append({"id": next_id, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": GRID_COLUMNS, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        x, row_height = 0, 0
        for panel in make():
            if x + panel.width > GRID_COLUMNS:
                x, y, row_height = 0, y + row_height, 0
            panels.append(panel_model(panel, next_id, x, y))
            next_id, x, row_height = next_id + 1, x + panel.width, max(row_height, panel.height)
        y += row_height
    return {
        "id": None, "uid": UID, "title": "tiercache", "tags": ["tiercache", "kv-cache"],
        "description": "tiercache host KV-cache tier: transfers, workers, pinning, cache "
                       "index, lower tiers, node events.",
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "timezone": "",
        "annotations": {"list": []}, "links": [],
        "templating": {"list": variables()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
