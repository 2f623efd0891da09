"""A real ``mooncake_master`` for tests: on 127.0.0.1, free ports, its HTTP metadata server
in the same process; killed, stopped and started again on the same ports by the test.
``stop()`` always runs (use it as a context manager). ``key_file``: the test cluster's key
(``cluster.key_file``, 0600), made in the master's directory for the nodes to share."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLIENT_TTL_S = 2  # a client silent this long is dropped (its segment unmounted): tests wait less
# the master leases each object it is asked about this long (its default: 10 s); a leased
# object is neither evicted nor removed (OBJECT_HAS_LEASE). Short, so that tests that remove
# objects wait less; the nodes' census_period_s stays above it, as the docs ask
LEASE_TTL_MS = 1000
# Mooncake's TCP transport gives up on a read whose peer sends no status frame within
# MC_TCP_STATUS_TIMEOUT_SEC (MC_TCP_PROGRESS_TIMEOUT_SEC bounds a stalled payload alike;
# both 30 s by default), a batch's reads in rounds: 60 s for the 4 blocks of 2 ranks that
# the frozen-peer tests read (measured with the pinned 0.3.13.post1). Those tests set both
# to this, so their reads give up after 2 x this instead of 2 x 30 s; what they check
# (the late answers land in held staging, never a host row) does not depend on how long.
TRANSFER_TIMEOUT_S = 10


def master_binary() -> str:
    path = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable),
                                                          "mooncake_master")
    if not os.access(path, os.X_OK):
        pytest.fail("mooncake_master is not installed: pip install the `test` extra "
                    "(mooncake-transfer-engine-non-cuda) and `make mooncake`; the cluster "
                    "tier's tests cannot run without it")
    return path


def short_transfer_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake clients started from now on in this process, and the coordinators it
    starts, give up on a read from a frozen peer after rounds of ``TRANSFER_TIMEOUT_S``."""
    for variable in ("MC_TCP_STATUS_TIMEOUT_SEC", "MC_TCP_PROGRESS_TIMEOUT_SEC"):
        monkeypatch.setenv(variable, str(TRANSFER_TIMEOUT_S))


def make_key_file(path: Path) -> Path:
    """A cluster key as the docs make one (32 random bytes, mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One master (RPC, HTTP metadata and metrics ports on 127.0.0.1)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.rpc_port}"
        self.metadata_url = f"http://127.0.0.1:{self.http_port}/metadata"
        self.key_file = str(make_key_file(workdir / "cluster.key"))
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.start()

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "the master runs already"
        self.starts += 1
        log = (self.workdir / f"master-{self.starts}.log").open("w")
        self.proc = subprocess.Popen(
            [master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}", f"--client_ttl={CLIENT_TTL_S}",
             f"--default_kv_lease_ttl={LEASE_TTL_MS}",
             "--enable_metric_reporting=false"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        # until it serves both ports or exits, however long a loaded machine takes (the
        # test's own timeout is the backstop for a master that hangs alive)
        while not (accepts(self.rpc_port) and accepts(self.http_port)):
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start:\n{self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        return "".join(p.read_text() for p in sorted(self.workdir.glob("master-*.log")))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
