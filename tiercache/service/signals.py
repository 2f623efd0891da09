"""Turning SIGTERM/SIGINT into a stop request that a main loop can wait on."""

from __future__ import annotations

import signal
import threading
from typing import Callable


def stop_on_signals(say: Callable[[str], None], what: str) -> threading.Event:
    """An Event set by the first SIGTERM or SIGINT; ``say`` reports the signal and ``what``
    happens next. Call from the main thread (Python runs signal handlers there only)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        say(f"{signal.Signals(signum).name}: {what}")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop
