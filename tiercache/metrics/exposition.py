"""Prometheus text exposition format 0.0.4 (Prometheus accepts it whatever it asks for)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from tiercache.errors import ArgumentError

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def encode_text(metrics: Iterable[Metric]) -> bytes:
    """Prometheus text format 0.0.4 of counter, gauge and histogram families.

    Equivalent to ``prometheus_client.generate_latest`` for these types (a test checks
    it) and written here because generic escaping of every name and label was most of
    a scrape's cost, whose budget is 20 ms for 8 ranks (docs/benchmarks.md).
    """
    out: list[str] = []
    for m in metrics:
        if m.type not in _TEXT_TYPES:
            raise ArgumentError(f"metric {m.name}: type {m.type!r} is not exported by tiercache "
                                f"(allowed: {', '.join(sorted(_TEXT_TYPES))})")
        name = m.name + "_total" if m.type == "counter" else m.name
        doc = m.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {m.type}\n")
        for s in m.samples:
            if s.labels:
                labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in s.labels.items())
                out.append(f"{s.name}{{{labels}}} {_number(s.value)}\n")
            else:
                out.append(f"{s.name} {_number(s.value)}\n")
    return "".join(out).encode()


_TEXT_TYPES = frozenset({"counter", "gauge", "histogram"})


def _escape_label(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace('"', r'\"').replace("\n", r"\n")
    return value


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value):
        return repr(value)
    return floatToGoString(value)  # +Inf, -Inf, NaN


__all__ = ["TEXT_CONTENT_TYPE", "encode_text"]
