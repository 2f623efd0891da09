"""The control server in a process of its own, over a fresh in-memory index: what the
control-plane tests and ``tiercache.tools.index_bench`` run (``tiercache serve`` runs the
real coordinator, ``tiercache.service.coordinator``)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from tiercache.control.options import ControlOptions
from tiercache.control.server import ControlServer
from tiercache.index.manager import OffloadingManager


def serve_forever(socket_path: str, num_blocks: int, policy: str = "lru",
                  ready_event: Any = None, enable_events: bool = False,
                  options: ControlOptions | None = None) -> None:
    """Serve a fresh manager until SIGTERM or SIGINT (entry point for a separate process).

    ``ready_event`` (e.g. a ``multiprocessing.Event``) is set once clients may connect.
    """
    stop = threading.Event()
    # A Python-level handler runs in the main thread whichever thread the kernel picked
    # (numpy's BLAS threads exist before we could block signals for sigwait).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    server = ControlServer(OffloadingManager(num_blocks, policy, enable_events), socket_path,
                           options)
    server.start()
    try:
        if ready_event is not None:
            ready_event.set()
        stop.wait()
    finally:
        server.close()
