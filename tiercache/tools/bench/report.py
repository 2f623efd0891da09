"""The bench's output: one progress line per step on stderr, the table on stdout, every
figure in the JSON rows."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field


@dataclass
class Progress:
    """One line per finished step on stderr: ``[i/n] what ... result``."""

    total: int
    done: int = 0

    def step(self, what: str, result: str) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {what:42s} {result}", file=sys.stderr, flush=True)


@dataclass
class Report:
    machine: str
    ceiling: dict[str, float] = field(default_factory=dict)  # GB/s
    rows: list[dict] = field(default_factory=list)

    def add(self, **row) -> None:
        self.rows.append(row)

    def write_json(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump({"machine": self.machine, "ceiling": self.ceiling, "rows": self.rows},
                      fh, indent=1, default=str)


def fmt_rate(gbps: float, ceiling: float) -> str:
    return f"{gbps:6.1f} GB/s ({gbps / ceiling:.2f})"


def _shown_name(row: dict) -> str:
    """The row's backend, with what ran where that is not the kind asked for (``auto``'s
    choice, or ``ce`` running as ``ce_loop``): ``auto=staged/staged``."""
    ran = (row.get("store_name", row["kind"]), row.get("load_name", row["kind"]))
    if ran == (row["kind"], row["kind"]):
        return row["backend"]
    return f"{row['backend']}={ran[0]}/{ran[1]}"


def _rate_lines(report: Report) -> list[str]:
    c = report.ceiling
    lines = [f"{'workload':24s} {'backend':14s} {'gpu_to_cpu':>20s} {'cpu_to_gpu':>20s} "
             f"{'both':>20s}"]
    for r in report.rows:
        if r.get("mode") == "matmul":
            continue
        cells = [(fmt_rate(r[k], c[k]) if k in r else "-")
                 for k in ("gpu_to_cpu", "cpu_to_gpu", "both")]
        lines.append(f"{r['workload']:24s} {_shown_name(r):14s} {cells[0]:>20s} {cells[1]:>20s} "
                     f"{cells[2]:>20s}")
    return lines


def _latency_lines(report: Report) -> list[str]:
    rows = [r for r in report.rows if "latency_us" in r]
    if not rows:
        return []
    lines = ["", f"{'backend':14s} {'1-block store us':>17s} {'load us':>8s} {'target us':>10s} "
                 f"{'submit 16k us':>14s} {'plan 16k us':>12s}"]
    for r in rows:
        lines.append(f"{r['backend']:14s} {r['latency_us']:17.0f} {r['latency_load_us']:8.0f} "
                     f"{r['latency_target_us']:10.0f} {r['submit_us']:14.0f} "
                     f"{r['plan_us']:12.0f}")
    return lines


def _engine_lines(report: Report) -> list[str]:
    """Wall clock as an engine sees it (through the handlers, transfer_async -> result)."""
    rows = [r for r in report.rows if "engine_both" in r]
    if not rows:
        return []
    c = report.ceiling
    lines = ["", "engine view (wall clock from transfer_async to the result, scattered blocks):",
             f"{'workload':24s} {'backend':14s} {'gpu_to_cpu':>20s} {'cpu_to_gpu':>20s} "
             f"{'both':>20s} {'call us st/ld/1':>16s} {'1-block us':>10s}"]
    for r in rows:
        cells = [fmt_rate(r[f"engine_{k}"], c[k]) for k in ("gpu_to_cpu", "cpu_to_gpu", "both")]
        calls = f"{r['engine_submit_us']:.0f}/{r['engine_submit_load_us']:.0f}/" \
                f"{r['engine_submit_one_us']:.0f}"
        lines.append(f"{r['workload']:24s} {_shown_name(r):14s} {cells[0]:>20s} {cells[1]:>20s} "
                     f"{cells[2]:>20s} {calls:>16s} {r['engine_one_block_us']:10.0f}")
    return lines


def _pattern_lines(report: Report) -> list[str]:
    """The engine's pattern (tiercache.tools.bench.engine): both-ways rates against the
    sum of the one-way ceilings, call host times and the one-block load as p50/p99."""
    rows = [r for r in report.rows if "pattern_store_first_ratio" in r]
    if not rows:
        return []
    lines = ["", "engine pattern (store and load back to back from one thread, another Python "
                 "thread busy; both ways / sum of one-way ceilings, median [min]; host time "
                 "p50/p99):",
             f"{'workload':24s} {'backend':14s} {'store first':>12s} {'load first':>12s} "
             f"{'torch copies':>12s} {'store call us':>14s} {'load call us':>13s} "
             f"{'1-block us':>11s} {'spin':>9s} {'torch':>9s} {'target':>6s} "
             f"{'1-block call':>12s} {'lost GIL':>8s} "
             f"{'GCs (max ms)':>12s} {'issue':>6s}"]
    for r in rows:
        def ratio(k: str) -> str:
            return f"{r[f'pattern_{k}_ratio']:.2f} [{r[f'pattern_{k}_min_ratio']:.2f}]"

        def pcts(k: str) -> str:
            return f"{r[f'pattern_{k}_p50_us']:.0f}/{r[f'pattern_{k}_p99_us']:.0f}"

        lines.append(f"{r['workload']:24s} {_shown_name(r):14s} {ratio('store_first'):>12s} "
                     f"{ratio('load_first'):>12s} {ratio('control'):>12s} "
                     f"{pcts('store_call'):>14s} {pcts('load_call'):>13s} "
                     f"{pcts('one_block'):>11s} {pcts('one_block_spin'):>9s} "
                     f"{pcts('one_block_torch'):>9s} {r['pattern_one_block_target_us']:6.0f} "
                     f"{pcts('one_call'):>12s} {r['pattern_calls_interrupted']:8.2f} "
                     f"{r['pattern_gc_collections']:>5d} ({r['pattern_gc_max_ms']:.1f}) "
                     f"{_issue(r):>6s}")
    return lines


_ISSUES: dict[tuple[object, object], str] = {(True, True): "native", (False, False): "python"}


def _issue(row: dict) -> str:
    """How the handlers issued: one native call per transfer, or plan + submit (Python)."""
    native = (row.get("pattern_native_store"), row.get("pattern_native_load"))
    return _ISSUES.get(native, "mixed")


def _matmul_lines(report: Report) -> list[str]:
    rows = [r for r in report.rows if r.get("mode") == "matmul"]
    if not rows:
        return []
    lines = ["", f"{'matmul beside':14s} {'solo TFLOP/s':>12s} {'beside':>8s} {'ratio':>6s} "
                 f"{'min':>6s} {'copies GB/s':>12s}   (median of rounds solo/beside/solo; "
                 "every round's ratio)"]
    both = report.ceiling["both"]
    for r in rows:
        copies = r["copy_both_gbps_beside"]
        lines.append(f"{r['backend']:14s} {r['matmul_solo_tflops']:12.0f} "
                     f"{r['matmul_beside_tflops']:8.0f} {r['matmul_ratio']:6.3f} "
                     f"{r['matmul_min_ratio']:6.3f} {copies:8.1f} ({copies / both:.2f})   "
                     + " ".join(f"{x:.3f}" for x in r["matmul_ratios"])
                     + ("" if r["copies_covered_matmul"] else " [copies ended first]"))
    return lines


def format_report(report: Report) -> str:
    header = [f"machine: {report.machine}",
              "ceiling: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in report.ceiling.items()),
              ""]
    return "\n".join(header + _rate_lines(report) + _latency_lines(report)
                     + _engine_lines(report) + _pattern_lines(report) + _matmul_lines(report))
