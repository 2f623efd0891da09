"""A second local user for the ownership tests: created with ``useradd`` when the tests run
as root (CI does), skipped otherwise. The name carries the pytest process's pid, so
concurrent sessions never share (or delete) each other's user."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class OtherUser:
    name: str
    uid: int
    gid: int
    python: str  # an interpreter this user may run (root's may live under a 0700 /root)

    def run(self, argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
        """``argv`` run as this user, with this checkout and its packages importable."""
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              user=self.uid, group=self.gid, extra_groups=[], env=_env(),
                              cwd="/")

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` started as this user (as ``run``), not waited for."""
        return subprocess.Popen(argv, user=self.uid, group=self.gid, extra_groups=[],
                                env=_env(), cwd="/", **kwargs)

    def tiercache(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        """``python -m tiercache ARGS`` run as this user."""
        return self.run([self.python, "-m", "tiercache", *args], timeout_s)

    def own(self, path: str | os.PathLike[str]) -> None:
        os.chown(path, self.uid, self.gid)


def _env() -> dict[str, str]:
    paths = [str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/",
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONDONTWRITEBYTECODE": "1"}


def other_user() -> Iterator[OtherUser]:
    """Generator for a fixture: a fresh user, deleted afterwards; skips when not root."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second user")
    name = f"tcother{os.getpid()}"
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd {name} failed: {made.stderr.strip()}")
    try:
        entry = pwd.getpwnam(name)
        yield OtherUser(name, entry.pw_uid, entry.pw_gid, _python_for(entry))
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _python_for(entry: pwd.struct_passwd) -> str:
    """This interpreter if the user may run it, else the system's of the same version."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, f"/usr/bin/python{version}"):
        probe = OtherUser(entry.pw_name, entry.pw_uid, entry.pw_gid, candidate)
        try:
            if probe.run([candidate, "-c", "import tiercache, numpy, posix_ipc"]).returncode == 0:
                return candidate
        except OSError:
            continue
    pytest.skip(f"no Python {version} that user {entry.pw_name} may run with these packages")


def shared_dir(user: OtherUser) -> tempfile.TemporaryDirectory:
    """A temporary directory the other user owns (its config files and socket go here)."""
    tmp = tempfile.TemporaryDirectory(prefix="tiercache-other-")
    os.chmod(tmp.name, 0o755)
    user.own(tmp.name)
    return tmp
