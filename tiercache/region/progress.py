"""``Progress``: what a long start-up step (fallocate of the region, a worker's pre-fault
and pinning of its slice) says while it runs, so an operator watching a 1 TiB start sees
it move instead of a silent minute.

The step calls ``advance(num_bytes)`` as pieces finish (from any of its threads). A line
``<step>: 12.0/64.0 GiB, 5.9 GiB/s, ETA 9 s`` goes to ``report`` at most once per
``interval_s`` (2 s); inside ``with progress:`` a ticker thread also reports when no piece
finished for ``interval_s`` (one ``cuMemHostRegister`` of 64 GiB is one piece), so a
running step shows a line at least that often. A step done within ``interval_s`` reports
nothing: its caller's own final line ("allocated 8.00 GiB ... in 0.41 s") is all it says.
Tests drive ``advance``/``tick`` with a fake ``clock`` and never enter the ticker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

GIB = 1 << 30
INTERVAL_S = 2.0


class Progress:
    def __init__(self, step: str, total_bytes: int, report: Callable[[str], None], *,
                 interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.step, self.total_bytes = step, total_bytes
        self._report, self._interval_s, self._clock = report, interval_s, clock
        self._lock = threading.Lock()
        self._done_bytes = 0
        self._start = clock()
        self._last_line = self._start
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @property
    def done_bytes(self) -> int:
        return self._done_bytes

    def advance(self, num_bytes: int) -> None:
        """``num_bytes`` more are done; reports if the last line is ``interval_s`` old."""
        with self._lock:
            self._done_bytes += num_bytes
        self.tick()

    def tick(self) -> None:
        """Report the step's state if no line went out for ``interval_s``."""
        with self._lock:
            now = self._clock()
            if now - self._last_line < self._interval_s:
                return
            self._last_line = now
            line = self._line(now)
        self._report(line)

    def _line(self, now: float) -> str:
        elapsed_s = max(now - self._start, 1e-9)
        rate = self._done_bytes / elapsed_s  # bytes/s since the step began
        left = self.total_bytes - self._done_bytes
        eta = f"ETA {left / rate:.0f} s" if rate > 0 else "ETA unknown (nothing done yet)"
        return (f"{self.step}: {self._done_bytes / GIB:.1f}/{self.total_bytes / GIB:.1f} GiB, "
                f"{rate / GIB:.1f} GiB/s, {eta}")

    def __enter__(self) -> Progress:
        self._ticker = threading.Thread(target=self._tick_until_stopped, daemon=True,
                                        name="tiercache-progress")
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()

    def _tick_until_stopped(self) -> None:
        while not self._stop.wait(self._until_due_s()):
            self.tick()

    def _until_due_s(self) -> float:
        """Seconds until the last line is ``interval_s`` old (the ticker wakes then)."""
        with self._lock:
            return max(0.0, self._last_line + self._interval_s - self._clock())
