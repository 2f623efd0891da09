"""``LogLimiter``: at most one log line per kind of event per interval.

A local user can make the control server hit the same condition thousands of times a
second (garbage frames, refused connections, EMFILE); one line per interval with the
count of what it stood for keeps the log useful and its size bounded."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class LogLimiter:
    """``warn(kind, message, *args)`` logs when ``kind`` last logged ``interval_s`` ago or
    more; otherwise it only counts. The next line of that kind says how many it stood for."""

    def __init__(self, logger: logging.Logger, interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object) -> bool:
        return self.log(logging.WARNING, kind, message, *args)

    def log(self, level: int, kind: str, message: str, *args: object) -> bool:
        """Log (True) or count (False) one event of ``kind``."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed and last is not None:  # a suppressed event had a last line
            message += f" ({suppressed} more like this in the last {now - last:.0f} s not logged)"
        self._log.log(level, message, *args)
        return True
