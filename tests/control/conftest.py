"""Fixtures of the control-plane tests: a socket path, and ``serve_forever`` children that
are killed after the test."""

from __future__ import annotations

import pytest

from control_support import ServerProcess


@pytest.fixture
def socket_path(tmp_path) -> str:
    return str(tmp_path / "ctl.sock")


@pytest.fixture
def servers():
    started: list[ServerProcess] = []

    def start(path: str, **kwargs) -> ServerProcess:
        server = ServerProcess(path, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()
