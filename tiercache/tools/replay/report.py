"""What a replay reports: per system the issue's figures, as JSON and as a table.

Per system (``summarize``): ``requests``, ``prompt_tokens``, ``computed_prefill_tokens``,
``hit_tokens`` {``gpu``, ``host``, ``disk``}, ``ttft_s`` {``p50``, ``p90``, ``p99``},
``throughput_rps``; and more (``loaded_blocks_checked``: tiercache's loads, each block's
bytes checked as it landed; ``checked_blocks``: blocks checked when a request computed on
them; ``disk_read_blocks`` and ``disk_read_s``: the blocks read from tiercache's disk tier
on the clock (each promotion once), and their simulated seconds;
``steps``, ``host_blocks``, ``bytes_scale``, ``wall_s``). Hits are vLLM's own
per-request prefill stats (``PrefillStats``: local prefix-cache tokens and external
tokens, the latter split by the connector's hit source), counted at a request's first
scheduling (a preempted request's recompute is not counted
as prefill), so ``computed_prefill_tokens + gpu + host + disk == prompt_tokens`` holds
for every system by construction, and ``check_identity`` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tiercache.tools.replay.engine import ReplayEngine, RequestRecord
from tiercache.sizes import format_bytes


def summarize(records: Sequence[RequestRecord], engines: Sequence[ReplayEngine],
              extra: dict[str, Any]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in records)
    gpu = sum(r.gpu_hit_tokens for r in records)
    external = sum(r.external_hit_tokens for r in records)
    disk = sum(e.disk_hit_tokens for e in engines)
    ttft = np.array([r.ttft_s for r in records])
    span = max(r.finish_s or 0.0 for r in records) - min(r.arrival_s for r in records)
    summary = {
        "requests": len(records), "prompt_tokens": prompt,
        "computed_prefill_tokens": prompt - gpu - external,
        "hit_tokens": {"gpu": gpu, "host": external - disk, "disk": disk},
        "ttft_s": {f"p{q}": round(float(np.percentile(ttft, q)), 6) for q in (50, 90, 99)},
        "throughput_rps": round(len(records) / span, 4) if span > 0 else None,
        "checked_blocks": sum(e.checked_blocks for e in engines),
        "loaded_blocks_checked": sum(e.loaded_blocks for e in engines),
        "disk_read_blocks": sum(e.disk_read_blocks for e in engines),
        "disk_read_s": round(sum(e.disk_read_s for e in engines), 6),
        "steps": sum(e.steps for e in engines), **extra}
    check_identity(summary)
    return summary


def check_identity(s: dict[str, Any]) -> None:
    hits = s["hit_tokens"]
    if s["computed_prefill_tokens"] + hits["gpu"] + hits["host"] + hits["disk"] != \
            s["prompt_tokens"] or min(s["computed_prefill_tokens"], *hits.values()) < 0:
        raise AssertionError(f"replay accounting broken: {s}")


def table(systems: dict[str, dict[str, Any]]) -> str:
    head = ("system", "requests", "prompt tok", "computed", "gpu hit", "host hit", "disk hit",
            "saved", "TTFT p50", "p90", "p99", "req/s")
    rows: list[tuple[str, ...]] = [head]
    for name, s in systems.items():
        h = s["hit_tokens"]
        saved = 1 - s["computed_prefill_tokens"] / s["prompt_tokens"]
        rows.append((name, str(s["requests"]), str(s["prompt_tokens"]),
                     str(s["computed_prefill_tokens"]), str(h["gpu"]), str(h["host"]),
                     str(h["disk"]), f"{saved:.1%}",
                     *(f"{s['ttft_s'][q] * 1e3:.1f} ms" for q in ("p50", "p90", "p99")),
                     f"{s['throughput_rps']:.2f}" if s["throughput_rps"] else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


def headline(engines: int, dram_bytes: int, disk_bytes: int, router: str, trace: dict[str, Any]
             ) -> str:
    disk = f", disk {format_bytes(disk_bytes)}" if disk_bytes else ""
    return (f"{engines} engine(s), DRAM {format_bytes(dram_bytes)}{disk}, router {router}, "
            f"trace {trace.get('generator', trace.get('file'))}: {trace['requests']} requests, "
            f"{trace['prompt_tokens']} prompt tokens (TTFT simulated by a cost model over "
            "real vLLM schedulers, not a served model)")
