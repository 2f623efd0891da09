"""Turning SIGTERM/SIGINT/SIGHUP into a stop request that a main loop can wait on.

SIGHUP is a stop like the others: it comes when the terminal that started ``tiercache
serve`` closes, and its default action would end the process without its shutdown
(region and control socket left behind, no "stopped" line).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_on_signals(say: Callable[[str], None], what: str) -> threading.Event:
    """An Event set by the first of ``STOP_SIGNALS``; ``say`` reports the signal and ``what``
    happens next. Call from the main thread (Python runs signal handlers there only)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        say(f"{signal.Signals(signum).name}: {what}")
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    return stop
