"""Structure rules for the shipped Grafana dashboards, checked without Grafana: the JSON
is what the generator writes, every query parses (promtool) after variable
substitution, and names only metrics and labels the collector exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiercache.metrics.exposition import encode_text
from tiercache.events.publisher import PublisherStats
from tiercache.events.sink import SinkStats
from tiercache.events.stream import EventStats
from tiercache.metrics.collector import TiercacheCollector
from tiercache.metrics.events import EventsCollector, collectors
from tiercache.numa.placement import NumaPlacement, NumaState
from tiercache.region.stats import PinState
from tiercache.specs import Direction

import dashboard_queries as dq
from metrics_support import sample_manager_stats, FakeRegion, attach_self, promtool

GRID_COLUMNS = 24
DASHBOARDS = [(path.name, dq.load(path)) for path in dq.dashboard_files()]
_RANGE = re.compile(r"\[([^\]]*)\]")
_RATE = re.compile(r"\b(rate|irate|increase)\(\s*[a-zA-Z_]\w*(?:\{[^}]*\})?\[([^\]]*)\]\)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right"}


def test_there_is_a_dashboard():
    assert "tiercache.json" in [name for name, _ in DASHBOARDS]


def test_json_is_what_the_generator_writes():
    run = subprocess.run([sys.executable, str(dq.DASHBOARD_DIR / "generate.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("name, model", DASHBOARDS)
def test_top_level(name, model):
    assert model["id"] is None
    assert 0 < len(model["uid"]) <= 40
    assert model["title"] and model["schemaVersion"] >= 39
    assert "__inputs" not in model, "export-for-sharing inputs break file provisioning"
    assert "DS_" not in json.dumps(model)


def test_uids_are_unique_across_files():
    uids = [model["uid"] for _, model in DASHBOARDS]
    assert len(uids) == len(set(uids))


@pytest.mark.parametrize("name, model", DASHBOARDS)
def test_variables(name, model):
    variables = {v["name"]: v for v in model["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}", var["name"]
            assert var["multi"] and var["includeAll"] and var["allValue"] == ".+"
    assert "tiercache_worker_up" in variables["rank"]["definition"]
    ceiling = variables["link_ceiling"]
    assert ceiling["type"] == "textbox" and float(ceiling["query"]) > 0


@pytest.mark.parametrize("name, model", DASHBOARDS)
def test_panels_are_laid_out_and_use_the_datasource_variable(name, model):
    panels = dq.panels(model)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    boxes = []
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= GRID_COLUMNS, p["title"]
        boxes.append((pos["x"], pos["y"], pos["x"] + pos["w"], pos["y"] + pos["h"], p["title"]))
        if p["type"] == "row":
            continue
        assert p["title"] and p["description"], f"panel {p['id']} needs a title and description"
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap = a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
            assert not overlap, f"panels {a[4]!r} and {b[4]!r} overlap"


@pytest.mark.parametrize("name, model", DASHBOARDS)
def test_every_rate_uses_rate_interval(name, model):
    instant = {(p["title"], t["refId"]) for p in dq.panels(model)
               for t in p.get("targets", []) if t.get("instant")}
    for q in dq.queries(model):
        calls = _RATE.findall(q.expr)
        assert len(calls) == len(_RANGE.findall(q.expr)), f"unrecognised range in {q}"
        for func, window in calls:
            if func == "increase" and window == "$__range":
                assert (q.panel, q.ref_id) in instant, f"$__range outside an instant tile: {q}"
            else:
                assert window == "$__rate_interval", str(q)


def _rules_file(exprs: list[str]) -> str:
    rules = [{"record": f"dashboard_query_{i}", "expr": e} for i, e in enumerate(exprs)]
    return json.dumps({"groups": [{"name": "dashboard_queries", "rules": rules}]})


def _promtool_rules(tmp_path, exprs: list[str]) -> subprocess.CompletedProcess:
    path = tmp_path / "rules.yml"  # JSON is YAML
    path.write_text(_rules_file(exprs))
    return subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                          text=True)


@pytest.mark.parametrize("name, model", DASHBOARDS)
def test_every_query_parses_after_substitution(name, model, tmp_path):
    values = dq.default_values(model)
    exprs = [dq.substitute(q.expr, values) for q in dq.queries(model)]
    run = _promtool_rules(tmp_path, exprs)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(exprs)} rules found" in run.stdout


def test_promtool_rejects_a_broken_query(tmp_path):
    """The parse check above can fail: an unsubstituted variable is a parse error."""
    run = _promtool_rules(tmp_path, ['sum(rate(tiercache_transfer_bytes_total[$__rate_interval]))'])
    assert run.returncode != 0


def _exposition() -> tuple[set[str], set[str]]:
    """Sample names and label names of a full scrape of fabricated state."""
    region = FakeRegion(world_size=2)
    for rank in range(2):
        view = attach_self(region, rank)
        view.set_pin(PinState.PINNED, 1 << 20, 0.1)
        view.set_numa(NumaPlacement(NumaState.PLACED, rank, 256, 256, 0.01))
        view.record_transfer(Direction.GPU_TO_CPU, 4096, 1e-4, success=True)
    from tiercache.results import TierStats

    disk = TierStats(capacity_blocks=8, used_blocks=2)  # a coordinator with a disk tier
    node = TiercacheCollector(region, sample_manager_stats, tier_stats=lambda: {"disk": disk})
    events = EventsCollector(lambda: EventStats(  # ... and an event stream
        SinkStats(queued_keys=3, namespaces=1),
        PublisherStats(batches=2, events=Counter({("AllBlocksCleared", ""): 1,
                                                  ("BlockStored", "CPU"): 4}),
                       peers={"pub": 2, "replay": 0})))
    text = encode_text(collectors(node, events).collect()).decode()
    samples, labels = set(), {"instance", "job"}  # added by Prometheus at scrape time
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.add(s.name)
            labels.update(s.labels)
    return samples, labels


def metric_names(expr: str) -> set[str]:
    """Identifiers of an expression that are neither functions, keywords nor labels."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = _GROUPING.sub("", bare)
    bare = _MATCHERS.sub("", bare)
    bare = _RANGE.sub("", bare)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][\w:]*", bare):
        followed_by_call = re.match(r"\s*\(", bare[m.end():])
        if not followed_by_call and m.group() not in _KEYWORDS:
            names.add(m.group())
    return names


