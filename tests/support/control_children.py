"""Entry points that control-plane tests spawn (multiprocessing ``spawn`` imports this
module by name): clients that take resources and wait to be killed, and servers run
under resource limits."""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading

from tiercache.index.client import Client

WAIT_S = 300.0  # a child waits this long at most for its SIGKILL


def reserve_pin_and_wait(path: str, store_keys: list[bytes], lease_keys: list[bytes],
                         load_keys: list[bytes], tokens, holding) -> None:
    """Child: reserve ``store_keys``, lease and load others, report the session token,
    then wait to be SIGKILLed (an engine that crashes mid-request)."""
    client = Client(path, name="doomed engine")
    out = client.prepare_store(store_keys)
    assert out is not None and len(out.keys_to_store) == len(store_keys)
    if lease_keys:
        assert client.lease(lease_keys).num_hit == len(lease_keys)
    if load_keys:
        client.prepare_load(load_keys)
    tokens.put(client.session_token)
    holding.set()
    threading.Event().wait(WAIT_S)


def serve_with_fd_limit(path: str, spare_fds: int, ready, log_path: str, options) -> None:
    """Child: a control server whose process may open only ``spare_fds`` more files once it
    serves (its log goes to ``log_path``), until SIGTERM."""
    from tiercache.index.control import ControlServer
    from tiercache.index.manager import OffloadingManager

    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = ControlServer(OffloadingManager(64), path, options)
    server.start()
    highest_fd = max(int(fd) for fd in os.listdir(f"/proc/{os.getpid()}/fd"))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest_fd + 1 + spare_fds, hard))
    ready.set()
    try:
        stop.wait(WAIT_S)
    finally:
        server.close()
