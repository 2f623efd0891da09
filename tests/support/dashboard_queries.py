"""The shipped Grafana dashboards as data: their panels, their queries, and the queries
with Grafana's variables substituted the way Grafana would (shared by the dashboard
structure tests and the end-to-end test against a real Prometheus)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "dashboards"
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}: {self.expr}"


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(model: dict) -> list[dict]:
    """Every panel, rows' children included (a collapsed row holds its panels)."""
    out = []
    for panel in model["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(model: dict) -> list[Query]:
    return [Query(model["uid"], p["title"], t["refId"], t["expr"])
            for p in panels(model) for t in p.get("targets", [])]


def default_values(model: dict) -> dict[str, str]:
    """What each template variable stands for when nothing is chosen: "All" for
    multi-value query variables (their ``allValue`` regex), the default of a textbox."""
    values = {}
    for var in model["templating"]["list"]:
        if var["type"] == "query":
            values[var["name"]] = var["allValue"]
        elif var["type"] == "textbox":
            values[var["name"]] = var["query"]
    return values


def substitute(expr: str, variables: dict[str, str], rate_interval: str = "1m",
               range_: str = "1h") -> str:
    """``expr`` with Grafana's macros and the given variables replaced; an unknown
    variable raises KeyError, so a typo in a dashboard cannot pass."""
    macros = {"__rate_interval": rate_interval, "__range": range_, "__interval": rate_interval}

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in macros:
            return macros[name]
        return variables[name]

    return _VARIABLE.sub(replace, expr)
