"""Only the owner gets in, and a client talks only to its own user's coordinator: peer uids
(``SO_PEERCRED``) checked on both sides, socket directories that others could write to
refused, and a socket path found through the region header, not the caller's environment.

Tests that need a second user create one with ``useradd`` and run its side with the
system Python (stdlib only); they are skipped unless the suite runs as root (CI does)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from control_support import START_TIMEOUT_S
from tiercache.config import Config
from tiercache.errors import ControlSocketError
from tiercache.link.client import Client
from tiercache.control.server import ControlOptions, ControlServer
from tiercache.index.manager import OffloadingManager
from tiercache.link.sockets import prepare_directory, trusted_uids
from tiercache.link.payloads import decode_error, encode_hello_request
from tiercache.link.protocol import HEADER_BYTES, FrameHeader, PayloadReader, Status, Verb, frame

SYSTEM_PYTHON = "/usr/bin/python3"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd") or not os.path.exists(SYSTEM_PYTHON),
    reason="needs root, useradd and /usr/bin/python3 to act as a second user")


@pytest.fixture(scope="session")
def other_uid() -> int:
    """A second user, created for this session and removed after it."""
    import pwd

    name = f"tcpeer{os.getpid()}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture
def shared_dir(tmp_path_factory) -> str:
    """A sticky, world-writable directory (like /tmp) that both users can reach."""
    path = f"/tmp/tiercache-trust-{os.getpid()}-{os.urandom(4).hex()}"
    os.mkdir(path)
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_as(uid: int, code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([SYSTEM_PYTHON, "-c", textwrap.dedent(code), *args], user=uid,
                            group=uid, extra_groups=[], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


# ---------------------------------------------------------------- the server checks its clients

@needs_root
def test_the_server_refuses_a_client_of_another_user(servers, shared_dir, other_uid):
    path = os.path.join(shared_dir, "ctl.sock")
    servers(path)
    os.chmod(path, 0o666)  # as if someone loosened the socket: the uid check still holds
    hello = frame(Verb.HELLO, 1, encode_hello_request(None, "intruder"))
    child = run_as(other_uid, """
        import socket, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(sys.argv[1])
        try:
            s.sendall(bytes.fromhex(sys.argv[2]))
        except OSError:
            pass
        reply = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:  # closed with our HELLO unread: the end, too
                break
            if not chunk:
                break
            reply += chunk
        print(reply.hex())
    """, path, hello.hex())
    out, err = child.communicate(timeout=START_TIMEOUT_S)
    assert child.returncode == 0, err
    reply = bytes.fromhex(out.strip())
    header = FrameHeader.unpack(reply[:HEADER_BYTES])
    assert (header.status, header.request_id) == (Status.ERROR, 0)  # refused, then closed
    error = decode_error(PayloadReader(reply[HEADER_BYTES:]))
    assert isinstance(error, ControlSocketError)
    assert f"uid {other_uid}" in str(error) and "trusted" in str(error)
    with Client(path) as owner:
        owner.ping()  # the owner is served as before


@needs_root
def test_the_configured_uid_is_trusted(servers, shared_dir, other_uid):
    path = os.path.join(shared_dir, "ctl.sock")
    servers(path, options=ControlOptions(trusted_uid=other_uid))
    os.chmod(path, 0o666)  # the file mode is the operator's business; the uid check passes
    hello = frame(Verb.HELLO, 1, encode_hello_request(None, "operator"))
    child = run_as(other_uid, """
        import socket, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(sys.argv[1])
        s.sendall(bytes.fromhex(sys.argv[2]))
        print(s.recv(65536).hex())
    """, path, hello.hex())
    out, err = child.communicate(timeout=START_TIMEOUT_S)
    assert child.returncode == 0, err
    header = FrameHeader.unpack(bytes.fromhex(out.strip())[:HEADER_BYTES])
    assert (header.verb, header.status, header.request_id) == (Verb.HELLO, Status.OK, 1)


# ---------------------------------------------------------------- the client checks its server

@needs_root
def test_a_client_refuses_a_socket_of_another_user(shared_dir, other_uid):
    path = os.path.join(shared_dir, "squatted.sock")
    squatter = run_as(other_uid, """
        import socket, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(sys.argv[1])
        s.listen()
        print("ready", flush=True)
        sys.stdin.read()
    """, path, stdin=subprocess.PIPE)
    try:
        assert squatter.stdout.readline().strip() == "ready"
        with pytest.raises(ControlSocketError, match=f"belongs to uid {other_uid}"):
            Client(path).ping()
    finally:
        squatter.kill()
        squatter.communicate()


@needs_root
def test_a_client_refuses_a_server_of_another_user_even_on_our_own_socket(shared_dir,
                                                                           other_uid):
    """The socket file is ours (bound by us), but the process listening on it is not: the
    kernel's record of the listener (SO_PEERCRED) is what the client trusts."""
    path = os.path.join(shared_dir, "ours.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    impostor = run_as(other_uid, """
        import socket, sys
        s = socket.socket(fileno=int(sys.argv[1]))
        s.listen()
        print("ready", flush=True)
        c, _ = s.accept()
        sys.stdin.read()
    """, str(listener.fileno()), pass_fds=[listener.fileno()], stdin=subprocess.PIPE)
    listener.close()
    try:
        assert impostor.stdout.readline().strip() == "ready"
        with pytest.raises(ControlSocketError, match=f"coordinator on .* runs as uid {other_uid}"):
            Client(path).ping()
        assert stat.S_ISSOCK(os.lstat(path).st_mode) and os.lstat(path).st_uid == 0
    finally:
        impostor.kill()
        impostor.communicate()


@needs_root
def test_a_socket_directory_of_another_user_is_refused(tmp_path, other_uid):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, other_uid, other_uid)
    with pytest.raises(ControlSocketError, match=f"belongs to uid {other_uid}"):
        ControlServer(OffloadingManager(4), str(theirs / "ctl.sock")).start()


# ---------------------------------------------------------------- directories (any user)

def test_a_directory_others_can_write_is_refused_unless_sticky(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ControlSocketError, match="writable by others .* not sticky"):
        ControlServer(OffloadingManager(4), str(open_dir / "ctl.sock")).start()
    with pytest.raises(ControlSocketError, match="writable by others"):
        Client(str(open_dir / "ctl.sock")).ping()
    os.chmod(open_dir, 0o1777)  # sticky, like /tmp: only a file's owner may replace it
    with ControlServer(OffloadingManager(4), str(open_dir / "ctl.sock")):
        with Client(str(open_dir / "ctl.sock")) as client:
            client.ping()


def test_the_private_default_directory_is_created_0700_and_must_stay_private(tmp_path):
    private = tmp_path / f"tiercache-{os.geteuid()}"
    prepare_directory(str(private / "x.sock"), trusted_uids(None))
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    os.chmod(private, 0o755)
    with pytest.raises(ControlSocketError, match="must be 0700"):
        prepare_directory(str(private / "x.sock"), trusted_uids(None))


def test_without_xdg_runtime_dir_the_socket_is_not_in_bare_tmp(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = Config(name="probe").socket_path
    assert path == f"/tmp/tiercache-{os.geteuid()}/tiercache-probe.sock"


# ---------------------------------------------------------------- finding the coordinator

def test_clients_and_status_find_a_coordinator_started_with_another_runtime_dir(
        make_config, tmp_path, tmp_path_factory, monkeypatch):
    from tiercache.service.process import CoordinatorProcess

    runtime = tmp_path_factory.mktemp("rt")  # short: under xdist tmp_path is 10 bytes longer
    theirs, mine = runtime / "a", runtime / "b"  # and the socket path at most 107 bytes
    for d in (theirs, mine):
        d.mkdir(mode=0o700)
    config = make_config(control_socket="")  # the path is derived from the environment
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(theirs))
    with CoordinatorProcess(config, tmp_path / "coord"):
        served = str(theirs / f"tiercache-{config.name}.sock")
        assert stat.S_ISSOCK(os.stat(served).st_mode)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(mine))  # the client's environment differs
        assert config.socket_path != served
        with Client(config) as client:
            client.ping()
            assert client.socket_path == served
        status = subprocess.run(
            [sys.executable, "-m", "tiercache", "status", "--name", config.name],
            capture_output=True, text=True, timeout=START_TIMEOUT_S,
            env={**os.environ, "XDG_RUNTIME_DIR": str(mine)})
        assert status.returncode == 0, status.stderr
        assert "index: 0 ready" in status.stdout and "not reachable" not in status.stdout
