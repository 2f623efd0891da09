"""What the demo counts, its live progress line, and its summary (text and JSON)."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from tiercache.specs import Direction
from tiercache.tools.demo.wire import Report

GB = 1e9


@dataclass
class DirectionTotals:
    """What the workers reported for one rank and direction."""

    bytes: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    busy_s: float = 0.0  # stream-timed

    def add(self, report: Report) -> None:
        if report.success:
            self.bytes += report.transfer_bytes
            self.transfers_ok += 1
            self.busy_s += report.transfer_s
        else:
            self.transfers_failed += 1


@dataclass
class Totals:
    """Counters of one demo run; the scheduler updates them as reports and outcomes arrive."""

    world_size: int
    requests: int = 0
    lookup_blocks: int = 0  # blocks asked for
    hit_blocks: int = 0  # blocks found (the leading run)
    loaded_blocks: int = 0  # hit blocks loaded (prepare_load)
    stored_blocks: int = 0  # blocks whose store completed successfully
    store_rejections: int = 0  # prepare_store said no room
    checked_blocks: int = 0  # loaded blocks checked, summed over ranks
    mismatched_blocks: int = 0  # ... of which held the wrong bytes (must stay 0)
    failed_jobs: int = 0  # a rank failed or died: completed as failed
    orphaned_jobs: int = 0  # their index died with a coordinator: not completed
    coordinator_gone: int = 0  # CoordinatorGoneError seen
    rank_restarts: int = 0
    ranks: list[list[DirectionTotals]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = [[DirectionTotals() for _ in Direction] for _ in range(self.world_size)]

    def add_transfer(self, report: Report) -> None:
        self.ranks[report.rank][report.direction].add(report)

    def bytes(self, direction: Direction) -> int:
        return sum(rank[direction].bytes for rank in self.ranks)

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


class Progress:
    """One status line: ``\\r``-rewritten on a terminal, a line per second otherwise."""

    def __init__(self, totals: Totals, out: TextIO = sys.stderr, target: int | None = None):
        self.totals = totals
        self.out = out
        self.target = target
        self.tty = out.isatty()
        self._every_s = 0.2 if self.tty else 1.0
        self._start = self._last = time.monotonic()
        self._last_bytes = [0, 0]

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._every_s:
            return
        t = self.totals
        rates = []
        for d in Direction:
            moved = t.bytes(d)
            rates.append((moved - self._last_bytes[d]) / max(now - self._last, 1e-9) / GB)
            self._last_bytes[d] = moved
        self._last = now
        of = f"/{self.target}" if self.target else ""
        line = (f"requests {t.requests}{of}  hit rate {t.hit_rate:6.1%}  "
                f"store {rates[Direction.GPU_TO_CPU]:6.2f} GB/s  "
                f"load {rates[Direction.CPU_TO_GPU]:6.2f} GB/s  "
                f"mismatches {t.mismatched_blocks}  failed jobs {t.failed_jobs}")
        self.out.write(f"\r{line}" if self.tty else f"{line}\n")
        self.out.flush()

    def done(self) -> None:
        self.tick(force=True)
        if self.tty:
            self.out.write("\n")
            self.out.flush()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._start


def summary(totals: Totals, elapsed_s: float, extra: dict[str, Any]) -> dict[str, Any]:
    """Everything the run measured, as plain data (the ``--json`` document)."""
    per_rank = []
    for rank, dirs in enumerate(totals.ranks):
        per_rank.append({"rank": rank, **{d.label: asdict(dirs[d]) for d in Direction}})
    directions = {}
    for d in Direction:
        moved = totals.bytes(d)
        busy = max((dirs[d].busy_s for dirs in totals.ranks), default=0.0)
        directions[d.label] = {
            "bytes": moved,
            "wall_gbps": moved / elapsed_s / GB if elapsed_s > 0 else 0.0,
            "transfers_ok": sum(dirs[d].transfers_ok for dirs in totals.ranks),
            "transfers_failed": sum(dirs[d].transfers_failed for dirs in totals.ranks),
            "busiest_rank_busy_s": busy,
        }
    counters = {k: v for k, v in asdict(totals).items() if k != "ranks"}
    return {**counters, "hit_rate": totals.hit_rate, "elapsed_s": elapsed_s,
            "directions": directions, "per_rank": per_rank, **extra}


def format_summary(doc: dict[str, Any]) -> str:
    """The human form of ``summary``."""
    lines = [
        f"{doc['requests']} requests on {doc['world_size']} rank(s) ({doc.get('device', '?')}) "
        f"in {doc['elapsed_s']:.2f} s{'  [interrupted]' if doc.get('interrupted') else ''}",
        f"  blocks: {doc['lookup_blocks']} looked up, {doc['hit_blocks']} hit "
        f"({doc['hit_rate']:.1%}), {doc['loaded_blocks']} loaded, {doc['stored_blocks']} stored, "
        f"{doc['store_rejections']} store rejections",
        f"  content: {doc['checked_blocks']} loaded blocks checked on all ranks, "
        f"{doc['mismatched_blocks']} wrong",
        f"  jobs: {doc['failed_jobs']} failed, {doc['orphaned_jobs']} orphaned by a lost "
        f"coordinator; {doc['rank_restarts']} rank restarts, {doc['coordinator_gone']} "
        "coordinator-gone errors",
    ]
    for label, d in doc["directions"].items():
        lines.append(f"  {label}: {d['bytes'] / GB:.3f} GB in {d['transfers_ok']} transfers "
                     f"({d['transfers_failed']} failed), {d['wall_gbps']:.2f} GB/s over the run")
    if "stats_agree" in doc:
        lines.append(f"  stats blocks agree with the workers' reports: "
                     f"{'yes' if doc['stats_agree'] else 'NO'}")
    if doc.get("numa"):
        lines.append("  NUMA: " + ", ".join(
            f"r{n['rank']} {n['state']}"
            + ("" if n["node"] is None else f" node {n['node']}")
            + ("" if n["local_ratio"] is None else f" {n['local_ratio']:.1%}")
            for n in doc["numa"]))
    bench = doc.get("bench")
    if bench:
        lines.append(f"  bench ({bench['blocks']} blocks = {bench['transfer_bytes'] / GB:.3f} GB "
                     f"per rank per transfer, {bench['repetitions']} repetitions):")
        for label, d in bench["directions"].items():
            ranks = ", ".join(f"r{r['rank']} {r['gbps']:.2f}" for r in d["all"]["per_rank"])
            lines.append(f"    {label}: 1 rank {d['solo']['gbps']:.2f} GB/s; {d['all']['ranks']} "
                         f"ranks {d['all']['gbps']:.2f} GB/s aggregate ({ranks}); "
                         f"ratio to {d['all']['ranks']} x 1 rank: {d['scaling']:.3f}")
    return "\n".join(lines)
