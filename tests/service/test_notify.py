"""``Type=notify``: a real ``tiercache serve`` tells its supervisor READY=1 once clients
are served and STOPPING=1 at its stop (the datagram socket systemd would hold is ours)."""

from __future__ import annotations

import socket

from tiercache.link.client import Client
from tiercache.service.notify import NOTIFY_ENV, notify
from tiercache.service.process import CoordinatorProcess


def _listener(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    return sock


def test_serve_says_ready_once_it_serves_and_stopping_at_its_stop(make_config, tmp_path,
                                                                  monkeypatch):
    config = make_config()
    with _listener(tmp_path / "notify.sock") as supervisor:
        monkeypatch.setenv(NOTIFY_ENV, str(tmp_path / "notify.sock"))
        with CoordinatorProcess(config, tmp_path / "coord") as coordinator:
            message = supervisor.recv(4096).decode().split("\n")
            assert message[0] == "READY=1" and message[1].startswith("STATUS=serving ")
            with Client(config) as client:  # READY means served: the socket answers
                client.ping()
            assert coordinator.stop() == 0
        assert supervisor.recv(4096) == b"STOPPING=1"


def test_no_supervisor_no_message_and_a_gone_one_is_not_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv(NOTIFY_ENV, raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv(NOTIFY_ENV, str(tmp_path / "nobody-listens.sock"))
    assert notify("READY=1") is False  # logged; the coordinator serves regardless


def test_an_abstract_socket_is_reached(monkeypatch):
    name = f"tiercache-notify-test-{id(monkeypatch)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as supervisor:
        supervisor.bind("\0" + name)
        supervisor.settimeout(10)
        monkeypatch.setenv(NOTIFY_ENV, "@" + name)
        assert notify("READY=1") is True
        assert supervisor.recv(64) == b"READY=1"
