"""The discrete-event clock that drives a replay: arrivals from the trace, engine steps.

Simulated time only: an engine that starts a step at ``t`` is busy until ``t + step_s``
(``engine.ReplayEngine.step``); the next event is the earliest of the next arrival and the
earliest moment an engine with work is free. Arrivals at the same instant as a step come
first; engines that tie step in index order, so a replay is deterministic for a system
without threads (``none``, ``vllm_native``; tiercache's flusher answers before each step
ends, ``systems``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from tiercache.tools.replay.engine import ReplayEngine, RequestRecord
from tiercache.tools.replay.routers import Router
from tiercache.tools.replay.trace import Trace

MAX_STEPS_PER_REQUEST = 20_000  # a replay that steps more than this per request is stuck
Progress = Callable[[int, int, float], None]  # (finished, requests, simulated seconds)


class ReplayStuckError(RuntimeError):
    """The engines kept stepping without finishing the trace (a bug, not a result)."""


def run(trace: Trace, engines: Sequence[ReplayEngine], router: Router,
        progress: Progress | None = None, progress_every_s: float = 1.0
        ) -> list[RequestRecord]:
    """Replay ``trace`` on ``engines``; every request's record, in arrival order."""
    start_s = trace.requests[0].t
    arrivals = list(trace.requests)
    next_arrival = 0
    records: list[RequestRecord] = []
    steps = 0
    last_report = time.monotonic()
    limit = MAX_STEPS_PER_REQUEST * len(arrivals)
    while True:
        arrival_s = (arrivals[next_arrival].t - start_s if next_arrival < len(arrivals)
                     else math.inf)
        busy = [e for e in engines if e.has_work]
        step_s = min((e.busy_until_s for e in busy), default=math.inf)
        if arrival_s == math.inf and step_s == math.inf:
            break
        if arrival_s <= step_s:
            request = arrivals[next_arrival]
            engine = engines[router.pick(request, engines)]
            if not engine.has_work:
                engine.busy_until_s = max(engine.busy_until_s, arrival_s)
            req_id = f"r{next_arrival}"
            engine.add(req_id, request, arrival_s)
            records.append(engine.records[req_id])
            next_arrival += 1
            continue
        engine = min(busy, key=lambda e: (e.busy_until_s, e.index))
        engine.step(engine.busy_until_s)
        steps += 1
        if steps > limit:
            raise ReplayStuckError(f"{steps} engine steps for {len(arrivals)} requests")
        if progress is not None and time.monotonic() - last_report >= progress_every_s:
            last_report = time.monotonic()
            progress(sum(r.finish_s is not None for r in records), len(arrivals), step_s)
    if progress is not None:
        progress(len(records), len(arrivals), max(e.busy_until_s for e in engines))
    return records