def label_names(expr: str, legend: str) -> set[str]:
    names = set()
    for _, group in _GROUPING.findall(expr):
        names.update(n.strip() for n in group.split(",") if n.strip())
    for block in _MATCHERS.findall(re.sub(r'"[^"]*"', '""', expr)):
        names.update(m.group(1) for m in re.finditer(r"(\w+)\s*[=!]~?", block))
    names.update(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    return names


def test_metric_name_extraction_sees_through_grouping_and_matchers():
    expr = ('sum by (rank, le) (rate(tiercache_a_bucket{rank=~"x|y"}[1m])) / '
            'on (rank) group_left tiercache_b > 0')
    assert metric_names(expr) == {"tiercache_a_bucket", "tiercache_b"}
    assert label_names(expr, "{{rank}} {{ state }}") == {"rank", "le", "state"}


@pytest.mark.parametrize("name, model", DASHBOARDS)
def test_queries_name_only_exported_metrics_and_labels(name, model):
    samples, labels = _exposition()
    values = dq.default_values(model)
    legends = {(p["title"], t["refId"]): t.get("legendFormat", "")
               for p in dq.panels(model) for t in p.get("targets", [])}
    for q in dq.queries(model):
        expr = dq.substitute(q.expr, values)
        unknown = metric_names(expr) - samples
        assert not unknown, f"{q} names metrics the collector does not export: {unknown}"
        legend = legends[q.panel, q.ref_id].replace("__auto", "")
        unknown_labels = label_names(expr, legend) - labels
        assert not unknown_labels, f"{q} uses labels nothing exports: {unknown_labels}"


@pytest.mark.parametrize("name, model", DASHBOARDS)
def test_every_variable_query_names_exported_metrics(name, model):
    samples, _ = _exposition()
    for var in model["templating"]["list"]:
        if var["type"] == "query":
            metric = re.match(r"label_values\((\w+)", var["definition"]).group(1)
            assert metric in samples, var["name"]


def test_overview_dashboard_covers_what_operators_need():
    model = dict(DASHBOARDS)["tiercache.json"]
    exprs = " ".join(q.expr for q in dq.queries(model))
    for needed in ("tiercache_transfer_bytes_total", "$link_ceiling",
                   "histogram_quantile(0.99, sum by (le, direction) "
                   "(rate(tiercache_transfer_duration_seconds_bucket",
                   "increase(tiercache_transfer_bytes_total", "tiercache_region_pinned",
                   "tiercache_pin_state", "tiercache_worker_up", "tiercache_index_capacity_blocks",
                   "tiercache_index_occupancy_ratio", "tiercache_index_hit_blocks_total",
                   "tiercache_index_miss_blocks_total", "tiercache_index_evicted_blocks_total",
                   "tiercache_index_store_rejections_total"):
        assert needed in exprs, needed


def test_every_event_stream_family_has_a_panel():
    """The node's event stream is watched: each ``tiercache_events_*`` family the collector
    exports is in a query of the dashboard (a new family fails here until it has a panel)."""
    model = dict(DASHBOARDS)["tiercache.json"]
    named = set().union(*(metric_names(q.expr) for q in dq.queries(model)))
    families = {name for name in _exposition()[0] if name.startswith("tiercache_events_")}
    assert len(families) >= 10
    assert not families - named, f"families without a panel: {sorted(families - named)}"


def test_observability_doc_lists_every_row_and_panel_in_order():
    """docs/observability.md's panel list is the dashboard's: each row (bold) with each of
    its panels (a bullet naming it in italics), in the dashboard's order."""
    text = (dq.DASHBOARD_DIR.parent / "docs" / "observability.md").read_text()
    listed: list[tuple[str, list[str]]] = []
    for line in text.split("### Panels", 1)[1].split("\n## ", 1)[0].splitlines():
        if row := re.match(r"\*\*(.+?)\*\*", line):
            listed.append((row.group(1), []))
        elif panel := re.match(r"\* \*(.+?)\* — ", line):
            listed[-1][1].append(panel.group(1))
    rows: list[tuple[str, list[str]]] = []
    for panel in dict(DASHBOARDS)["tiercache.json"]["panels"]:
        if panel["type"] == "row":
            rows.append((panel["title"], []))
        else:
            rows[-1][1].append(panel["title"])
    assert listed == rows


def test_provisioning_files_point_grafana_at_the_dashboards():
    provider = (dq.DASHBOARD_DIR / "provisioning" / "dashboards" / "tiercache.yaml").read_text()
    assert "apiVersion: 1" in provider and "type: file" in provider
    assert re.search(r"^\s+path: /\S+", provider, re.M)
    source = (dq.DASHBOARD_DIR / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    assert "type: prometheus" in source and re.search(r"timeInterval: \d+s", source)
